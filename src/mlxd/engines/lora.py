"""LoRA adapters per row of one batch (``model: "<adapter>"`` on a request).

The base model's linear layers that any loaded adapter targets are wrapped once in a
:class:`RowLoRALinear`: the base layer's output plus, per row, that row's adapter delta
``scale * (x @ A) @ B``, with every adapter's ``A`` and ``B`` stacked (slot 0 is zeros: a
row without an adapter gets exactly the base output) and gathered by the row's slot. The
batch tells the model its rows' order before each forward (:func:`set_rows`, called by
engines/serving_batch.py), since rows join and leave between steps. The arithmetic is
mlx-lm's own ``LoRALinear``'s, so a row decodes as a server started with that adapter alone
(``--adapter``) does.

Adapters are mlx-lm's format (``adapter_config.json`` + ``adapters.safetensors``, as
``mlx_lm.lora`` saves them) or PEFT's (store/adapters.py maps it); DoRA and full fine-tunes
are refused (they change the base weights, which every row shares).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxd.core.errors import InvalidRequest
from mlxd.store.adapters import (
    MLX_WEIGHTS,
    PEFT_WEIGHTS,
    adapter_format,
    check_mlx_lm,
    is_peft,
    peft_key,
    peft_lora,
    read_adapter_config,
)


@dataclass
class Adapter:
    name: str
    path: Path
    scale: float
    rank: int
    weights: dict[str, tuple[mx.array, mx.array]]  # module path -> (lora_a, lora_b)
    nbytes: int = 0
    stamp: tuple[int, int] | None = None  # files_stamp when read


@dataclass
class _Rows:
    """The order of the batch's rows and each row's adapter slot, for the next forward."""

    idx: mx.array | None = None  # slot per row; None: no row uses an adapter
    scale: mx.array | None = None  # scale per row
    slot_of: dict[int, int] = field(default_factory=dict)  # uid -> slot


class RowLoRALinear(nn.Module):
    """A base linear layer plus each row's own adapter (see the module docstring)."""

    def __init__(self, base: nn.Module, rows: _Rows) -> None:
        super().__init__()
        self.base = base
        self._rows = [rows]  # in a list: not a child module or parameter
        self._stacks: list[tuple[mx.array, mx.array] | None] = [None]

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        rows, stacks = self._rows[0], self._stacks[0]
        if rows.idx is None or stacks is None or rows.scale is None:
            return y
        a, b = stacks[0][rows.idx], stacks[1][rows.idx]  # (B, in, r), (B, r, out)
        z = (x @ a) @ b
        return y + (rows.scale[:, None, None] * z).astype(x.dtype)


def read_adapter(name: str, path: Path) -> Adapter:
    """An adapter directory, mlx-lm's or PEFT's (converted in memory, as vLLM reads it),
    checked: a 400 naming ``lora_path`` when unusable."""
    path = Path(path).expanduser()
    config = read_adapter_config(path)
    peft = is_peft(config) or adapter_format(path) == "peft"
    if peft:
        _, scale = peft_lora(config, name)
    else:
        check_mlx_lm(config, name)
        scale = float((config.get("lora_parameters") or {}).get("scale", 20.0))
    file = PEFT_WEIGHTS if peft else MLX_WEIGHTS
    try:
        raw = mx.load(str(path / file))
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable file
        raise InvalidRequest(
            f"adapter '{name}': cannot read {file} ({exc})", param="lora_path"
        ) from exc
    assert isinstance(raw, dict)
    if peft:  # [r, in] and [out, r] -> mlx-lm's [in, r] and [r, out]
        pairs: dict[str, dict[str, mx.array]] = {}
        for key, w in raw.items():
            mod, ab = peft_key(key, name)
            pairs.setdefault(mod, {})[ab] = w.T
        raw = {f"{mod}.lora_{ab}": w for mod, p in pairs.items() for ab, w in p.items()}
    weights: dict[str, tuple[mx.array, mx.array]] = {}
    for key, a in raw.items():
        if key.endswith(".lora_a"):
            mod = key[: -len(".lora_a")]
            b = raw.get(mod + ".lora_b")
            if b is None:
                raise InvalidRequest(f"adapter '{name}': {mod} has no lora_b", param="lora_path")
            weights[mod] = (a, b)
    if not weights:
        raise InvalidRequest(f"adapter '{name}' holds no LoRA weights", param="lora_path")
    rank = max(a.shape[-1] for a, _ in weights.values())
    nbytes = sum(a.nbytes + b.nbytes for a, b in weights.values())
    return Adapter(name, path, scale, rank, weights, nbytes, files_stamp(path))


def files_stamp(path: Path) -> tuple[int, int] | None:
    """Identity of an adapter's weights file (inode, mtime): a store entry replaced under the
    same name is another file, so the core reads it again; None when it is gone."""
    for file in (MLX_WEIGHTS, PEFT_WEIGHTS):
        try:
            st = (Path(path).expanduser() / file).stat()
        except OSError:
            continue
        return st.st_ino, st.st_mtime_ns
    return None


class RowAdapters:
    """The adapters loaded on one model and the slot of each running row."""

    def __init__(self, model: nn.Module, busy: Callable[[str], bool]) -> None:
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.rows = _Rows()
        self.in_use = busy  # whether a waiting or running sequence uses an adapter
        self._layers: dict[str, RowLoRALinear] = {}
        self._slot: dict[str, int] = {}
        self._scales: list[float] = [0.0]
        model._mlxd_rows = self  # what set_rows finds

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())

    def load(self, adapter: Adapter) -> None:
        """Add (or replace, when unused) an adapter; wraps the layers it targets."""
        modules = dict(self.model.named_modules())
        missing = [m for m in adapter.weights if m not in modules and m not in self._layers]
        if missing:
            raise InvalidRequest(
                f"adapter '{adapter.name}' targets layers this model lacks: {missing[:3]}",
                param="lora_path",
            )
        if self.in_use(adapter.name):
            raise InvalidRequest(
                f"adapter '{adapter.name}' is in use; unload it when its requests end",
                param="lora_name",
            )
        wrap = []
        for mod in adapter.weights:
            if mod not in self._layers:
                layer = RowLoRALinear(modules[mod], self.rows)
                self._layers[mod] = layer
                wrap.append((mod, layer))
        if wrap:
            self.model.update_modules(tree_unflatten(wrap))
        self.adapters[adapter.name] = adapter
        self._restack()

    def unload(self, name: str) -> None:
        if self.in_use(name):
            raise InvalidRequest(
                f"adapter '{name}' is in use by running requests", param="lora_name"
            )
        self.adapters.pop(name, None)
        self._restack()

    def _restack(self) -> None:
        """Every wrapped layer's stacks: slot 0 zeros, then each adapter's A and B padded to
        the largest rank (zeros beyond an adapter's own rank add nothing)."""
        names = list(self.adapters)
        self._slot = {n: i + 1 for i, n in enumerate(names)}
        self._scales = [0.0] + [self.adapters[n].scale for n in names]
        for mod, layer in self._layers.items():
            pairs = [self.adapters[n].weights.get(mod) for n in names]
            shape = next((p for p in pairs if p is not None), None)
            if shape is None:
                layer._stacks[0] = None
                continue
            d_in, d_out = shape[0].shape[0], shape[1].shape[-1]
            rank = max(p[0].shape[-1] for p in pairs if p is not None)
            dtype = shape[0].dtype
            a_s = [mx.zeros((d_in, rank), dtype=dtype)]
            b_s = [mx.zeros((rank, d_out), dtype=dtype)]
            for p in pairs:
                if p is None:
                    a_s.append(mx.zeros((d_in, rank), dtype=dtype))
                    b_s.append(mx.zeros((rank, d_out), dtype=dtype))
                    continue
                a, b = p
                pad = rank - a.shape[-1]
                a_s.append(mx.pad(a, [(0, 0), (0, pad)]) if pad else a)
                b_s.append(mx.pad(b, [(0, pad), (0, 0)]) if pad else b)
            stacks = (mx.stack(a_s), mx.stack(b_s))
            mx.eval(stacks)
            layer._stacks[0] = stacks

    def admit(self, uid: int, name: str) -> None:
        """Row ``uid`` decodes with adapter ``name`` until :meth:`release`."""
        self.rows.slot_of[uid] = self._slot[name]

    def release(self, uid: int) -> None:
        self.rows.slot_of.pop(uid, None)

    def set_rows(self, uids: list[int]) -> None:
        slots = [self.rows.slot_of.get(u, 0) for u in uids]
        if not any(slots):
            self.rows.idx = self.rows.scale = None
            return
        self.rows.idx = mx.array(slots)
        self.rows.scale = mx.array([self._scales[s] for s in slots], dtype=mx.float32)


def set_rows(model: Any, uids: list[int]) -> None:
    """Tell a model with per-row adapters the order of the rows of its next forward."""
    rows = getattr(model, "_mlxd_rows", None)
    if rows is not None:
        rows.set_rows(list(uids))
