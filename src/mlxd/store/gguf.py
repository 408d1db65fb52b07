"""Import GGUF files (what people download for llama.cpp/Ollama) into MLX model directories.

GGUF bundles weights, hyper-parameters and the tokenizer in one file, while the rest of
mlxd (and ``mlx_lm.load``) expects a Hugging Face style directory. Converting once at
import time keeps a single loading path for every model the server runs, instead of
teaching each engine about GGUF. The file is read with llama.cpp's own ``gguf`` package
(``GGUFReader``, ``gguf.quants.dequantize``), so every block format decodes exactly as
llama.cpp's reference does.

Architectures: llama (also Mistral, which GGUF files as llama), qwen2 (Qwen2/2.5), qwen3,
gemma2, gemma3 (text), phi3. Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K (see ``gguf_weights`` for what each becomes).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from mlxd.store.gguf_arch import ARCHS, build_config, llama3_rope_scaling
from mlxd.store.gguf_meta import GGUFImportError, meta, open_gguf, read_metadata
from mlxd.store.gguf_tokenizer import build_tokenizer
from mlxd.store.gguf_weights import GROUP_SIZE, SUPPORTED_TYPES, convert_tensor

__all__ = ["GGUFImportError", "import_gguf", "llama3_rope_scaling"]

DTYPES = ("float32", "float16", "bfloat16", "native")
# progress(completed_bytes, total_bytes), called after each tensor
ImportProgress = Callable[[int, int], None]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first


def _quantization_config(quant_bits: dict[str, int]) -> dict[str, Any]:
    """mlx-lm's quantization entry: the commonest bits as default, the rest per module
    (mlx-lm consults per-module entries first, so a Q6_K/8-bit tensor may sit next to
    Q4_K/4-bit ones, as in Q4_K_M files)."""
    default_bits = Counter(quant_bits.values()).most_common(1)[0][0]
    q: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for module, bits in sorted(quant_bits.items()):
        if bits != default_bits:
            q[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    return q


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    progress: ImportProgress | None = None,
) -> dict:
    """Convert a GGUF file into an MLX model directory loadable by ``mlx_lm.load``.

    ``out_dir`` must be new or empty: the caller stages into a scratch directory and
    renames it into place, so a failed import never leaves a half-written model that
    the server would later try to load.

    ``dtype`` is "float32", "float16" or "bfloat16" to dequantize everything, or
    "native" to keep quantized tensors as MLX affine quantization (group 32): lossless
    for the formats that are affine already, 8-bit for Q6_K. The remaining matrices are
    stored in float16; 1-D tensors (norms) stay float32 so activations run in float32.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} is not empty")

    reader = open_gguf(gguf_path)
    md = read_metadata(reader)
    arch_name = md.get("general.architecture")
    if arch_name not in ARCHS:
        raise GGUFImportError(
            f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(ARCHS)}"
        )
    arch = ARCHS[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    type_counts = Counter(t.tensor_type.name for t in reader.tensors)
    unsupported = sorted(t for t in type_counts if GGMLQuantizationType[t] not in SUPPORTED_TYPES)
    if unsupported:
        raise GGUFImportError(
            f"unsupported GGUF tensor type(s) {unsupported}; supported: "
            f"{sorted(t.name for t in SUPPORTED_TYPES)}"
        )
    hf_names = {name: arch.hf_name(name) for name in tensors}  # raises on unknown tensors

    def table(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        return None if t is None else dequantize(np.asarray(t.data), t.tensor_type).ravel()

    tok_files = build_tokenizer(md, int(meta(md, f"{arch_name}.context_length")))
    config = build_config(
        md,
        arch_name,
        {n: _shape(t) for n, t in tensors.items()},
        table,
        len(md["tokenizer.ggml.tokens"]),
    )

    weights: dict[str, mx.array] = {}
    quant_bits: dict[str, int] = {}
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done, n_params = 0, 0
    for name, t in tensors.items():
        done += int(t.n_bytes)
        hf = hf_names[name]
        if hf is None:
            continue
        n_params += int(t.n_elements)
        conv = convert_tensor(t.data, t.tensor_type, _shape(t), dtype, offset=arch.offset_of(name))
        weights[hf] = conv.weight
        if conv.bits is not None and conv.scales is not None and conv.biases is not None:
            module = hf.rsplit(".", 1)[0]
            weights[f"{module}.scales"], weights[f"{module}.biases"] = conv.scales, conv.biases
            quant_bits[module] = conv.bits
        mx.eval(weights[hf], *(w for w in (conv.scales, conv.biases) if w is not None))
        if progress is not None:
            progress(done, total)

    quantization = None
    if quant_bits:
        q_config = _quantization_config(quant_bits)
        config["quantization"] = config["quantization_config"] = q_config
        quantization = {"group_size": GROUP_SIZE, "bits": q_config["bits"]}
    config["torch_dtype"] = "float16" if dtype == "native" else dtype
    ids: dict[str, Any] = {}
    if tok_files.bos_id is not None:
        ids["bos_token_id"] = tok_files.bos_id
    if tok_files.eos_ids:
        eos = tok_files.eos_ids
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    config.update(ids)

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    tok_files.tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tok_files.config)
    _write_json(out_dir / "special_tokens_map.json", tok_files.special_tokens_map)
    if tok_files.pad_id is not None:
        ids["pad_token_id"] = tok_files.pad_id
    _write_json(out_dir / "generation_config.json", ids)

    return {
        "architecture": arch_name,
        "quantization": quantization,
        "dtype": dtype,
        "num_parameters": n_params,
        "source_tensor_types": dict(sorted(type_counts.items())),
    }
