"""Which devices get an engine core: the ``engine.devices`` setting (``--devices``).

One engine core per device (data parallel): each core is its own process with its own
copy of the models, its own batch and prefix cache; front ends route each request to one
of them (frontend/cores.py). The spelling:

* unset or ``""``: one core on MLX's default device, unpinned (what a single-device host
  wants, and mlxd's behaviour before this setting existed);
* ``all``: one core per GPU MLX sees (one core on the CPU when it sees none);
* ``0,1`` (or ``gpu:0,gpu:1``): one core on each of those GPUs. On CUDA a core sees only
  its own GPU (``CUDA_VISIBLE_DEVICES``, mapped through the one mlxd was started with);
* ``cpu`` or ``cpu:N``: N cores (1 by default) on the CPU. ``N`` counts cores here, it is
  not an index: a CPU is one MLX device, and several cores on it serve many-socket hosts
  and tests.

Parsing needs no MLX; how many GPUs there are is asked by the caller (``gpus``), so only
``all`` and GPU indices cost a probe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

DEVICE_ENV = "MLXD_CORE_DEVICE"  # set in each core's environment: "gpu:1", "cpu:0", ""

_GPU = re.compile(r"^(?:gpu:)?(\d+)$")
_CPU = re.compile(r"^cpu(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """Where one engine core runs: ``name`` as /health shows it, and the environment its
    process gets (the pinning)."""

    name: str
    kind: str  # "gpu" | "cpu" | "default"
    index: int = 0
    env: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


DEFAULT = Device("default", "default")


def check(spec: str | None) -> str | None:
    """The spec normalised (``"0, 1"`` -> ``"0,1"``), or ValueError saying what is wrong."""
    if spec is None or not spec.strip():
        return None
    parts = [s.strip().lower() for s in spec.split(",")]
    if parts == ["all"]:
        return "all"
    if len(parts) == 1 and (m := _CPU.match(parts[0])):
        if m.group(1) is not None and not 1 <= int(m.group(1)) <= 64:
            raise ValueError(f"'{spec}': cpu:N takes 1 to 64 engine cores")
        return parts[0]
    indices = []
    for s in parts:
        m = _GPU.match(s)
        if m is None:
            raise ValueError(
                f"'{spec}': expected all, a list of GPU indices (0,1 or "
                "gpu:0,gpu:1), cpu or cpu:N (N engine cores on the CPU)"
            )
        indices.append(int(m.group(1)))
    if len(set(indices)) != len(indices):
        raise ValueError(f"'{spec}': a GPU is named twice (one engine core per device)")
    return ",".join(str(i) for i in indices)


def core_folder_tag() -> str:
    """This engine core's device as a folder name ("gpu-1", "cpu-0"), or "" for the one
    core on the default device. Several cores keep their own on-disk state (the prefix
    cache's disk tier) in folders of their own: each bounds, indexes and evicts its files
    alone, which two processes sharing one folder could not do safely."""
    return os.environ.get(DEVICE_ENV, "").replace(":", "-")


def resolve(spec: str | None, gpus: Callable[[], int], visible: str | None = None) -> list[Device]:
    """The devices ``spec`` names. ``gpus()`` counts the GPUs MLX sees; ``visible`` is the
    ``CUDA_VISIBLE_DEVICES`` mlxd itself was started with (indices then count within it)."""
    spec = check(spec)
    if spec is None:
        return [DEFAULT]
    if spec.startswith("cpu"):
        n = int(spec.split(":")[1]) if ":" in spec else 1
        return [Device(f"cpu:{i}", "cpu", i, {DEVICE_ENV: f"cpu:{i}"}) for i in range(n)]
    count = gpus()
    if spec == "all":
        if count == 0:
            return [Device("cpu:0", "cpu", 0, {DEVICE_ENV: "cpu:0"})]
        indices = list(range(count))
    else:
        indices = [int(i) for i in spec.split(",")]
        missing = [i for i in indices if i >= count]
        if missing:
            raise ValueError(
                f"engine.devices '{spec}': no GPU {missing[0]} (MLX sees "
                f"{count} GPU(s)); on the CPU use cpu or cpu:N"
            )
    visible_list = [v.strip() for v in visible.split(",")] if visible else None
    return [
        Device(
            f"gpu:{i}",
            "gpu",
            i,
            {
                DEVICE_ENV: f"gpu:{i}",
                "CUDA_VISIBLE_DEVICES": visible_list[i] if visible_list else str(i),
            },
        )
        for i in indices
    ]
