"""Cross-site requests and DNS rebinding are refused before anything reads them.

Without API keys (the default on loopback) any web page could otherwise drive a local
server: browsers send a "simple" cross-site POST (``text/plain``) without asking first, and
a page whose own name is made to resolve to 127.0.0.1 (DNS rebinding) is even same-origin
to the browser. Two checks, on every route, before the key check, body limit or handler:

Host
    The ``Host`` header must be one of ``server.allowed_hosts`` (any port); loopback names
    and the bound address always are (a rebinding page's Host is the attacker's name, never
    these). Bound beyond loopback the default is any name (config.py says why).
Origin
    A request that carries ``Origin`` (browsers do on cross-site requests, and on same-origin
    ones that are not GET/HEAD) must come from the server's own origin (its host and port
    are the ``Host`` it was sent to: the web UI; when ``Host`` has no port, as behind a proxy
    that passes only the name, the names must agree) or one of ``server.allowed_origins``
    (+ ``security.cors_origins``), which CORS then serves (api/middleware.py). Requests
    without ``Origin`` (curl, SDKs, the official clients) pass.

A refusal is 403 in the caller's dialect. ``/health`` is never refused (load balancers and
Kubernetes probe it as the pod's IP): a request there that fails a check gets only the
status, as a caller without a key does.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxd.api.security import is_loopback, reject
from mlxd.config import ServerSettings, Settings
from mlxd.hostnames import host_matches, parse_origin, split_host

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Answered whatever Host or Origin they carry, with only what anyone may see (the status).
EXEMPT = frozenset({"/health"})
_UNSPECIFIED = ("0.0.0.0", "::", "")


def allowed_hosts(server: ServerSettings) -> frozenset[str]:
    """The host patterns this server accepts: ``server.allowed_hosts`` or its default, with
    the loopback names and the bound address."""
    names = set(LOOPBACK_NAMES)
    bound = split_host(server.host) if server.host not in _UNSPECIFIED else None
    if bound is not None:
        names.add(bound[0])
    if server.allowed_hosts is not None:
        names.update(server.allowed_hosts)
    elif not is_loopback(server.host):
        names.add("*")
    return frozenset(names)


def allowed_origins(settings: Settings) -> list[str]:
    """Origins other than the server's own whose pages may call it (and get CORS)."""
    out = list(settings.server.allowed_origins)
    out += [o for o in settings.security.cors_origins if o not in out]
    return out


def _shown(value: str) -> str:
    return value if len(value) <= 100 else value[:100] + "..."


class OriginMiddleware:
    """The Host and Origin checks (module docstring), as pure ASGI."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.hosts = allowed_hosts(settings.server)
        self.origins = frozenset(allowed_origins(settings))

    def problem(self, host: str | None, origins: list[str]) -> tuple[str, str] | None:
        """(code, message) of why a request with these headers is refused, or None."""
        seen = split_host(host) if host is not None else None
        if host is not None and (seen is None or not host_matches(seen[0], self.hosts)):
            return (
                "host_not_allowed",
                f"host '{_shown(host)}' is not accepted by this server; its operator "
                "can add it to server.allowed_hosts",
            )
        if "*" in self.origins:
            return None
        for value in origins:
            origin = parse_origin(value)
            if origin is not None and (
                str(origin) in self.origins
                or (seen is not None and origin.host == seen[0] and seen[1] in (None, origin.port))
            ):
                continue
            if value.strip() == "null" and "null" in self.origins:
                continue
            return (
                "cross_origin_forbidden",
                f"cross-site request from origin '{_shown(value)}' refused: it is not "
                "this server's own origin; its operator can add it to "
                "server.allowed_origins",
            )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host: str | None = None
        origins: list[str] = []
        for k, v in scope.get("headers", ()):
            if k == b"host" and host is None:
                host = v.decode("latin-1")
            elif k == b"origin":
                origins.append(v.decode("latin-1"))
        found = self.problem(host, origins)
        if found is None:
            await self.app(scope, receive, send)
        elif scope["path"] in EXEMPT:
            scope.setdefault("state", {})["anonymous"] = True  # the status, nothing more
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: a 403
        else:
            code, message = found
            await reject(scope, receive, send, 403, message, code=code, type_="permission_error")
