"""KV-cache bytes of a batch, with and without each KV option, read from the engines.

    python benchmarks/kv_memory.py --batch 4 --context 1024 [--dtype float32] [--out r.json]

Runs mlxd's own engines on random-weight models with Qwen2.5-0.5B's attention shape
(24 layers, 14 query heads, 2 KV heads of 64 dimensions, hidden 896): the text engine
(engines/llm.py, mlx-lm's BatchGenerator) unbounded and with ``max_kv_size``; the vision
engine (engines/vlm.py, mlx-vlm's BatchGenerator, a Qwen2-VL whose language model has that
shape) in full precision and with each ``kv_bits`` / ``kv_quant_scheme``. KV bytes depend
only on the attention shape, the dtype and the token count, so the MLP is shrunk
(intermediate 896 instead of 4864) and the vocabulary too (the tokenizer's, a few thousand
ids instead of 151,936): the full shape takes minutes per configuration on a 2-core CPU and
would measure the same bytes.

Each configuration: ``--batch`` sequences of ``--context - --decode`` random prompt tokens
are prefilled together and decode ``--decode`` tokens; the reading is the engine's
``memory_bytes()["kv_cache"]`` (what the memory budget counts) once every row has decoded
all but its last token, and the peak over all steps (prefill chunks included). Text-only
prompts: the vision tower never runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(Path(__file__).parent)]

SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=896,
)
TEXT_VOCAB = 4096


def make_text_model(out: Path, dtype: str) -> Path:
    """A random qwen2 text model of SHAPE (mlx-lm's own class, saved in the mlx layout)."""
    import mlx.core as mx
    from make_random_model import SPECIAL, write_tokenizer
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": TEXT_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "torch_dtype": dtype,
        "eos_token_id": SPECIAL["<|im_end|>"],
        "tie_word_embeddings": True,
        **SHAPE,
    }
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    model.apply(lambda x: x.astype(getattr(mx, dtype)))
    mx.save_safetensors(
        str(out / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    return out


def make_vision_model(out: Path) -> Path:
    from fixtures.tiny_vlm import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(
        out,
        vocab_size=4096,
        hidden_size=SHAPE["hidden_size"],
        num_layers=SHAPE["num_hidden_layers"],
        max_position_embeddings=32768,
        text_shape={
            k: SHAPE[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        },
    )


def measure(engine: Any, batch: int, context: int, decode: int, vocab: int) -> dict:
    """Prefill ``batch`` random prompts together, decode, and read the KV bytes."""
    import numpy as np

    from mlxd.core.types import SamplingParams

    rng = np.random.default_rng(0)
    lo = 300  # clear of the byte alphabet's specials and the vision tokens at the end
    seqs = []
    for _ in range(batch):
        ids = rng.integers(lo, vocab - 64, context - decode).tolist()
        seq = engine.new_sequence(ids, SamplingParams(max_tokens=decode, temperature=0.0))
        seq.handle = None
        seqs.append(seq)
    for seq in seqs:
        engine.add(seq)
        seq.t_added = 0.0  # no coalescing delay: one prefill for all
    t0 = time.perf_counter()
    peak = steady = 0
    while engine.has_work():
        engine.step()
        kv = engine.memory_bytes()["kv_cache"]
        peak = max(peak, kv)
        if all(s.generated >= decode - 1 for s in seqs) and not steady:
            steady = kv
    return {
        "kv_bytes": steady,
        "peak_kv_bytes": peak,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--max-kv-size", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="weights, hence KV (float32 on CPU)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from mlxd.blas import preload

    blas = preload("auto")  # before MLX loads, as the engine core does
    from mlxd.engines.llm import LLMEngine
    from mlxd.engines.vlm import VisionEngine

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="kv-memory-"))
    text_dir = make_text_model(tmp / "text", args.dtype)
    vision_dir = make_vision_model(tmp / "vision")
    n = args.max_kv_size
    runs: list[tuple[str, str, dict]] = [
        ("text", "full precision", {}),
        ("text", f"max_kv_size {n}", {"max_kv_size": n}),
        ("vision", "full precision", {}),
        ("vision", "kv_bits 8 (uniform)", {"kv_bits": 8}),
        ("vision", "kv_bits 4 (uniform)", {"kv_bits": 4}),
        ("vision", "kv_bits 4 (turboquant)", {"kv_bits": 4, "kv_quant_scheme": "turboquant"}),
        ("vision", "kv_bits 3.5 (turboquant)", {"kv_bits": 3.5}),
        ("vision", "kv_bits 3 (turboquant)", {"kv_bits": 3, "kv_quant_scheme": "turboquant"}),
    ]
    common = dict(max_num_seqs=args.batch, prefill_batch_size=args.batch, dtype=args.dtype)
    rows = []
    for kind, label, opts in runs:
        if kind == "text":
            engine: Any = LLMEngine("text", text_dir, **common, **opts)
            vocab = TEXT_VOCAB
        else:
            engine = VisionEngine("vision", vision_dir, **common, **opts)
            vocab = engine.vocab_size
        try:
            row = {
                "engine": kind,
                "option": label,
                **measure(engine, args.batch, args.context, args.decode, vocab),
            }
        finally:
            engine.close()
        base = next((r for r in rows if r["engine"] == kind), row)
        row["vs_full"] = round(row["kv_bytes"] / base["kv_bytes"], 3)
        rows.append(row)
        print(
            f"{kind:6} {label:26} {row['kv_bytes'] / 2**20:8.1f} MiB  peak "
            f"{row['peak_kv_bytes'] / 2**20:8.1f} MiB  x{row['vs_full']:<6} "
            f"({row['seconds']} s)",
            flush=True,
        )
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 64
    import mlx.core as mx

    result = {
        "batch": args.batch,
        "context": args.context,
        "decode": args.decode,
        "dtype": args.dtype,
        "shape": SHAPE,
        "analytic_full_bytes": per_token
        * mx.array(0, getattr(mx, args.dtype)).itemsize
        * args.batch
        * args.context,
        "machine": f"{platform.system()} {platform.machine()}, {platform.processor()}",
        "blas": blas.describe(),
        "commit": commit,
        "rows": rows,
    }
    print(f"analytic full-precision KV: {result['analytic_full_bytes'] / 2**20:.1f} MiB")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
