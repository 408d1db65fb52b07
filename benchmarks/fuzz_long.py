"""The long fuzz: schemathesis over every operation of a real `mlxd serve`, for minutes.

    python benchmarks/fuzz_long.py [--minutes 5] [--examples 50] [--out summary.json]

The CI version is tests/ops/test_fuzz.py (20 examples per operation and mode, contained).
This one starts `python -m mlxd serve` in a subprocess on a throwaway MLXD_HOME (a tiny
random-weight llama from tests/fixtures, the hub switched off), and then, round after round
with a new seed each time until the time is up, fuzzes every documented operation in both
modes (valid and invalid requests) with tests/ops/fuzzing.py: nothing excluded, since the
store is thrown away (``POST /api/pull`` of generated names, unload and delete of the
served model included). Output lengths stay tiny (``max_tokens`` <= 4).

The summary JSON: requests sent, statuses per operation, every distinct failure (first
example, with the curl to reproduce), the known issues (tests/ops/fuzzing.py) with counts,
5xx seen, the server's "unhandled error" log lines, RSS of both server processes before and
after, and whether /health still answers 200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops"), str(Path(__file__).parent)]
from mlxd_proc import UNHANDLED, unhandled_samples  # noqa: E402
from serve_compare import free_port, wait_healthy  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_server(home: Path) -> tuple[subprocess.Popen, str, Path]:
    from fixtures.tiny_models import make_tiny_chat_model

    model = make_tiny_chat_model(home / "src" / "tiny-llama", "llama")
    port = free_port()
    cfg = home / "config.yaml"
    cfg.write_text(
        json.dumps(
            {  # JSON is YAML
                "server": {"host": "127.0.0.1", "port": port},
                "models": {
                    "default": str(model),
                    "dir": str(home / "models"),
                    "auto_download": False,
                },
                "engine": {"max_num_seqs": 8},
                "log": {"level": "info"},
            }
        )
    )
    env = {
        **os.environ,
        "MLXD_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src"),
    }
    log = home / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg)],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, "/health", timeout=300)
    return proc, url, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--examples", type=int, default=50, help="per operation, mode and round")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "fuzz-long.json")
    args = ap.parse_args()

    from fuzzing import KNOWN_ISSUES, fuzz_operation, load_schema, operations
    from schemathesis import GenerationMode

    with tempfile.TemporaryDirectory(prefix="mlxd-fuzz-") as tmp:
        home = Path(tmp)
        try:
            proc, url, log = start_server(home)
        except RuntimeError:
            print((home / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        try:
            health = httpx.get(url + "/health", timeout=10).json()
            pids = {"frontend": proc.pid, "engine_core": health["engine_core"]["pid"]}
            rss_before = {k: rss_kib(p) for k, p in pids.items()}
            schema = load_schema(url)
            ops = operations(schema)
            t0 = time.monotonic()
            deadline = t0 + args.minutes * 60
            per_op: dict[str, dict] = {}
            failures: dict[str, dict] = {}
            known: dict[str, dict] = {}
            rounds = 0
            while time.monotonic() < deadline:
                rounds += 1
                for op in ops:
                    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                        if time.monotonic() >= deadline:
                            break
                        res = fuzz_operation(
                            op,
                            mode,
                            base_url=url,
                            model="tiny-llama",
                            max_examples=args.examples,
                            seed=rounds,
                            contained=False,
                        )
                        key = f"{res.operation} [{res.mode}]"
                        agg = per_op.setdefault(
                            key,
                            {
                                "examples": 0,
                                "seconds": 0.0,
                                "statuses": Counter(),
                                "unsatisfiable": False,
                            },
                        )
                        agg["examples"] += res.examples
                        agg["seconds"] += res.seconds
                        agg["statuses"].update(res.statuses)
                        agg["unsatisfiable"] |= res.unsatisfiable
                        if res.failure:
                            kind = res.failure.split("\n- ", 1)[-1].split("\n", 1)[0]
                            f = failures.setdefault(
                                f"{key}: {kind}",
                                {"count": 0, "first_round": rounds, "detail": res.failure},
                            )
                            f["count"] += 1
                        for name, seen in res.known.items():
                            k = known.setdefault(
                                name,
                                {
                                    "where": KNOWN_ISSUES[name].where,
                                    "count": 0,
                                    "routes": {},
                                    "example": seen,
                                },
                            )
                            k["count"] += seen["count"]
                            k["routes"][res.operation] = (
                                k["routes"].get(res.operation, 0) + seen["count"]
                            )
            elapsed = time.monotonic() - t0
            h = httpx.get(url + "/health", timeout=30)
            rss_after = {k: rss_kib(p) for k, p in pids.items()}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        text = log.read_text(errors="replace")

    statuses = Counter()
    for agg in per_op.values():
        statuses.update(agg["statuses"])
    summary = {
        "minutes": round(elapsed / 60, 2),
        "rounds": rounds,
        "examples_per_operation_mode_round": args.examples,
        "operations": len(ops),
        "requests": sum(statuses.values()),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "failures": failures,
        "known_issues": known,
        "unhandled_errors_in_server_log": len(UNHANDLED.findall(text)),
        "unhandled_error_samples": unhandled_samples(text),
        "health_after": {"status_code": h.status_code, "body": h.json()},
        "rss_kib": {"before": rss_before, "after": rss_after},
        "per_operation": {
            k: {
                **v,
                "seconds": round(v["seconds"], 1),
                "statuses": {str(s): n for s, n in sorted(v["statuses"].items())},
            }
            for k, v in per_op.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "minutes",
                    "rounds",
                    "requests",
                    "statuses",
                    "server_errors_5xx",
                    "unhandled_errors_in_server_log",
                )
            },
            indent=1,
        )
    )
    print("failures:", list(failures) or "none", "| known issues:", list(known) or "none")


if __name__ == "__main__":
    main()
