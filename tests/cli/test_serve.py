"""`mlxd serve` as a user runs it: a real process, a real port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
from conftest import free_port


def _mlxd(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxd", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    return env


def test_bad_config_file_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  prot: 80\n")
    p = _mlxd("serve", "--config", str(cfg), env=_env(tmp_path))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "unknown key 'server.prot'" in out
    assert "Traceback" not in out


def test_serve_answers_and_stops_on_sigterm(tmp_path, tiny_llama, tiny_qwen2):
    port = free_port()
    env = _env(tmp_path)
    env["MLXD_ENGINE__MAX_NUM_SEQS"] = "4"  # env reaches the process
    p = _mlxd("serve", "--model", str(tiny_llama), "--port", str(port),
              "--preload", str(tiny_qwen2), "--log-format", "json", env=env)
    try:
        deadline = time.time() + 90
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert p.poll() is None, p.stdout.read()
            assert time.time() < deadline
            time.sleep(0.2)
        assert {m["name"] for m in r.json()["models"]} == {"tiny-llama", "tiny-qwen2"}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    # uvicorn drains, then re-raises the signal so the exit status says "terminated"
    assert p.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in out
    assert '"logger": "mlxd.access"' in out  # structured json logs, one line per request
