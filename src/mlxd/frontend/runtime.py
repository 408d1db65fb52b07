"""What the API dialects call, in a front-end process: admission, prompts, the catalogue.

A front end never runs MLX. Per request it validates, templates and tokenizes (with the
model's tokenizer, loaded here from the model's directory: tokenizer files only), checks
the context, says what the grammar is made of (the core compiles it: an unsupported
schema is a 400 before any output), then sends the core token ids and sampling
parameters (frontend/generation.py turns the tokens that come back into text).
Embeddings, reranking and token counts are calls to the core, which batches them on the
device. Listing, describing, pulling and deleting models read and write the store
directly.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.config import Settings
from mlxd.core import heap
from mlxd.core.blocks import cache_salt
from mlxd.core.errors import (
    InvalidRequest,
    ModelNotFound,
    QueueFull,
    ShuttingDown,
    Unavailable,
)
from mlxd.core.render import Renderer
from mlxd.core.slots import provisional
from mlxd.core.types import (
    DEFAULT_PRIORITY,
    EmbedRequest,
    EmbedResult,
    GenerateRequest,
    RerankRequest,
    RerankResult,
    Timings,
    TokenEvent,
    TokenizeResult,
)
from mlxd.enginecore import protocol as p
from mlxd.enginecore.supervisor import supervisors_for
from mlxd.frontend import health, prompts
from mlxd.frontend.adapters import AdapterEntry, AdapterRegistry
from mlxd.frontend.catalog import ModelCatalogOps
from mlxd.frontend.client import CoreClient
from mlxd.frontend.cores import CorePool
from mlxd.frontend.generation import Generation, new_rid
from mlxd.frontend.models import ModelsView
from mlxd.frontend.speech import SpeechRequests
from mlxd.observability.context import add_usage, current, note, note_first
from mlxd.store.catalog import ModelCatalog

log = logging.getLogger(__name__)

# A front end of `--api-workers N`: the cores are elsewhere; their run directories,
# os.pathsep-separated, in core order.
CORE_DIR_ENV = "MLXD_CORE_DIR"


class Runtime:
    def __init__(
        self,
        settings: Settings,
        *,
        core_dirs: list[Path] | None = None,
        startup_timeout: float = 3600.0,
        front_ends: Any = None,
    ) -> None:
        self.settings = settings
        # with --api-workers N: their supervisor's shared counts (workers.py)
        self.front_ends = front_ends
        self.catalog = ModelCatalog.from_settings(settings)
        self.adapters = AdapterRegistry(settings.models_dir)
        # this process supervises the cores, or (core_dirs given) another process does
        self.supervisors = supervisors_for(settings) if core_dirs is None else []
        e = settings.engine
        self.cores = CorePool(
            core_dirs if core_dirs is not None else [s.run_dir for s in self.supervisors],
            devices=[s.device.name for s in self.supervisors] or None,
            affinity_slack=e.affinity_slack,
            affinity_min_tokens=max(e.prefix_cache_min_tokens, 1),
        )
        self.models = ModelsView(self)
        self.catalog_ops = ModelCatalogOps(self)  # pull, delete, describe (the store)
        self.speech = SpeechRequests(self)  # transcription and speech (the audio routes)
        # chat templates run bounded, and stop with their request (core/render.py)
        self.renderer = Renderer(
            settings.server.template_timeout_s, settings.server.max_concurrent_renders
        )
        self.startup_timeout = startup_timeout
        self.started_at = time.time()
        self.draining = False  # set on SIGTERM: admit nothing new, finish what runs
        self.inflight = 0  # this front end's generations admitted by the core
        self._admitted = 0  # this front end's requests between submit and release
        self._processors: dict[tuple[str, str], Any] = {}
        self._loading: dict[tuple[str, str], asyncio.Future] = {}
        self._info: dict[str, p.ModelInfo] = {}
        self._info_epoch: tuple[int, ...] = ()
        self.backend = "unknown"
        self.blas = "unknown"  # the BLAS the engine core loaded (it runs the matmuls)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # before the tokenizer loads: their worker thread's arena gives its top back (heap.py)
        heap.cap_thresholds()
        try:
            for sup in self.supervisors:
                sup.start()
            await self.cores.start()
            await self.cores.wait_ready(self.startup_timeout)
            if self.cores.startup_error:
                raise RuntimeError(
                    f"the engine core could not load the pinned models: {self.cores.startup_error}"
                )
        except BaseException:
            await self.stop()  # a failed start leaves no engine core behind
            raise
        try:
            core = await self.cores.call(p.Status())
            self.backend, self.blas = core.backend, core.blas
        except Exception:  # noqa: BLE001 - only informative
            log.exception("could not ask the engine core for its backend")
        await self._warm_processors()
        gc.collect()
        gc.freeze()  # start-up objects out of the cyclic collector's walks (see enginecore)
        heap.release_free_memory()  # what imports and tokenizer loads freed (core/heap.py)
        # the event loop shares the GIL with ZeroMQ's reader: hand it over in 0.5 ms, not 5
        # (measured with the engine core's same setting in an A/B on an H200)
        sys.setswitchinterval(0.0005)

    async def _warm_processors(self) -> None:
        """Load the pinned models' tokenizers and render their chat templates once (jinja
        compiles a template on first use), so the first request costs what the second does."""
        for name in self.catalog.pinned:
            try:
                info = await self.model_info(name)
                if info.kind not in ("chat", "vision"):
                    continue
                proc = await self.processor(info)
                if getattr(proc.tokenizer, "has_chat_template", False):
                    await self.renderer.run(
                        proc.encode_messages, [{"role": "user", "content": "Hello"}]
                    )
            except Exception:  # noqa: BLE001 - the first request will say what is wrong
                log.warning("could not prepare the tokenizer of %s", name, exc_info=True)

    async def stop(self) -> None:
        await self.cores.close()
        for sup in self.supervisors:
            await asyncio.to_thread(sup.stop)

    # -- status ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Able to serve: a core that is up with its pinned models loaded, no drain."""
        return bool(self.cores.serving) and not self.draining

    @property
    def restarts(self) -> int:
        if self.supervisors:
            return sum(s.restarts for s in self.supervisors)
        return self.cores.deaths

    @property
    def admission_limit(self) -> int:
        """What the cores admit together: each core's own limit from its heartbeat (it
        follows the batch sizes of the models it loaded); before one came, the most the
        setting allows (core/slots.py)."""
        first = provisional(self.settings, on_cpu=False) + self.settings.engine.max_queued_requests
        return sum(c.core_limit or first for c in self.cores.clients)

    @property
    def state(self) -> str:
        """ok | degraded (some cores restarting, the others serve) | draining | restarting
        (no core serving: none up, or their pinned models still loading)."""
        if self.healthy:
            return "ok" if len(self.cores.serving) == len(self.cores) else "degraded"
        return "draining" if self.draining else "restarting"

    @staticmethod
    def health_code(state: str) -> int:
        """/health's status code for a :attr:`state`: 200 only while some core serves."""
        return 200 if state in ("ok", "degraded") else 503

    async def status(self) -> dict[str, Any]:
        replies = await self.cores.call_all(p.Status(), timeout=5)
        found = {c.index: r for c, r in replies if isinstance(r, p.CoreStatus)}
        cores = [
            health.core_view(c, found.get(c.index), self._restarts_of(c))
            for c in self.cores.clients
        ]
        merged = health.merge_status(sorted(found.items()))
        first = cores[0]
        return {
            "status": self.state,
            "worker_restarts": self.restarts,
            "frontend_pid": os.getpid(),
            "front_ends": (
                self.front_ends.view()
                if self.front_ends is not None
                else {"workers": 1, "restarts": 0}
            ),
            "engine_core": {k: first[k] for k in ("pid", "epoch", "alive", "ready")}
            | health.rank_group_view(found.get(0)),
            "engine_cores": cores,
            "model_loaded": bool(merged["models"]),
            "default_model": self.catalog.default_name,
            "uptime_s": round(time.time() - self.started_at, 3),
            **merged,
        }

    def _restarts_of(self, client: CoreClient) -> int:
        for s in self.supervisors:
            if s.index == client.index:
                return s.restarts
        return client.deaths

    async def memory(self) -> dict[str, int]:
        replies = await self.cores.values_all(p.Status())
        return health.merge_status([(c.index, r) for c, r in replies])["memory"]

    def cut_streams(self) -> int:
        """The shutdown grace is over: every generation and core call of this front end
        ends now with ShuttingDown (a stream with an error event in its dialect, a request
        still waiting with a 503), and the cores drop them. Returns how many were cut."""
        err = p.WireError(
            "ShuttingDown",
            "the server shut down before this request "
            "finished (server.shutdown_grace_s ran out); retry on another "
            "instance",
        )
        return sum(c.cut(err) for c in self.cores.clients)

    def check_serving(self) -> None:
        """Some core serves (a core that died fails only its own requests)."""
        if self.draining:
            raise ShuttingDown()
        if not self.healthy:
            raise Unavailable(
                "the engine core is not running (restarting); retry shortly",
                headers={"Retry-After": "2"},
            )

    # -- models and their tokenizers ---------------------------------------------------------
    async def model_info(
        self, name: str, keep_alive: Any = None, *, fresh: bool = False
    ) -> p.ModelInfo:
        """What the core knows of a model, loading it if needed (cached per core)."""
        if self._info_epoch != self.cores.epochs:
            self._info, self._info_epoch = {}, self.cores.epochs
        info = None if fresh else self._info.get(name)
        if info is None:
            if fresh:  # a load without a request (Ollama's empty prompt): every core
                replies = await self.cores.values_all(p.Touch(name, keep_alive))
                if not replies:
                    raise Unavailable(
                        "the engine core is not running (restarting); retry shortly",
                        headers={"Retry-After": "2"},
                    )
                info = replies[0][1]
            else:  # a request's model: on the core its first request will get
                info = await self.cores.call(p.Touch(name, keep_alive))
            self._info[name] = self._info[info.name] = info
        return info

    def forget_model(self, name: str) -> None:
        self._info.pop(name, None)
        for key in [k for k in self._processors if k[0] == name]:
            del self._processors[key]

    async def processor(self, info: p.ModelInfo) -> Any:
        """The model's TextProcessor (its tokenizer loaded once, off the event loop)."""
        key = (info.name, info.path)
        proc = self._processors.get(key)
        if proc is not None:
            return proc
        fut = self._loading.get(key)
        if fut is None:
            from mlxd.text.processor import TextProcessor, load_tokenizer

            def load() -> Any:
                tok = load_tokenizer(
                    Path(info.path),
                    trust_remote_code=self.settings.models.trust_remote_code,
                    defaults=info.tokenizer_defaults,
                )
                vocab = info.vocab_size or len(tok)
                eos = info.eos_token_ids or None
                proc = TextProcessor(info.name, tok, vocab, eos)
                heap.release_free_memory()  # the parse's temporaries (core/heap.py)
                return proc

            fut = asyncio.ensure_future(asyncio.to_thread(load))
            self._loading[key] = fut
            fut.add_done_callback(lambda _: self._loading.pop(key, None))
        proc = await asyncio.shield(fut)
        self._processors[key] = proc
        return proc

    # -- generation --------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> Generation:
        """Validate, tokenize and admit ``req``; errors here are clean 4xx/5xx before any
        output. The returned Generation must be iterated or closed (that frees its slot)."""
        self.check_serving()
        prompts.check_limits(self.settings, req)
        adapter = self.adapters.resolve(req.model)
        if adapter is not None:  # the base model decodes it, with the adapter on its rows
            req.model = adapter.base
            req.adapter = (adapter.name, adapter.path)
        name = self.catalog.resolve(req.model)
        note(model=name)
        if req.images or req.audio:
            prompts.check_images(self.settings, name, self._known_kind(name), req)
        if req.user:
            note(user=req.user)
        req.priority = request_priority(req.priority)
        note_first(max_tokens=req.sampling.max_tokens, temperature=req.sampling.temperature)
        if self._admitted >= self.admission_limit:
            raise QueueFull("too many requests queued; retry shortly", headers={"Retry-After": "1"})
        self._admitted += 1
        try:
            return await self._submit(name, req)
        finally:
            self._admitted -= 1

    async def _submit(self, name: str, req: GenerateRequest) -> Generation:
        t0 = time.perf_counter()
        info = await self.model_info(name, req.keep_alive)
        name = info.name
        t_acquired = time.perf_counter()
        kind = info.kind
        if kind not in ("chat", "vision"):
            raise InvalidRequest(
                f"model '{name}' is a {kind} model, not a chat model", param="model"
            )
        if kind != "chat":
            prompts.check_text_only_features(name, req)
        proc = await self.processor(info)
        principal = (current() or {}).get("principal")
        vision = None
        if kind == "vision" or req.images or req.audio:
            vision = await prompts.vision_input(self.settings, name, kind, req, info.sample_rate)
            tokens: list[int] = list(req.prompt_tokens or [])
            plan = None
            params = prompts.fit_to_context(self.settings, info, req, 0)
        else:
            tokens, plan = await self.renderer.run(prompts.tokenize_and_prepare, proc, req)
            params = prompts.fit_to_context(self.settings, info, req, len(tokens))
        add = p.Add(
            epoch=0,
            frontend=0,
            rid=new_rid(),
            model=name,
            keep_alive=req.keep_alive,
            prompt_tokens=tokens,
            sampling=p.sampling_to_wire(params),
            grammar=plan.grammar if plan is not None else None,
            arm_after=list(plan.arm_after) if plan is not None and plan.arm_after else None,
            think=plan.think if plan is not None else None,
            adapter=list(req.adapter) if req.adapter else None,
            vision=vision,
            cache_salt=self._cache_salt(req),
            priority=DEFAULT_PRIORITY if req.priority is None else req.priority,
            tenant=getattr(principal, "owner", None) or "",
            weight=float(getattr(principal, "weight", 1.0)),
            traceparent=(current() or {}).get("traceparent"),
        )
        core = self.cores.pick(name, tokens, add.cache_salt)
        gen = Generation(
            self, core, name, proc, tokens if vision is None else None, params, plan, add
        )
        gen.t_submitted, gen.t_acquired = t0, t_acquired
        gen.key_name = getattr(principal, "name", None)
        await gen.start()
        return gen

    def _cache_salt(self, req: GenerateRequest) -> str | None:
        """The prefix-cache partition of ``req``: its ``cache_salt``, joined under
        ``security.prefix_cache_isolation: per_key`` by the owner of the API key it came
        with (the principal the security middleware put in the request's state; one that
        came without: an owner of its own, never the shared partition)."""
        owner = None
        if self.settings.security.prefix_cache_isolation == "per_key":
            principal = (current() or {}).get("principal")
            owner = getattr(principal, "owner", None) or ""
        salt = cache_salt(owner, req.cache_salt)
        if req.adapter is not None:  # KV computed with an adapter is that adapter's alone
            salt = f"{salt or ''}\x1flora:{req.adapter[0]}"
        return salt

    async def load_adapter(self, entry: AdapterEntry) -> None:
        """Load a LoRA adapter onto its base model in every core (a 400 when it does not
        fit), then register it for every front end (frontend/adapters.py)."""
        await self.cores.values_all(p.LoadLora(entry.base, entry.name, entry.path))
        self.adapters.add(entry)

    async def unload_adapter(self, name: str) -> None:
        """Drop a LoRA adapter from every core (a 400 while requests use it), then forget it."""
        await self.cores.values_all(p.UnloadLora(name))
        self.adapters.remove(name)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        gen = await self.submit(req)
        async for event in gen:
            yield event

    async def count_tokens(self, req: GenerateRequest) -> tuple[str, int]:
        """(model name, prompt tokens) of ``req`` as it would be generated: templated with
        its tools; loads the model if it has to."""
        self.check_serving()
        info = await self.model_info(self.catalog.resolve(req.model), req.keep_alive)
        note(model=info.name)
        if info.kind == "vision":
            res = await self.tokenize(info.name, None, req.messages)
            return info.name, len(res.tokens[0])
        proc = await self.processor(info)
        tokens = await self.renderer.run(proc.tokenize, req)
        return info.name, len(tokens)

    def _known_kind(self, name: str) -> str | None:
        """The model's kind without loading it (None: unknown; the load will say)."""
        info = self._info.get(name)
        try:
            return info.kind if info else self.catalog.kind(name)
        except (InvalidRequest, ModelNotFound, OSError, ValueError):
            return None

    # -- encoders (batched in the core) ------------------------------------------------------
    async def encoder_call(self, request: p.Request[p.R]) -> p.R:
        self.check_serving()
        if self._admitted >= self.admission_limit:
            raise QueueFull("too many requests queued; retry shortly", headers={"Retry-After": "1"})
        self._admitted += 1
        try:
            return await self.cores.call(request)
        finally:
            self._admitted -= 1

    async def embed(self, req: EmbedRequest) -> EmbedResult:
        timings = Timings()
        r = await self.encoder_call(
            p.Embed(
                req.model,
                req.inputs,
                truncate=req.truncate,
                dimensions=req.dimensions,
                keep_alive=req.keep_alive,
                request_id=req.request_id,
            )
        )
        timings.t_acquired = timings.t_submitted + r.load_s
        timings.t_done = time.perf_counter()
        vectors = np.frombuffer(r.vectors, dtype=np.float32).reshape(r.shape)
        note(model=r.model)
        add_usage(r.model, r.prompt_tokens, 0)
        return EmbedResult(r.model, vectors, r.prompt_tokens, timings)

    async def rerank(self, req: RerankRequest) -> RerankResult:
        timings = Timings()
        r = await self.encoder_call(
            p.Rerank(
                req.model,
                req.query,
                req.documents,
                truncate=req.truncate,
                instruction=req.instruction,
                keep_alive=req.keep_alive,
                request_id=req.request_id,
            )
        )
        timings.t_acquired = timings.t_submitted + r.load_s
        timings.t_done = time.perf_counter()
        note(model=r.model)
        add_usage(r.model, r.prompt_tokens, 0)
        return RerankResult(r.model, r.scores, r.prompt_tokens, timings)

    async def tokenize(
        self,
        model: str | None,
        inputs: list[str] | None,
        messages: list[dict] | None = None,
        *,
        add_special_tokens: bool = True,
        token_strings: bool = False,
        keep_alive: Any = None,
    ) -> TokenizeResult:
        r = await self.encoder_call(
            p.Tokenize(model, inputs, messages, add_special_tokens, token_strings, keep_alive)
        )
        note(model=r.model)
        return TokenizeResult(r.model, r.kind, r.tokens, r.context_length, r.token_strings)


def request_priority(asked: int | None) -> int:
    """The priority a request runs at: what it asks for, else its API key's (the principal
    the security middleware put in the request's state; none: DEFAULT_PRIORITY). Only an
    admin key (or the open API's local operator) may ask for a better one than its key's:
    else any key could jump its own queue."""
    principal = (current() or {}).get("principal")
    own = getattr(principal, "priority", DEFAULT_PRIORITY)
    if asked is None:
        return own
    if asked < own and not getattr(principal, "admin", False):
        raise InvalidRequest(
            f"priority {asked} is better than this API key's ({own}); "
            "only an admin key may ask for a smaller number",
            param="priority",
        )
    return asked
