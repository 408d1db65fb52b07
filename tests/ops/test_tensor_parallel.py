"""engine.tensor_parallel and engine.pipeline_parallel: 2 ranks on loopback (mx.distributed's
ring backend, CPU) serve the tiny models split (sharded, or a layer each), with the token ids
one process gives; a rank killed -> the group's requests end with 503, the group restarts
with its model, and serves again. Both modes compare against one single-process server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import LiveServer, make_settings, wait_until

from mlxd.enginecore.protocol import Status

MODEL = "tiny-llama"
PROMPTS = ["hello there", "the quick brown fox", "1 2 3 4 5 6 7", "a"]


def _ready(srv: LiveServer) -> LiveServer:
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, 90)
    return srv


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Path:
    from fixtures.tiny_encoders import make_tiny_bert_embedder

    return make_tiny_bert_embedder(tmp_path_factory.mktemp("emb") / "tiny-embed")


def _server(home: Path, model: Path, others: dict[str, Path], **sections) -> LiveServer:
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    settings = make_settings(home, model, **sections)
    for name, path in others.items():
        pull(ModelStore(settings.models_dir), str(path), settings.models, as_name=name)
    return _ready(LiveServer(settings).start())


@pytest.fixture(scope="module")
def others(embedder, tiny_qwen2) -> dict[str, Path]:
    """A second chat model (sharded too) and an embedding model (rank 0 alone)."""
    return {"tiny-embed": embedder, "tiny-qwen2": tiny_qwen2}


@pytest.fixture(scope="module")
def one(tmp_path_factory, tiny_llama, others):
    srv = _server(tmp_path_factory.mktemp("tp1"), tiny_llama, others)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tp(tmp_path_factory, tiny_llama, others):
    srv = _server(tmp_path_factory.mktemp("tp2"), tiny_llama, others, engine={"tensor_parallel": 2})
    yield srv
    srv.stop()


def _requests(model: str = MODEL, second: str | None = "tiny-qwen2") -> list[dict]:
    """Greedy rows of different lengths in one batch (they join and leave it at different
    steps), one with its top-2 alternatives, a seeded sampled row, a grammar-constrained row
    (processors on rank 0), and a row for a second split model stepping alongside. Every
    row names its tokens by id (logprobs with vLLM's return_tokens_as_token_ids)."""
    ids = {"return_tokens_as_token_ids": True}
    reqs = [
        {
            "model": model,
            "prompt": p,
            "max_tokens": 6 + 3 * i,
            "temperature": 0,
            "logprobs": 1,
            **ids,
        }
        for i, p in enumerate(PROMPTS)
    ]
    reqs[0]["logprobs"] = 2
    reqs.append(
        {
            "model": model,
            "prompt": "once upon",
            "max_tokens": 10,
            "temperature": 0.9,
            "seed": 7,
            "logprobs": 1,
            **ids,
        }
    )
    reqs.append(
        {
            "model": model,
            "messages": [{"role": "user", "content": "json please"}],
            "max_tokens": 12,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "logprobs": True,
            **ids,
        }
    )
    if second is not None:
        reqs.append(
            {
                "model": second,
                "prompt": "hello there",
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 1,
                **ids,
            }
        )
    return reqs


def _token_ids(choice: dict) -> tuple[list[int], list[list[int]]]:
    """A choice's token ids and, per token, its top alternatives' ids (sorted)."""
    lp = choice["logprobs"]
    if "content" in lp:  # chat
        names = [t["token"] for t in lp["content"]]
        tops = [[a["token"] for a in t["top_logprobs"]] for t in lp["content"]]
    else:
        names, tops = lp["tokens"], [list(t) for t in lp["top_logprobs"]]

    def as_id(name: str) -> int:
        assert name.startswith("token_id:"), name
        return int(name.removeprefix("token_id:"))

    return [as_id(n) for n in names], [sorted(as_id(n) for n in t) for t in tops]


def _run(srv: LiveServer, reqs: list[dict] | None = None) -> list[tuple]:
    """Each request's (token ids, their top alternatives' ids, completion tokens, finish
    reason), all sent at once."""

    def one(body: dict) -> tuple:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids, tops = _token_ids(choice)
        n = r.json()["usage"]["completion_tokens"]
        assert len(ids) == n
        return ids, tops, n, choice["finish_reason"]

    reqs = reqs if reqs is not None else _requests()
    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def test_two_ranks_give_the_tokens_of_one_process(one, tp, tmp_path):
    h = tp.health()
    group = h["engine_core"]["tensor_parallel"]
    assert group["size"] == 2 and group["backend"] == "ring"
    assert len(set(group["rank_pids"])) == 2 and group["rank_pids"][0] == tp.core_pid
    # `mlxd ps` shows the group: mode, size, backend and the ranks' pids in rank order
    env = dict(os.environ, MLXD_HOME=str(tmp_path / "cli-home"), MLXD_SERVER__PORT=str(tp.port))
    out = subprocess.run(
        [sys.executable, "-m", "mlxd", "ps"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["CORE", "PARALLEL", "RANKS", "BACKEND", "RANK", "PIDS"] in rows
    assert ["0", "tensor", "2", "ring", ",".join(map(str, group["rank_pids"]))] in rows
    assert group["mode"] == "tensor"
    assert "tensor_parallel" not in one.health()["engine_core"]
    expected = _run(one)
    assert [e[2] for e in expected[:4]] == [6, 9, 12, 15]
    assert all(len(top) == 2 for top in expected[0][1])  # the top-2 alternatives' ids
    assert _run(tp) == expected
    # a stream whose client leaves mid-way: rank 0 removes the row, the followers too,
    # and the batch stays in step for the next requests
    with httpx.stream(
        "POST",
        tp.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    assert _run(tp) == expected
    # unloaded (Ollama's keep_alive 0) and loaded again: every rank drops its shard and
    # loads it again, and the new batch is in step too
    r = httpx.post(tp.url + "/api/generate", json={"model": MODEL, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    assert MODEL not in [m["name"] for m in tp.health()["models"]]
    assert _run(tp) == expected
    assert tp.health()["model_loads"][MODEL] == 2
    # a step that fails on rank 0 before it runs fails that batch; every rank starts a
    # fresh batch and the group carries on, in step
    tp.fault("step_error", model=MODEL, message="simulated step failure")
    r = httpx.post(
        tp.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 500 and "simulated step failure" in r.text
    assert _run(tp) == expected


def test_encoders_run_unsharded_on_rank_0(one, tp):
    """Only text models are sharded; an embedding model is served by rank 0 alone, and a
    sharded chat model is not a reranker."""
    body = {"model": "tiny-embed", "input": ["hello there", "a b c"]}
    got = [httpx.post(s.url + "/v1/embeddings", json=body, timeout=60) for s in (one, tp)]
    assert [r.status_code for r in got] == [200, 200], got[1].text
    a, b = (np.array([d["embedding"] for d in r.json()["data"]]) for r in got)
    assert a.shape == (2, 32) and np.allclose(a, b, atol=1e-5)
    # a chat model as a reranker would run its shard on rank 0 alone: refused, not hung
    body = {"model": MODEL, "query": "q", "documents": ["a", "b"]}
    r = httpx.post(tp.url + "/v1/rerank", json=body, timeout=60)
    assert r.status_code == 400 and "tensor-parallel" in r.json()["error"]["message"]
    assert _run(tp) == _run(one)


def test_a_model_that_does_not_divide_over_the_ranks_fails_its_load(one, tp, tmp_path):
    """3 attention heads over 2 ranks: mlx-lm's shard would split them silently (and
    answer wrongly); the load fails, naming the size, and the group serves on."""
    from conftest import install_into_store
    from fixtures.tiny_models import make_tiny_chat_model

    src = make_tiny_chat_model(tmp_path / "odd", "llama", hidden_size=48)
    install_into_store(tp.settings.models_dir, "odd-heads", src)
    r = httpx.post(
        tp.url + "/v1/completions",
        timeout=60,
        json={"model": "odd-heads", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 500, r.text
    assert "num_attention_heads (3) does not divide by 2" in r.json()["error"]["message"]
    assert _run(tp) == _run(one)


def _stream(url: str, model: str, out: list, started: threading.Event) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 200,
        "stream": True,
    }
    text = ""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    text += line
                    if line == "data: [DONE]":
                        break
        out.append((r.status_code, text))
    except httpx.HTTPError as exc:
        out.append((0, repr(exc)))


def _kill_a_rank_and_see_the_group_restart(
    srv: LiveServer, rank: int, model: str, key: str = "tensor_parallel"
) -> None:
    """Four streams and one non-streaming request in flight, then kill -9 of ``rank``: every
    one of them ends with a 503 in OpenAI's shape (the streams with an error event), new
    requests get 503 + Retry-After until a new group, with none of the old ranks, has
    loaded the pinned model again."""
    before = srv.health()
    pids = before["engine_core"][key]["rank_pids"]
    srv.fault("slow_steps", model=model, seconds=0.02)
    results: list = []
    started = [threading.Event() for _ in range(4)]
    threads = [
        threading.Thread(target=_stream, args=(srv.url, model, results, ev)) for ev in started
    ]
    whole: list[httpx.Response] = []
    threads.append(
        threading.Thread(
            target=lambda: whole.append(
                httpx.post(
                    srv.url + "/v1/completions",
                    timeout=60,
                    json={"model": model, "prompt": "go on", "max_tokens": 200},
                )
            )
        )
    )
    for t in threads:
        t.start()
    assert all(ev.wait(20) for ev in started)
    assert wait_until(lambda: srv.core(Status()).requests_in_flight == 5, 20)
    os.kill(pids[rank], signal.SIGKILL)  # kill -9 of one rank, from outside
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, 60)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"]
    for t in threads:
        t.join(30)
    assert len(results) == 4 and len(whole) == 1
    for status, text in results:
        assert status == 200 and "service_unavailable" in text, text[-300:]
        assert text.endswith("data: [DONE]")
    assert whole[0].status_code == 503, whole[0].text
    assert whole[0].json()["error"]["code"] == "service_unavailable"
    # every rank of the old group is gone; a new group loaded the pinned model
    assert wait_until(lambda: not any(_alive(p) for p in pids), 10)
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, 90)
    h = srv.health()
    new = h["engine_core"][key]["rank_pids"]
    assert not set(new) & set(pids) and h["worker_restarts"] == before["worker_restarts"] + 1
    assert model in [m["name"] for m in h["models"]]


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_fails_the_groups_requests_and_the_group_restarts(one, tp, rank):
    _kill_a_rank_and_see_the_group_restart(tp, rank, MODEL)
    assert _run(tp) == _run(one)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_mlxd_serve_over_a_hosts_file_and_sigterm_ends_every_rank(one, tmp_path, tiny_llama):
    """``mlxd serve --tensor-parallel 2`` as a user runs it, with engine.distributed.hosts:
    rank 1 is started the way it is on another host (over ssh, its hostfile and settings
    written there, commands over TCP; the ``ssh`` here is a stand-in that runs the remote
    command on this machine, over loopback). SIGTERM leaves no rank behind."""
    from conftest import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text(
        '#!/bin/sh\nfor last; do :; done\necho "$@" > "$0.args"\nexec /bin/bash -c "$last"\n'
    )
    fake.chmod(0o755)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(
        '[{"ssh": "head", "ips": ["127.0.0.1"]}, {"ssh": "peer", "ips": ["127.0.0.1"]}]'
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        MLXD_HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        MLXD_ENGINE__DISTRIBUTED__HOSTS=str(hosts),
        MLXD_ENGINE__DISTRIBUTED__PORT=str(free_port()),
    )
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--tensor-parallel",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: list[int] = []
    try:
        assert wait_until(lambda: p.poll() is None and _healthy(url), 90), p.poll()
        assert "peer" in (bin_dir / "ssh.args").read_text()
        group = httpx.get(url + "/health").json()["engine_core"]["tensor_parallel"]
        pids = group["rank_pids"]
        assert group["size"] == 2 and all(_alive(x) for x in pids)
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        r, expected = (
            httpx.post(u + "/v1/completions", json=body, timeout=30) for u in (url, one.url)
        )
        assert r.status_code == 200 and r.json()["choices"] == expected.json()["choices"]
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    assert p.returncode in (0, -signal.SIGTERM), out[-2000:]
    assert wait_until(lambda: not any(_alive(x) for x in pids), 10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_hosts_file_that_cannot_start_the_group_stops_the_start(tmp_path, tiny_llama):
    from mlxd.config import ConfigError, load_settings

    hosts = tmp_path / "hosts.json"
    hosts.write_text('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]')
    env = dict(
        os.environ, MLXD_HOME=str(tmp_path / "home"), MLXD_ENGINE__DISTRIBUTED__HOSTS=str(hosts)
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            str(tiny_llama),
            "--tensor-parallel",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "engine.distributed.hosts" in p.stderr and "lists 2 hosts" in p.stderr
    with pytest.raises(ConfigError, match="engine.distributed.port: set it"):
        load_settings(
            None, {"engine": {"tensor_parallel": 2, "distributed": {"hosts": str(hosts)}}}
        )
    hosts.write_text('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b"}]')
    with pytest.raises(ConfigError, match='host 1 .* has no "ips"'):
        load_settings(
            None,
            {"engine": {"tensor_parallel": 2, "distributed": {"hosts": str(hosts), "port": 41000}}},
        )


# -- pipeline parallel: a run of layers per rank -----------------------------------------------

PP_MODEL = "tiny-qwen2"
# ~70 prompt tokens: with 16-token prefill steps, several pipelined chunks (whose outputs no
# rank evaluates) before the last one
LONG = " ".join(f"w{i}" for i in range(40))


@pytest.fixture(scope="module")
def pp(tmp_path_factory, tiny_qwen2, tiny_llama):
    """Two ranks, one layer each of the tiny Qwen2 (its mlx-lm class pipelines); Llama's
    does not, and is installed to be refused."""
    srv = _server(
        tmp_path_factory.mktemp("pp2"),
        tiny_qwen2,
        {"tiny-llama": tiny_llama},
        engine={"pipeline_parallel": 2, "prefill_step_size": 16},
    )
    yield srv
    srv.stop()


def _pp_requests() -> list[dict]:
    reqs = _requests(PP_MODEL, second=None)
    reqs.append(
        {
            "model": PP_MODEL,
            "prompt": LONG,
            "max_tokens": 7,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        }
    )
    return reqs


def test_two_pipeline_ranks_give_the_tokens_of_one_process(one, pp):
    h = pp.health()
    group = h["engine_core"]["pipeline_parallel"]
    assert (group["mode"], group["size"], group["backend"]) == ("pipeline", 2, "ring")
    assert len(set(group["rank_pids"])) == 2 and group["rank_pids"][0] == pp.core_pid
    assert "tensor_parallel" not in h["engine_core"]
    cores = httpx.get(pp.url + "/api/ps").json()["engine_cores"]
    assert cores[0]["pipeline_parallel"]["rank_pids"] == group["rank_pids"]
    r = httpx.post(
        pp.url + "/v1/completions",
        timeout=60,
        json={"model": PP_MODEL, "prompt": LONG, "max_tokens": 1},
    )
    assert r.json()["usage"]["prompt_tokens"] > 3 * 16  # LONG takes several prefill steps
    expected = _run(one, _pp_requests())
    assert expected[-1][2] == 7
    assert _run(pp, _pp_requests()) == expected
    # a model whose mlx-lm class has no pipelining fails its load, naming why; the group
    # serves on, in step
    r = httpx.post(
        pp.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 500, r.text
    assert "has no pipeline parallelism in mlx-lm" in r.json()["error"]["message"]
    assert _run(pp, _pp_requests()) == expected


def test_a_killed_pipeline_rank_fails_the_groups_requests_and_the_group_restarts(one, pp):
    _kill_a_rank_and_see_the_group_restart(pp, 1, PP_MODEL, "pipeline_parallel")
    assert _run(pp, _pp_requests()) == _run(one, _pp_requests())


def test_tensor_and_pipeline_parallel_at_once_are_refused():
    from mlxd.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="cannot both be above 1"):
        load_settings(None, {"engine": {"tensor_parallel": 2, "pipeline_parallel": 2}})
