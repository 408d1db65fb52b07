"""/health's and the model views' answers from several engine cores: per core, and merged.

Each core reports its own models, requests and memory (its ``Status`` and ``Loaded`` calls,
enginecore/calls.py); a host with one core per device shows each core (``engine_cores``:
device, pid, state, loaded models, requests) and totals over the cores that answered, with
a model loaded on several cores listed once, naming the cores that hold it. A core that is a rank
group (tensor or pipeline parallel) shows it under the setting's name
(``tensor_parallel`` / ``pipeline_parallel``: mode, size, backend, rank pids).
"""

from __future__ import annotations

from typing import Any

from mlxd.enginecore.protocol import CoreStatus

_SUMMED = ("active_requests", "running", "waiting")


def core_state(client: Any) -> str:
    if client.serving:
        return "ok"
    return "loading" if client.alive else "restarting"


def rank_group_view(status: CoreStatus | None) -> dict[str, Any]:
    """``{"tensor_parallel": group}`` or ``{"pipeline_parallel": group}`` for a core whose
    status reports a rank group; ``{}`` otherwise."""
    rg = status.rank_group if status is not None else None
    return {f"{rg['mode']}_parallel": rg} if rg else {}


def core_view(client: Any, status: CoreStatus | None, restarts: int) -> dict[str, Any]:
    """One core as /health and /api/ps show it (``status``: its status call, None when it
    did not answer)."""
    return {
        "index": client.index,
        "device": (status.device if status else None) or client.device or "default",
        "pid": client.core_pid,
        "epoch": client.epoch,
        "alive": client.alive,
        "ready": client.ready,
        "state": core_state(client),
        "restarts": restarts,
        "requests_in_flight": status.requests_in_flight if status else 0,
        "requests_total": status.requests_total if status else 0,
        "models": [m["name"] for m in status.models] if status else [],
        "memory": status.memory if status else {},
        **rank_group_view(status),
    }


def merge_models(per_core: list[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Loaded-model views (enginecore/calls.py ``loaded_view``) of each core, one per model:
    request counts summed, the latest expiry, and ``engine_cores`` (the cores holding it)."""
    merged: dict[str, dict[str, Any]] = {}
    for index, views in per_core:
        for v in views:
            m = merged.get(v["name"])
            if m is None:
                merged[v["name"]] = {**v, "engine_cores": [index]}
                continue
            m["engine_cores"].append(index)
            for key in _SUMMED:
                if isinstance(v.get(key), int):
                    m[key] = (m.get(key) or 0) + v[key]
            a, b = m.get("expires_at"), v.get("expires_at")
            m["expires_at"] = None if a is None or b is None else max(a, b)
            m["pinned"] = bool(m.get("pinned")) or bool(v.get("pinned"))
    return list(merged.values())


def merge_status(per_core: list[tuple[int, CoreStatus]]) -> dict[str, Any]:
    """Totals of several cores' status calls, (core index, status) each (one core: its own
    figures)."""
    statuses = [st for _, st in per_core]
    memory: dict[str, int] = {}
    loads: dict[str, int] = {}
    for st in statuses:
        for k, v in st.memory.items():
            memory[k] = memory.get(k, 0) + v
        for k, v in st.model_loads.items():
            loads[k] = loads.get(k, 0) + v
    return {
        "requests_in_flight": sum(st.requests_in_flight for st in statuses),
        "memory": memory,
        "model_loads": loads,
        "model_evictions": sum(st.model_evictions for st in statuses),
        "models": merge_models([(i, st.models) for i, st in per_core]),
    }
