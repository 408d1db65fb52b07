"""The internal request and event types every dialect translates to and from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


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
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class GenerateRequest:
    """One sequence to generate. ``prompt`` is text; ``prompt_tokens`` wins when given."""

    model: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_tokens: list[int] | None = None
    request_id: str = ""
    keep_alive: str | int | float | None = None  # Ollama semantics; None: the model's own


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

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenEvent:
    """What one decode step produced for one sequence.

    ``text`` is the newly printable text (possibly empty while a multi-byte character or
    a possible stop string is held back). ``finish_reason`` is set on the last event.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: Exception | None = None


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
