"""Every failure becomes an OpenAI error object with a status that tells the truth."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxd.core.errors import MlxdError

log = logging.getLogger(__name__)


def openai_error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_payload(exc: MlxdError) -> dict:
    return {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }


# Union members and validators appear in pydantic locations ("stop.str", "x.list[int]");
# the caller only wants the field path.
_TYPE_TAG = re.compile(
    r"^(str|int|float|bool|list|dict|none|function-.*|.*\[.*\]|"
    r"constrained-.*|json-or-python.*|lax-.*|strict-.*)$"
)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _TYPE_TAG.match(str(p))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def is_ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_anthropic(request: Request) -> bool:
    return is_anthropic_path(request.url.path)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    type_ = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def ollama_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Errors in the caller's dialect: Ollama's ``{"error": ...}`` on /api/*, else OpenAI's."""

    @app.exception_handler(MlxdError)
    async def _mlxd(request: Request, exc: MlxdError) -> JSONResponse:
        if exc.status >= 500:
            log.error("%s: %s", exc.code, exc.message)
        if is_ollama(request):
            return ollama_error(exc.status, exc.message, exc.headers)
        if is_anthropic(request):
            return anthropic_error(exc.status, exc.message, exc.headers)
        return openai_error(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            if is_ollama(request):
                return ollama_error(400, "the request body is not valid JSON")
            if is_anthropic(request):
                return anthropic_error(400, "the request body is not valid JSON")
            return openai_error(
                400,
                "the request body is not valid JSON",
                "invalid_request_error",
                None,
                "invalid_json",
            )
        msgs: list[str] = []
        for e in errs:
            param = _loc_to_param(tuple(e.get("loc", ())))
            msg = f"{param or 'body'}: {e.get('msg')}"
            if msg not in msgs and len(msgs) < 5:
                msgs.append(msg)
        if is_ollama(request):
            return ollama_error(400, "; ".join(msgs))
        if is_anthropic(request):
            return anthropic_error(400, "; ".join(msgs))
        return openai_error(
            400,
            "; ".join(msgs),
            "invalid_request_error",
            _loc_to_param(tuple(first.get("loc", ()))),
            "invalid_value",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        raw: object = exc.detail  # FastAPI's HTTPException takes any JSON value
        detail = raw if isinstance(raw, str) else json.dumps(raw)
        if is_ollama(request):
            return ollama_error(exc.status_code, detail, getattr(exc, "headers", None))
        if is_anthropic(request):
            return anthropic_error(exc.status_code, detail, getattr(exc, "headers", None))
        # an HTTPException of ours may name its code (api/security.py's 413)
        return openai_error(
            exc.status_code,
            detail,
            type_,
            None,
            getattr(exc, "code", None),
            getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        if is_ollama(request):
            return ollama_error(500, f"internal error: {type(exc).__name__}")
        if is_anthropic(request):
            return anthropic_error(500, f"internal error: {type(exc).__name__}")
        return openai_error(
            500, f"internal error: {type(exc).__name__}", "server_error", None, "internal_error"
        )
