"""How one model is served, read from Settings in one place: engine.* with the model's own
models.options.<name>.* over it (and models.adapter_path for the default model).

The decode engines take one of these instead of a keyword argument per setting, so a new
setting is added here and in config.py only; tests build them directly with the fields they
vary. No MLX here: the registry, the tensor-parallel followers and tests import it freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import Settings, resolve_kv_quant_scheme
from mlxd.core.devices import core_folder_tag
from mlxd.core.errors import ModelLoadError

TEXT_KV_BITS_ALLOWED = (4, 8)  # engines/kv_quant.py's widths (no MLX imported here)


def model_options(name: str, settings: Settings) -> dict[str, Any]:
    """The KV options, prefill chunk and adapter for ``name``: models.options.<name> over
    engine.*; models.adapter_path belongs to the default model."""
    e, m = settings.engine, settings.models
    out: dict[str, Any] = {
        "kv_bits": e.kv_bits,
        "kv_quant_scheme": e.kv_quant_scheme,
        "kv_group_size": e.kv_group_size,
        "max_kv_size": e.max_kv_size,
        "prefill_step_size": e.prefill_step_size,
        "adapter_path": None,
    }
    default = Path(m.default).expanduser()
    default_name = (
        default.resolve().name
        if (("/" in m.default or m.default.startswith(".")) and default.is_dir())
        else m.default
    )
    if name == default_name and m.adapter_path is not None:
        out["adapter_path"] = m.adapter_path
    opts = m.options.get(name)
    if opts is not None:  # the batch size is the model manager's (core/slots.py)
        out.update(
            {k: v for k, v in opts.model_dump(exclude={"max_num_seqs"}).items() if v is not None}
        )
    out["kv_quant_scheme"] = resolve_kv_quant_scheme(out["kv_bits"], out["kv_quant_scheme"])
    return out


def fixed_max_num_seqs(name: str, settings: Settings) -> int:
    """The batch size without a memory budget to size it by: a set number as it is, and
    for 'auto' the floor that auto never goes below."""
    opts = settings.models.options.get(name)
    value = (
        opts.max_num_seqs
        if opts is not None and opts.max_num_seqs is not None
        else settings.engine.max_num_seqs
    )
    return value if isinstance(value, int) else 8  # core/slots.py's AUTO_FLOOR


def option_key(name: str, settings: Settings, key: str) -> str:
    """Where the operator set ``key`` for ``name``: its models.options entry, else engine."""
    opts = settings.models.options.get(name)
    if opts is not None and getattr(opts, key, None) is not None:
        return f"models.options.{name}.{key}"
    return f"engine.{key}"


@dataclass(frozen=True, kw_only=True)
class TextEngineOptions:
    """A text model's engine (engines/llm.py): batch, prefix cache tiers, KV bound, adapter
    and speculative decoding. The defaults are a bare engine's (tests); a server's come from
    :meth:`from_settings`."""

    max_num_seqs: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    max_step_tokens: int | str = "auto"  # tokens per step (engines/serving_batch.py)
    dtype: str = "auto"
    trust_remote_code: bool = False
    prefix_cache_bytes: int = 0
    prefix_cache_min_tokens: int = 0
    hybrid_checkpoint_tokens: int = 1024
    prefix_cache_disk_bytes: int = 0
    prefix_cache_disk_min_tokens: int = 256
    prefix_cache_disk_writes: str = "reused"
    prefix_cache_dir: Path | None = None
    adapter_path: Path | None = None
    max_kv_size: int | None = None
    kv_bits: int | None = None  # a quantized KV cache (engines/kv_quant.py): 4 or 8
    kv_group_size: int = 64
    kv_quant_start: int = 0
    speculative: str = "off"
    draft_path: Path | None = None
    num_draft_tokens: int = 6
    speculative_policy: str = "cost"
    speculative_max_batch: int = 0  # 0: no cap
    speculative_min_acceptance: float = 0.3
    clean_prefill_groups: bool | None = None  # None: on a GPU only (LLMEngine._admit)
    defer_leaves: bool | None = None  # None: on a GPU only (engines/serving_batch.py)
    pipeline_decode: str = "auto"  # auto|on|off (engines/serving_batch.py)
    mixed_steps: bool = True  # decode and prefill in one pass (engines/mixed_step.py)
    fair_preemption: bool = True  # a starved key takes a slot (engines/scheduler.py)

    def __post_init__(self) -> None:
        for key in ("prefix_cache_dir", "adapter_path", "draft_path"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, key, Path(value))

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        name: str,
        *,
        draft_path: Path | None = None,
        max_num_seqs: int | None = None,
    ) -> TextEngineOptions:
        """``name``'s options on this server (``draft_path``: its draft model, with
        engine.speculative: draft; ``max_num_seqs``: the batch size the model manager
        resolved, None: :func:`fixed_max_num_seqs`). A text model's KV cache is quantized
        uniformly (engines/kv_quant.py), 4 or 8 bits: other widths and turboquant are
        refused here, at load, since the same settings serve vision models too."""
        e = settings.engine
        opts = model_options(name, settings)
        bits = opts["kv_bits"]
        if bits is not None and (
            opts["kv_quant_scheme"] != "uniform" or bits not in TEXT_KV_BITS_ALLOWED
        ):
            raise ModelLoadError(
                f"{option_key(name, settings, 'kv_bits')} is {bits}"
                f" ({opts['kv_quant_scheme']}), but '{name}' is a text model: text models "
                "take kv_bits 4 or 8 (uniform quantization); fractional bits and "
                "turboquant are for vision models."
            )
        return cls(
            max_num_seqs=max_num_seqs
            if max_num_seqs is not None
            else fixed_max_num_seqs(name, settings),
            prefill_batch_size=e.prefill_batch_size,
            prefill_step_size=opts["prefill_step_size"],
            max_step_tokens=e.max_step_tokens,
            pipeline_decode=e.pipeline_decode,
            mixed_steps=e.mixed_steps,
            fair_preemption=e.fair_preemption,
            dtype=settings.models.dtype,
            trust_remote_code=settings.models.trust_remote_code,
            prefix_cache_bytes=e.prefix_cache_bytes,
            prefix_cache_min_tokens=e.prefix_cache_min_tokens,
            hybrid_checkpoint_tokens=e.hybrid_checkpoint_tokens,
            prefix_cache_disk_bytes=e.prefix_cache_disk_bytes,
            prefix_cache_disk_min_tokens=e.prefix_cache_disk_min_tokens,
            prefix_cache_disk_writes=e.prefix_cache_disk_writes,
            # one folder per engine core when there are several
            prefix_cache_dir=(e.prefix_cache_dir or settings.home / "prefix-cache")
            / core_folder_tag(),
            adapter_path=opts["adapter_path"],
            max_kv_size=opts["max_kv_size"],
            kv_bits=int(bits) if bits is not None else None,
            kv_group_size=opts["kv_group_size"],
            kv_quant_start=e.kv_quant_start,
            speculative=e.speculative,
            draft_path=draft_path,
            num_draft_tokens=e.num_draft_tokens,
            speculative_policy=e.speculative_policy,
            speculative_max_batch=e.speculative_max_batch,
            speculative_min_acceptance=e.speculative_min_acceptance,
        )

    def for_followers(self) -> dict[str, Any]:
        """What a tensor-parallel follower loads its shard with, as plain data for the
        command link (``TextEngineOptions(**it)`` there): the same batch and weights, no
        prefix cache and no speculation (engines/tensor_parallel.py says why)."""
        return dict(
            max_num_seqs=self.max_num_seqs,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
            max_step_tokens=self.max_step_tokens,
            dtype=self.dtype,
            trust_remote_code=self.trust_remote_code,
            adapter_path=str(self.adapter_path) if self.adapter_path is not None else None,
            max_kv_size=self.max_kv_size,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            kv_quant_start=self.kv_quant_start,
        )


@dataclass(frozen=True, kw_only=True)
class VisionEngineOptions:
    """A vision model's engine (engines/vlm.py): batch, KV cache (quantized or bounded),
    adapter and the image feature cache."""

    max_num_seqs: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    kv_bits: float | None = None
    kv_quant_scheme: str | None = None
    kv_group_size: int = 64
    max_kv_size: int | None = None
    adapter_path: Path | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    batching: bool = True
    feature_cache_entries: int = 64
    feature_cache_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.adapter_path is not None and not isinstance(self.adapter_path, Path):
            object.__setattr__(self, "adapter_path", Path(self.adapter_path))
        # the scheme mlx-vlm will use, so that /health shows it (config.py's rule)
        object.__setattr__(
            self, "kv_quant_scheme", resolve_kv_quant_scheme(self.kv_bits, self.kv_quant_scheme)
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, name: str, *, max_num_seqs: int | None = None
    ) -> VisionEngineOptions:
        """``name``'s options on this server (``max_num_seqs`` as for text models)."""
        e, v = settings.engine, settings.vision
        opts = model_options(name, settings)
        return cls(
            max_num_seqs=max_num_seqs
            if max_num_seqs is not None
            else fixed_max_num_seqs(name, settings),
            prefill_batch_size=e.prefill_batch_size,
            prefill_step_size=opts["prefill_step_size"],
            kv_bits=opts["kv_bits"],
            kv_quant_scheme=opts["kv_quant_scheme"],
            kv_group_size=opts["kv_group_size"],
            max_kv_size=opts["max_kv_size"],
            adapter_path=opts["adapter_path"],
            dtype=settings.models.dtype,
            trust_remote_code=settings.models.trust_remote_code,
            batching=v.batching,
            feature_cache_entries=v.feature_cache_entries,
            feature_cache_bytes=v.feature_cache_bytes,
        )
