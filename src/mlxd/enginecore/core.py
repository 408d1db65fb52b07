"""The engine-core process: everything MLX for one device, behind a ZeroMQ socket.

Three threads:

* the **device thread** (runtime/worker.py): loads, prefills, decode steps and encoder
  passes. What a step produced goes, as one list, to :class:`FrontendChannel`, which turns
  it into one :class:`~.protocol.Outputs` message per front end and sends it then and
  there (enginecore/outlet.py says why not through another thread);
* the **heartbeat thread**: a heartbeat to every front end each :data:`HEARTBEAT_S`, which
  front ends use to tell a busy core from a dead one;
* the **main thread**'s asyncio loop: reads requests, runs the model manager (loads,
  LRU/TTL, memory budget), admission, leases, and the calls (status, embed, rerank...).

A fault that kills the device thread ends the process (exit code 3): the supervisor starts
a fresh core, as it does after a kill -9 or a Metal/CUDA abort, which nothing in-process
can catch. One recovery path for every way a core can die.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from mlxd.config import Settings
from mlxd.core.devices import DEVICE_ENV
from mlxd.core.errors import InvalidRequest, QueueFull, Unavailable
from mlxd.core.render import Renderer
from mlxd.enginecore import protocol as p
from mlxd.enginecore.outlet import Outlet
from mlxd.observability import tracing

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-off bound (see main)
FAULTS_ENV = "MLXD_TEST_FAULTS"  # "1": the "fault" call exists (tests and failure drills)


@dataclass(eq=False)
class _Live:
    """A request admitted into an engine: what its end must release."""

    lease: Any
    engine: Any
    seq: Any
    frontend: int
    traceparent: str | None = None  # the front end's request span (traces on)
    t_received: float = 0.0  # time.monotonic() when the Add arrived


class FrontendChannel:
    """The device thread's outlet to one front end (see runtime/worker.py's channels)."""

    __slots__ = ("core", "frontend")

    def __init__(self, core: EngineCore, frontend: int) -> None:
        self.core = core
        self.frontend = frontend

    def send(self, items: list) -> None:
        outs: list[p.SeqOut] = []
        finished: list[str] = []
        for (rid, seq), ev in items:
            so = p.SeqOut(rid, [] if ev.token is None else [ev.token], ev.finish_reason)
            if ev.logprob is not None:
                so.logprobs = [p.Logprob(*ev.logprob)]
            if ev.queued_s is not None:
                so.queued_s = ev.queued_s
            if ev.error is not None:
                so.error = p.error_to_wire(ev.error)
                so.finish_reason = "error"
            if so.finish_reason is not None:
                first = getattr(seq, "cached_first", None)  # a preempted row's first hit
                so.cached_tokens = seq.cached_tokens if first is None else first
                finished.append(rid)
            outs.append(so)
        core = self.core
        core.outlet.send(self.frontend, p.Outputs(core.epoch, outs))
        if finished:
            try:
                core.loop.call_soon_threadsafe(core.finished, finished)
            except RuntimeError:  # the loop is closing: the process is exiting
                pass


class EngineCore:
    def __init__(self, settings: Settings, run_dir: str | Path, epoch: int) -> None:
        from mlxd.runtime.audio import AudioService
        from mlxd.runtime.encoders import EncoderService
        from mlxd.runtime.models import ModelManager
        from mlxd.runtime.worker import DeviceWorker

        self.settings = settings
        self.run_dir = Path(run_dir)
        self.epoch = epoch
        self.worker = DeviceWorker()
        self.models = ModelManager(settings, self.worker)
        self.encoders = EncoderService(self)
        # vision prompts' templates and /v1/tokenize's, bounded (core/render.py)
        self.renderer = Renderer(
            settings.server.template_timeout_s, settings.server.max_concurrent_renders
        )
        self.audio = AudioService(self, self.encoders)
        self.draining = False
        self.ready = False
        self.startup_error: str | None = None
        self._inflight = 0
        self.admitted_total = 0  # generations admitted since start (per-core load, /health)
        self.outlet = Outlet(self._heartbeat)
        self._live: dict[str, _Live] = {}
        self._aborted: deque[str] = deque(maxlen=4096)  # aborts that beat their Add
        self._rendering: dict[str, asyncio.Task] = {}  # Adds whose prompt renders, by rid
        self._channels: dict[int, FrontendChannel] = {}
        self._calls: dict[tuple[int, int], asyncio.Task] = {}
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.started_at = time.time()

    # -- what EncoderService and the model manager read ------------------------------------
    @property
    def healthy(self) -> bool:
        return self.worker.alive and not self.draining

    @property
    def admission_limit(self) -> int:
        """Batch slots plus queue: the loaded models' largest batch (per model, resolved at
        load: core/slots.py) and engine.max_queued_requests."""
        return self.models.max_num_seqs() + self.settings.engine.max_queued_requests

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(p.core_address(self.run_dir))
        stop_beats = threading.Event()
        threading.Thread(
            target=self.outlet.run_heartbeat,
            args=(HEARTBEAT_S, stop_beats),
            name="mlxd-core-heartbeat",
            daemon=True,
        ).start()
        self.models.store.clean_temp()
        self.worker.start()
        tasks = [
            asyncio.create_task(self._load_pinned()),
            asyncio.create_task(self._sweep()),
            asyncio.create_task(self._watch_worker()),
            asyncio.create_task(self._watch_parent(os.getppid())),
            asyncio.create_task(self._watch_frontends()),
        ]
        decode = p.core_decoder().decode
        log.info("engine core %d ready for requests (pid %d)", self.epoch, os.getpid())
        try:
            while True:
                raw = await sock.recv()
                try:
                    msg = decode(raw)
                except msgspec.DecodeError as exc:
                    self._undecodable(raw, exc)
                    continue
                self._dispatch(msg)
        finally:
            stop_beats.set()
            for t in tasks:
                t.cancel()

    async def _load_pinned(self) -> None:
        names = dict.fromkeys([self.models.default_name, *self.models.preload_names])
        try:
            for name in names:
                await self.models.touch(name, None)
        except Exception as exc:  # noqa: BLE001 - reported to the front ends, which decide
            log.exception("could not load the pinned models")
            self.startup_error = f"{type(exc).__name__}: {exc}"
        _freeze_heap()
        self.ready = True
        self.outlet.beat()

    async def _sweep(self, every: float = 0.5) -> None:
        """Unload models whose keep_alive ran out."""
        while True:
            await asyncio.sleep(every)
            try:
                self.models.expire()
            except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
                log.exception("model expiry sweep failed")

    def flush_caches(self, timeout: float) -> None:
        """Before the process exits: finish the disk writes the prefix caches queued (a
        conversation that ended just before a stop is what the restart should find)."""
        deadline = time.monotonic() + timeout
        for entry in self.models.loaded():
            flush = getattr(entry.engine, "flush", None)
            if flush is None:
                continue
            try:
                flush(max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - exiting anyway: what is written is written
                log.warning("could not finish the disk writes of %s in time", entry.name)

    async def _watch_worker(self) -> None:
        """The device thread died: its sequences were failed; end the process so that the
        supervisor starts a clean core (MLX state of a dead thread is not to be trusted)."""
        while not self.worker.dead:
            await asyncio.sleep(0.05)
        log.critical(
            "device thread died (%s); the engine core exits for a restart", self.worker.error
        )
        await asyncio.sleep(0.2)  # let ZeroMQ's I/O thread deliver the failed sequences
        os._exit(3)

    async def _watch_parent(self, parent: int) -> None:
        """The server process is gone (even a kill -9 of it): no core outlives its server."""
        while os.getppid() == parent:
            await asyncio.sleep(0.5)
        log.warning("the mlxd server process (pid %d) is gone; the engine core exits", parent)
        os._exit(0)

    async def _watch_frontends(self, every: float = 0.5) -> None:
        """A front end's process ended without its Bye (kill -9, a crash): its requests
        and calls end here too, rather than hold batch slots for no one."""
        from mlxd.process import pid_alive

        while True:
            await asyncio.sleep(every)
            for fe in list(self._channels):
                if not pid_alive(p.frontend_pid(fe)):
                    n = sum(1 for live in self._live.values() if live.frontend == fe)
                    log.warning(
                        "front end %d (pid %d) is gone; dropping its %d request(s)",
                        fe,
                        p.frontend_pid(fe),
                        n,
                    )
                    self._drop_frontend(fe)

    # -- requests ----------------------------------------------------------------------------
    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, p.Hello):
            self._channels.setdefault(msg.frontend, FrontendChannel(self, msg.frontend))
            self.outlet.connect(msg.frontend, msg.address)
            return
        if isinstance(msg, p.Bye):
            self._drop_frontend(msg.frontend)
            return
        if msg.epoch != self.epoch:
            return  # meant for a core that has died since: its sender already failed it
        if isinstance(msg, p.Add):
            asyncio.create_task(self._add(msg))
        elif isinstance(msg, p.Abort):
            for rid in msg.rids:
                if not self._end(rid, cancel=True):
                    self._aborted.append(rid)
                    rendering = self._rendering.get(rid)
                    if rendering is not None:  # its prompt still renders: interrupt that
                        rendering.cancel()
        elif isinstance(msg, p.Call):
            self._calls[(msg.frontend, msg.cid)] = asyncio.create_task(self._call(msg))
        elif isinstance(msg, p.CancelCall):
            task = self._calls.pop((msg.frontend, msg.cid), None)
            if task is not None:
                task.cancel()

    def _undecodable(self, raw: bytes, exc: msgspec.DecodeError) -> None:
        """A message that does not decode: dropped; a call's caller gets the reason (a
        400), so that it does not wait for an answer that never comes."""
        head = p.call_head(raw)
        if head is None or head.epoch != self.epoch:
            log.error("dropped an undecodable message (%d bytes): %s", len(raw), exc)
            return
        self.outlet.send(
            head.frontend,
            p.Reply(
                self.epoch,
                head.cid,
                None,
                p.error_to_wire(InvalidRequest(f"malformed engine-core call: {exc}")),
            ),
        )

    def _reply_error(self, fe: int, rid: str, exc: BaseException) -> None:
        self.outlet.send(
            fe,
            p.Outputs(
                self.epoch, [p.SeqOut(rid, [], "error", error=p.error_to_wire(exc), accepted=True)]
            ),
        )

    async def _add(self, m: p.Add) -> None:
        fe = m.frontend
        t_received = time.monotonic()
        if self.draining or not self.worker.alive:
            self._reply_error(
                fe,
                m.rid,
                Unavailable(
                    "the engine core is not running; retry shortly", headers={"Retry-After": "2"}
                ),
            )
            return
        if self._inflight >= self.admission_limit:
            self._reply_error(
                fe,
                m.rid,
                QueueFull("too many requests queued; retry shortly", headers={"Retry-After": "1"}),
            )
            return
        self._inflight += 1
        lease = None
        try:
            await self.models.check_headroom()
            lease = await self.models.acquire(m.model, m.keep_alive)
            engine = lease.engine
            params = p.sampling_from_wire(m.sampling)
            if m.vision is not None or engine.kind == "vision":
                self._rendering[m.rid] = asyncio.current_task()  # type: ignore[assignment]
                try:
                    prompt = await self.renderer.run(self._vision_prompt, engine, m)
                finally:
                    self._rendering.pop(m.rid, None)
            elif engine.kind != "chat":
                raise InvalidRequest(
                    f"model '{engine.name}' is a {engine.kind} model, not a chat model",
                    param="model",
                )
            else:
                prompt = m.prompt_tokens
            grammar = None
            if m.grammar is not None:
                grammar = await asyncio.to_thread(engine.text.matcher, m.grammar)
            seq = engine.new_sequence(
                prompt,
                params,
                grammar=grammar,
                arm_after=tuple(m.arm_after) if m.arm_after else None,
                think=m.think,
            )
            seq.cache_salt = m.cache_salt
            if m.adapter:
                if engine.kind != "chat":
                    raise InvalidRequest(
                        f"model '{engine.name}' takes no LoRA adapters per request (a "
                        f"{engine.kind} model)",
                        param="model",
                    )
                seq.adapter = (m.adapter[0], m.adapter[1])
            seq.priority, seq.tenant, seq.weight = m.priority, m.tenant, m.weight
        except BaseException as exc:
            self._inflight -= 1
            if lease is not None:
                lease.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._reply_error(fe, m.rid, exc)
            return
        if m.rid in self._aborted:  # the front end gave up while the model loaded
            self._inflight -= 1
            lease.release()
            return
        channel = self._channels.get(fe)
        if channel is None:
            channel = self._channels[fe] = FrontendChannel(self, fe)
        seq.handle = (channel, (m.rid, seq))
        self._live[m.rid] = _Live(lease, engine, seq, fe, m.traceparent, t_received)
        self.admitted_total += 1
        self.outlet.send(
            fe,
            p.Outputs(
                self.epoch,
                [p.SeqOut(m.rid, [], accepted=True, prompt_tokens=len(seq.prompt_tokens))],
            ),
        )
        self.worker.submit(engine, seq)

    def _vision_prompt(self, engine: Any, m: p.Add) -> Any:
        """Decode and process a vision request's images (in a thread, off the loop)."""
        import numpy as np

        from mlxd.core.images import decode_image
        from mlxd.engines.vlm import LoadedAudio, LoadedImage

        v = m.vision
        if engine.kind != "vision":
            raise InvalidRequest(
                f"model '{engine.name}' does not accept images (it is not a vision model)",
                param="messages",
            )
        if v is None:  # a token-id or text prompt to a vision model
            return engine.encode_vision(prompt_tokens=m.prompt_tokens)
        vs = self.settings.vision
        images = [
            LoadedImage(decode_image(data, param, vs), hashlib.sha256(data).hexdigest(), param)
            for data, param in zip(v.images, v.image_params, strict=True)
        ]
        if images:
            from mlxd.observability import metrics

            metrics.vision_images_total.labels(engine.name).inc(len(images))
        audio = [
            LoadedAudio(np.frombuffer(data, dtype="<f4"), param)
            for data, param in zip(v.audio, v.audio_params, strict=True)
        ]
        return engine.encode_vision(
            messages=v.messages,
            prompt=v.prompt,
            prompt_tokens=v.prompt_tokens,
            images=images,
            template_kwargs=v.template_kwargs,
            audio=audio,
        )

    def finished(self, rids: list[str]) -> None:
        """On the loop: these requests' last output went out; release their leases."""
        for rid in rids:
            self._end(rid, cancel=False)

    def _end(self, rid: str, *, cancel: bool) -> bool:
        live = self._live.pop(rid, None)
        if live is None:
            return False
        if cancel:
            self.worker.cancel(live.engine, live.seq)
        self._inflight -= 1
        live.lease.release()
        if live.traceparent is not None and tracing.enabled():
            _trace(live, cancel)
        return True

    def _drop_frontend(self, fe: int) -> None:
        self._channels.pop(fe, None)
        for rid, live in list(self._live.items()):
            if live.frontend == fe:
                self._end(rid, cancel=True)
        for key, task in list(self._calls.items()):
            if key[0] == fe:
                task.cancel()
        self.outlet.disconnect(fe)

    # -- calls -------------------------------------------------------------------------------
    async def _call(self, m: p.Call) -> None:
        from mlxd.enginecore import calls

        try:
            request = m.request
            fn = calls.HANDLERS.get(type(request))
            if fn is None or (isinstance(request, p.Fault) and os.environ.get(FAULTS_ENV) != "1"):
                raise InvalidRequest(
                    f"unknown engine-core call '{type(request).__struct_config__.tag}'"
                )
            reply = p.Reply(self.epoch, m.cid, await fn(self, request))
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            reply = p.Reply(self.epoch, m.cid, None, p.error_to_wire(exc))
        finally:
            self._calls.pop((m.frontend, m.cid), None)
        self.outlet.send(m.frontend, reply)

    def _heartbeat(self) -> p.Heartbeat:
        return p.Heartbeat(
            self.epoch,
            os.getpid(),
            self.ready,
            self.startup_error,
            self._inflight,
            self.admission_limit,
        )


def _freeze_heap() -> None:
    """Move everything alive after start-up (modules, weights' wrappers, tokenizers) out of
    the cyclic collector's reach (``gc.freeze``, as vLLM does after initialisation): a full
    collection otherwise walks that whole heap, a pause of tens of milliseconds in the middle
    of the decode loop, every few thousand steps."""
    import gc

    gc.collect()
    gc.freeze()


def _use_device(device: str) -> None:
    """A core placed on the CPU (``engine.devices: cpu:N``) computes there even where MLX
    has a GPU; a GPU core needs nothing here: its process sees only its own GPU
    (``CUDA_VISIBLE_DEVICES``, set by the supervisor), which MLX takes by default."""
    if device.startswith("cpu"):
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    if device:
        log.info("engine core device: %s", device)


def _trace(live: _Live, cancelled: bool) -> None:
    """The finished sequence's queue, prefill and decode spans (monotonic timestamps the
    engine kept), children of the front end's request span."""
    seq = live.seq
    now = time.monotonic()
    scheduled = seq.t_scheduled or (now if cancelled else 0.0)
    first = seq.t_first or (now if cancelled and seq.t_scheduled else 0.0)
    tracing.core_spans(
        live.traceparent,
        [
            ("queue", live.t_received, scheduled),
            ("prefill", seq.t_scheduled, first),
            ("decode", seq.t_first, now),
        ],
        {
            "gen_ai.request.model": live.engine.name,
            "gen_ai.usage.input_tokens": len(seq.prompt_tokens),
            "gen_ai.usage.output_tokens": seq.generated,
            "mlxd.cached_tokens": seq.cached_tokens,
            "mlxd.cancelled": cancelled,
        },
    )


def main(run_dir: str, epoch: int) -> None:
    """The process entry (``python -m mlxd.enginecore RUN_DIR EPOCH``)."""
    import pickle

    from mlxd import blas

    settings: Settings = pickle.loads((Path(run_dir) / "settings.pkl").read_bytes())
    from mlxd.observability.logs import setup_logging

    info = blas.preload(settings.backend.blas)  # before anything imports MLX
    setup_logging(settings.log.level, settings.log.format)
    _use_device(os.environ.get(DEVICE_ENV, ""))
    from mlxd.dtype_policy import backend_name

    backend = backend_name()
    if backend == "cpu":
        (log.info if info.loaded else log.warning)("BLAS: %s", info.describe())
    log.info("MLX backend: %s", backend)
    # The parent decides when the core stops; Ctrl-C in a terminal reaches the whole process
    # group, and the front end's drain must not lose its core before it is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # The device thread shares the GIL with the heartbeat thread and the event loop. At the
    # default 5 ms switch interval a step that needs the GIL back can wait up to 5 ms per
    # hand-off (a decode step of a 0.5B model on an H200 is ~10 ms); at 0.5 ms the device
    # loop got 12% (C=16) and 25% (C=64) more tokens/s through the server in an A/B on the
    # H200.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if settings.engine.rank_group_size > 1:
        from mlxd.enginecore import group

        group.lead(settings)  # rank 0 of a rank group (enginecore/group.py)
    tracing.setup(settings.observability.otlp_traces_endpoint, "engine-core")
    core = EngineCore(settings, run_dir, epoch)

    def terminate(*_: Any) -> None:
        try:
            core.flush_caches(5.0)  # the supervisor waits 10 s before a kill
            tracing.shutdown(2.0)
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, terminate)
    asyncio.run(core.run())
