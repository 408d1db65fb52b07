"""What the OpenAPI document says about responses: error shapes and streaming media types
(the 200 bodies are api/bodies.py's models, which the routes also build), so that
generated clients and readers see what the server really sends.

Errors are documented per dialect, as
api/errors.py renders them: OpenAI's object, Ollama's ``{"error": "..."}`` under /api/,
Anthropic's shape under /v1/messages. Validation failures are 400, the app's behaviour,
never FastAPI's 422 (a ``default`` response, the same error shape for any other status,
keeps FastAPI from adding one).
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from mlxd.api.errors import is_anthropic_path

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
