"""The long attack campaign: what an outsider tries against a real `mlxd serve`, with 1 and
2 front ends.

    python benchmarks/attack_campaign.py [--workers 1,2] [--phases open,keyed,life]
                                         [--out summary.json]

Each phase starts `python -m mlxd serve` on a throwaway MLXD_HOME (a tiny random-weight
llama from tests/fixtures, the hub off) and checks what docs/security.md promises:

* cross-site: every route of /openapi.json and the web UI's, with a foreign ``Origin`` and a
  ``text/plain`` body, and with a rebinding ``Host``: 403, and the model is still loaded;
* cross-key: keys alice, bob and an admin key; bob reads, continues and deletes alice's
  stored response (404 each, the object intact for alice), lists the request log (none of
  alice's paths), the admin key lists everything;
* bombs: template variables that name a template or the server's own arguments, grammars
  the grammar engine cannot serve, malformed tool calls: a 4xx each, never a 5xx, never a
  "stop" with invalid output; and an unrelated chat's latency while they run;
* lifecycle, per front-end count: kill -9 of the engine core under streaming load (every
  stream ends with an error event or completes, /health's code and status word agree),
  kill -9 of one front end (with 2: its gauges leave /metrics, /health counts the restart),
  SIGTERM under load (/health 503 "draining", in-flight streams complete, new requests 503
  with Retry-After, the process exits).

The CI-sized sweep is tests/ops/test_attack_campaign.py. Exit status 1 when any check
failed; the summary JSON lists every check with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).parent)]
from conftest import core_call  # noqa: E402
from mlxd_proc import UNHANDLED, free_port  # noqa: E402

from mlxd.enginecore.protocol import Fault  # noqa: E402

EVIL = "http://evil.example"
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "root": "sk-root-0123456789"}


class Checks:
    """Every check's outcome, in order; ``ok`` is False once any failed."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def check(self, phase: str, name: str, passed: bool, seen: Any = None) -> bool:
        self.rows.append({"phase": phase, "check": name, "passed": bool(passed), "seen": seen})
        print(
            f"[{'ok' if passed else 'FAIL'}] {phase}: {name}"
            + ("" if passed else f"  seen: {str(seen)[:300]}"),
            flush=True,
        )
        return passed

    @property
    def ok(self) -> bool:
        return all(r["passed"] for r in self.rows)


class Server:
    """One `mlxd serve` on a free port with a YAML config (JSON is YAML)."""

    def __init__(
        self,
        home: Path,
        model: Path,
        *,
        workers: int = 1,
        keys: bool = False,
        extra: dict | None = None,
    ) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg: dict[str, Any] = {
            "server": {
                "host": "127.0.0.1",
                "port": self.port,
                "api_workers": workers,
                "shutdown_grace_s": 20,
            },
            "models": {"default": str(model), "dir": str(home / "models"), "auto_download": False},
            "engine": {"max_num_seqs": 8},
            "log": {"level": "info"},
        }
        if keys:
            cfg["security"] = {
                "api_keys": [
                    {"name": "alice", "key": KEYS["alice"]},
                    {"name": "bob", "key": KEYS["bob"]},
                    {"name": "root", "key": KEYS["root"], "admin": True},
                ]
            }
        for section, values in (extra or {}).items():
            cfg.setdefault(section, {}).update(values)
        (home / "config.yaml").write_text(json.dumps(cfg))
        self.log = home / "server.log"
        env = {
            **os.environ,
            "MLXD_HOME": str(home),
            "HF_HUB_OFFLINE": "1",
            "MLXD_TEST_FAULTS": "1",
            "PYTHONPATH": str(ROOT / "src"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "serve", "--config", str(home / "config.yaml")],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.proc.kill()
                raise TimeoutError(self.log.read_text()[-3000:])
            time.sleep(0.3)

    def client(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        headers = {"authorization": f"Bearer {KEYS[key]}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def health(self) -> httpx.Response:
        return httpx.get(
            self.url + "/health", timeout=10, headers={"authorization": f"Bearer {KEYS['root']}"}
        )

    def front_ends(self, n: int) -> list[int]:
        """The pids of ``n`` front ends, as /health names them (each connection may meet
        another)."""
        pids: set[int] = set()
        deadline = time.time() + 60
        while len(pids) < n and time.time() < deadline:
            r = self.health()
            if r.status_code == 200 and r.json().get("frontend_pid"):
                pids.add(r.json()["frontend_pid"])
        return sorted(pids)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def unhandled(self) -> int:
        return sum(
            1
            for line in self.log.read_text(errors="replace").splitlines()
            if UNHANDLED.search(line)
        )


def routes(srv: Server) -> list[tuple[str, str]]:
    """(method, path) of every documented operation plus the web UI's, ids filled in."""
    spec = httpx.get(srv.url + "/openapi.json", timeout=10).json()
    out = []
    for path, ops in spec["paths"].items():
        concrete = path.replace("{response_id}", "resp_x").replace("{model_id}", "tiny-llama")
        concrete = concrete.replace("{path}", "app.js")
        for method in ops:
            if method in ("get", "post", "delete", "put", "patch"):
                out.append((method.upper(), concrete))
    out += [
        ("GET", p)
        for p in ("/", "/ui/", "/ui/api/overview", "/ui/api/stats", "/ui/api/requests", "/metrics")
    ]
    return sorted(set(out))


def phase_cross_site(checks: Checks, srv: Server) -> None:
    phase = "cross-site"
    bad_origin, bad_host = [], []
    for method, path in routes(srv):
        r = httpx.request(
            method,
            srv.url + path,
            content=b'{"model": "tiny-llama"}',
            headers={"origin": EVIL, "content-type": "text/plain"},
            timeout=30,
        )
        if r.status_code != 403 and path != "/health":  # probes: the status only
            bad_origin.append((method, path, r.status_code))
        r = httpx.request(
            method,
            srv.url + path,
            content=b'{"model": "tiny-llama"}',
            headers={"host": f"evil.example:{srv.port}", "content-type": "text/plain"},
            timeout=30,
        )
        if r.status_code != 403 and path != "/health":
            bad_host.append((method, path, r.status_code))
    checks.check(
        phase, "a foreign Origin is 403 on every route but /health", not bad_origin, bad_origin
    )
    checks.check(
        phase, "a rebinding Host is 403 on every route but /health", not bad_host, bad_host
    )
    ps = httpx.get(srv.url + "/api/ps", timeout=10).json()
    checks.check(
        phase,
        "the model is still loaded after the sweep",
        any(m["name"] == "tiny-llama" for m in ps.get("models", [])),
        ps,
    )
    r = httpx.get(srv.url + "/health", headers={"origin": EVIL}, timeout=30)
    checks.check(
        phase,
        "/health for a foreign page says only its status",
        set(r.json()) == {"status"},
        r.text[:200],
    )
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
    checks.check(phase, "a request without Origin is served", r.status_code == 200, r.text)


def phase_cross_key(checks: Checks, srv: Server) -> None:
    phase = "cross-key"
    with srv.client("alice") as alice, srv.client("bob") as bob, srv.client("root") as root:
        r = alice.post(
            "/v1/responses",
            json={"model": "tiny-llama", "input": "secret plans", "max_output_tokens": 4},
        )
        if not checks.check(phase, "alice stores a response", r.status_code == 200, r.text):
            return
        rid = r.json()["id"]
        missing = bob.get("/v1/responses/resp_doesnotexist")
        got = bob.get(f"/v1/responses/{rid}")
        checks.check(
            phase,
            "bob's GET of alice's response is the same 404 as a missing id",
            got.status_code == 404
            and got.json()["error"]["type"] == missing.json()["error"]["type"],
            got.text,
        )
        cont = bob.post(
            "/v1/responses",
            json={
                "model": "tiny-llama",
                "input": "go on",
                "previous_response_id": rid,
                "max_output_tokens": 4,
            },
        )
        checks.check(
            phase, "bob cannot continue alice's response", cont.status_code == 404, cont.text
        )
        dele = bob.delete(f"/v1/responses/{rid}")
        checks.check(
            phase, "bob cannot delete alice's response", dele.status_code == 404, dele.text
        )
        mine = alice.get(f"/v1/responses/{rid}")
        checks.check(phase, "alice still reads her response", mine.status_code == 200, mine.text)
        # with several front ends each keeps its own log: ask each a few times
        seen_bob, seen_root = set(), set()
        for _ in range(8):
            seen_bob |= {
                row.get("key") or row.get("key_name") for row in _rows(bob.get("/ui/api/requests"))
            }
            seen_root |= {
                row.get("key") or row.get("key_name") for row in _rows(root.get("/ui/api/requests"))
            }
        checks.check(
            phase,
            "bob's request log holds only bob's requests",
            seen_bob <= {"bob"},
            sorted(map(str, seen_bob)),
        )
        checks.check(
            phase,
            "the admin key's request log holds alice's requests too",
            "alice" in seen_root,
            sorted(map(str, seen_root)),
        )
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
        checks.check(phase, "no key: 401", r.status_code == 401, r.status_code)


def _rows(r: httpx.Response) -> list[dict]:
    body = r.json() if r.status_code == 200 else {}
    rows = body.get("requests", body.get("data", [])) if isinstance(body, dict) else body
    return [row for row in rows if isinstance(row, dict)]


TEMPLATE_BOMB = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
)
BAD_KWARGS = [
    {"chat_template": "SYSTEM OVERRIDE: {{ messages|length }}"},
    {"chat_template": TEMPLATE_BOMB},
    {"messages": "x"},
    {"tools": "x"},
    {"add_generation_prompt": False},
    {"tokenize": False},
]
BAD_FORMATS = [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                "required": ["a"],
            },
        },
    },
    {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(((a+)+)+)+$"}},
    },
]
BAD_MESSAGES = [
    [
        {
            "role": "assistant",
            "tool_calls": [{"id": "a", "type": "function", "function": "notadict"}],
        }
    ],
    [{"role": "assistant", "tool_calls": "x"}],
    [
        {
            "role": "assistant",
            "tool_calls": [{"id": "a", "type": "function", "function": {"arguments": 5}}],
        }
    ],
    [{"role": "tool", "content": {"x": 1}}],
]


def _latency(url: str) -> float:
    t = time.monotonic()
    httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=300)
    return time.monotonic() - t


def _send(c: httpx.Client, body: dict) -> tuple[int | str, dict | str]:
    """A chat request's status and JSON body, or the transport error's name (a hung
    request is a finding, not a crash of the campaign)."""
    try:
        r = c.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return type(exc).__name__, ""
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _valid_or_refused(status: int | str, body: dict | str) -> bool:
    """400, or an answer whose "stop" holds valid JSON (truncation must say so)."""
    if status == 400:
        return True
    if status != 200 or not isinstance(body, dict):
        return False
    choice = body["choices"][0]
    if choice["finish_reason"] != "stop":
        return True
    try:
        json.loads(choice["message"]["content"] or "")
        return True
    except ValueError:
        return False


def phase_bombs(checks: Checks, srv: Server) -> None:
    phase = "bombs"
    with srv.client(timeout=30) as c:
        for kw in BAD_KWARGS:
            status, body = _send(c, {**CHAT, "chat_template_kwargs": kw})
            checks.check(
                phase,
                f"chat_template_kwargs {list(kw)} is a 400",
                status == 400,
                (status, str(body)[:200]),
            )
        for fmt in BAD_FORMATS:
            status, body = _send(c, {**CHAT, "response_format": fmt, "max_tokens": 16})
            checks.check(
                phase,
                f"response_format {json.dumps(fmt)[:60]} is refused or valid",
                _valid_or_refused(status, body),
                (status, str(body)[:200]),
            )
        for msgs in BAD_MESSAGES:
            status, body = _send(c, {**CHAT, "messages": [{"role": "user", "content": "x"}, *msgs]})
            checks.check(
                phase,
                f"malformed message {json.dumps(msgs)[:60]} is a 4xx",
                isinstance(status, int) and 400 <= status < 500,
                (status, str(body)[:200]),
            )
    # an unrelated chat while eight callers send template bombs and leave after 2 s
    base = sorted(_latency(srv.url) for _ in range(5))[2]

    def bomb() -> None:
        try:
            httpx.post(
                srv.url + "/v1/chat/completions",
                timeout=2,
                json={**CHAT, "chat_template_kwargs": {"chat_template": TEMPLATE_BOMB}},
            )
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=bomb) for _ in range(8)]
    for t in threads:
        t.start()
    during = sorted(_latency(srv.url) for _ in range(5))[2]
    for t in threads:
        t.join()
    checks.check(
        phase,
        "an unrelated chat is served while bombs arrive (latency in seen)",
        True,
        {"median_s_idle": round(base, 3), "median_s_during": round(during, 3)},
    )


def _stream(url: str, out: list, body: dict) -> None:
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out.append(("status", r.status_code))
                return
            text = "".join(r.iter_lines())
            out.append(
                ("error" if '"error"' in text else "done" if "[DONE]" in text else "cut", 200)
            )
    except httpx.HTTPError as exc:
        out.append(("transport", type(exc).__name__))


def _load(url: str, n: int, max_tokens: int = 200) -> tuple[list, list[threading.Thread]]:
    out: list = []
    body = {**CHAT, "max_tokens": max_tokens, "stream": True}
    threads = [threading.Thread(target=_stream, args=(url, out, body)) for _ in range(n)]
    for t in threads:
        t.start()
    return out, threads


def _health_consistent(r: httpx.Response) -> bool:
    status = r.json().get("status")
    return (r.status_code == 200) == (status in ("ok", "degraded"))


def phase_core_kill(checks: Checks, srv: Server, workers: int) -> None:
    phase = f"core kill -9 ({workers} front end{'s' * (workers > 1)})"
    pid = srv.health().json()["engine_core"]["pid"]
    out, threads = _load(srv.url, 6)
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    inconsistent = []
    deadline = time.time() + 120
    back = False
    while time.time() < deadline:
        try:
            r = srv.health()
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        if not _health_consistent(r):
            inconsistent.append((r.status_code, r.json().get("status")))
        if r.status_code == 200 and r.json()["engine_core"]["pid"] != pid:
            back = True
            break
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    checks.check(
        phase,
        "every stream ends with an error event or completes",
        all(o[0] in ("error", "done", "status") for o in out),
        out,
    )
    checks.check(
        phase, "/health's code and status word always agree", not inconsistent, inconsistent[:5]
    )
    checks.check(phase, "a new core serves", back)
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
    checks.check(phase, "requests succeed again", r.status_code == 200, r.status_code)


def _gauge(srv: Server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


def phase_frontend_kill(checks: Checks, srv: Server) -> None:
    phase = "front-end kill -9 (2 front ends)"
    fronts = srv.front_ends(2)
    if not checks.check(phase, "two front-end processes found", len(fronts) >= 2, fronts):
        return
    core_restarts = srv.health().json().get("worker_restarts", 0)
    out, threads = _load(srv.url, 8, max_tokens=400)
    time.sleep(1.5)
    os.kill(fronts[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    deadline = time.time() + 60
    waiting = running = -1.0
    while time.time() < deadline:
        waiting = _gauge(srv, "mlxd:num_requests_waiting")
        running = _gauge(srv, "mlxd:num_requests_running")
        if waiting == 0 and running == 0:
            break
        time.sleep(0.5)
    checks.check(
        phase,
        "the killed front end's gauges leave /metrics",
        waiting == 0 and running == 0,
        {"waiting": waiting, "running": running},
    )
    deadline = time.time() + 60
    fronts_seen: Any = None
    while time.time() < deadline:
        health = srv.health().json()
        fronts_seen = health.get("front_ends")
        if isinstance(fronts_seen, dict) and fronts_seen.get("restarts", 0) >= 1:
            break
        time.sleep(0.5)
    checks.check(
        phase,
        "/health counts the front-end restart apart from the core's",
        isinstance(fronts_seen, dict)
        and fronts_seen.get("restarts") == 1
        and health.get("worker_restarts", 0) == core_restarts,
        fronts_seen,
    )


def phase_sigterm(checks: Checks, srv: Server, workers: int) -> None:
    phase = f"SIGTERM drain ({workers} front end{'s' * (workers > 1)})"
    # steps of 50 ms: the streams are still running while the drain is probed
    core_call(srv.url, Fault("slow_steps", model="tiny-llama", seconds=0.05))
    out, threads = _load(srv.url, 4, max_tokens=150)
    time.sleep(1.0)
    srv.proc.send_signal(signal.SIGTERM)
    health, fresh = [], []
    for _ in range(10):
        try:
            r = httpx.get(srv.url + "/health", timeout=5)
            health.append((r.status_code, r.json().get("status")))
            r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=10)
            fresh.append((r.status_code, r.headers.get("retry-after")))
        except httpx.HTTPError as exc:
            fresh.append((type(exc).__name__, None))
        time.sleep(0.1)
    for t in threads:
        t.join(120)
    code = srv.proc.wait(120)
    checks.check(
        phase,
        "/health is 503 draining from the signal on",
        bool(health) and all(h == (503, "draining") for h in health),
        health,
    )
    checks.check(
        phase,
        "new requests get 503 with Retry-After",
        bool(fresh) and all(f[0] == 503 and f[1] for f in fresh),
        fresh,
    )
    checks.check(phase, "in-flight streams complete", all(o[0] == "done" for o in out), out)
    # uvicorn ends a drained server by re-raising the signal: -SIGTERM is a clean end too
    checks.check(phase, "the server exits cleanly", code in (0, -signal.SIGTERM), code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2", help="front-end counts for the lifecycle")
    ap.add_argument(
        "--phases",
        default="open,keyed,life",
        help="open (cross-site, bombs), keyed (cross-key), life (kills, drains)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    from fixtures.tiny_models import make_tiny_chat_model

    checks = Checks()
    unhandled = 0
    with tempfile.TemporaryDirectory(prefix="mlxd-attack-") as tmp:
        model = make_tiny_chat_model(Path(tmp) / "tiny-llama", "llama")

        def server(name: str, **kw: Any) -> Server:
            home = Path(tmp) / name
            home.mkdir()
            return Server(home, model, **kw)

        if "open" in phases:
            srv = server("open")
            try:
                phase_cross_site(checks, srv)
                phase_bombs(checks, srv)
            finally:
                srv.stop()
                unhandled += srv.unhandled()
        if "keyed" in phases:
            srv = server("keyed", keys=True)
            try:
                phase_cross_key(checks, srv)
            finally:
                srv.stop()
                unhandled += srv.unhandled()
        for workers in (int(w) for w in args.workers.split(",") if "life" in phases):
            srv = server(f"life-{workers}", workers=workers)
            try:
                phase_core_kill(checks, srv, workers)
                if workers > 1:
                    phase_frontend_kill(checks, srv)
                phase_sigterm(checks, srv, workers)
            finally:
                srv.stop()
                unhandled += srv.unhandled()
    checks.check("all", "no unhandled error in any server log", unhandled == 0, unhandled)
    summary = {
        "passed": checks.ok,
        "checks": checks.rows,
        "failed": [r for r in checks.rows if not r["passed"]],
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{sum(r['passed'] for r in checks.rows)} passed, "
        f"{sum(not r['passed'] for r in checks.rows)} failed"
    )
    sys.exit(0 if checks.ok else 1)


if __name__ == "__main__":
    main()
