"""`mlxd start | status | stop` as a user runs them: real processes, pid files, a drain."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    env.update(MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", MLXD_TEST_FAULTS="1")
    return env


class _HeldStream(http.client.HTTPConnection):
    """A connection whose receive buffer is set small before it connects: while its reader
    pauses, the server's writes wait on it and the response stays in flight."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def mlxd(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_start_status_stop_with_a_graceful_drain(tmp_path, long_llama):
    env = _env(tmp_path)
    port, mport = free_port(), free_port()
    env["MLXD_METRICS__PORT"] = str(mport)
    env["MLXD_SERVER__SHUTDOWN_GRACE_S"] = "300"  # the drain waits for the held stream
    url = f"http://127.0.0.1:{port}"
    r = mlxd("start", "--model", long_llama, "--port", port, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"mlxd is running at {url}" in r.stdout
    home = Path(env["MLXD_HOME"])
    info = json.loads((home / "run" / f"mlxd-{port}.pid").read_text())
    assert info["port"] == port and info["log"] == str(home / "logs" / f"mlxd-{port}.log")

    try:
        again = mlxd("start", "--model", long_llama, "--port", port, env=env)
        assert again.returncode == 1 and "already running" in again.stderr
        assert f"pid {info['pid']}" in again.stderr

        st = mlxd("status", "--port", port, "--json", env=env)
        assert st.returncode == 0, st.stderr
        data = json.loads(st.stdout)
        assert data["running"] and data["pid"] == info["pid"]
        assert data["models"] == ["long-llama"] and data["uptime_s"] >= 0
        st = mlxd("status", "--port", port, env=env)
        assert st.returncode == 0 and "running" in st.stdout and str(info["pid"]) in st.stdout

        m = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5)  # metrics.port
        assert m.status_code == 200 and "mlxd:http_requests_total" in m.text
        assert 'mlxd:models_loaded{kind="chat"} 1.0' in m.text  # the engine core's families
        # no key applies there: a rebinding page's Host and a foreign Origin are refused
        m = httpx.get(
            f"http://127.0.0.1:{mport}/metrics",
            timeout=5,
            headers={"host": f"evil.example:{mport}"},
        )
        assert m.status_code == 403 and "server.allowed_hosts" in m.text
        m = httpx.get(
            f"http://127.0.0.1:{mport}/metrics",
            timeout=5,
            headers={"origin": "http://evil.example"},
        )
        assert m.status_code == 403 and "mlxd:" not in m.text

        # Drain: a request in flight when SIGTERM arrives completes; a new one gets 503.
        # The stream's client stops reading after its first event: with its small receive
        # buffer and ~6 MB to come (20 logprobs a token), the server cannot finish the
        # response before the client reads on, so it is in flight when `mlxd stop` signals,
        # however slow this machine is.
        held = _HeldStream("127.0.0.1", port, timeout=120)
        held.request(
            "POST",
            "/v1/chat/completions",
            headers={"Content-Type": "application/json"},
            body=json.dumps(
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 4000,
                    "stream": True,
                    "logprobs": True,
                    "top_logprobs": 20,
                }
            ),
        )
        stream = held.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: {")
        stopper = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "stop", "--port", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        refused = None
        deadline = time.time() + 120  # a bound to wait for the signal only
        while time.time() < deadline:
            r = httpx.post(
                url + "/v1/completions", json={"prompt": "y", "max_tokens": 1}, timeout=30
            )
            if r.status_code == 503:
                refused = r
                health = httpx.get(url + "/health", timeout=30)
                break
            time.sleep(0.05)
        assert refused is not None, "no 503 while draining"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 503 and health.json()["status"] == "draining"
        lines = stream.read().decode().split("\n")  # the client reads on: the rest comes
        held.close()
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # it finished
        assert "data: [DONE]" in lines
        out, _ = stopper.communicate(timeout=60)
        assert stopper.returncode == 0, out
        assert f"stopped mlxd on port {port}" in out
    finally:
        mlxd("stop", "--port", port, "--force", "--timeout", "5", env=env)

    st = mlxd("status", "--port", port, env=env)
    assert st.returncode == 1 and "not running" in st.stdout
    assert not (home / "run" / f"mlxd-{port}.pid").exists()
    log = (home / "logs" / f"mlxd-{port}.log").read_text()
    assert "shutting down: new requests get 503" in log and "all requests finished" in log


def _write_pidfile(home: Path, port: int, pid: int, **extra) -> Path:
    path = home / "run" / f"mlxd-{port}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"pid": pid, "port": port, "host": "127.0.0.1", "started_at": time.time(), **extra}
        )
    )
    return path


def test_stale_pid_files_are_detected_and_cleaned(tmp_path):
    env = _env(tmp_path)
    home = Path(env["MLXD_HOME"])
    port = free_port()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = _write_pidfile(home, port, gone.pid)
    r = mlxd("status", "--port", port, env=env)
    assert r.returncode == 1 and "not running" in r.stdout and "stale" in r.stderr
    assert not path.exists()

    # the pid now belongs to another program: never signalled, file removed
    other = subprocess.Popen(["sleep", "60"])
    try:
        path = _write_pidfile(home, port, other.pid)
        r = mlxd("stop", "--port", port, env=env)
        assert r.returncode == 0 and "stale" in r.stdout and "not running" in r.stdout
        assert not path.exists() and other.poll() is None
        # a python process that mentions mlxd, but started at another time than recorded
        fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "mlxd"])
        try:
            path = _write_pidfile(home, port, fake.pid, proc_start="1")
            r = mlxd("status", "--port", port, "--json", env=env)
            assert r.returncode == 1 and json.loads(r.stdout)["running"] is False
            assert not path.exists() and fake.poll() is None
        finally:
            fake.kill()
    finally:
        other.kill()
    r = mlxd("stop", "--all", env=env)
    assert r.returncode == 0 and "no mlxd server is running" in r.stdout


def test_a_failed_start_prints_the_log_tail_and_exits_1(tmp_path, tiny_llama):
    env = _env(tmp_path)
    with socket.socket() as busy:  # another program holds the port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = mlxd("start", "--model", tiny_llama, "--port", port, env=env)
    assert r.returncode == 1
    assert "failed to start" in r.stderr and "in use by another program" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (Path(env["MLXD_HOME"]) / "run" / f"mlxd-{port}.pid").exists()


def test_start_foreground_is_serve(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  prot: 80\n")
    r = mlxd("start", "--foreground", "--config", cfg, env=_env(tmp_path))
    assert r.returncode == 2 and "unknown key 'server.prot'" in r.stderr
    r = mlxd("start", "--config", cfg, env=_env(tmp_path))  # checked before spawning
    assert r.returncode == 2 and "unknown key 'server.prot'" in r.stderr
