"""The front end's view of the models: what the core has loaded, and the store on disk."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.enginecore import protocol as p
from mlxd.frontend.health import merge_models


@dataclass
class LoadedModel:
    """One model loaded in the engine core, as its last status call described it."""

    name: str
    kind: str
    path: str
    size: int
    pinned: bool = False
    active_requests: int = 0
    expires_at: float | None = None
    loaded_at: float = 0.0
    context_length: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        try:
            data = json.loads((Path(self.path) / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @classmethod
    def from_view(cls, v: dict[str, Any]) -> LoadedModel:
        return cls(
            name=v["name"],
            kind=v["kind"],
            path=v["path"],
            size=v["size"],
            pinned=v["pinned"],
            active_requests=v["active_requests"],
            expires_at=v["expires_at"],
            loaded_at=v["loaded_at"],
            context_length=v.get("context_length"),
            stats=v,
        )


class ModelsView:
    def __init__(self, runtime: Any) -> None:
        self._rt = runtime

    @property
    def store(self) -> Any:
        return self._rt.catalog.store

    @property
    def default_name(self) -> str:
        return self._rt.catalog.default_name

    def resolve(self, name: str | None) -> str:
        return self._rt.catalog.resolve(name)

    def installed(self) -> list[dict[str, Any]]:
        return self._rt.catalog.installed()

    async def loaded(self) -> list[LoadedModel]:
        """Every core's loaded models, one entry per model (see frontend/health.py)."""
        replies = await self._rt.cores.values_all(p.Loaded())
        views = merge_models([(c.index, r.models) for c, r in replies])
        return [LoadedModel.from_view(v) for v in views]

    async def get_loaded(self, name: str | None) -> LoadedModel | None:
        name = self.resolve(name)
        return next((m for m in await self.loaded() if m.name == name), None)

    async def touch(self, name: str | None, keep_alive: Any = None) -> LoadedModel:
        """Load (or refresh) a model without a request, as Ollama's empty-prompt call does."""
        info = await self._rt.model_info(self.resolve(name), keep_alive, fresh=True)
        found = await self.get_loaded(info.name)
        if found is not None:
            return found
        return LoadedModel(info.name, info.kind, info.path, 0, context_length=info.context_length)

    async def unload(self, name: str | None = None) -> dict[str, Any]:
        """Unload from every core that is up; the names any of them unloaded or deferred."""
        model = None if name is None else self.resolve(name)
        replies = await self._rt.cores.values_all(p.Unload(model))
        unloaded = list(dict.fromkeys(n for _, r in replies for n in r.unloaded))
        deferred = list(dict.fromkeys(n for _, r in replies for n in r.deferred))
        result: dict[str, Any] = {"unloaded": unloaded, "deferred": deferred}
        if replies:
            result["memory"] = replies[0][1].memory  # the first core's
        for n in unloaded:
            self._rt.forget_model(n)
        return result
