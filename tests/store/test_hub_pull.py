"""`mlxd pull` from the Hugging Face hub, with a local fake hub (tests never reach the net).

The real huggingface_hub code runs: ``HF_ENDPOINT`` points at ``fake_hub.FakeHub`` and
``HF_HUB_OFFLINE`` is unset for these subprocesses only.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_mlxd
from fake_hub import FakeHub
from fixtures.tiny_models import make_tiny_chat_model

REPO = "acme/tiny-chat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny-llama", "llama")


@pytest.fixture()
def hub(tiny):
    h = FakeHub().start()
    h.add_dir(REPO, tiny)
    yield h
    h.stop()


def _env(tmp_path, hub: FakeHub) -> dict:
    env = dict(
        os.environ,
        MLXD_HOME=str(tmp_path / "home"),
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    return env


def _listed(env: dict) -> list[dict]:
    p = run_mlxd(env, "list", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_pull_from_the_hub(tmp_path, hub, tiny):
    env = _env(tmp_path, hub)
    p = run_mlxd(env, "pull", REPO)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        "pulling manifest",
        f"downloading {REPO}",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    [m] = _listed(env)
    assert m["name"] == REPO and m["kind"] == "chat" and m["source"] == f"hf:{REPO}"
    assert m["revision"] == hub.repos[REPO]["sha"]
    model_dir = tmp_path / "home" / "models" / "acme--tiny-chat"
    for f in tiny.iterdir():
        assert (model_dir / f.name).read_bytes() == f.read_bytes()
    # the download cache has done its job once the model is in the store
    assert not (tmp_path / "home" / "models" / ".hf-cache" / "models--acme--tiny-chat").exists()
    # hf: prefix names the same store entry; pulling again is a no-op
    p = run_mlxd(env, "pull", f"hf:{REPO}")
    assert p.returncode == 0 and p.stderr.splitlines()[-1] == "success"
    assert hub.gets("model.safetensors") == 1


def test_missing_repo_is_one_clear_line(tmp_path, hub):
    p = run_mlxd(_env(tmp_path, hub), "pull", "acme/nope", ok=False)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == (
        "mlxd: could not pull 'acme/nope': hf:acme/nope: no repository acme/nope on the hub "
        "(a private one needs HF_TOKEN)"
    )


def test_an_unreachable_hub_is_one_clear_line(tmp_path):
    """HF_HUB_OFFLINE unset, HF_ENDPOINT at a port where nothing listens."""
    from conftest import free_port

    env = dict(
        os.environ,
        MLXD_HOME=str(tmp_path / "home"),
        HF_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        HF_HOME=str(tmp_path / "hf"),
    )
    env.pop("HF_HUB_OFFLINE", None)
    p = run_mlxd(env, "pull", "acme/anything", ok=False)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1].startswith(
        "mlxd: could not pull 'acme/anything': hf:acme/anything: hub unreachable: ConnectError"
    )
    assert _listed(env) == []


def test_corrupt_download_is_rejected_and_leaves_nothing(tmp_path, hub, tiny):
    # the hub lists one sha256 and serves other bytes
    files = {f.name: f.read_bytes() for f in tiny.iterdir()}
    good = files["model.safetensors"]
    hub.add_repo("acme/corrupt", files)
    orig_entry = hub._entry

    def lying_entry(path, data):
        e = orig_entry(path, data)
        if "lfs" in e:
            e["lfs"]["oid"] = hashlib.sha256(good + b"x").hexdigest()
        return e

    hub._entry = lying_entry
    env = _env(tmp_path, hub)
    p = run_mlxd(env, "pull", "acme/corrupt", ok=False)
    assert p.returncode == 1
    assert "model.safetensors: sha256" in p.stderr and "does not match" in p.stderr
    assert _listed(env) == []
    models = tmp_path / "home" / "models"
    assert not [d for d in models.iterdir() if not d.name.startswith(".")]
    assert not list(models.glob(".tmp-*"))
    assert not (models / ".hf-cache" / "models--acme--corrupt").exists()


def test_killed_pull_leaves_no_model_and_the_next_one_resumes(tmp_path, hub):
    env = _env(tmp_path, hub)
    models = tmp_path / "home" / "models"
    hub.slow = 0.05  # ~130 chunks of 4 KiB: a few seconds for model.safetensors
    p = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "pull", REPO],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hub.big_download_started.wait(60), "the download never started"
        time.sleep(0.3)
        assert p.poll() is None, "the pull finished before it could be killed"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(30)
    assert p.returncode == -signal.SIGKILL

    # nothing half-written is visible: no model, no entry that is not hidden
    assert _listed(env) == []
    assert not [d for d in models.iterdir() if not d.name.startswith(".")]
    gets_before = hub.gets("/config.json")
    assert gets_before == 1

    hub.slow = 0.0
    r = run_mlxd(env, "pull", REPO)
    assert r.returncode == 0, r.stderr
    [m] = _listed(env)
    assert m["name"] == REPO
    # files the killed pull had finished came from the cache, not the hub again
    assert hub.gets("/config.json") == gets_before
    assert hub.gets("model.safetensors") == 2
    assert not list(models.glob(".tmp-*")), "the dead pull's temp dir was swept"
    from mlx_lm.utils import load

    load(str(models / "acme--tiny-chat"))
