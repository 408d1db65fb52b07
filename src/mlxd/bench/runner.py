"""Interleaved passes against mlxd and a peer, their summary, the table and the JSON.

Per concurrency: a short warm-up pass on each side, then ``pairs`` pairs of passes, the
order of each pair the reverse of the previous one (mlxd, peer; peer, mlxd; ...), so that
both sides meet a host whose speed drifts in the same mood. Both sides of a pair get the
same prompts, new to both; every pair has prompts of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from mlxd import __version__
from mlxd.bench.engine_peer import EnginePeer
from mlxd.bench.load import Target, make_prompts, pct, run_pass
from mlxd.bench.servers import BenchError, Server, mlx_lm_command, mlxd_command, wait_ready

PEER_KINDS = ("mlx_lm", "engine", "none")
URL_PEER_TIMEOUT = 30.0  # a server said to be running answers at once; a wrong URL never


@dataclass
class BenchOptions:
    model: str
    peer: str = "mlx_lm"
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    pairs: int = 10
    max_tokens: int = 128
    prompt_tokens: int = 256
    requests_per_client: int = 2
    server_args: str = ""
    peer_args: str = ""
    peer_blas: bool = False
    seed: int | None = None
    json_path: Path | None = None
    command: str = ""
    start_timeout: float = 600.0
    # mlxd's Authorization header where its settings name API keys; never written out
    mlxd_headers: dict[str, str] = field(default_factory=dict)


def run(opts: BenchOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the servers, run every level, stop them; returns (and writes) the results."""
    if opts.peer not in PEER_KINDS and not opts.peer.startswith(("http://", "https://")):
        raise BenchError(
            f"--peer must be mlx_lm, engine, none or an http(s) URL, not {opts.peer!r}"
        )
    if opts.model.startswith(("/", ".", "~")) and not Path(opts.model).expanduser().is_dir():
        raise BenchError(f"no model directory at {opts.model}")
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(2**31)
    results: dict[str, Any] = {
        "command": opts.command,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mlxd_version": __version__,
        "git_commit": _git_commit(),
        "machine": _machine(),
        "model": opts.model,
        "options": {
            k: v
            for k, v in asdict(opts).items()
            if k not in ("json_path", "command", "mlxd_headers")
        },
        "complete": False,
        "levels": [],
    }
    with _stopping_on_sigterm(), tempfile.TemporaryDirectory(prefix="mlxd-bench-") as tmp:
        with contextlib.ExitStack() as servers:
            targets = _start(opts, Path(tmp), servers, results, say)
            for c in opts.concurrency:
                results["levels"].append(_level(opts, targets, c, say))
                _write(opts, results)
            say("stopping the servers")
    results["complete"] = True
    results["machine"]["load_average_end"] = _load_average()
    _write(opts, results)
    return results


def _start(
    opts: BenchOptions,
    tmp: Path,
    stack: contextlib.ExitStack,
    results: dict[str, Any],
    say: Callable[[str], None],
) -> list[Target | EnginePeer]:
    """mlxd first (it pulls a store model that is not there yet), then the peer; a peer
    already running is asked first, so that a wrong URL costs no server start."""
    seqs = max(opts.concurrency)
    url = opts.peer.rstrip("/")
    if url.startswith(("http://", "https://")):
        try:
            wait_ready(url, ("/v1/models", "/health"), timeout=URL_PEER_TIMEOUT)
        except BenchError as exc:
            raise BenchError(f"peer {url}: {exc}") from None
    env = dict(os.environ)
    # the prefix cache's disk tier of a run stays out of the user's home
    env.setdefault("MLXD_ENGINE__PREFIX_CACHE_DIR", str(tmp / "prefix-cache"))
    mlxd = Server(
        "mlxd",
        mlxd_command(opts.model, seqs, shlex.split(opts.server_args)),
        tmp / "mlxd.log",
        env,
        ready=("/health",),
    )
    say(f"starting mlxd: {shlex.join(mlxd.cmd)}")
    stack.callback(mlxd.stop)
    mlxd.start(opts.start_timeout)
    say(f"mlxd ready at {mlxd.url} (pid {mlxd.pid})")
    health = httpx.get(mlxd.url + "/health", headers=opts.mlxd_headers, timeout=30).json()
    results["machine"]["mlx_devices"] = sorted(
        {str(c.get("device")) for c in health.get("engine_cores", [])}
    )
    results["mlxd"] = {"url": mlxd.url, "command": shlex.join(mlxd.cmd)}
    targets: list[Target | EnginePeer] = [
        Target("mlxd", mlxd.url, _served_name(opts.model), opts.mlxd_headers)
    ]
    if opts.peer == "none":
        results["peer"] = None
        return targets
    if opts.peer == "mlx_lm":
        model_dir = _model_dir(opts.model, opts.peer)
        peer_env, preload = _peer_env(opts.peer_blas)
        peer = Server(
            "mlx_lm",
            mlx_lm_command(model_dir, seqs, shlex.split(opts.peer_args)),
            tmp / "mlx_lm.log",
            peer_env,
            ready=("/health", "/v1/models"),
        )
        say(f"starting mlx_lm.server: {shlex.join(peer.cmd)}")
        stack.callback(peer.stop)
        peer.start(opts.start_timeout)
        say(f"mlx_lm.server ready at {peer.url} (pid {peer.pid})")
        # "default_model" is the model named on its command line: no load on request
        targets.append(Target("mlx_lm", peer.url, "default_model"))
        results["peer"] = {
            "kind": "mlx_lm",
            "url": peer.url,
            "command": shlex.join(peer.cmd),
            "ld_preload": preload,
        }
        return targets
    if opts.peer == "engine":
        from mlxd.config import load_settings

        engine = EnginePeer(
            _model_dir(opts.model, opts.peer), load_settings(None), tmp / "engine.log"
        )
        say(f"starting the engine alone: {shlex.join(engine.cmd)}")
        stack.callback(engine.stop)
        engine.start(opts.start_timeout)
        say(f"engine alone ready (pid {engine.pid}): {engine.loaded}")
        targets.append(engine)
        results["peer"] = {
            "kind": "engine",
            "command": shlex.join(engine.cmd),
            "env": engine.mlx_env,
            **engine.loaded,
        }
        return targets
    model = _peer_model(url, _served_name(opts.model))
    targets.append(Target("peer", url, model))
    results["peer"] = {"kind": "url", "url": url, "model": model}
    return targets


def _peer_env(same_blas: bool) -> tuple[dict[str, str] | None, str | None]:
    """The peer's environment: as inherited, or with the BLAS mlxd loads preloaded
    (``LD_PRELOAD``), so that on a Linux CPU the two differ in the server, not the BLAS."""
    if not same_blas:
        return None, None
    from mlxd import blas
    from mlxd.config import load_settings

    info = blas.preload(load_settings(None).backend.blas)
    if not info.loaded or info.path is None:
        raise BenchError(f"--peer-blas: mlxd loads no BLAS of its own here ({info.name})")
    before = os.environ.get("LD_PRELOAD")
    return {**os.environ, "LD_PRELOAD": f"{info.path} {before}" if before else info.path}, info.path


def _served_name(model: str) -> str:
    """The name mlxd serves MODEL under: a directory's own name, else MODEL itself."""
    p = Path(model).expanduser()
    if ("/" in model or model.startswith(".")) and p.is_dir():
        return p.resolve().name
    return model


def _model_dir(model: str, peer: str) -> Path:
    """MODEL's directory, for a peer that loads from disk: MODEL itself, or its store entry
    (after mlxd started, which pulls a model the store lacks)."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve()
    from mlxd.config import load_settings
    from mlxd.store.catalog import ModelCatalog

    settings = load_settings(None)
    found = ModelCatalog.from_settings(settings).path(model)
    if found is None:
        raise BenchError(
            f"--peer {peer} needs a model directory: {model!r} is not one, nor in the store "
            f"at {settings.models_dir}"
        )
    return found


def _peer_model(url: str, fallback: str) -> str:
    """The peer's one model, if it lists exactly one; else the name mlxd serves."""
    try:
        data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return fallback
    ids = [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")]
    return ids[0] if len(ids) == 1 else fallback


def _pass(t: Target | EnginePeer, prompts: list[str], c: int, max_tokens: int) -> dict[str, Any]:
    if isinstance(t, EnginePeer):
        return t.run_pass(prompts, c, max_tokens)
    return asyncio.run(run_pass(t, prompts, c, max_tokens))


def _level(
    opts: BenchOptions, targets: list[Target | EnginePeer], c: int, say: Callable[[str], None]
) -> dict[str, Any]:
    n = c * opts.requests_per_client
    assert opts.seed is not None
    warm = make_prompts(c, _prompt_seed(opts.seed, c, -1), opts.prompt_tokens)
    for t in targets:
        w = _pass(t, warm, c, min(opts.max_tokens, 8))
        if w["errors"] == w["requests"]:  # nothing to measure: say why now, not at the end
            raise BenchError(f"{t.name} ({t.url}) failed every request: {w['error_samples'][0]}")
    pairs = []
    for k in range(opts.pairs):
        prompts = make_prompts(n, _prompt_seed(opts.seed, c, k), opts.prompt_tokens)
        order = targets if k % 2 == 0 else targets[::-1]
        pair: dict[str, Any] = {"order": [t.name for t in order]}
        for t in order:
            pair[t.name] = _pass(t, prompts, c, opts.max_tokens)
        if len(targets) == 2:
            a, b = (pair[t.name]["output_tps"] for t in targets)
            pair["ratio"] = a / b if b else None
        say(
            f"C={c} pair {k + 1}/{opts.pairs}: "
            + ", ".join(f"{t.name} {pair[t.name]['output_tps']:.1f} tok/s" for t in order)
            + (f" (mlxd/{targets[1].name} {pair['ratio']:.2f})" if pair.get("ratio") else "")
        )
        pairs.append(pair)
    level: dict[str, Any] = {"concurrency": c, "sides": {}}
    for t in targets:
        level["sides"][t.name] = _side_summary([p[t.name] for p in pairs])
    ratios = [p["ratio"] for p in pairs if p.get("ratio") is not None]
    level["ratio"] = (
        {
            "of": f"mlxd/{targets[1].name} output tok/s",
            "per_pair": ratios,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
        if ratios
        else None
    )
    level["pairs"] = [
        {k: (_pass_row(v) if isinstance(v, dict) else v) for k, v in p.items()} for p in pairs
    ]
    return level


def _prompt_seed(seed: int, concurrency: int, pair: int) -> int:
    """Prompts of their own for each level's warm-up (pair -1) and each pair."""
    return seed * 1_000_003 + concurrency * 10_007 + pair + 1


def _side_summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One side at one concurrency: throughput per pass, latencies pooled over passes."""
    tps = [p["output_tps"] for p in passes]
    ttft = [x for p in passes for x in p["ttft_s"]]
    gaps = [x for p in passes for x in p["gaps_s"]]
    prompt = [p["prompt_tokens_mean"] for p in passes if p["prompt_tokens_mean"] is not None]
    return {
        "output_tps": {
            "median": statistics.median(tps),
            "min": min(tps),
            "max": max(tps),
            "per_pass": tps,
        },
        "ttft_s": {"p50": pct(ttft, 50), "p95": pct(ttft, 95)},
        "inter_token_s": {
            "p50": pct(gaps, 50),
            "p95": pct(gaps, 95),
            "max": max(gaps, default=None),
        },
        "requests": sum(p["requests"] for p in passes),
        "errors": sum(p["errors"] for p in passes),
        "error_samples": [e for p in passes for e in p["error_samples"]][:5],
        "output_tokens": sum(p["output_tokens"] for p in passes),
        "finished_by_length": sum(p["finished_by_length"] for p in passes),
        "prompt_tokens_mean": statistics.mean(prompt) if prompt else None,
    }


def _pass_row(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "output_tps": p["output_tps"],
        "output_tokens": p["output_tokens"],
        "wall_s": p["wall_s"],
        "errors": p["errors"],
        "ttft_p50_s": pct(p["ttft_s"], 50),
        "inter_token_p95_s": pct(p["gaps_s"], 95),
    }


def table(results: dict[str, Any]) -> str:
    """The results as a Markdown table (milliseconds for latencies)."""

    def ms(x: float | None) -> str:
        return f"{x * 1000:.0f}" if x is not None else "-"

    rows = [
        "| C | side | tok/s median (min-max) | TTFT p50 / p95 ms | inter-token p50 / p95 / max"
        " ms | errors | mlxd/peer per pair: median (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for lv in results["levels"]:
        r = lv["ratio"]
        ratio = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
        for i, (name, s) in enumerate(lv["sides"].items()):
            t, g, tps = s["ttft_s"], s["inter_token_s"], s["output_tps"]
            rows.append(
                f"| {lv['concurrency']} | {name} | {tps['median']:.1f} ({tps['min']:.1f}-"
                f"{tps['max']:.1f}) | {ms(t['p50'])} / {ms(t['p95'])} | {ms(g['p50'])} / "
                f"{ms(g['p95'])} / {ms(g['max'])} | {s['errors']} | {ratio if i == 0 else ''} |"
            )
    return "\n".join(rows)


def _write(opts: BenchOptions, results: dict[str, Any]) -> None:
    if opts.json_path is not None:
        opts.json_path.write_text(json.dumps(results, indent=2) + "\n")


def _git_commit() -> str | None:
    """The commit of the source tree mlxd runs from, with ``-dirty`` if it has changes;
    None for an installed wheel."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _machine() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        # other work on the host: a shared machine's figures are its own, not the servers'
        "load_average_start": _load_average(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_default_device": _mlx_device(),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _mlx_device() -> str | None:
    """MLX's default device, asked of a child process: this one never imports MLX."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import mlx.core as mx; print(mx.default_device())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def _stopping_on_sigterm() -> Iterator[None]:
    """SIGTERM as Ctrl-C: the servers are stopped on the way out either way."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
