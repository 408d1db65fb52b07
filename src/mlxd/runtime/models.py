"""The model manager: which models are loaded, loading on demand, and eviction.

Policy: LRU within a per-kind cap, a TTL since last use (``keep_alive``), and a memory
budget. Before a load the manager evicts idle models until the newcomer fits and reserves
the newcomer's size while it loads, so two concurrent loads cannot oversubscribe memory.
A model with requests in flight is never evicted; preloaded models are pinned against
automatic eviction (an explicit unload still unloads them). All bookkeeping runs on the
event loop, so the checks between awaits are atomic.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.core import heap, slots
from mlxd.core.errors import (
    InsufficientStorage,
    MlxdError,
    ModelLoadError,
    ModelNotFound,
    OutOfMemory,
    Unavailable,
)
from mlxd.core.keepalive import FOREVER, parse_keep_alive
from mlxd.observability import metrics
from mlxd.runtime.memory import default_budget, estimate_model_bytes
from mlxd.runtime.worker import DeviceWorker, WorkerDied, is_out_of_memory
from mlxd.store.catalog import ModelCatalog
from mlxd.store.names import validate_name

log = logging.getLogger(__name__)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass(eq=False)
class LoadedModel:
    name: str
    kind: str
    engine: Any
    path: Path
    size: int
    loaded_at: float
    load_seconds: float
    pinned: bool = False
    active: int = 0
    last_used: float = field(default_factory=time.time)
    keep_alive: float = 1800.0
    max_num_seqs: int | None = None  # chat and vision models: their batch size
    max_num_seqs_reason: str | None = None

    @property
    def expires_at(self) -> float:
        """When an idle model goes; inf while busy or kept forever."""
        if self.active or self.keep_alive == FOREVER:
            return FOREVER
        return self.last_used + self.keep_alive


class Lease:
    """A request's hold on a loaded model: while held, the model cannot be evicted."""

    def __init__(self, manager: ModelManager, entry: LoadedModel, keep_alive: float | None):
        self._manager = manager
        self.entry = entry
        self.engine = entry.engine
        self._keep_alive = keep_alive
        self._released = False
        entry.active += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._manager._release(self.entry, self._keep_alive)


class ModelManager:
    def __init__(self, settings: Settings, worker: DeviceWorker) -> None:
        self.settings = settings
        self.worker = worker
        self.catalog = ModelCatalog.from_settings(settings)
        self.store = self.catalog.store
        m = settings.models
        self.default_keep_alive = parse_keep_alive(m.keep_alive)
        self.budget = (
            m.memory_budget_bytes if m.memory_budget_bytes is not None else default_budget()
        )
        self.caps = {
            "chat": m.max_chat_models,
            "vision": m.max_vision_models,
            "embedding": m.max_embedding_models,
            "reranker": m.max_rerankers,
            "stt": m.max_stt_models,
            "tts": m.max_tts_models,
        }
        self._paths = self.catalog.paths  # models served straight from a directory
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self._reserved = 0
        self.evictions = 0
        self.load_counts: dict[str, int] = {}
        self.default_name = self.catalog.default_name
        self.preload_names = self.catalog.preload_names
        from mlxd.dtype_policy import backend_name

        self.on_cpu = backend_name() == "cpu"

    # -- names ---------------------------------------------------------------------------
    def resolve(self, name: str | None) -> str:
        return self.catalog.resolve(name)

    # -- views ---------------------------------------------------------------------------
    def loaded(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    def get_loaded(self, name: str) -> LoadedModel | None:
        return self._loaded.get(self.resolve(name))

    def max_num_seqs(self) -> int:
        """The largest batch of the loaded models (what admission counts on); with none
        loaded, the provisional figure (core/slots.py). The heartbeat thread reads it
        too: one copy of the values, taken under the GIL."""
        sizes = [e.max_num_seqs for e in list(self._loaded.values()) if e.max_num_seqs]
        return max(sizes) if sizes else slots.provisional(self.settings, self.on_cpu)

    def dynamic_bytes(self) -> int:
        """Memory the loaded models hold beyond their weights: KV caches of running batches,
        prefix caches, image features. Counted against the budget with the weights."""
        return sum(
            sum(e.engine.memory_bytes().values())
            for e in self._loaded.values()
            if e.engine is not None
        )

    async def shrink(self) -> int:
        """Drop every model's reusable caches (prefix KV, image features), on the device
        thread; returns the bytes freed."""
        engines = [e.engine for e in self._loaded.values() if e.engine is not None]
        if not engines:
            return 0
        return await asyncio.wrap_future(
            self.worker.call(lambda: sum(eng.shrink() for eng in engines))
        )

    async def check_headroom(self) -> None:
        """Before admitting work: weights + KV + caches within the budget, or shed load.

        Over the budget, the reusable caches go first; if the running batches alone still
        fill it, the request is refused with 503 and Retry-After rather than letting the
        device run out of memory mid-batch.
        """
        if self.used_bytes + self.dynamic_bytes() <= self.budget:
            return
        await self.shrink()
        used = self.used_bytes + self.dynamic_bytes()
        if used > self.budget:
            raise Unavailable(
                f"the memory budget is full ({_human(used)} of {_human(self.budget)} in "
                "weights and running batches' KV caches); retry shortly",
                headers={"Retry-After": "1"},
            )

    @property
    def used_bytes(self) -> int:
        return sum(e.size for e in self._loaded.values())

    def installed(self) -> list[dict[str, Any]]:
        return self.catalog.installed()

    # -- acquire / release ---------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: str | int | float | None = None) -> Lease:
        """Load ``name`` if needed and hold it for one request."""
        name = self.resolve(name)
        ka = parse_keep_alive(keep_alive)
        while True:
            entry = self._loaded.get(name)
            if entry is not None:
                return Lease(self, entry, ka)
            fut = self._loading.get(name)
            if fut is not None:
                await asyncio.shield(fut)  # re-raises the load's error for every waiter
                continue
            entry = await self._load_once(name)
            return Lease(self, entry, ka)

    def _release(self, entry: LoadedModel, keep_alive: float | None) -> None:
        entry.active -= 1
        entry.last_used = time.time()
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        if entry.active == 0 and entry.keep_alive == 0 and self._loaded.get(entry.name) is entry:
            self._unload_entry(entry)

    async def touch(self, name: str | None, keep_alive: str | int | float | None) -> LoadedModel:
        """Load (or refresh) a model without a request, as Ollama's empty-prompt call does."""
        lease = await self.acquire(name, keep_alive)
        entry = lease.entry
        lease.release()
        return entry

    # -- loading -------------------------------------------------------------------------
    async def _load_once(self, name: str) -> LoadedModel:
        """Start one load of ``name`` that every waiter shares.

        The load runs as a task of its own: a waiter that goes away (its client left) stops
        waiting, but never cancels the load the others wait for, and a finished load is
        always attached and counted.
        """
        fut = asyncio.get_running_loop().create_future()
        self._loading[name] = fut
        task = asyncio.ensure_future(self._load(name))

        def done(t: asyncio.Task) -> None:
            self._loading.pop(name, None)
            if t.cancelled():
                fut.set_exception(Unavailable(f"loading '{name}' was interrupted; retry"))
            elif (exc := t.exception()) is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(t.result())
                return
            fut.exception()  # retrieved here: each waiter re-raises it itself

        task.add_done_callback(done)
        return await asyncio.shield(fut)

    async def _draft_path(self) -> Path | None:
        """Where engine.draft_model lives (speculative: draft): a directory, or a store
        name resolved (and pulled, if allowed) the way a served model's is."""
        e = self.settings.engine
        if e.speculative != "draft" or not e.draft_model:
            return None
        p = Path(e.draft_model).expanduser()
        if ("/" in e.draft_model or e.draft_model.startswith(".")) and p.is_dir():
            return p.resolve()
        if e.draft_model in self._paths:
            return self._paths[e.draft_model]
        validate_name(e.draft_model)
        from mlxd.store.pull import ensure_model

        return await asyncio.to_thread(
            ensure_model, self.store, e.draft_model, self.settings.models
        )

    async def _resolve_path(self, name: str) -> tuple[Path, str]:
        if name in self._paths:
            from mlxd.store.inspect import infer_kind

            return self._paths[name], infer_kind(self._paths[name]) or "chat"
        validate_name(name)
        from mlxd.store.pull import ensure_model

        path = await asyncio.to_thread(ensure_model, self.store, name, self.settings.models)
        manifest = self.store.manifest(name) or {}
        if manifest.get("kind"):
            return path, manifest["kind"]
        from mlxd.store.inspect import infer_kind  # e.g. served from the Hugging Face cache

        return path, infer_kind(path) or "chat"

    async def _load(self, name: str) -> LoadedModel:
        path, kind = await self._resolve_path(name)
        from mlxd.engines.backend import wants_float32

        dtype = self.settings.models.dtype
        upcast = dtype == "float32" or (dtype == "auto" and wants_float32())
        need = await asyncio.to_thread(estimate_model_bytes, path, upcast_half=upcast)
        if kind == "chat":  # a rank holds 1/N of the weights (of the layers, pipelined)
            need //= self.settings.engine.rank_group_size
        draft = await self._draft_path() if kind == "chat" else None
        if draft is not None:
            need += await asyncio.to_thread(estimate_model_bytes, draft, upcast_half=upcast)
        if self.used_bytes + self.dynamic_bytes() + self._reserved + need > self.budget:
            await self.shrink()  # reusable caches go before any model does
        self._make_room(name, kind, need)
        batch = None
        if kind in ("chat", "vision"):
            batch = await asyncio.to_thread(
                slots.resolve,
                self.settings,
                name,
                kind,
                path,
                budget=self.budget,
                weight_bytes=need,
                upcast=upcast,
                on_cpu=self.on_cpu,
                draft_path=draft,
            )
        self._reserved += need
        t0 = time.perf_counter()

        from mlxd.engines import registry

        def build() -> Any:
            return registry.create_engine(
                kind,
                name,
                path,
                self.settings,
                draft_path=draft,
                max_num_seqs=batch.value if batch else None,
            )

        try:
            if registry.loads_off_device(kind):
                # weights read and evaluated on a loader thread, and the warm-up run as the
                # new engine's own steps between the other models' steps: a load never holds
                # the device thread for long
                engine = await asyncio.to_thread(build)
                warm = await asyncio.wrap_future(
                    self.worker.call(lambda: registry.finish_on_device(engine, self.settings))
                )
                self.worker.attach(engine)
                try:
                    await asyncio.wrap_future(warm)
                except BaseException:
                    self.worker.detach(engine)
                    self.worker.call(engine.close)
                    raise
            else:
                engine = await asyncio.wrap_future(self.worker.call(build))
        except MlxdError:
            raise
        except WorkerDied as exc:
            raise Unavailable(
                f"could not load '{name}': {exc}; retry shortly", headers={"Retry-After": "2"}
            ) from exc
        except Exception as exc:
            if is_out_of_memory(exc):
                raise OutOfMemory(
                    f"out of memory while loading '{name}' ({exc}); retry later, unload "
                    "other models, or lower models.memory_budget_bytes",
                    headers={"Retry-After": "5"},
                ) from exc
            raise ModelLoadError(f"could not load model '{name}': {exc}") from exc
        finally:
            self._reserved -= need
        from mlxd.engines.decode import Engine

        if not isinstance(engine, Engine):  # what the worker relies on, checked once here
            raise ModelLoadError(f"model '{name}': {type(engine).__name__} is not an Engine")
        self.worker.attach(engine)
        took = time.perf_counter() - t0
        entry = LoadedModel(
            name=name,
            kind=kind,
            engine=engine,
            path=path,
            size=engine.nbytes or need,
            loaded_at=time.time(),
            load_seconds=took,
            pinned=name in (self.default_name, *self.preload_names),
            keep_alive=self.default_keep_alive if self.default_keep_alive is not None else 1800.0,
            max_num_seqs=batch.value if batch else None,
            max_num_seqs_reason=batch.reason if batch else None,
        )
        self._loaded[name] = entry
        self.load_counts[name] = self.load_counts.get(name, 0) + 1
        metrics.model_loaded(name, kind, entry.size, took)
        log.info(
            "loaded model %s (%s, %s) from %s in %.2fs", name, kind, _human(entry.size), path, took
        )
        if batch is not None:
            log.info("model %s: max_num_seqs %d (%s)", name, batch.value, batch.reason)
        heap.release_free_memory()  # the loaders' parse temporaries (core/heap.py)
        return entry

    def _evictable(self, kind: str | None = None) -> list[LoadedModel]:
        """Idle, unpinned models, least recently used first."""
        c = [
            e
            for e in self._loaded.values()
            if e.active == 0 and not e.pinned and (kind is None or e.kind == kind)
        ]
        return sorted(c, key=lambda e: e.last_used)

    def _make_room(self, name: str, kind: str, need: int) -> None:
        if need > self.budget:
            raise InsufficientStorage(
                f"model '{name}' needs {_human(need)}, more than the whole memory budget "
                f"({_human(self.budget)}); raise models.memory_budget_bytes or use a smaller "
                "or quantized model"
            )
        cap = self.caps.get(kind, 1)
        same = [e for e in self._loaded.values() if e.kind == kind]
        while len(same) >= cap:
            victims = self._evictable(kind)
            if not victims:
                raise Unavailable(
                    f"cannot load '{name}': {len(same)} {kind} model(s) loaded (the limit is "
                    f"{cap}) and all are busy or pinned; retry later",
                    headers={"Retry-After": "5"},
                )
            self._unload_entry(victims[0], evicted=True, reason="capacity")
            same = [e for e in self._loaded.values() if e.kind == kind]
        while self.used_bytes + self.dynamic_bytes() + self._reserved + need > self.budget:
            victims = self._evictable()
            if not victims:
                raise Unavailable(
                    f"cannot load '{name}' ({_human(need)}): {_human(self.used_bytes)} in use "
                    f"and {_human(self._reserved)} reserved by loads in progress, of a "
                    f"{_human(self.budget)} budget, and no idle model can be unloaded; "
                    "retry later",
                    headers={"Retry-After": "5"},
                )
            self._unload_entry(victims[0], evicted=True, reason="memory")

    # -- unloading -----------------------------------------------------------------------
    def _unload_entry(
        self, entry: LoadedModel, evicted: bool = False, reason: str = "idle"
    ) -> None:
        """Forget the model now; the worker frees its memory before any later load runs.

        ``reason`` (capacity | memory | idle) labels the eviction metric when ``evicted``.
        """
        if self._loaded.get(entry.name) is not entry:
            return
        del self._loaded[entry.name]
        metrics.model_unloaded(entry.name, entry.kind, reason if evicted else None)
        if evicted:
            self.evictions += 1
        engine = entry.engine
        self.worker.detach(engine)

        def free() -> None:
            engine.close()
            gc.collect()
            try:
                import mlx.core as mx

                mx.clear_cache()
            except Exception:  # noqa: BLE001 - freeing is best effort
                pass

        self.worker.call(free)
        log.info(
            "%s model %s (%s)", "evicted" if evicted else "unloaded", entry.name, _human(entry.size)
        )

    async def unload(self, name: str | None = None) -> dict[str, list[str]]:
        """Unload one model or all; busy ones go as soon as their requests finish."""
        targets = (
            list(self._loaded.values())
            if name is None
            else [e for e in self._loaded.values() if e.name == self.resolve(name)]
        )
        if name is not None and not targets:
            raise ModelNotFound(f"model '{name}' is not loaded", param="model")
        done, deferred = [], []
        for entry in targets:
            if entry.active:
                entry.keep_alive = 0
                deferred.append(entry.name)
            else:
                self._unload_entry(entry)
                done.append(entry.name)
        await asyncio.wrap_future(self.worker.call(lambda: None))  # let the frees run
        return {"unloaded": done, "deferred": deferred}

    def expire(self, now: float | None = None) -> list[str]:
        """Unload idle models whose keep_alive ran out (pinned ones stay)."""
        now = time.time() if now is None else now
        gone = [e for e in self._loaded.values() if not e.pinned and e.expires_at <= now]
        for e in gone:
            self._unload_entry(e, evicted=True, reason="idle")
        return [e.name for e in gone]

    def forget_store_entry(self, name: str) -> None:
        """After a delete: an idle loaded copy goes too; a busy one at its last request."""
        entry = self._loaded.get(name)
        if entry is not None:
            if entry.active:
                entry.keep_alive = 0
            else:
                self._unload_entry(entry)
