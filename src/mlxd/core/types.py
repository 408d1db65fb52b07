"""The internal request and event types every dialect translates to and from."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]

# Below this temperature sampling is greedy (as in vLLM): 1/T would overflow float32 logits
# (a temperature of 1e-300 gives inf and NaN probabilities), and the result is argmax anyway.
GREEDY_TEMPERATURE = 1e-5

# Request priorities (vLLM's field): lower runs first. A key's own priority is the default of
# its requests; batch work (the Batch API's rows) runs at BATCH_PRIORITY, behind interactive.
DEFAULT_PRIORITY = 0
BATCH_PRIORITY = 100
PRIORITY_MIN = -1000
PRIORITY_MAX = 1000


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: the server's default, capped by the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclass(frozen=True)
class OutputConstraint:
    """Decoding is constrained (a grammar masks the logits every step) so the output matches.

    ``kind``: "json_object" (any JSON object), "json_schema" (``spec`` is the schema as JSON
    text), "regex" or "lark" (``spec`` is the pattern / grammar).
    """

    kind: Literal["json_object", "json_schema", "regex", "lark"]
    spec: str = ""


ToolChoice = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class ThinkSpec:
    """A thinking model's reasoning markers for one request (text/thinking.py): the
    tokenizer's think-start and think-end ids, whether the prompt already opened the part,
    and the request's reasoning budget in tokens (None: unbounded)."""

    start: list[int]
    end: list[int]
    open: bool = False
    budget: int | None = None


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's grammar is made of, as a front end sends it to the engine core,
    which compiles it (llguidance lives only there: text/processor.py's
    ``TextProcessor.matcher``); an unsupported schema or grammar is still a 400 before
    any output.

    ``tool_call``: the output must be a call of one of ``names`` among ``tools``
    (tool_choice "required" or a named function); else ``constraint`` shapes the answer,
    and with ``tools`` (tool_choice "auto", a JSON answer) the model may call one instead.
    """

    constraint: OutputConstraint | None = None
    tools: list[dict] | None = None
    names: list[str] = field(default_factory=list)
    tool_call: bool = False
    parallel: bool = False


@dataclass(frozen=True)
class ImageInput:
    """One image a request carries, not yet fetched or decoded.

    ``source`` is a ``data:`` URL, raw base64 or an http(s) URL; ``param`` names where it came
    from (``messages[0].content[1]``), for errors. In ``GenerateRequest.messages`` each image
    sits at its place as a ``{"type": "image"}`` content part, in the order of ``images``.
    """

    source: str
    param: str


@dataclass(frozen=True)
class AudioInput:
    """One audio clip a chat message carries (OpenAI's ``input_audio`` part), not yet
    decoded: ``data`` is its base64, ``format`` what the caller says it is (wav, mp3...).
    In ``GenerateRequest.messages`` it sits at its place as a ``{"type": "audio"}`` part."""

    data: str
    format: str | None
    param: str


@dataclass
class GenerateRequest:
    """One sequence to generate. ``prompt`` is text; ``prompt_tokens`` wins when given.

    ``tools`` are function tools in OpenAI's shape (``{"type": "function", "function":
    {"name", "description", "parameters"}}``); every dialect translates to it. With
    ``tool_choice`` "required" or "function" (``tool_name``) the engine constrains decoding
    to a tool call; "none" renders no tools and parses none.
    """

    model: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_tokens: list[int] | None = None
    request_id: str = ""
    keep_alive: str | int | float | None = None  # Ollama semantics; None: the model's own
    tools: list[dict] | None = None
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None  # tool_choice == "function"
    parallel_tool_calls: bool = True
    constraint: OutputConstraint | None = None
    template_kwargs: dict | None = None  # extra chat-template variables (enable_thinking...)
    user: str | None = None  # the caller's end-user id, logged
    images: list[ImageInput] | None = None  # only vision models accept them
    audio: list[AudioInput] | None = None  # only vision models with an audio tower
    cache_salt: str | None = None  # vLLM's: only requests with equal salts share cached KV
    thinking_budget: int | None = None  # reasoning tokens before the part is closed
    adapter: tuple[str, str] | None = None  # a LoRA adapter's name and directory
    priority: int | None = None  # lower runs first; None: the API key's (DEFAULT_PRIORITY)


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (no prefill)
    reasoning_tokens: int | None = None  # of completion_tokens; None: not a thinking model

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class ToolCall:
    """One parsed function call; ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass
class TokenEvent:
    """What one decode step produced for one sequence.

    ``text`` is the newly printable answer text (possibly empty while a multi-byte character,
    a possible stop string or a possible tool-call/thinking marker is held back).
    ``reasoning`` is text of the model's thinking part (between its think markers);
    ``tool_calls`` are calls completed at this step. ``finish_reason`` is set on the last
    event ("tool_calls" when the model stopped after calling tools); ``stop_sequence`` names
    the stop string that ended it, if one did.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: Exception | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    stop_sequence: str | None = None


# -- encoders: embeddings, reranking, token counting ------------------------------------------


@dataclass
class EmbedRequest:
    """Texts (or token-id lists, used verbatim) to embed; results keep the input order."""

    model: str | None
    inputs: list[str | list[int]]
    truncate: bool = True  # False: an input over the model's limit is a 400
    dimensions: int | None = None  # keep the first N dimensions, then L2-normalise
    keep_alive: str | int | float | None = None
    request_id: str = ""


@dataclass
class RerankRequest:
    """Score each document's relevance to ``query``; scores keep the document order."""

    model: str | None
    query: str
    documents: list[str]
    truncate: bool = True
    instruction: str | None = None  # LLM rerankers: the task description in the prompt
    keep_alive: str | int | float | None = None
    request_id: str = ""


@dataclass
class EncodeEvent:
    """What one encoder batch produced for one request: results for some of its inputs.

    ``indices`` are positions in the request; ``values`` the matching results (a float32
    vector per input for embeddings, a float score for rerankers). ``error`` fails the
    whole request.
    """

    indices: list[int] = field(default_factory=list)
    values: list = field(default_factory=list)
    error: Exception | None = None
    finish_reason: FinishReason | None = None


# -- encoder results (what the core's encoder service answers) --------------------------------


@dataclass
class Timings:
    t_submitted: float = field(default_factory=time.perf_counter)
    t_acquired: float = 0.0
    t_done: float = 0.0

    def durations_ns(self) -> dict[str, int]:
        ns = 1_000_000_000
        return {
            "total_duration": int((self.t_done - self.t_submitted) * ns),
            "load_duration": int(max(self.t_acquired - self.t_submitted, 0) * ns),
        }


@dataclass
class EmbedResult:
    model: str
    vectors: Any  # numpy array (inputs, dimensions) float32, in input order
    prompt_tokens: int
    timings: Timings


@dataclass
class RerankResult:
    model: str
    scores: list[float]  # in document order
    prompt_tokens: int
    timings: Timings


@dataclass
class TokenizeResult:
    model: str
    kind: str
    tokens: list[list[int]]
    context_length: int
    token_strings: list[list[str]] | None = None
