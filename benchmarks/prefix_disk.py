"""Turn 10 of an agent conversation: warm server, restarted with the disk tier, cold.

An agent-style conversation (a long system prompt listing tools, then short user turns,
each resending the whole history) is played up to its next-to-last turn on a server with
the prefix cache's disk tier on, and the disk tier's folder is copied once its writes are
done. The last turn's time to first token on that server is the *warm* figure (its history
comes from the memory tier). Then the folder is put back as it was before the last turn,
a new server starts on the same ``MLXD_HOME`` and the very same last-turn request is sent:
its history now comes from the disk tier (*restart, disk*). Once more with the prefix
cache off (``MLXD_ENGINE__PREFIX_CACHE_BYTES=0``): the whole prompt is prefilled
(*restart, no disk*, what a restart cost before the disk tier). Medians over
``--conversations`` conversations (different tasks, the same system prompt); every timed
request waits until the disk tier's queued writes are done, so no measurement shares the
CPU with a write.

    python benchmarks/prefix_disk.py --model-dir ~/.mlxd/models/smollm2-135m-instruct \\
        --out docs/results/cpu-prefix-disk-YYYY-MM-DD.json

Without ``--model-dir`` the model is ``--model`` (an alias or store name) resolved from the
store of ``--home``. ``--home`` defaults to a fresh temporary MLXD_HOME, so the disk tier
starts empty. TTFT is the first content chunk of a streamed, greedy completion.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlxd_proc

TOOLS = [
    "read_file",
    "write_file",
    "list_directory",
    "search_code",
    "run_tests",
    "run_shell",
    "git_diff",
    "git_commit",
    "open_issue",
    "comment_on_issue",
    "fetch_url",
    "query_database",
    "send_email",
    "schedule_job",
    "resize_image",
    "translate_text",
    "summarise_document",
    "create_calendar_event",
]
TASKS = [
    "the failing unit test in the parser",
    "the slow database query in reports",
    "the broken link checker",
    "the flaky upload test",
    "the memory leak in the cache",
]
ASKS = [
    "Start by looking at the repository layout.",
    "Which file should we open first?",
    "Read it and tell me what looks wrong.",
    "Search for other callers of that function.",
    "Propose a minimal fix.",
    "Write the fix.",
    "Run the tests.",
    "One test still fails; what do you check next?",
    "Fix that too and rerun.",
    "Summarise what we changed and why, for the commit message.",
]


def system_prompt() -> str:
    lines = [
        "You are a coding agent working in a software repository. You can call these "
        "tools; answer with one tool call or a short message.",
        "",
    ]
    for i, t in enumerate(TOOLS):
        lines.append(
            f"- {t}(path: string, options: object) -> result. Use {t} when the task needs "
            f"it; arguments are validated, errors come back as text. Tool number {i}: never "
            f"call it twice with the same arguments, prefer the narrowest query, and report "
            f"what you learned in one sentence after each call."
        )
    lines += [
        "",
        "Rules: keep answers short; never invent file contents; ask before "
        "deleting anything; explain each change in one line.",
    ]
    return "\n".join(lines)


def start(home: str, model: str, disk_bytes: int | None) -> tuple[subprocess.Popen, str]:
    env = {} if disk_bytes is None else {"MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES": str(disk_bytes)}
    return mlxd_proc.start(home, model, env)


def turn(
    client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int
) -> tuple[float, str, dict]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(text), usage


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0


def disk_stats(url: str) -> dict:
    models = httpx.get(url + "/health", timeout=10).json().get("models") or []
    return ((models[0].get("prefix_cache") or {}).get("disk") or {}) if models else {}


def settle(url: str) -> dict:
    """The disk tier's stats once its queued writes are on disk."""
    for _ in range(600):
        d = disk_stats(url)
        if not d.get("writes_pending"):
            return d
        time.sleep(0.1)
    return disk_stats(url)


def warm_request(client: httpx.Client, url: str, model: str) -> None:
    """One short request, so a lazily loaded model is loaded before anything is timed."""
    turn(client, url, model, [{"role": "user", "content": "Hi"}], 1)


def last_turn(
    url: str, model: str, convs: list[list[dict]], max_tokens: int, warm_up: bool = True
) -> list[dict]:
    rows = []
    with httpx.Client(timeout=600) as client:
        if warm_up:
            warm_request(client, url, model)
        for messages in convs:
            settle(url)
            ttft, text, usage = turn(client, url, model, messages, max_tokens)
            rows.append(
                {
                    "ttft": ttft,
                    "text": text,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": cached(usage),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--model-dir", default=None, help="serve this model directory instead")
    ap.add_argument("--home", default=None, help="MLXD_HOME (default: a fresh temporary one)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--disk-bytes",
        type=int,
        default=None,
        help="engine.prefix_cache_disk_bytes for the disk runs (default: mlxd's)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    home = args.home or tempfile.mkdtemp(prefix="mlxd-prefix-disk-")
    if args.home is None and args.model_dir is None:
        # the store of the user's home, so an alias needs no second import
        default_models = Path(os.environ.get("MLXD_HOME") or Path.home() / ".mlxd") / "models"
        os.environ["MLXD_MODELS__DIR"] = str(default_models)
    model = str(Path(args.model_dir).expanduser().resolve()) if args.model_dir else args.model
    name = Path(model).name if args.model_dir else args.model
    system = {"role": "system", "content": system_prompt()}

    # 1. warm: every conversation up to its next-to-last turn; the disk tier's folder as it
    # is then; the last turns, timed
    folder = Path(home) / "prefix-cache"
    proc, url = start(home, model, args.disk_bytes)
    convs: list[list[dict]] = []
    try:
        with httpx.Client(timeout=600) as client:
            warm_request(client, url, name)
            for c in range(args.conversations):
                messages = [system]
                for k in range(args.turns):
                    ask = ASKS[k % len(ASKS)]
                    messages.append(
                        {"role": "user", "content": f"Task: {TASKS[c % len(TASKS)]}. {ask}"}
                    )
                    if k == args.turns - 1:
                        break
                    _, text, _ = turn(client, url, name, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": text})
                convs.append(messages)
        disk_before = settle(url)
        shutil.copytree(folder, Path(home) / "prefix-cache-snapshot")
        warm = last_turn(url, name, convs, args.max_tokens, warm_up=False)
    finally:
        mlxd_proc.stop(proc)
    shutil.rmtree(folder)
    (Path(home) / "prefix-cache-snapshot").rename(folder)
    files = sorted(folder.glob("*/*.safetensors"))
    disk_bytes = sum(f.stat().st_size for f in files)
    # 2. restarted, disk tier on; 3. restarted, prefix cache off (today's cold prefill)
    proc, url = start(home, model, args.disk_bytes)
    try:
        disk = last_turn(url, name, convs, args.max_tokens)
        disk_after = disk_stats(url)
    finally:
        mlxd_proc.stop(proc)
    os.environ["MLXD_ENGINE__PREFIX_CACHE_BYTES"] = "0"
    proc, url = start(home, model, None)
    try:
        cold = last_turn(url, name, convs, args.max_tokens)
    finally:
        mlxd_proc.stop(proc)
        del os.environ["MLXD_ENGINE__PREFIX_CACHE_BYTES"]

    med = {
        k: statistics.median(r["ttft"] for r in rows)
        for k, rows in (("warm", warm), ("disk", disk), ("cold", cold))
    }
    same = all(
        d["text"] == c["text"] == w["text"] for w, d, c in zip(warm, disk, cold, strict=True)
    )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "model": model,
        "turns": args.turns,
        "conversations": args.conversations,
        "max_tokens": args.max_tokens,
        "median_ttft_s": med,
        "disk_vs_warm": med["disk"] / med["warm"],
        "cold_vs_warm": med["cold"] / med["warm"],
        "greedy_text_identical": same,
        "disk_files": len(files),
        "disk_bytes": disk_bytes,
        "disk_stats_before_restart": disk_before,
        "disk_stats_after_restart": disk_after,
        "warm": warm,
        "disk": disk,
        "cold": cold,
    }
    print(f"{result['machine']}, commit {result['commit']}, {result['date']}")
    print(
        f"model {model}: {args.conversations} conversations x {args.turns} turns, "
        f"{args.max_tokens} tokens per answer, greedy; turn {args.turns}, medians"
    )
    print("| server | prompt tokens | cached tokens | TTFT (s) | vs warm |")
    print("| --- | --- | --- | --- | --- |")
    for label, key, rows in (
        ("warm", "warm", warm),
        ("restarted, disk tier", "disk", disk),
        ("restarted, prefix cache off", "cold", cold),
    ):
        print(
            f"| {label} | {statistics.median(r['prompt_tokens'] for r in rows):.0f} "
            f"| {statistics.median(r['cached_tokens'] for r in rows):.0f} "
            f"| {med[key]:.3f} | {med[key] / med['warm']:.2f}x |"
        )
    print(
        f"greedy answers identical in all three: {same}; disk: {len(files)} files, "
        f"{disk_bytes / 1e6:.1f} MB"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.home is None:
        shutil.rmtree(home, ignore_errors=True)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs ({cpu})" + (
        f", {gpu}" if gpu else ""
    )


def commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return out + ("+dirty" if dirty.strip() else "") if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
