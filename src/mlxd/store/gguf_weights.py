"""GGUF tensors -> MLX arrays: float, or MLX affine quantization (``mx.quantize``'s format).

Every tensor is decoded with llama.cpp's reference ``gguf.quants.dequantize``, so there is
one bit-exact decoder for all block formats. For ``dtype="native"`` the decoded values go
back into MLX affine quantization with group size 32:

* Formats that *are* affine over 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants
  Q4_K/Q5_K whose 256-blocks hold eight 32-value sub-blocks of ``d*sc*q - dmin*m``) keep
  their bits: the per-group scale and bias are read from the block headers and the codes
  recovered as ``(w - bias) / scale``. Lossless: ``mx.dequantize`` gives back exactly what
  ``gguf.quants.dequantize`` gives.
* Q6_K has a scale per 16 values, which MLX (groups of 32, 64, 128) cannot express; it is
  re-quantized with ``mx.quantize`` to 8 bits, group 32 (256 levels per 32 values against
  Q6_K's 64 per 16: the added error stays within one 8-bit step, about a quarter of a
  Q6_K step). 6 bits would lose up to a full Q6_K step wherever two sub-blocks differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from mlxd.store.gguf_meta import GGUFImportError

__all__ = [
    "FLOAT_TYPES",
    "GROUP_SIZE",
    "NATIVE_BITS",
    "SUPPORTED_TYPES",
    "Converted",
    "convert_tensor",
    "pack_codes",
]

Q = GGMLQuantizationType
GROUP_SIZE = 32
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# Lossless repacking: type -> bits of the MLX affine codes (group 32).
_AFFINE_BITS: dict[Q, int] = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q8_0: 8,
    Q.Q4_K: 4,
    Q.Q5_K: 5,
}
# Re-quantized with mx.quantize: type -> bits (group 32).
_REQUANT_BITS: dict[Q, int] = {Q.Q6_K: 8}
NATIVE_BITS: dict[Q, int] = {**_AFFINE_BITS, **_REQUANT_BITS}
SUPPORTED_TYPES = FLOAT_TYPES | frozenset(NATIVE_BITS)

_FLOAT_TARGETS = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class Converted:
    """One converted tensor; ``scales``/``biases``/``bits`` are set when it is quantized."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int | None = None


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset : offset + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _group_affine(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-value group ``(scale, bias)`` with ``w = scale * code + bias``, codes >= 0."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        # the reference computes d*sc*q - dmin*m in float32: the same products here
        return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))
    d = _f16(blocks, 0)
    if qtype in (Q.Q4_1, Q.Q5_1):
        return d[:, None], _f16(blocks, 2)[:, None]
    offset = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128}[qtype]  # signed codes, made unsigned
    return d[:, None], -(offset * d)[:, None]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``codes`` (rows x cols) the way ``mx.quantize`` does: a little-endian
    bit stream, ``bits`` per value, read as uint32 words."""
    rows, cols = codes.shape
    out = np.empty((rows, cols * bits // 8), dtype=np.uint8)
    step = max(1, (1 << 22) // cols)  # rows per chunk: the uint64 scratch stays ~32 MB
    for r in range(0, rows, step):
        c = codes[r : r + step].astype(np.uint64).reshape(-1, cols // 8, 8)
        words = np.zeros(c.shape[:2], dtype=np.uint64)
        for i in range(8):
            words |= c[:, :, i] << np.uint64(bits * i)
        packed = words.view(np.uint8).reshape(*c.shape[:2], 8)[:, :, :bits]
        out[r : r + step] = packed.reshape(len(c), -1)
    return out.view(np.uint32)


def _smallest_exact(x: np.ndarray) -> mx.array:
    """float16 when it holds ``x`` exactly (Q4_0/Q8_0 scales do), float32 otherwise."""
    h = x.astype(np.float16)
    return mx.array(h) if np.array_equal(h.astype(np.float32), x) else mx.array(x)


def _repack(raw: np.ndarray, values: np.ndarray, qtype: Q, bits: int) -> Converted:
    rows, cols = values.shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    scale, bias = (a.reshape(rows, cols // GROUP_SIZE) for a in _group_affine(blocks, qtype))
    groups = values.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    safe = np.where(scale == 0, 1.0, scale)[..., None]
    codes = np.rint((groups - bias[..., None]) / safe)
    codes = np.where(scale[..., None] == 0, 0, codes)
    codes = np.clip(codes, 0, (1 << bits) - 1).astype(np.uint8).reshape(rows, cols)
    return Converted(
        mx.array(pack_codes(codes, bits)), _smallest_exact(scale), _smallest_exact(bias), bits
    )


def convert_tensor(
    raw: np.ndarray, qtype: Q, shape: tuple[int, ...], dtype: str, *, offset: float = 0.0
) -> Converted:
    """Convert one tensor's file data (as ``GGUFReader`` maps it) per the import dtype.

    ``shape`` is row-major (numpy order). ``offset`` is added to float values (Gemma's
    norms are stored as ``1 + w``); it is only allowed on float tensors.
    """
    if qtype not in SUPPORTED_TYPES:
        raise GGUFImportError(f"unsupported tensor type {qtype.name}")
    values = dequantize(np.asarray(raw), qtype).reshape(shape)
    if offset:
        if qtype not in FLOAT_TYPES:
            raise GGUFImportError(f"a {qtype.name} tensor cannot take a norm offset")
        values = values + np.float32(offset)
    if dtype in _FLOAT_TARGETS:
        return Converted(mx.array(values).astype(_FLOAT_TARGETS[dtype]))
    if dtype != "native":
        raise ValueError(f"unknown dtype {dtype!r}")
    if qtype in FLOAT_TYPES:
        # Norms and biases stay float32 because they set the activation dtype (x * f32
        # weight promotes to f32); with float16 activations MLX's CPU quantized matmul
        # was ~35x slower and flipped SmolLM2's greedy answer. They cost a few KB.
        return Converted(mx.array(values).astype(mx.float32 if len(shape) == 1 else mx.float16))
    if len(shape) != 2 or shape[1] % GROUP_SIZE:
        raise GGUFImportError(
            f"a {qtype.name} tensor of shape {shape} cannot be kept quantized; only 2-D weights can"
        )
    if qtype in _AFFINE_BITS:
        return _repack(raw, values, qtype, _AFFINE_BITS[qtype])
    bits = _REQUANT_BITS[qtype]
    w, scales, biases = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=bits)
    return Converted(w, scales.astype(mx.float16), biases.astype(mx.float16), bits)
