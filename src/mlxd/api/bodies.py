"""The 200 bodies the routes build: one pydantic model per response shape of each dialect.

A route constructs its body from these models and sends it with :func:`json_body`, and the
same models are what the OpenAPI document publishes (``responses=ok(Model)``), so the
document cannot drift from what the server sends: a field the code sets that the model
lacks, or one of the wrong type, fails where it is built (and under the type checker)
instead of reaching a client. ``json_body`` writes the fields a route set and those with a
default other than None, so optional fields (``reasoning_content``, ``tool_calls``,
``token_ids``...) appear only when given, while a field set to None (``logprobs: null``)
is sent as null, as OpenAI sends it.

Streamed events stay hand-framed where they are per token (api/openai.py frames its
per-token chunk around one ``json.dumps``); the models cover every whole body.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """A response body: only the fields declared here, each of its declared type. A field
    with a default other than None (``object``, ``type``, a count) is always sent."""

    model_config = ConfigDict(extra="forbid")

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.update(_always_sent(type(self)))


@functools.cache
def _always_sent(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(
        name
        for name, f in cls.model_fields.items()
        if not f.is_required() and f.default is not None and f.default_factory is None
    )


def json_body(body: BaseModel, status_code: int = 200) -> Response:
    """``body`` as JSON: the fields the route set (see the module docstring), serialised
    by pydantic-core (2.4x faster than ``json.dumps`` on 256 embeddings of 384 floats)."""
    return Response(
        body.model_dump_json(exclude_unset=True),
        status_code=status_code,
        media_type="application/json",
    )


# -- OpenAI --------------------------------------------------------------------------------------


class PromptTokensDetails(Body):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class CompletionTokensDetails(Body):
    reasoning_tokens: int = Field(description="Completion tokens of the reasoning part.")


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="A thinking model's reasoning tokens."
    )


class FunctionCall(Body):
    name: str
    arguments: str = Field(description="The arguments as a JSON string.")


class ToolCallOut(Body):
    index: int | None = Field(None, description="Streaming only: the call's position.")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(Body):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="A thinking model's reasoning.")
    tool_calls: list[ToolCallOut] | None = None


class TopLogprobOut(Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(Body):
    content: list[TokenLogprobOut]


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(Body):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = Field(None, description="A LoRA adapter's directory.")
    parent: str | None = Field(None, description="A LoRA adapter's base model.")


class ModelList(Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Embedding(Body):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 little-endian float32")


class EmbeddingList(Body):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class RerankResult(Body):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = Field(
        None, description="The document as sent: {'text': ...} for a string one."
    )
    text_output: Literal["yes", "no"] | None = None


class RerankVersion(Body):
    version: str


class RerankUnits(Body):
    search_units: int
    input_tokens: int


class RerankTokens(Body):
    input_tokens: int
    output_tokens: int


class RerankMeta(Body):
    """Cohere's ``meta``."""

    api_version: RerankVersion
    billed_units: RerankUnits
    tokens: RerankTokens


class RerankResponse(Body):
    id: str
    object: Literal["list"] = "list"
    model: str
    results: list[RerankResult]
    usage: Usage
    meta: RerankMeta


class TokenCount(Body):
    index: int
    tokens: int = Field(description="The number of tokens of input i.")
    token_ids: list[int] | None = Field(None, description="With return_tokens.")
    token_strings: list[str] | None = Field(None, description="With return_token_strings.")


class TokenizeResponse(Body):
    object: Literal["list"] = "list"
    model: str
    data: list[TokenCount]
    count: int = Field(description="Tokens of all inputs together.")
    context_length: int | None
    usage: Usage


# -- mlxd's own ----------------------------------------------------------------------------------


class GenerateResponse(Body):
    text: str
    model: str
    finish_reason: str | None
    usage: Usage


# -- Anthropic -----------------------------------------------------------------------------------


class ThinkingBlock(Body):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class TextBlock(Body):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(Body):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(Body):
    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int


class AnthropicResponse(Body):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCountAnthropic(Body):
    input_tokens: int


# -- Ollama --------------------------------------------------------------------------------------


class OllamaDurations(Body):
    """The nanosecond timings Ollama reports with a finished request."""

    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_duration: int | None = None
    eval_duration: int | None = None


class OllamaGenerate(OllamaDurations):
    model: str
    created_at: str
    response: str
    thinking: str | None = Field(None, description="A thinking model's reasoning.")
    done: bool
    done_reason: str | None = None
    context: list[int] | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None


class OllamaChat(OllamaDurations):
    model: str
    created_at: str
    message: dict[str, Any] = Field(description="role, content; thinking, tool_calls.")
    done: bool
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None


class OllamaEmbed(OllamaDurations):
    model: str
    embeddings: list[list[float]]
    prompt_eval_count: int | None = None


class OllamaLegacyEmbedding(Body):
    embedding: list[float]


class Health(BaseModel):
    """``/health``: the status word always; the rest (models, engine cores, memory) is the
    runtime's report, documented in docs/operations.md, and shown only to a valid key when
    keys are configured."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "degraded", "draining", "restarting", "unavailable"]
