"""How many sequences a model's continuous batch decodes together (``engine.max_num_seqs``).

A fixed default sizes the batch for the smallest machine: a small model on a big device is
then held back by the setting, not by the device. ``auto`` sizes it per model at load from
the memory budget instead: what the budget leaves once the model's weights, the prefix
cache and a margin for activations are counted, divided by the KV cache one sequence of
``engine.auto_seq_context`` tokens takes, within a floor and a per-backend cap. KV caches
grow as sequences do (nothing is reserved up front), so the figure bounds the batch rather
than allotting memory; the budget's headroom check still sheds load past it.

Everything here is a pure function of numbers and a model's config.json, so that the same
inputs always give the same batch size (the model manager supplies the inputs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Floor: fewer slots than this would serialise ordinary traffic; a sequence's KV grows on
# demand and the budget's headroom check sheds load, so the floor cannot run memory out.
AUTO_FLOOR = 8
# GPU cap: past a few hundred rows a decode step stops being bound by reading the weights
# and every row slows the others down; queueing beyond it costs latency, not throughput.
AUTO_CAP_GPU = 256
# CPU cap: the CPU computes, memory is not the limit. On 2 cores the engine gave 61.7 tok/s
# at 16 clients and 68.8 at 32 (docs/benchmarks.md, peers): more rows only add latency.
AUTO_CAP_CPU = 32
# Share of what the weights and the prefix cache leave that is kept for activations (a
# prefill chunk's temporaries, logits, the allocator's cache).
ACTIVATION_SHARE = 0.10
# When a model's attention shape cannot be read: the long-standing fixed default.
UNKNOWN_SHAPE_SEQS = 32

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


@dataclass(frozen=True)
class Slots:
    """A batch size and, in words, why (for /health and the load log)."""

    value: int
    reason: str


def human(n: float) -> str:
    """1,536 -> '1.5 KiB'; binary units, as memory is counted."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of ``model_dir``; {} when absent or unreadable (the shape is unknown)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part: vision-language configs nest it under text_config."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and inner.get("num_hidden_layers"):
        return {**config, **inner}
    return config


def context_length(config: dict[str, Any]) -> int | None:
    """The context the model was trained for, as the engine reads it (None: not given)."""
    cfg = text_config(config)
    for key in _CONTEXT_KEYS:
        v = cfg.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def kv_element_bytes(config: dict[str, Any], dtype: str, upcast: bool) -> int:
    """Bytes of one KV cache element: the dtype the model computes in (the weights' dtype
    after ``models.dtype`` applies; quantized weights keep their float parts' dtype)."""
    native = _DTYPE_BYTES.get(
        str(text_config(config).get("torch_dtype") or config.get("torch_dtype") or ""), 2
    )
    if "quantization" in config:
        return native
    if dtype == "float32" or (dtype == "auto" and upcast):
        return 4
    if dtype in ("float16", "bfloat16"):
        return 2
    return native


def _window_layers(cfg: dict[str, Any], layers: int) -> list[int | None]:
    """Per layer: its sliding window (tokens) or None for full attention; 0 for a layer
    that keeps no per-token cache (linear attention, state-space). Only what the config
    states layer by layer is taken: a bare ``sliding_window`` (Qwen2's, Mistral's) is not
    applied by every mlx-lm model, and counting it full errs toward fewer slots."""
    window = cfg.get("sliding_window")
    window = window if isinstance(window, int) and window > 0 else None
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        out: list[int | None] = []
        for t in types:
            if t == "sliding_attention":
                out.append(window)
            elif t in ("full_attention", "attention"):
                out.append(None)
            else:
                out.append(0)
        return out
    pattern = cfg.get("sliding_window_pattern")
    if window is not None and isinstance(pattern, int) and pattern > 1:
        # every pattern-th layer is global, the others slide (Gemma 3)
        return [None if (i + 1) % pattern == 0 else window for i in range(layers)]
    return [None] * layers


def kv_bytes_per_sequence(
    config: dict[str, Any],
    tokens: int,
    element_bytes: int,
    kv_bits: int | None = None,
    group_size: int = 64,
) -> int:
    """KV cache bytes of one sequence of ``tokens`` tokens: per attention layer, keys and
    values of every KV head (``2 x kv heads x head dim x element bytes`` a token), over
    ``tokens`` or the layer's sliding window if shorter. 0 when the shape is not given.
    With ``kv_bits`` (uniform quantization), a head's vector takes its packed bits plus a
    scale and a bias per ``group_size`` elements (engines/kv_quant.py's layout)."""
    cfg = text_config(config)
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    if not isinstance(layers, int) or not isinstance(heads, int) or layers <= 0 or heads <= 0:
        return 0
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        hidden = cfg.get("hidden_size") or cfg.get("n_embd")
        if not isinstance(hidden, int) or hidden <= 0:
            return 0
        head_dim = hidden // heads
    per_head = head_dim * element_bytes
    if kv_bits is not None:
        per_head = head_dim * kv_bits // 8 + 2 * (head_dim // group_size) * element_bytes
    per_token_layer = 2 * int(kv_heads) * per_head
    total = 0
    for window in _window_layers(cfg, layers):
        if window == 0:
            continue
        total += per_token_layer * (tokens if window is None else min(tokens, window))
    return total


def auto_max_num_seqs(
    *,
    budget: int,
    weight_bytes: int,
    prefix_cache_bytes: int,
    kv_bytes_per_seq: int,
    seq_tokens: int,
    cap: int,
    floor: int = AUTO_FLOOR,
    cache_name: str = "prefix cache",
) -> Slots:
    """The batch size ``auto`` picks: ``(budget - weights - prefix cache) x (1 - 10%)``
    over one sequence's KV bytes at ``seq_tokens`` tokens, within ``floor..cap``."""
    cap = max(cap, floor)
    if kv_bytes_per_seq <= 0:
        value = min(max(UNKNOWN_SHAPE_SEQS, floor), cap)
        return Slots(value, f"auto: no attention shape in the model's config.json -> {value}")
    left = budget - weight_bytes - prefix_cache_bytes
    free = max(int(left * (1 - ACTIVATION_SHARE)), 0)
    fit = free // kv_bytes_per_seq
    value = min(max(fit, floor), cap)
    if fit > cap:
        outcome = f"{fit} fit -> {value} (cap {cap})"
    elif fit < floor:
        outcome = f"{fit} fit -> {value} (floor {floor})"
    else:
        outcome = f"{value} (cap {cap})"
    reason = (
        f"auto: {human(free)} free for KV (budget {human(budget)} - weights "
        f"{human(weight_bytes)} - {cache_name} {human(prefix_cache_bytes)} - "
        f"{ACTIVATION_SHARE:.0%} for activations) / {human(kv_bytes_per_seq / seq_tokens)} "
        f"per token / {seq_tokens} tokens -> {outcome}"
    )
    return Slots(value, reason)


def kv_quantization(settings: Any, name: str) -> tuple[int | None, int]:
    """(bits, group size) of ``name``'s uniformly quantized KV cache, (None, ...) when it
    is kept in full precision (or quantized by turboquant, whose size this does not model)."""
    e = settings.engine
    opts = settings.models.options.get(name)

    def pick(key: str) -> Any:
        v = getattr(opts, key, None) if opts is not None else None
        return v if v is not None else getattr(e, key)

    bits, scheme = pick("kv_bits"), pick("kv_quant_scheme")
    if bits is None or scheme == "turboquant" or not float(bits).is_integer():
        return None, pick("kv_group_size")
    return int(bits), pick("kv_group_size")


def setting_for(settings: Any, name: str) -> tuple[int | str, str]:
    """(value, where it was set): models.options.<name>.max_num_seqs over the engine's."""
    opts = settings.models.options.get(name)
    if opts is not None and opts.max_num_seqs is not None:
        return opts.max_num_seqs, f"models.options.{name}.max_num_seqs"
    return settings.engine.max_num_seqs, "engine.max_num_seqs"


def auto_cap(on_cpu: bool) -> int:
    return AUTO_CAP_CPU if on_cpu else AUTO_CAP_GPU


def provisional(settings: Any, on_cpu: bool) -> int:
    """The batch size admission counts on before any model has loaded: the setting when it
    is a number, else the most ``auto`` can pick (a guess lower than the load's would turn
    away requests that its batch will hold)."""
    v = settings.engine.max_num_seqs
    return v if isinstance(v, int) else auto_cap(on_cpu)


def resolve(
    settings: Any,
    name: str,
    kind: str,
    path: Path,
    *,
    budget: int,
    weight_bytes: int,
    upcast: bool,
    on_cpu: bool,
    draft_path: Path | None = None,
) -> Slots:
    """The batch size of model ``name`` (a chat or vision model at ``path``) and why.

    ``weight_bytes``: what its load counts against ``budget`` (per rank of a rank group,
    with the draft model's); ``upcast``: half-precision weights run as float32."""
    value, where = setting_for(settings, name)
    if isinstance(value, int):
        return Slots(value, f"{where}: {value}")
    e = settings.engine
    config = read_config(path)
    opts = settings.models.options.get(name)
    max_kv = (
        opts.max_kv_size if opts is not None and opts.max_kv_size is not None else e.max_kv_size
    )
    target = min(context_length(config) or e.auto_seq_context, e.auto_seq_context)
    if max_kv is not None:  # a rotating cache never holds more
        target = min(target, max_kv)
    dtype = settings.models.dtype
    bits, group = kv_quantization(settings, name)
    per_seq = kv_bytes_per_sequence(
        config, target, kv_element_bytes(config, dtype, upcast), bits, group
    )
    if per_seq and draft_path is not None:  # the draft keeps a KV cache per sequence too
        draft = read_config(draft_path)
        per_seq += kv_bytes_per_sequence(draft, target, kv_element_bytes(draft, dtype, upcast))
    if kind == "chat":  # a rank holds 1/N of the KV heads (or of the layers, pipelined)
        per_seq = -(-per_seq // e.rank_group_size)
    # a sharded model keeps no prefix cache (engines/tensor_parallel.py); a vision model's
    # reusable cache is its image features
    if kind == "vision":
        cache, cache_name = settings.vision.feature_cache_bytes, "image features"
    else:
        cache = e.prefix_cache_bytes if e.rank_group_size == 1 else 0
        cache_name = "prefix cache"
    return auto_max_num_seqs(
        budget=budget,
        weight_bytes=weight_bytes,
        prefix_cache_bytes=cache,
        kv_bytes_per_seq=per_seq,
        seq_tokens=target,
        cap=auto_cap(on_cpu),
        cache_name=cache_name,
    )
