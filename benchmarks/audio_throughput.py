"""Transcription throughput: audio seconds transcribed per wall second, one vs many clients.

    python benchmarks/audio_throughput.py [--stt DIR] [--clients 1,8] [--seconds 30]
        [--audio-seconds 10] [--max-batch-size 8] [--max-tokens 224] [--home DIR] [--out FILE]

Starts ``python -m mlxd serve`` with a speech-to-text model (``--stt``: a Whisper
directory; default: the tiny random-weight Whisper of tests/fixtures/tiny_audio.py, built
into ``--home``) and, for each client count, has that many clients POST a
``--audio-seconds`` wav (a tone with noise) to /v1/audio/transcriptions back to back for
``--seconds``. Each count runs twice: with window batching (``audio.max_batch_size``) and
with batching off (``MLXD_AUDIO__MAX_BATCH_SIZE=1``). Reported: audio s/s, requests/s,
p50/p95 latency, the largest batch the engine saw.

Random weights write Whisper's full ``--max-tokens`` per window (they never say
end-of-text), so the tiny model measures the worst case of the decode loop, not a real
model's speed; with a real checkpoint pass ``--stt``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_wav(seconds: float, rate: int = 16000) -> bytes:
    import av
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * np.random.RandomState(0).randn(t.size)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=rate, layout="mono")
        f = av.AudioFrame.from_ndarray(x[None, :].astype(np.float32), format="fltp", layout="mono")
        f.sample_rate = rate
        for p in list(s.encode(f)) + list(s.encode(None)):
            c.mux(p)
    return buf.getvalue()


def prepare_models(home: Path, stt: str | None) -> tuple[str, str]:
    """(chat model dir, stt model name): the tiny fixtures unless --stt names a model."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.tiny_audio import make_tiny_whisper
    from fixtures.tiny_models import make_tiny_chat_model

    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    chat = make_tiny_chat_model(home / "src" / "tiny-llama", "llama")
    src = Path(stt) if stt else make_tiny_whisper(home / "src" / "tiny-whisper")
    models = home / "models"
    m = pull(ModelStore(models), str(src), ModelSettings(dir=models))
    return str(chat), m["name"]


async def run_clients(
    port: int, model: str, wav: bytes, clients: int, seconds: float, audio_seconds: float
) -> dict:
    import httpx

    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            r = await c.post(
                "/v1/audio/transcriptions",
                files={"file": ("a.wav", wav)},
                data={"model": model, "response_format": "json"},
            )
            if r.status_code == 200:
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
        await asyncio.gather(*(client(c) for _ in range(clients)))
    wall = time.perf_counter() - t0
    lat.sort()

    def pct(p: float) -> float:
        return round(lat[min(int(p * len(lat)), len(lat) - 1)] * 1000, 1) if lat else 0.0

    return {
        "clients": clients,
        "requests": len(lat),
        "errors": errors,
        "wall_s": round(wall, 2),
        "audio_s_per_s": round(len(lat) * audio_seconds / wall, 3),
        "requests_per_s": round(len(lat) / wall, 3),
        "p50_ms": pct(0.5),
        "p95_ms": pct(0.95),
    }


def bench(args, chat: str, model: str, wav: bytes, clients: int, batch: int) -> dict:
    port = free_port()
    env = dict(
        os.environ,
        MLXD_HOME=str(args.home),
        HF_HUB_OFFLINE="1",
        MLXD_AUDIO__MAX_BATCH_SIZE=str(batch),
        MLXD_AUDIO__MAX_TOKENS_PER_WINDOW=str(args.max_tokens),
        MLXD_MODELS__DIR=str(Path(args.home) / "models"),
        MLXD_MODELS__AUTO_DOWNLOAD_DEFAULTS="false",
    )
    log_path = Path(args.home) / f"server-{clients}-{batch}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--port",
                str(port),
                "--model",
                chat,
                "--preload",
                model,
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=log,
            stderr=log,
            cwd=ROOT,
        )
        try:
            import httpx

            deadline = time.time() + 600
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
                try:
                    r = httpx.post(
                        f"http://127.0.0.1:{port}/v1/audio/transcriptions",
                        files={"file": ("a.wav", wav)},
                        data={"model": model},
                        timeout=600,
                    )
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError("server did not become ready")
                time.sleep(0.5)
            res = asyncio.run(
                run_clients(port, model, wav, clients, args.seconds, args.audio_seconds)
            )
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            m = next((x for x in health.get("models", []) if x["name"] == model), {})
            res["max_batch_size"] = batch
            res["max_batch_size_seen"] = m.get("max_batch_size_seen")
            return res
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stt", help="a Whisper model directory (default: the tiny fixture)")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--audio-seconds", type=float, default=10.0)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=224)
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.home = Path(args.home or tempfile.mkdtemp(prefix="mlxd-audio-bench-"))
    chat, model = prepare_models(args.home, args.stt)
    wav = make_wav(args.audio_seconds)
    runs = []
    for clients in (int(c) for c in args.clients.split(",")):
        for batch in (args.max_batch_size, 1):
            r = bench(args, chat, model, wav, clients, batch)
            runs.append(r)
            print(json.dumps(r), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python benchmarks/audio_throughput.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.system()} {os.cpu_count()} CPUs "
        f"({platform.processor() or 'unknown cpu'})",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit,
        "model": args.stt or "tiny random-weight Whisper (tests/fixtures/tiny_audio.py)",
        "audio_seconds_per_request": args.audio_seconds,
        "max_tokens_per_window": args.max_tokens,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
