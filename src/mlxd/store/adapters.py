"""LoRA adapters: the registry of the names requests may use, and adapter directories in
mlx-lm's format or PEFT's, read and (for the store) converted without MLX.

A request names an adapter as its ``model`` (or ``"<base>:<adapter>"``); it decodes on the
base model with that adapter (engines/lora.py). Names are kept in
``<models dir>/lora-adapters.json``, written by ``POST /v1/load_lora_adapter`` and by
``mlxd pull`` of an adapter, and re-read by every front end when its mtime changes, so a
server resolves an adapter pulled while it runs at once, and a restart keeps them.

mlx-lm's format is ``adapter_config.json`` + ``adapters.safetensors`` (``lora_a`` [in, r],
``lora_b`` [r, out]); PEFT's is ``adapter_config.json`` (``peft_type: LORA``) +
``adapter_model.safetensors`` (``...lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]),
which maps onto mlx-lm's by transposing both and dropping PEFT's ``base_model.model.``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.core.errors import InvalidRequest
from mlxd.store.inspect import safetensors_header

FILE = "lora-adapters.json"
CONFIG = "adapter_config.json"
MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}


# --------------------------------------------------------------------------------------- #
# The registry
# --------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    base: str
    path: str
    created: int


class AdapterRegistry:
    def __init__(self, models_dir: Path) -> None:
        self.file = Path(models_dir) / FILE
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._entries: dict[str, AdapterEntry] = {}

    def all(self) -> list[AdapterEntry]:
        self._refresh()
        return list(self._entries.values())

    def get(self, name: str) -> AdapterEntry | None:
        """The adapter registered under exactly ``name``."""
        self._refresh()
        return self._entries.get(name)

    def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter ``model`` names (its name, or ``base:name``), else None."""
        if not model:
            return None
        self._refresh()
        entry = self._entries.get(model)
        if entry is not None:
            return entry
        base, sep, name = model.rpartition(":")
        entry = self._entries.get(name) if sep else None
        return entry if entry is not None and entry.base == base else None

    def add(self, entry: AdapterEntry) -> None:
        with self._lock:
            self._refresh()
            self._write({**self._entries, entry.name: entry})

    def remove(self, name: str) -> bool:
        with self._lock:
            self._refresh()
            if name not in self._entries:
                return False
            self._write({k: v for k, v in self._entries.items() if k != name})
            return True

    def _refresh(self) -> None:
        try:
            mtime = self.file.stat().st_mtime_ns
        except FileNotFoundError:
            self._entries, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        try:
            raw = json.loads(self.file.read_text())
            self._entries = {
                k: AdapterEntry(k, v["base"], v["path"], int(v.get("created", 0)))
                for k, v in raw.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._entries = {}
        self._mtime = mtime

    def _write(self, entries: dict[str, AdapterEntry]) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        data = {
            k: {"base": e.base, "path": e.path, "created": e.created or int(time.time())}
            for k, e in entries.items()
        }
        fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".lora-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.file)
        self._mtime = None
        self._refresh()


# --------------------------------------------------------------------------------------- #
# Adapter directories
# --------------------------------------------------------------------------------------- #


def adapter_format(path: Path) -> str | None:
    """ "mlx-lm" or "peft" when ``path`` is a LoRA adapter directory of that layout, else None
    (a model directory, a file, nothing)."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        return None
    if (path / MLX_WEIGHTS).is_file():
        return "mlx-lm"
    if (path / PEFT_WEIGHTS).is_file():
        return "peft"
    return None


def read_adapter_config(path: Path, param: str = "lora_path") -> dict[str, Any]:
    """``adapter_config.json`` of ``path`` as a dict (a 400 naming ``param`` otherwise)."""
    try:
        config = json.loads((Path(path) / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(
            f"'{path}' is not a LoRA adapter directory ({CONFIG}: {exc})", param=param
        ) from exc
    if not isinstance(config, dict):
        raise InvalidRequest(f"'{path}': {CONFIG} is not a JSON object", param=param)
    return config


def is_peft(config: dict[str, Any]) -> bool:
    return "peft_type" in config


def peft_lora(config: dict[str, Any], name: str, param: str = "lora_path") -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; a 400 naming the first feature that per-row
    LoRA cannot serve (each changes more than the low-rank update of shared layers)."""
    if config.get("peft_type") != "LORA":
        raise InvalidRequest(
            f"adapter '{name}' is a PEFT {config.get('peft_type')} adapter; only LORA is served",
            param=param,
        )
    unsupported = [
        ("DoRA (use_dora: true)", bool(config.get("use_dora"))),
        ("rank_pattern (per-layer ranks)", bool(config.get("rank_pattern"))),
        ("alpha_pattern (per-layer alphas)", bool(config.get("alpha_pattern"))),
        ("modules_to_save (fully trained modules)", bool(config.get("modules_to_save"))),
        (f"bias: {config.get('bias')!r} (trained biases)", config.get("bias", "none") != "none"),
        ("lora_bias: true", bool(config.get("lora_bias"))),
    ]
    for feature, present in unsupported:
        if present:
            raise InvalidRequest(
                f"adapter '{name}' uses PEFT's {feature}, which mlxd does not serve",
                param=param,
            )
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise InvalidRequest(
            f"adapter '{name}': {CONFIG} needs r (a positive integer) and lora_alpha",
            param=param,
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def peft_key(key: str, name: str, param: str = "lora_path") -> tuple[str, str]:
    """(module path as mlx-lm names it, "a" or "b") of a PEFT weight name."""
    m = _PEFT_KEY.match(key)
    if m is None:
        what = "LoRA on embeddings" if "lora_embedding" in key else f"the tensor {key!r}"
        raise InvalidRequest(
            f"adapter '{name}' holds {what}, which mlxd does not serve", param=param
        )
    mod = m["mod"]
    return mod[len(PEFT_PREFIX) :] if mod.startswith(PEFT_PREFIX) else mod, m["ab"].lower()


def check_mlx_lm(config: dict[str, Any], name: str, param: str = "lora_path") -> None:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidRequest(
            f"adapter '{name}' is a {kind} fine-tune; only LoRA adapters are served per request",
            param=param,
        )


# --------------------------------------------------------------------------------------- #
# Into the store
# --------------------------------------------------------------------------------------- #


def import_adapter(
    src: Path, out: Path, name: str, find_base: Callable[[dict[str, Any], str], str]
) -> dict[str, Any]:
    """Write adapter ``src`` into ``out`` in mlx-lm's format (PEFT converted on the way);
    return the manifest fields. ``find_base(config, format)`` names its base model or
    raises; everything is checked before a byte is written."""
    fmt = adapter_format(src)
    if fmt is None:
        raise InvalidRequest(
            f"{src}: not a LoRA adapter directory ({CONFIG} with {MLX_WEIGHTS} or {PEFT_WEIGHTS})",
            param="model",
        )
    config = read_adapter_config(src, param="model")
    if fmt == "peft":
        rank, scale = peft_lora(config, name, param="model")
    else:
        check_mlx_lm(config, name, param="model")
        rank, scale = 0, float((config.get("lora_parameters") or {}).get("scale", 20.0))
    base = find_base(config, fmt)
    if fmt == "mlx-lm":
        shutil.copy2(src / MLX_WEIGHTS, out / MLX_WEIGHTS)
        (out / CONFIG).write_text(json.dumps({**config, "base": base}, indent=2) + "\n")
    else:
        _convert_peft(src, out, config, name, rank, scale, base)
    return {"kind": "adapter", "format": fmt, "base": base, "scale": scale}


def _convert_peft(
    src: Path, out: Path, config: dict[str, Any], name: str, rank: int, scale: float, base: str
) -> None:
    """PEFT's weights as mlx-lm's: each A and B transposed (a permutation of its bytes, so
    any dtype is copied exactly), named ``<module>.lora_a`` / ``.lora_b``."""
    path = src / PEFT_WEIGHTS
    header = safetensors_header(path)
    header.pop("__metadata__", None)
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n)
        data = fh.read()
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for key, spec in header.items():
        mod, ab = peft_key(key, name, param="model")
        dtype, shape = spec["dtype"], list(spec["shape"])
        size = _ITEMSIZE.get(dtype)
        if size is None or len(shape) != 2:
            raise InvalidRequest(
                f"adapter '{name}': {key} is a {dtype} tensor of shape {shape}; expected a "
                "matrix of floats",
                param="model",
            )
        start, end = spec["data_offsets"]
        raw = np.frombuffer(data[start:end], dtype=f"<u{size}").reshape(shape)
        tensors[f"{mod}.lora_{ab}"] = (dtype, shape[::-1], np.ascontiguousarray(raw.T).tobytes())
    mods = {k.rsplit(".", 1)[0] for k in tensors}
    for mod in mods:
        if f"{mod}.lora_a" not in tensors or f"{mod}.lora_b" not in tensors:
            raise InvalidRequest(f"adapter '{name}': {mod} lacks lora_A or lora_B", param="model")
    if not mods:
        raise InvalidRequest(f"adapter '{name}' holds no LoRA weights", param="model")
    _write_safetensors(out / MLX_WEIGHTS, tensors)
    keys = sorted({re.sub(r"^.*\blayers\.\d+\.", "", m) for m in mods})
    mlx_config = {  # what mlx-lm's --adapter reads too: -1 wraps every layer (zero where untrained)
        "fine_tune_type": "lora",
        "num_layers": -1,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys},
        "base": base,
        "peft": {k: config.get(k) for k in ("base_model_name_or_path", "r", "lora_alpha")},
    }
    (out / CONFIG).write_text(json.dumps(mlx_config, indent=2) + "\n")


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for key, (dtype, shape, raw) in tensors.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for _, _, raw in tensors.values():
            fh.write(raw)


def base_hints(config: dict[str, Any], fmt: str) -> list[str]:
    """What an adapter's config says its base model is: PEFT's
    ``base_model_name_or_path``, mlx-lm's ``model`` (and the ``base`` mlxd records)."""
    keys = ("base", "base_model_name_or_path") if fmt == "peft" else ("base", "model")
    return [v for k in keys if isinstance(v := config.get(k), str) and v.strip()]
