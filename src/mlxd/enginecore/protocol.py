"""The wire between front ends and the engine core: msgspec structs over ZeroMQ.

Why ZeroMQ + msgspec (as vLLM's engine core does): ZeroMQ gives message framing, automatic
reconnection to a restarted core on the same ``ipc://`` address, and I/O on its own thread,
so neither side blocks on the other; msgspec encodes these typed structs (``array_like``:
positional, no field names on the wire) in about a microsecond, an order of magnitude less
than pickle or JSON, and decoding validates the types.

Topology (every socket ``ipc://`` under one run directory):

* ``core-in``: the core binds a PULL socket; every front end connects a PUSH socket and
  sends :data:`ToCore` messages.
* ``fe-<id>``: each front end binds a PULL socket; the core connects one PUSH socket per
  front end (after its :class:`Hello`) and sends :data:`ToFrontend` messages: per engine
  step ONE :class:`Outputs` batch holding the new tokens of all that front end's requests.

Calls (model management, status, encoders, audio) are a tagged request struct per call,
``Request[ItsResult]``, answered by that result struct in a :class:`Reply`: dispatch and
callers' types follow the struct, not a method name.

Nothing here is HTTP or a dialect: requests are token ids plus sampling parameters.
Every message the core sends carries its ``epoch`` (a counter the supervisor raises at each
core start) and every request a front end sends names the epoch it was meant for: a
message queued for a core that has since died is dropped, never run by its successor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, get_args

import msgspec

from mlxd.core.types import GrammarSpec, ThinkSpec


def core_address(run_dir: str | Path) -> str:
    """The socket a core reads requests from, in its run directory (front ends push to it)."""
    return f"ipc://{Path(run_dir) / 'core-in'}"


class Sampling(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0


def sampling_to_wire(params: Any) -> Sampling:
    """core.types.SamplingParams -> the wire (its stop strings stay in the front end)."""
    return Sampling(**{name: getattr(params, name) for name in Sampling.__struct_fields__})


def sampling_from_wire(s: Sampling) -> Any:
    from mlxd.core.types import SamplingParams

    return SamplingParams(**msgspec.structs.asdict(s))


class VisionInput(msgspec.Struct, array_like=True, gc=False):
    """A vision request as the core's vision adapter templates and processes it: the
    messages (images as ``{"type": "image"}`` parts, audio as ``{"type": "audio"}``), the
    images' raw bytes in order, and the audio clips the front end decoded: mono float32
    samples (little-endian bytes) at the model's ``sample_rate``."""

    messages: list[dict] | None
    prompt: str | None
    prompt_tokens: list[int] | None
    images: list[bytes]
    image_params: list[str]
    template_kwargs: dict | None = None
    audio: list[bytes] = msgspec.field(default_factory=list)
    audio_params: list[str] = msgspec.field(default_factory=list)


class Add(msgspec.Struct, tag="add", array_like=True, gc=False):
    """Admit one sequence. ``grammar`` says what the request's grammar is made of (the
    core compiles it: a 400 before any output when it is not supported); ``arm_after``
    the token ids after which it starts to apply; ``cache_salt`` the prefix cache's
    partition it may reuse and fill (None: the shared one)."""

    epoch: int
    frontend: int
    rid: str
    model: str
    keep_alive: str | int | float | None
    prompt_tokens: list[int]
    sampling: Sampling
    grammar: GrammarSpec | None = None
    arm_after: list[int] | None = None
    vision: VisionInput | None = None
    tools: bool = False  # only for errors' wording in the vision adapter
    cache_salt: str | None = None  # the prefix-cache partition (core/blocks.py cache_salt)
    think: ThinkSpec | None = None  # a thinking model's markers and the reasoning budget
    adapter: list[str] | None = None  # a LoRA adapter's [name, directory] (engines/lora.py)
    priority: int = 0  # lower runs first (core/types.py DEFAULT_PRIORITY)
    tenant: str = ""  # who shares the engine fairly with whom: the API key's owner id
    weight: float = 1.0  # the tenant's share among tenants waiting at one priority
    traceparent: str | None = None  # W3C: the front end's request span, parent of the core's


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    epoch: int
    rids: list[str]


class Call(msgspec.Struct, tag="call", array_like=True, gc=False):
    """A request/response call: ``request`` is one of :data:`CallRequest` (its type says
    which call; the core answers with a :class:`Reply` holding that call's result)."""

    epoch: int
    frontend: int
    cid: int
    request: CallRequest


class CancelCall(msgspec.Struct, tag="cancel", array_like=True, gc=False):
    """The caller of call ``cid`` is gone: the core stops working on it."""

    epoch: int
    frontend: int
    cid: int


class Hello(msgspec.Struct, tag="hello", array_like=True, gc=False):
    """A front end announces itself (again, after a core restart): where to send to it."""

    frontend: int
    address: str


class Bye(msgspec.Struct, tag="bye", array_like=True, gc=False):
    frontend: int


def frontend_id(pid: int, n: int) -> int:
    """A front end's id on the wire: its process id and the number of its client there (one
    per core), so that a core can tell when the process behind an id is gone."""
    return pid * 1000 + n % 1000


def frontend_pid(frontend: int) -> int:
    return frontend // 1000


ToCore = Add | Abort | Call | CancelCall | Hello | Bye


class WireError(msgspec.Struct, array_like=True, gc=False):
    """An exception crossing the boundary: its class name (one of core/errors.py's, or
    ``out_of_memory`` / ``core_died`` / ``engine``), message, param and headers."""

    kind: str
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None


class Logprob(msgspec.Struct, array_like=True, gc=False):
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class SeqOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step produced for one sequence."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    prompt_tokens: int = -1  # set once (first output): what the core prefilled
    cached_tokens: int = 0
    error: WireError | None = None
    accepted: bool = False  # the first message of every request: admitted (or error)
    queued_s: float = -1.0  # with the first token: time in the core before joining a batch


class Outputs(msgspec.Struct, tag="out", array_like=True, gc=False):
    epoch: int
    outputs: list[SeqOut]


class Reply(msgspec.Struct, tag="reply", array_like=True, gc=False):
    """A call's answer: its result, or the error it raised (``value`` None)."""

    epoch: int
    cid: int
    value: CallResult | None = None
    error: WireError | None = None


class Heartbeat(msgspec.Struct, tag="hb", array_like=True, gc=False):
    """Sent on connect and every few hundred ms by the core's heartbeat thread (never by the
    device thread, so a long step does not look like a death). ``ready``: the pinned models
    are loaded."""

    epoch: int
    pid: int
    ready: bool
    error: str | None = None  # the pinned models could not be loaded at start
    load: int = 0  # requests in flight in this core (all front ends'): routing reads it
    limit: int = 0  # requests this core admits (its batch slots + queue); 0: not known yet


ToFrontend = Outputs | Reply | Heartbeat


# -- calls: one request struct and one result struct per call --------------------------------

KeepAlive = str | int | float | None


class Result(msgspec.Struct, array_like=True, gc=False):
    """A call's answer; each call has its own subclass (tagged, so the union decodes it)."""


R = TypeVar("R", bound=Result)


class Request(msgspec.Struct, Generic[R], array_like=True, gc=False):
    """A call's arguments; each call has its own subclass, ``Request[ItsResult]``, so the
    core dispatches on the type and a caller's ``call(Touch(...))`` is typed ModelInfo."""

    result: ClassVar[type[Result]]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for base in getattr(cls, "__orig_bases__", ()):
            args = get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], Result):
                cls.result = args[0]


# results


class ModelInfo(Result, tag="info"):
    """What a front end needs to serve a loaded model: its tokenizer's place and limits."""

    name: str
    kind: str
    path: str
    context_length: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    adapter_path: str | None = None
    sample_rate: int = 0
    window_seconds: int = 0
    # what the front end's tokenizer load cannot find without importing MLX (engines/text.py)
    tokenizer_defaults: dict[str, Any] | None = None


class Unloaded(Result, tag="unloaded"):
    """The models unloaded now, those unloaded when their last request ends, and MLX's
    allocator view after it."""

    unloaded: list[str]
    deferred: list[str]
    memory: dict[str, int]


class LoadedModels(Result, tag="loaded"):
    """One view per loaded model (enginecore/calls.py ``loaded_view``: its fixed keys and
    what its engine's ``stats()`` adds, which differs by kind)."""

    models: list[dict[str, Any]]


class CoreStatus(Result, tag="status"):
    """One core for /health: process, memory (allocator, budget, models, caches), loads and
    its models' views; ``rank_group`` when it leads a tensor or pipeline parallel group."""

    pid: int
    epoch: int
    backend: str
    blas: str
    device: str
    uptime_s: float
    requests_in_flight: int
    requests_total: int
    memory: dict[str, int]
    model_loads: dict[str, int]
    model_evictions: int
    models: list[dict[str, Any]]
    rank_group: dict[str, Any] | None = None


class MetricsText(Result, tag="metrics"):
    text: bytes  # the core's Prometheus exposition


class Embedded(Result, tag="embedded"):
    model: str
    vectors: bytes  # float32, C order, of ``shape``
    shape: list[int]
    prompt_tokens: int
    load_s: float  # waiting for the model to load


class Reranked(Result, tag="reranked"):
    model: str
    scores: list[float]
    prompt_tokens: int
    load_s: float


class Tokenized(Result, tag="tokenized"):
    model: str
    kind: str
    tokens: list[list[int]]
    context_length: int
    token_strings: list[list[str]] | None = None


class TranscriptWindow(Result, tag="window"):
    """Whisper's result for one window (engines/stt.py); segments as it made them."""

    language: str | None
    language_name: str | None
    text: str
    segments: list[dict[str, Any]]
    avg_logprob: float | None
    no_speech_prob: float | None
    compression_ratio: float | None
    temperature: float
    tokens: int


class Transcribed(Result, tag="transcribed"):
    model: str
    duration: float
    window: TranscriptWindow


class Spoken(Result, tag="spoken"):
    model: str
    audio: bytes  # float32 samples at ``sample_rate``
    sample_rate: int
    speed_applied: bool  # the model spoke at the asked speed itself


class ScorerCount(Result, tag="scorers"):
    count: int  # LLM rerank scorers borrowing a chat model's weights


class Done(Result, tag="done"):
    """A call that answers nothing but its success."""


class Faulted(Result, tag="faulted"):
    """A failure drill done; ``held_loads``: with kind ``held_loads``, the loads waiting at
    the ``hold_load`` gate."""

    held_loads: int = 0


# requests


class Touch(Request[ModelInfo], tag="touch"):
    """Load ``model`` (None: the default) if it is not, refresh its keep-alive."""

    model: str | None
    keep_alive: KeepAlive = None


class Unload(Request[Unloaded], tag="unload"):
    model: str | None = None  # None: every model that is not pinned


class Loaded(Request[LoadedModels], tag="loaded"):
    pass


class Forget(Request[Done], tag="forget"):
    """The store entry ``name`` was deleted: drop what the core remembers of it."""

    name: str


class Status(Request[CoreStatus], tag="status"):
    pass


class Metrics(Request[MetricsText], tag="metrics"):
    pass


class Embed(Request[Embedded], tag="embed"):
    model: str | None
    inputs: list[str | list[int]]
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: KeepAlive = None
    request_id: str = ""


class Rerank(Request[Reranked], tag="rerank"):
    model: str | None
    query: str
    documents: list[str]
    truncate: bool = True
    instruction: str | None = None
    keep_alive: KeepAlive = None
    request_id: str = ""


class Tokenize(Request[Tokenized], tag="tokenize"):
    model: str | None
    inputs: list[str] | None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    token_strings: bool = False
    keep_alive: KeepAlive = None


class Transcribe(Request[Transcribed], tag="transcribe"):
    """One window of samples (mono float32 bytes at the model's rate, at most its window)."""

    model: str | None
    audio: bytes
    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    words: bool = False
    keep_alive: KeepAlive = None


class Speak(Request[Spoken], tag="speak"):
    model: str | None
    text: str
    voice: str | None = None
    speed: float = 1.0
    keep_alive: KeepAlive = None


class Scorers(Request[ScorerCount], tag="scorers"):
    pass


class Fault(Request[Faulted], tag="fault"):
    """A failure drill (only in a core started with MLXD_TEST_FAULTS=1; enginecore/calls.py
    ``fault`` lists the kinds)."""

    kind: str
    model: str | None = None
    seconds: float = 0.0
    message: str = ""
    value: bool = True


class LoadLora(Request[Done], tag="lora_load"):
    """Load (or reload) LoRA adapter ``name`` from ``path`` onto ``model`` now, so that an
    adapter that does not fit the model is a 400 when it is registered."""

    model: str
    name: str
    path: str


class UnloadLora(Request[Done], tag="lora_unload"):
    """Drop LoRA adapter ``name`` from every loaded model (a 400 while requests use it)."""

    name: str


# tagged unions: the first element of a call's array names its struct
CallRequest = (
    LoadLora
    | UnloadLora
    | Touch
    | Unload
    | Loaded
    | Forget
    | Status
    | Metrics
    | Embed
    | Rerank
    | Tokenize
    | Transcribe
    | Speak
    | Scorers
    | Fault
)
CallResult = (
    ModelInfo
    | Unloaded
    | LoadedModels
    | CoreStatus
    | MetricsText
    | Embedded
    | Reranked
    | Tokenized
    | Transcribed
    | Spoken
    | ScorerCount
    | Done
    | Faulted
)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def result_type(request: Request[R]) -> type[R]:
    """The result struct ``request``'s call answers with."""
    return request.result  # type: ignore[return-value]


class _CallHead(msgspec.Struct, tag="call", array_like=True, gc=False):
    """A :class:`Call`'s addressing, its request left undecoded."""

    epoch: int
    frontend: int
    cid: int
    request: msgspec.Raw


class _ReplyHead(msgspec.Struct, tag="reply", array_like=True, gc=False):
    """A :class:`Reply`'s addressing, its value and error left undecoded."""

    epoch: int
    cid: int
    value: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()


def call_head(raw: bytes) -> _CallHead | None:
    """Where to answer a message that did not decode, if it is a call (None otherwise)."""
    try:
        return msgspec.msgpack.decode(raw, type=_CallHead)
    except msgspec.DecodeError:
        return None


def reply_head(raw: bytes) -> _ReplyHead | None:
    """Which call a reply that did not decode answers, if it is a reply (None otherwise)."""
    try:
        return msgspec.msgpack.decode(raw, type=_ReplyHead)
    except msgspec.DecodeError:
        return None


def core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def frontend_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToFrontend)


# -- errors across the boundary ----------------------------------------------------------------


def error_to_wire(exc: BaseException) -> WireError:
    from mlxd.core.errors import MlxdError
    from mlxd.runtime.worker import WorkerDied, is_out_of_memory

    if isinstance(exc, MlxdError):
        return WireError(
            type(exc).__name__,
            exc.message,
            exc.param,
            {str(k): str(v) for k, v in exc.headers.items()} or None,
        )
    if isinstance(exc, WorkerDied):
        return WireError("core_died", str(exc))
    if is_out_of_memory(exc):
        return WireError("out_of_memory", str(exc))
    return WireError("engine", f"{type(exc).__name__}: {exc}")


def error_from_wire(err: WireError) -> Exception:
    """The front end's exception for ``err``: the same MlxdError class, or a 503/500."""
    from mlxd.core import errors

    cls = getattr(errors, err.kind, None)
    if isinstance(cls, type) and issubclass(cls, errors.MlxdError):
        return cls(err.message, param=err.param, headers=err.headers)
    if err.kind == "core_died":
        return errors.Unavailable(
            f"{err.message}; it is being restarted, retry shortly", headers={"Retry-After": "2"}
        )
    if err.kind == "out_of_memory":
        return errors.OutOfMemory(
            f"out of memory while generating ({err.message}); the batch was cancelled to "
            "free memory. Retry, or lower max_tokens or engine.max_num_seqs",
            headers={"Retry-After": "1"},
        )
    return errors.EngineError(f"generation failed: {err.message}")
