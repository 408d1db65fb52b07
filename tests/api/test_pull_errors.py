"""``/api/pull`` of a model that cannot be fetched: an Ollama error with the status that
tells the truth, never a 500. 404 for a repository the hub does not have, 400 for one that
holds no model, 503 for a hub this server is set not to reach (``HF_HUB_OFFLINE``), 502 for
one it cannot reach or that answers wrongly, 504 for one that does not answer in time.

A pull that fails before its second progress event answers with that status also when it
streams; a later failure is the stream's last line (``{"error": ...}``), as in Ollama.
With the hub on, the server is ``mlxd serve`` in its own process, ``HF_ENDPOINT`` pointing
at ``store/fake_hub.py``, a closed port or a port that never answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from conftest import free_port, wait_healthy
from store.fake_hub import FakeHub

GOOD, BARE, CORRUPT = "acme/tiny-chat", "acme/no-weights", "acme/corrupt"


@dataclass
class Served:
    url: str


@pytest.fixture(scope="module")
def hub(tiny_llama) -> Iterator[FakeHub]:
    h = FakeHub().start()
    h.add_dir(GOOD, tiny_llama)
    h.add_repo(BARE, {"config.json": b"{}", "README.md": b"nothing to serve"})
    files = {f.name: f.read_bytes() for f in tiny_llama.iterdir()}
    weights = files["model.safetensors"] + b" " * 8  # CORRUPT's own, to be listed wrongly
    h.add_repo(CORRUPT, {**files, "model.safetensors": weights})
    orig_entry = h._entry

    def lying_entry(path, data):  # CORRUPT's weights listed with another sha256
        e = orig_entry(path, data)
        if "lfs" in e and data == weights:
            e["lfs"]["oid"] = hashlib.sha256(b"other bytes").hexdigest()
        return e

    h._entry = lying_entry
    yield h
    h.stop()


@pytest.fixture()
def serve(tmp_path, tiny_llama) -> Iterator[Callable[[str], Served]]:
    """``mlxd serve`` with the hub switched on at ``endpoint``."""
    procs: list[subprocess.Popen] = []

    def start(endpoint: str) -> Served:
        port, home = free_port(), tmp_path / f"home-{len(procs)}"
        env = dict(
            os.environ,
            MLXD_HOME=str(home),
            HF_ENDPOINT=endpoint,
            HF_HOME=str(tmp_path / "hf-home"),
            HF_HUB_DISABLE_TELEMETRY="1",
            MLXD_MODELS__HUB_TIMEOUT_S="1",
        )
        env.pop("HF_HUB_OFFLINE", None)
        log = tmp_path / f"serve-{len(procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mlxd",
                    "serve",
                    "--model",
                    str(tiny_llama),
                    "--port",
                    str(port),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 120, lambda: Path(log).read_text()[-3000:])
        return Served(url)

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pull(srv: Any, name: str, stream: bool) -> httpx.Response:
    return httpx.post(srv.url + "/api/pull", json={"model": name, "stream": stream}, timeout=120)


def _assert_ollama_error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for w in words:
        assert w in body["error"], body
    return body["error"]


def _tags(srv: Any) -> list[str]:
    return [m["name"] for m in httpx.get(srv.url + "/api/tags").json()["models"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_hub_switched_off_is_503(server, stream):
    """The shared test server: HF_HUB_OFFLINE is set (tests/conftest.py)."""
    for name in ("acme/nope", "qwen3-0.6b"):  # a repository id, and an alias of one
        _assert_ollama_error(_pull(server, name, stream), 503, "HF_HUB_OFFLINE")
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=server.url).pull("acme/nope")
    assert info.value.status_code == 503 and "HF_HUB_OFFLINE" in info.value.error
    assert "nope" not in " ".join(_tags(server))


def test_a_hub_that_cannot_be_reached_is_502(serve):
    srv = serve(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for stream in (False, True):
        _assert_ollama_error(
            _pull(srv, "acme/nope", stream), 502, "hub unreachable", "ConnectError"
        )


def test_a_hub_that_does_not_answer_is_504(serve):
    with socket.socket() as quiet:  # takes connections (into its backlog), never answers
        quiet.bind(("127.0.0.1", 0))
        quiet.listen(8)
        srv = serve(f"http://127.0.0.1:{quiet.getsockname()[1]}")
        _assert_ollama_error(_pull(srv, "acme/nope", False), 504, "hub unreachable")


def test_what_the_hub_cannot_give_in_every_way(serve, hub):
    srv = serve(hub.url)
    for stream in (False, True):
        _assert_ollama_error(_pull(srv, "acme/nope", stream), 404, "no repository acme/nope")
        _assert_ollama_error(_pull(srv, BARE, stream), 400, "no .safetensors weights")
    # the hub lists one sha256 and sends other bytes: a bad gateway, 502 when the pull is
    # not streamed; streamed, the progress came first, so the error is the last line
    _assert_ollama_error(_pull(srv, CORRUPT, False), 502, "does not match")
    r = _pull(srv, CORRUPT, True)
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"}
    assert any(e.get("status", "").startswith("downloading") for e in lines)
    assert set(lines[-1]) == {"error"} and "does not match" in lines[-1]["error"]
    assert not {"acme/nope", BARE, CORRUPT} & set(_tags(srv))
    # and a good pull still streams to success
    events = list(ollama.Client(host=srv.url).pull(GOOD, stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    assert GOOD in _tags(srv)
    r = _pull(srv, GOOD, False)  # already there
    assert r.status_code == 200 and r.json() == {"status": "success"}
