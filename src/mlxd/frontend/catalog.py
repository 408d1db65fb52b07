"""The model catalogue as a front end serves it: pull, delete and describe read and write
the store directly (no MLX, no engine core), then tell the core what changed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.core.errors import ModelNotFound
from mlxd.enginecore import protocol as p


class ModelCatalogOps:
    def __init__(self, runtime: Any) -> None:
        self._rt = runtime

    async def pull(
        self, name: str, *, kind: str | None = None, progress: Callable[[dict], None] | None = None
    ) -> dict:
        """Pull into the store off the event loop; ``progress`` is called on the loop."""
        from mlxd.store.pull import pull as store_pull
        from mlxd.store.pull import resolve

        # A name from the network never reaches a local path or a pip spec; aliases the
        # operator configured still may.
        resolve(name, self._rt.settings.models, allow_local=False)
        loop = asyncio.get_running_loop()

        def cb(event: dict) -> None:
            if progress is not None:
                loop.call_soon_threadsafe(progress, dict(event))

        return await asyncio.to_thread(
            store_pull,
            self._rt.catalog.store,
            name,
            self._rt.settings.models,
            kind=kind,
            progress=cb,
        )

    async def delete(self, name: str) -> None:
        from mlxd.store.pull import remove

        await asyncio.to_thread(remove, self._rt.catalog.store, name)
        self._rt.forget_model(name)
        await self._rt.cores.values_all(p.Forget(name))  # every core that is up

    def describe(self, name: str) -> dict[str, Any]:
        """What /api/show tells: manifest, config.json, chat template."""
        name = self._rt.catalog.resolve(name)
        info = self._rt._info.get(name)
        path = Path(info.path) if info else self._rt.catalog.path(name)
        if path is None:
            raise ModelNotFound(f"model '{name}' not found", param="model")
        config = _read_json(path / "config.json")
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):
            template = next(
                (t.get("template") for t in template if t.get("name") == "default"), None
            )
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        manifest = self._rt.catalog.store.manifest(name) or {
            "name": name,
            "kind": "chat",
            "source": str(path),
        }
        return {
            "name": name,
            "path": str(path),
            "manifest": manifest,
            "config": config,
            "chat_template": template or "",
        }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
