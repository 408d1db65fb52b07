"""Pure-ASGI middleware (no BaseHTTPMiddleware: it buffers streams and hides disconnects).

Order, outermost first (:func:`install_middleware`):

1. :class:`AccessMiddleware`: request id (``X-Request-ID`` honoured or generated, echoed
   back), the drain gate (503 while shutting down), HTTP metrics by route template, and one
   access-log line per request with the facts the layers below recorded in
   ``scope["state"]`` (model, tokens, key name; see observability/context.py).
2. :class:`mlxd.api.origin.OriginMiddleware`: 403 for a Host or Origin not allowed (DNS
   rebinding, cross-site requests), before anything reads the request.
3. CORS (Starlette's), only when ``server.allowed_origins`` or ``security.cors_origins`` is
   set, on the same list; outside the key check so that preflights pass and refusals carry
   CORS headers.
4. :class:`mlxd.api.security.SecurityMiddleware`: API keys, rate limits, body limit.
5. :class:`MethodMiddleware`: HEAD for every GET route, ``Allow`` on every 405.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.core.errors import ShuttingDown
from mlxd.observability import context, metrics, tracing
from mlxd.observability.history import RequestLog
from mlxd.observability.logs import log_value
from mlxd.observability.usage import UsageStore
from mlxd.ui import is_ui_route

log = logging.getLogger("mlxd.access")

# Answered even while draining: load balancers and scrapers must see the truth.
_DRAIN_EXEMPT = frozenset({"/health", "/metrics"})

# GenAI semantic conventions' gen_ai.operation.name of the model routes, by route template
GENAI_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/api/chat": "chat",
    "/v1/completions": "text_completion",
    "/completions": "text_completion",
    "/api/generate": "text_completion",
    "/v1/embeddings": "embeddings",
    "/embeddings": "embeddings",
    "/api/embed": "embeddings",
    "/api/embeddings": "embeddings",
}


@dataclass
class Lifecycle:
    """Shared by the middleware and the server's signal handling (server.py)."""

    draining: bool = False
    inflight: int = 0


def iter_routes(routes: Any) -> list[Any]:
    """Every route of an app, flattened (newer FastAPI wraps included routers in an
    ``_IncludedRouter``; ``fastapi.routing.iter_route_contexts`` unwraps them). Each item has
    ``path``, ``methods`` (None for mounts) and ``matches(scope)``."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # FastAPI before included-router contexts: app.routes is flat
        return list(routes)
    return list(iter_route_contexts(list(routes)))


def route_template(router: Any, scope: Scope) -> str:
    """The matched route's path template ('/v1/models/{model_id:path}'), never the raw path
    (raw paths would explode the metric's label set)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    if router is not None:
        partial = None
        for r in iter_routes(getattr(router, "routes", ())):
            try:
                match, _ = r.matches(scope)
            except Exception:  # noqa: BLE001 - a route that cannot judge this scope
                continue
            if match == Match.FULL:
                return getattr(r, "path", "unmatched")
            if match == Match.PARTIAL and partial is None:
                partial = getattr(r, "path", None)
        if partial:
            return partial
    return "unmatched"


class AccessMiddleware:
    """Request id, drain gate, HTTP metrics and the access log."""

    def __init__(
        self,
        app: ASGIApp,
        lifecycle: Lifecycle | None = None,
        router: Any = None,
        recent: RequestLog | None = None,
        usage: UsageStore | None = None,
    ) -> None:
        self.app = app
        self.lifecycle = lifecycle or Lifecycle()
        self.router = router
        self.recent = recent  # the web UI's request list (the UI's own requests left out)
        self.usage = usage  # usage per key name and model (None: usage.enabled false)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                rid = v.decode("latin-1").strip()[:128]
                break
        rid = rid or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        status = 0
        span = None
        if tracing.enabled() and scope["path"] not in _DRAIN_EXEMPT:
            span = self._start_span(scope)
            state["traceparent"] = tracing.traceparent_of(span)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        lc = self.lifecycle
        lc.inflight += 1
        token = context.bind(state)
        try:
            if lc.draining and scope["path"] not in _DRAIN_EXEMPT:
                from mlxd.api.security import reject

                await reject(
                    scope,
                    receive,
                    send_wrapper,
                    503,
                    ShuttingDown.MESSAGE,
                    code=ShuttingDown.code,
                    type_=ShuttingDown.type,
                    headers={"Retry-After": ShuttingDown.RETRY_AFTER, "Connection": "close"},
                )
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            context.unbind(token)
            lc.inflight -= 1
            self._record(scope, state, status or 500, time.perf_counter() - t0, rid, span)

    @staticmethod
    def _start_span(scope: Scope) -> Any:
        parent = None
        for k, v in scope.get("headers", []):
            if k == b"traceparent":
                parent = v.decode("latin-1")
                break
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": scope["path"]}
        return tracing.start_server_span(f"{method} {scope['path']}", parent, attributes)

    def _record(
        self, scope: Scope, state: dict, status: int, seconds: float, rid: str, span: Any = None
    ) -> None:
        method = scope["method"]
        route = route_template(self.router, scope)
        metrics.http_requests_total.labels(method, route, str(status)).inc()
        metrics.http_request_duration.labels(method, route).observe(seconds)
        operation = GENAI_OPERATIONS.get(route)
        if operation is not None or state.get("model"):
            self._count_usage(state, status)
        if span is not None:
            _end_span(span, state, method, route, operation, status, rid)
        fields: dict[str, Any] = {
            "request_id": rid,
            "method": method,
            "path": scope["path"],
            "route": route,
            "status": status,
            "duration_ms": round(seconds * 1000, 1),
        }
        client = scope.get("client")
        if client:
            fields["client"] = client[0]
        for key in ("model", "prompt_tokens", "completion_tokens", "key_name", "user"):
            if state.get(key) is not None:
                fields["key" if key == "key_name" else key] = state[key]
        # path, request id, model, key name and user come from the client: log_value keeps
        # each one token on this one line (a newline in a user forged a log line)
        extra = " ".join(
            f"{k}={log_value(fields[k])}" for k in ("model", "key", "user") if k in fields
        )
        if "prompt_tokens" in fields:
            extra += f" tokens={fields['prompt_tokens']}+{fields.get('completion_tokens', 0)}"
        line = (
            f"{method} {log_value(scope['path'])} {status} {seconds * 1000:.1f}ms "
            f"rid={log_value(rid)}{' ' + extra if extra else ''}"
        )
        log.info("%s", line, extra={"fields": fields})
        if self.recent is not None and not is_ui_route(route):
            who = state.get("principal")
            self.recent.add(fields, line, who.owner if who is not None else None)

    def _count_usage(self, state: dict, status: int) -> None:
        """A model request's tokens, and whether it failed, under its key name and model.

        A failed request that used no tokens counts under the model "": the name it asked
        for may be anything, and a label per made-up name would grow without bound."""
        key = state.get("key_name") or ""
        tokens_in, tokens_out = state.get("prompt_tokens", 0), state.get("completion_tokens", 0)
        error = status >= 400
        model = "" if error and not (tokens_in or tokens_out) else state.get("model") or ""
        metrics.key_requests_total.labels(key, model).inc()
        if error:
            metrics.key_errors_total.labels(key, model).inc()
        if tokens_in:
            metrics.key_tokens_total.labels(key, model, "input").inc(tokens_in)
        if tokens_out:
            metrics.key_tokens_total.labels(key, model, "output").inc(tokens_out)
        if self.usage is not None:
            self.usage.record(key, model, tokens_in, tokens_out, error)


def _end_span(
    span: Any, state: dict, method: str, route: str, operation: str | None, status: int, rid: str
) -> None:
    """The request span's GenAI attributes (semantic conventions), from what the layers
    below recorded in the request's state."""
    model = state.get("model")
    attributes: dict[str, Any] = {
        "http.route": route,
        "http.response.status_code": status,
        "mlxd.request_id": rid,
        "gen_ai.operation.name": operation,
        "gen_ai.system": "mlxd" if operation else None,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": state.get("max_tokens"),
        "gen_ai.request.temperature": state.get("temperature"),
        "gen_ai.response.id": state.get("response_id"),
        "gen_ai.usage.input_tokens": state.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": state.get("completion_tokens"),
        "mlxd.time_to_first_token_s": state.get("ttft_s"),
        "mlxd.queue_time_s": state.get("queue_s"),
        "mlxd.api_key_name": state.get("key_name"),
    }
    reasons = state.get("finish_reasons")
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = list(reasons)
    if operation is not None:
        name = f"{operation} {model}" if model else operation
    else:
        name = f"{method} {route}"
    tracing.end_span(span, name, attributes, f"HTTP {status}" if status >= 500 else None)


def allowed_methods(router: Any, scope: Scope) -> set[str]:
    """Every method the routes at ``scope``'s path take (HEAD wherever GET is)."""
    out: set[str] = set()
    for r in iter_routes(getattr(router, "routes", ())):
        methods = getattr(r, "methods", None)
        if not methods:
            continue
        try:
            match, _ = r.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot judge this scope
            continue
        if match != Match.NONE:
            out |= set(methods)
    if "GET" in out:
        out.add("HEAD")
    return out


class MethodMiddleware:
    """HEAD on every GET route, and an ``Allow`` header on every 405 (RFC 9110 9.3.2 and
    15.5.6). FastAPI's routes take no HEAD of their own, and Starlette's 405 names only the
    first route whose path matched (``POST /v1/responses/x``: GET, not DELETE).

    A HEAD that no route takes runs as the GET, and its body is dropped: status and headers,
    Content-Length included, are the GET's. The 405's body is the app's own, in the dialect.
    """

    def __init__(self, app: ASGIApp, router: Any) -> None:
        self.app = app
        self.router = router

    def _takes(self, scope: Scope) -> bool:
        for r in iter_routes(getattr(self.router, "routes", ())):
            try:
                if r.matches(scope)[0] == Match.FULL:
                    return True
            except Exception:  # noqa: BLE001 - a route that cannot judge this scope
                continue
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = (
            scope["method"] == "HEAD"
            and not self._takes(scope)
            and "GET" in allowed_methods(self.router, scope)
        )
        ended = False

        async def send_wrapper(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                if message["status"] == 405:
                    allow = ", ".join(sorted(allowed_methods(self.router, scope)))
                    MutableHeaders(scope=message)["Allow"] = allow
            elif head and message["type"] == "http.response.body":
                if ended or message.get("more_body", False):
                    return  # the GET's body: a HEAD answer has none
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # a copy: the server keeps its own scope, whose method (HEAD) tells it to send no body
        await self.app(dict(scope, method="GET") if head else scope, receive, send_wrapper)


def install_middleware(app: Any, settings: Any) -> Lifecycle:
    """Wire the stack onto a FastAPI app; returns the Lifecycle (also ``app.state``)."""
    from mlxd.api.origin import OriginMiddleware, allowed_origins
    from mlxd.api.ratelimit import make_limits
    from mlxd.api.security import KeyRing, SecurityMiddleware

    lifecycle = Lifecycle()
    app.state.lifecycle = lifecycle
    app.add_middleware(MethodMiddleware, router=app.router)  # innermost: next to the routes
    keys = KeyRing(settings)  # now, so that a missing key file fails the start
    SecurityMiddleware.warn_if_open(settings, keys)
    # now too: a Redis store without its client fails the start; closed in the lifespan
    app.state.rate_limits = make_limits(settings.security)
    app.add_middleware(
        SecurityMiddleware, settings=settings, keys=keys, limits=app.state.rate_limits
    )
    origins = allowed_origins(settings)
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After"],
            max_age=600,
        )
    app.add_middleware(OriginMiddleware, settings=settings)
    app.state.recent_requests = RequestLog(settings.server.ui_recent_requests)
    app.add_middleware(
        AccessMiddleware,
        lifecycle=lifecycle,
        router=app.router,
        recent=app.state.recent_requests,
        usage=getattr(app.state, "usage", None),
    )
    return lifecycle
