"""What the OpenAPI document says about responses: error shapes, streaming media types and
the 200 bodies, so that generated clients and readers see what the server really sends.

The models here document; they do not serialise (each is given as ``responses={200:
{"model": ...}}``, which FastAPI only publishes). Errors are documented per dialect, as
api/errors.py renders them: OpenAI's object, Ollama's ``{"error": "..."}`` under /api/,
Anthropic's shape under /v1/messages. Validation failures are 400, the app's behaviour,
never FastAPI's 422 (a ``default`` response, the same error shape for any other status,
keeps FastAPI from adding one).
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxd.api.errors import is_anthropic_path


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")  # responses may carry more than documented


# -- errors --------------------------------------------------------------------------------------


class OpenAIErrorBody(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error...")
    param: str | None = Field(description="The request field at fault, as a path.")
    code: str | None = Field(description="A stable code: invalid_value, model_not_found...")


class OpenAIError(BaseModel):
    error: OpenAIErrorBody


class OllamaError(BaseModel):
    error: str


class AnthropicErrorBody(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error...")
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody


_ERRORS: dict[int | str, str] = {
    400: "Invalid request: a missing or out-of-range parameter, a wrong JSON type, a body "
    "that is not JSON (validation errors are 400, never 422).",
    401: "Missing or invalid API key (only when keys are configured).",
    404: "Unknown model (or stored response).",
    413: "The body is larger than security.max_body_bytes.",
    429: "The queue is full or a key's rate limit is reached (see Retry-After).",
    503: "Shutting down, an engine core restarting, or out of memory (see Retry-After).",
    "default": "Any other error, in the same shape.",
}


def error_model(path: str) -> type[BaseModel]:
    if path.startswith("/api/"):
        return OllamaError
    if is_anthropic_path(path):
        return AnthropicError
    return OpenAIError


def error_responses(path: str, body: bool, public: bool) -> dict[int | str, Any]:
    """The documented error responses of a route: a body can be invalid or too large, a path
    parameter name something unknown, a public route (/health) needs no key."""
    model = error_model(path)
    if public:
        codes: list[int | str] = [503]
    else:
        codes = [401, 429, 503, "default"]
        if body:
            codes += [400, 404, 413]
        elif "{" in path:
            codes += [404]
    return {c: {"model": model, "description": _ERRORS[c]} for c in sorted(codes, key=str)}


def streamed(media_type: StreamMedia, what: str) -> dict[str, Any]:
    """A 200 that is also a stream (``"stream": true``), for ``responses=``.

    For ``text/event-stream`` the schema describes *one event* (OpenAPI 3.1 leaves streams
    to convention; 3.2 and the tools that read 3.1 this way, schemathesis among them, parse
    the stream into events ``{data, event, id, retry}``): ``data`` is a string, a JSON
    object for every event but OpenAI's final ``[DONE]``. Documented as a plain string it
    was wrong for every event (tests/ops/test_fuzz.py found it)."""
    if media_type == "text/event-stream":
        schema = {
            "type": "object",
            "description": f"One server-sent event: {what}",
            "properties": {
                "data": {"type": "string", "description": "JSON, or [DONE] at the end (OpenAI)"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        }
    else:
        schema = {"type": "string", "description": f"Newline-delimited JSON: {what}"}
    return {"content": {media_type: {"schema": schema}}}


def ok(
    model: type[BaseModel] | UnionType, stream: tuple[StreamMedia, str] | None = None
) -> dict[int | str, Any]:
    """``responses=`` for a route whose 200 body is ``model`` (and, streaming, a stream)."""
    out: dict[str, Any] = {"model": model}
    if stream is not None:
        out.update(streamed(*stream))
    return {200: out}


StreamMedia = Literal["text/event-stream", "application/x-ndjson"]
SSE: Final = "text/event-stream"
NDJSON: Final = "application/x-ndjson"


# -- 200 bodies ------------------------------------------------------------------------------------


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ChatChoice(_Doc):
    index: int
    message: dict[str, Any] = Field(
        description="role, content; reasoning_content and tool_calls when present."
    )
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class Completion(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(_Doc):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 little-endian float32")


class EmbeddingList(_Doc):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class RerankResult(_Doc):
    index: int
    relevance_score: float
    document: dict[str, Any] | None = None
    text_output: Literal["yes", "no"] | None = None


class RerankResponse(_Doc):
    id: str
    model: str
    results: list[RerankResult]
    usage: Usage


class TokenCount(_Doc):
    index: int
    tokens: int = Field(description="The number of tokens of input i.")
    token_ids: list[int] | None = Field(None, description="With return_tokens.")


class TokenizeResponse(_Doc):
    object: Literal["list"]
    model: str
    data: list[TokenCount]
    count: int = Field(description="Tokens of all inputs together.")
    context_length: int | None
    usage: Usage


class GenerateResponse(_Doc):
    text: str
    model: str
    finish_reason: str | None
    usage: Usage


class Health(_Doc):
    status: Literal["ok", "degraded", "draining", "restarting", "unavailable"] = Field(
        description="With API keys configured and no valid key, the only field."
    )


class AnthropicResponse(_Doc):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: dict[str, int]


class TokenCountAnthropic(_Doc):
    input_tokens: int


class OllamaGenerate(_Doc):
    model: str
    created_at: str
    response: str
    done: bool
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None


class OllamaChat(_Doc):
    model: str
    created_at: str
    message: dict[str, Any] = Field(description="role, content; thinking, tool_calls.")
    done: bool
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None


class OllamaEmbed(_Doc):
    model: str
    embeddings: list[list[float]]
