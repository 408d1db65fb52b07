"""Where the rate-limit buckets live: this process's memory, or a Redis shared by replicas.

Both stores implement the same two token buckets per caller (api/security.py says what
they mean): ``requests_per_minute`` is pre-paid, one token per admitted request;
``tokens_per_minute`` is post-paid, a request is admitted while the bucket is positive and
its real usage is taken when it ends (the bucket may go negative). A bucket holds
``per_minute`` at most and refills continuously at ``per_minute / 60`` per second.

Memory (the default)
    One process's dict of buckets. Each replica, and each ``--api-workers`` front end,
    enforces the whole limit on its own.

Redis (``security.rate_limit_store: redis://...``)
    Every bucket is a Redis hash ``{level, ts}``, read, refilled and written by one Lua
    script, so a check-and-take is atomic however many front ends call at once. The clock
    is Redis's own (``TIME``): replicas with skewed clocks still refill one bucket alike.
    A key expires when its bucket would be full again (a missing bucket *is* a full one),
    so idle callers leave nothing behind. Callers are named by a hash of their API key
    (never the key), or ``anonymous``. mlxd speaks to one Redis (``redis://``,
    ``rediss://`` for TLS, ``unix://``); the two buckets of a caller share a hash tag
    (``{id}``), one slot, so a cluster-aware proxy can run the script on a Redis Cluster.

    When Redis cannot be reached (``security.rate_limit_store_failure``):

    * ``open`` (default): this process's in-memory buckets limit meanwhile (so one replica
      still holds each caller to the limit, N replicas to N times it), one warning per
      outage, and ``mlxd:rate_limit_store_errors`` counts each failed check. A model server
      that refuses all traffic because a side store blinked is worse than one that limits
      less strictly for a while;
    * ``closed``: every limited request gets 503 (``Retry-After: 1``) until Redis is back,
      for deployments where the limit is a hard budget.

    After a failure Redis is left alone for ``RETRY_AFTER_S``, so a dead or black-holed
    Redis costs the requests of that window nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from mlxd.config import ConfigError, SecuritySettings
from mlxd.observability import metrics

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2.0
KEY_PREFIX = "mlxd:ratelimit:"


class StoreUnavailable(Exception):
    """The shared store could not answer and the policy is to fail closed."""


# --------------------------------------------------------------------------------------- #
# In memory
# --------------------------------------------------------------------------------------- #


class TokenBucket:
    """``per_minute`` capacity, refilled continuously at per_minute/60 per second."""

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = float(per_minute)
        self._t = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
        self._t = now

    def wait_for(self, need: float) -> float:
        """Seconds until the bucket holds at least ``need`` (0: now)."""
        self._refill()
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float) -> None:
        self._refill()
        self.level -= n


class Limiter:
    """A caller's request bucket and post-paid token bucket (either may be absent)."""

    def __init__(self, rpm: int | None, tpm: int | None) -> None:
        self.requests = TokenBucket(rpm) if rpm else None
        self.tokens = TokenBucket(tpm) if tpm else None

    def admit(self) -> tuple[float, str]:
        """(0, '') when admitted (one request taken), else (seconds to wait, which limit)."""
        if self.tokens is not None:
            # post-paid: any positive balance admits; 1e-6 so "exactly 0" waits a little
            wait = self.tokens.wait_for(1e-6)
            if wait > 0:
                return wait, "tokens per minute"
        if self.requests is not None:
            wait = self.requests.wait_for(1.0)
            if wait > 0:
                return wait, "requests per minute"
            self.requests.take(1.0)
        return 0.0, ""

    def charge(self, tokens: int) -> None:
        if self.tokens is not None and tokens > 0:
            self.tokens.take(tokens)


class MemoryLimits:
    """This process's buckets, by caller id."""

    def __init__(self) -> None:
        self._limiters: dict[str, Limiter] = {}

    def _get(self, caller: str, rpm: int | None, tpm: int | None) -> Limiter:
        lim = self._limiters.get(caller)
        if lim is None:
            lim = self._limiters[caller] = Limiter(rpm, tpm)
        return lim

    async def admit(self, caller: str, rpm: int | None, tpm: int | None) -> tuple[float, str]:
        return self._get(caller, rpm, tpm).admit()

    async def charge(self, caller: str, rpm: int | None, tpm: int | None, tokens: int) -> None:
        self._get(caller, rpm, tpm).charge(tokens)

    async def aclose(self) -> None:
        return None


# --------------------------------------------------------------------------------------- #
# Redis
# --------------------------------------------------------------------------------------- #

# Shared by both scripts: `now` from Redis's clock, a bucket's refilled level, and its write
# with a TTL of "until full again" (+1s). Numbers go through "%.17g" so that no digit of a
# microsecond timestamp is lost (Lua's tostring keeps 14).
_LUA_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  return math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / 60)
end
local function store(key, cap, lvl)
  redis.call('HSET', key, 'level', string.format('%.17g', lvl),
             'ts', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil((cap - lvl) * 60000 / cap) + 1000)
end
"""

# KEYS: request bucket, token bucket. ARGV: rpm, tpm (0: no such limit).
# Returns {1, "0", ""} when admitted (a request token taken), else {0, seconds, which}.
_ADMIT = (
    _LUA_COMMON
    + """
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 then
  local l = level(KEYS[2], tpm)
  if l < 0.000001 then
    return {0, string.format('%.17g', (0.000001 - l) * 60 / tpm), 'tokens per minute'}
  end
end
if rpm > 0 then
  local l = level(KEYS[1], rpm)
  if l < 1 then
    return {0, string.format('%.17g', (1 - l) * 60 / rpm), 'requests per minute'}
  end
  store(KEYS[1], rpm, l - 1)
end
return {1, '0', ''}
"""
)

# KEYS: token bucket. ARGV: tpm, tokens used.
_CHARGE = (
    _LUA_COMMON
    + """
local cap = tonumber(ARGV[1])
store(KEYS[1], cap, level(KEYS[1], cap) - tonumber(ARGV[2]))
return 1
"""
)


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisLimits:
    """Buckets in Redis, shared by every front end that names the same store."""

    def __init__(self, url: str, failure: Literal["open", "closed"], timeout_s: float) -> None:
        try:
            import redis.asyncio as aioredis
            from redis.backoff import NoBackoff
            from redis.exceptions import RedisError
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError(
                "security.rate_limit_store is a Redis URL but the redis client is not "
                "installed: pip install 'mlxd[redis]'"
            ) from exc
        self.url = redact(url)
        self.failure = failure
        # one quick retry (a pooled connection that a Redis restart broke), no backoff: a
        # rate-limit check must not hold a request up for seconds
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)
        self._timeout = timeout_s
        self._down_until = 0.0
        self._down = False
        self.local = MemoryLimits()  # the fallback of the "open" policy

    @staticmethod
    def _keys(caller: str) -> list[str]:
        return [f"{KEY_PREFIX}{{{caller}}}:requests", f"{KEY_PREFIX}{{{caller}}}:tokens"]

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """The script's answer, or None when Redis failed (and the policy is open)."""
        if time.monotonic() < self._down_until:
            return self._failed(None)
        try:
            # the socket timeouts bound each read; this bounds the whole call (a retry too)
            out = await asyncio.wait_for(script(keys=keys, args=args), self._timeout * 3)
        except self._errors as exc:
            self._down_until = time.monotonic() + RETRY_AFTER_S
            return self._failed(exc)
        if self._down:
            self._down = False
            log.warning("rate-limit store %s is reachable again: limits are shared again", self.url)
        return out

    def _failed(self, exc: BaseException | None) -> None:
        metrics.rate_limit_store_errors.labels(self.failure).inc()
        if exc is not None and not self._down:
            self._down = True
            how = (
                "this process limits on its own meanwhile"
                if self.failure == "open"
                else "limited requests get 503 meanwhile"
            )
            log.warning(
                "rate-limit store %s unreachable (%s: %s): %s "
                "(security.rate_limit_store_failure=%s)",
                self.url,
                type(exc).__name__,
                exc,
                how,
                self.failure,
            )
        if self.failure == "closed":
            raise StoreUnavailable(self.url)
        return None

    async def admit(self, caller: str, rpm: int | None, tpm: int | None) -> tuple[float, str]:
        out = await self._call(self._admit, self._keys(caller), [rpm or 0, tpm or 0])
        if out is None:
            return await self.local.admit(caller, rpm, tpm)
        ok, wait, which = out
        if int(ok) == 1:
            return 0.0, ""
        return float(wait), which.decode() if isinstance(which, bytes) else str(which)

    async def charge(self, caller: str, rpm: int | None, tpm: int | None, tokens: int) -> None:
        if not tpm or tokens <= 0:
            return
        try:
            out = await self._call(self._charge, self._keys(caller)[1:], [tpm, tokens])
        except StoreUnavailable:
            return  # the request already ran: nothing to refuse
        if out is None:
            await self.local.charge(caller, rpm, tpm, tokens)

    async def aclose(self) -> None:
        try:
            await self._redis.aclose()
        except self._errors:
            pass


RateLimits = MemoryLimits | RedisLimits


def make_limits(sec: SecuritySettings) -> RateLimits:
    """The store ``security.rate_limit_store`` names (ConfigError: Redis without its client)."""
    if sec.rate_limit_store == "memory":
        return MemoryLimits()
    return RedisLimits(
        sec.rate_limit_store, sec.rate_limit_store_failure, sec.rate_limit_store_timeout_s
    )
