"""API keys, per-key rate limits and the request body limit, as one pure-ASGI middleware.

Pure ASGI on purpose: ``BaseHTTPMiddleware`` buffers streaming responses and hides client
disconnects (see api/middleware.py).

Keys
    The union of ``security.api_keys`` (config file or ``MLXD_SECURITY__API_KEYS``), the
    ``MLXD_API_KEYS`` environment variable (comma-separated ``key`` or ``name:key``) and
    ``security.api_key_file`` (one ``key`` or ``name:key`` per line, ``#`` comments; re-read
    when it changes); either form may end in `` admin`` (an admin key, see api/owner.py).
    No key anywhere: the API is open. A client sends
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY``; the candidate is compared with every
    key's SHA-256 digest with :func:`hmac.compare_digest` (fixed length, no early exit), so
    timing tells neither which prefix matched nor how long the keys are. ``/health`` is
    always public, ``/metrics`` unless ``metrics.require_key``; with keys configured,
    ``/health`` answers a caller without a valid key only its status (``{"status": "ok"}``
    and the status code), the details (models, memory, load) need a key: ``anonymous`` in
    the request state tells the handler. The key's *name* (never the key) goes to the access
    log. Every admitted caller gets a ``principal`` in the request state (api/owner.py): the
    owner of what it stores.

Rate limits (token buckets, refilled continuously)
    ``requests_per_minute``: a request takes one token from its key's bucket before it runs.
    ``tokens_per_minute``: post-paid. A request is admitted while the key's token bucket is
    positive; when it ends, its real prompt + completion tokens (from the runtime's usage, see
    observability/context.py) are taken, and the bucket may go negative, which holds the
    next requests back until it refills. No up-front estimate (prompt length + max_tokens)
    is needed, so nothing is over-reserved, and a streaming request is charged for what it
    really generated, also when the client leaves early. The price: one request may
    overshoot the limit once. Beyond a limit: 429 with ``Retry-After`` (whole seconds until
    the bucket allows the next request).

    Keys without their own limits use ``security.default_*_per_minute``. With no keys at all,
    ``security.anonymous_*_per_minute`` is one bucket shared by every caller.

    The buckets live in this process or, with ``security.rate_limit_store: redis://...``,
    in a Redis that every replica shares (api/ratelimit.py, also for what happens when
    Redis is down).

Body limit
    ``security.max_body_bytes``: a larger ``Content-Length`` is refused at once, and a body
    without one (chunked) is counted as it arrives; either way 413 before any handler runs.

Every refusal is in the caller's dialect: Ollama's ``{"error": "..."}`` under ``/api/``,
OpenAI's error object elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from fastapi import HTTPException
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.api.errors import anthropic_error, is_anthropic_path, ollama_error, openai_error
from mlxd.api.owner import LOCAL_OPERATOR, Principal, owner_id
from mlxd.api.ratelimit import RateLimits, StoreUnavailable, make_limits
from mlxd.config import ApiKey, ConfigError, Settings, parse_key_item
from mlxd.core.types import DEFAULT_PRIORITY
from mlxd.ui import is_public_ui_path

log = logging.getLogger(__name__)

ENV_KEYS = "MLXD_API_KEYS"
ALWAYS_PUBLIC = frozenset({"/health"})


# --------------------------------------------------------------------------------------- #
# Keys
# --------------------------------------------------------------------------------------- #


@dataclass(eq=False)
class KeyEntry:
    name: str
    secret: bytes = field(repr=False)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    admin: bool = False
    priority: int = DEFAULT_PRIORITY
    weight: float = 1.0
    digest: bytes = field(init=False, repr=False)
    principal: Principal = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # compared as fixed-length digests: not even the key's length leaks through timing
        self.digest = hashlib.sha256(self.secret).digest()
        self.principal = Principal(
            owner_id(self.digest), self.admin, self.name, self.priority, self.weight
        )


def _parse_lines(text: str, prefix: str) -> list[KeyEntry]:
    """Keys, one a line; a line whose attributes are wrong (``priority=x``, a weight of 0)
    is a ConfigError that names its line number, never the line (it holds a secret)."""
    out: list[KeyEntry] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            item = parse_key_item(line)
            fields = ApiKey.model_validate(item)
        except ValidationError as exc:
            reason = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{prefix} key line {n}: {reason}") from None
        except ValueError as exc:
            raise ConfigError(f"{prefix} key line {n}: {exc}") from None
        out.append(
            KeyEntry(
                fields.name or f"{prefix}-{len(out) + 1}",
                fields.key.encode(),
                admin=fields.admin,
                priority=fields.priority,
                weight=fields.weight,
            )
        )
    return out


class KeyRing:
    """Every accepted key; the file part is re-read when the file changes (checked every 2s)."""

    def __init__(self, settings: Settings, environ: dict[str, str] | None = None) -> None:
        sec = settings.security
        env = os.environ if environ is None else environ
        self._static: list[KeyEntry] = []
        for i, k in enumerate(sec.api_keys, 1):
            self._static.append(
                KeyEntry(
                    k.name or f"config-{i}",
                    k.key.encode(),
                    k.requests_per_minute,
                    k.tokens_per_minute,
                    k.admin,
                    k.priority,
                    k.weight,
                )
            )
        self._static += _parse_lines(env.get(ENV_KEYS, "").replace(",", "\n"), "env")
        self._file = Path(sec.api_key_file).expanduser() if sec.api_key_file else None
        self._file_keys: list[KeyEntry] = []
        self._file_sig: tuple | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self._file is not None:
            if not self._file.is_file():
                # Fail closed: a configured key file that is missing must not open the API.
                raise ConfigError(f"security.api_key_file: file not found: {self._file}")
            self._reload_file(force=True)

    def _reload_file(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._file is None or (not force and now - self._checked < 2.0):
            return
        with self._lock:
            self._checked = now
            try:
                st = self._file.stat()
                sig = (st.st_mtime_ns, st.st_size, st.st_ino)
                if sig == self._file_sig and not force:
                    return
                keys = _parse_lines(self._file.read_text(), "file")
            except ConfigError as exc:
                if force:
                    raise  # at start: the server refuses to start on a wrong key file
                log.error("%s (keeping the keys read before)", exc)
                return
            except OSError as exc:
                log.error(
                    "cannot read security.api_key_file %s: %s (keeping the keys read before)",
                    self._file,
                    exc,
                )
                return
            self._file_sig = sig
            if self._file_keys and [(k.secret, k.principal) for k in keys] != [
                (k.secret, k.principal) for k in self._file_keys
            ]:
                log.info("API key file %s changed: %d key(s)", self._file, len(keys))
            self._file_keys = keys

    @property
    def keys(self) -> list[KeyEntry]:
        self._reload_file()
        return self._static + self._file_keys

    @property
    def enabled(self) -> bool:
        return self._file is not None or bool(self._static)

    def match(self, candidate: str) -> KeyEntry | None:
        """Constant time per key, and every key is compared (no early exit)."""
        cand = hashlib.sha256(candidate.encode()).digest()
        found = None
        for entry in self.keys:
            if hmac.compare_digest(cand, entry.digest) and found is None:
                found = entry
        return found


# --------------------------------------------------------------------------------------- #
# The middleware
# --------------------------------------------------------------------------------------- #


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def reject(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    message: str,
    *,
    code: str,
    type_: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> None:
    """An error response in the caller's dialect, straight from middleware."""
    if scope["path"].startswith("/api/"):
        resp = ollama_error(status, message, headers)
    elif is_anthropic_path(scope["path"]):
        resp = anthropic_error(status, message, headers)
    else:
        resp = openai_error(status, message, type_, None, code, headers)
    await resp(scope, receive, send)


class Quota(NamedTuple):
    """One caller's limits, as the rate-limit store takes them."""

    caller: str
    rpm: int | None
    tpm: int | None


class _BodyTooLarge(HTTPException):
    """Raised from ``receive`` while a handler reads a body without Content-Length.

    An HTTPException because FastAPI turns any other error raised while it reads a body
    into a 400; this one it re-raises, and the app's handler renders it in the dialect,
    with ``code`` (the same one a refused Content-Length gets)."""

    code = "request_too_large"

    def __init__(self, limit: int, path: str = "") -> None:
        super().__init__(413, _too_large_message(limit, path))


# Routes that take file uploads (multipart): their body limit is audio.max_upload_bytes.
UPLOAD_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})


def _too_large_message(limit: int, path: str = "") -> str:
    setting = (
        "audio.max_upload_bytes"
        if path in UPLOAD_PATHS
        else "batch.max_file_bytes"
        if path == "/v1/files"
        else "security.max_body_bytes"
    )
    return f"request body larger than {limit} bytes ({setting})"


class SecurityMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        keys: KeyRing | None = None,
        limits: RateLimits | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        sec = settings.security
        self.keys = keys if keys is not None else KeyRing(settings)
        self.limits = limits if limits is not None else make_limits(sec)
        self.public = set(ALWAYS_PUBLIC)
        if not settings.metrics.require_key:
            self.public.add("/metrics")
        # the web UI's page and files hold no data: they load without a key, and the page
        # asks for one before it reads anything (its /ui/api/* data needs the key)
        self.ui_public = settings.server.ui
        self.max_body = sec.max_body_bytes
        # audio uploads have their own limit (audio.max_upload_bytes) plus the multipart
        # framing and form fields around the file
        self.max_upload = settings.audio.max_upload_bytes + 256 * 1024
        self._anonymous: Quota | None = None
        if sec.anonymous_requests_per_minute or sec.anonymous_tokens_per_minute:
            self._anonymous = Quota(
                "anonymous", sec.anonymous_requests_per_minute, sec.anonymous_tokens_per_minute
            )

    @staticmethod
    def warn_if_open(settings: Settings, keys: KeyRing) -> bool:
        if keys.enabled or is_loopback(settings.server.host):
            return False
        log.warning(
            "!!! mlxd listens on %s without API keys: ANYONE who can reach this port can use "
            "it. Set security.api_keys, MLXD_API_KEYS or security.api_key_file, or bind "
            "127.0.0.1. !!!",
            settings.server.host,
        )
        return True

    def _quota(self, entry: KeyEntry) -> Quota | None:
        sec = self.settings.security
        rpm = entry.requests_per_minute or sec.default_requests_per_minute
        tpm = entry.tokens_per_minute or sec.default_tokens_per_minute
        if not rpm and not tpm:
            return None
        # the caller's id in a store that other programs may read: a hash of the key's
        # digest under a label of its own (never the key, nor the digest compared at the
        # door; nor the key's name, which two configurations may give to different keys)
        caller = hashlib.sha256(b"mlxd-ratelimit:" + entry.digest).hexdigest()[:32]
        return Quota(caller, rpm, tpm)

    @staticmethod
    def _credential(scope: Scope) -> str | None:
        bearer = api_key = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                scheme, _, token = v.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    bearer = token.strip()
            elif k == b"x-api-key":
                api_key = v.decode("latin-1").strip() or None
        return bearer or api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        state = scope.setdefault("state", {})
        acting = scope.get("mlxd.acting_for")  # set only in-process (api/batch_runner.py)
        if isinstance(acting, Principal):
            state["principal"] = acting
            await self.app(scope, receive, send)
            return
        quota: Quota | None = None
        public = path in self.public or (
            self.ui_public and scope["method"] in ("GET", "HEAD") and is_public_ui_path(path)
        )
        if public and self.keys.enabled:
            cred = self._credential(scope)
            entry = self.keys.match(cred) if cred else None
            if entry is None:
                state["anonymous"] = True  # served, but only what anyone may see
            else:
                state["key_name"] = entry.name
                state["principal"] = entry.principal
        elif public:
            state["principal"] = LOCAL_OPERATOR
        else:
            if self.keys.enabled:
                cred = self._credential(scope)
                entry = self.keys.match(cred) if cred else None
                if entry is None:
                    msg = (
                        "invalid API key"
                        if cred
                        else "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                    )
                    await reject(
                        scope,
                        receive,
                        send,
                        401,
                        msg,
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    return
                state["key_name"] = entry.name
                state["principal"] = entry.principal
                quota = self._quota(entry)
            else:
                state["principal"] = LOCAL_OPERATOR
                quota = self._anonymous
            if quota is not None:
                try:
                    wait, which = await self.limits.admit(*quota)
                except StoreUnavailable:
                    await reject(
                        scope,
                        receive,
                        send,
                        503,
                        "the rate-limit store is unreachable; retry shortly",
                        code="rate_limit_store_unavailable",
                        type_="server_error",
                        headers={"Retry-After": "1"},
                    )
                    return
                if wait > 0:
                    secs = max(1, math.ceil(wait))
                    who = f"key '{state['key_name']}'" if "key_name" in state else "this server"
                    await reject(
                        scope,
                        receive,
                        send,
                        429,
                        f"rate limit of {who} reached ({which}); retry in {secs}s",
                        code="rate_limit_exceeded",
                        type_="rate_limit_error",
                        headers={"Retry-After": str(secs)},
                    )
                    return

        max_body = self.max_upload if path in UPLOAD_PATHS else self.max_body
        if path == "/v1/files":  # its own limit, checked exactly as the file is stored
            max_body = self.settings.batch.max_file_bytes + 256 * 1024
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > max_body
                except ValueError:
                    too_big = False
                if too_big:
                    await self._too_large(scope, receive, send, max_body)
                    return
                break

        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_body:
                    raise _BodyTooLarge(max_body, path)
            return message

        started = False

        async def watch_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, watch_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._too_large(scope, receive, send, max_body)
        finally:
            if quota is not None and quota.tpm:
                used = state.get("prompt_tokens", 0) + state.get("completion_tokens", 0)
                await self.limits.charge(*quota, used)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        await reject(
            scope,
            receive,
            send,
            413,
            _too_large_message(limit, scope["path"]),
            code="request_too_large",
        )
