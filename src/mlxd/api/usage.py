"""``GET /v1/usage``: tokens, requests and errors per API key name and model, for admins.

The counts live in ``$MLXD_HOME/mlxd.sqlite3`` (observability/usage.py); the access
middleware counts each model request under its key's name. Only an admin key may read
them (they show every key's traffic); with no keys configured, only a loopback caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from mlxd.api.docs import error_model, ok
from mlxd.api.owner import LOCAL_OPERATOR, principal
from mlxd.api.routing import ApiRoute
from mlxd.api.security import is_loopback
from mlxd.core.errors import InvalidRequest, MlxdError
from mlxd.observability.usage import UsageStore

log = logging.getLogger(__name__)

router = APIRouter(route_class=ApiRoute)

DEFAULT_SPAN_S = 7 * 86400
MAX_SECONDS = 253402300799  # 9999-12-31T23:59:59Z: SQLite's integers and datetime both hold it


class UsageRow(BaseModel):
    start: int
    key: str | None = None
    model: str | None = None
    requests: int
    errors: int
    input_tokens: int
    output_tokens: int


class UsageReport(BaseModel):
    object: Literal["usage"]
    start: int
    end: int
    bucket: Literal["hour", "day"]
    group_by: list[str]
    data: list[UsageRow]


_REFUSALS: dict[int | str, Any] = {
    400: {"model": error_model("/v1/usage"), "description": "A bad start, end or group_by."},
    403: {
        "model": error_model("/v1/usage"),
        "description": "Not an admin key (or, without keys, not a loopback caller).",
    },
}


class PermissionDenied(MlxdError):
    status = 403
    code = "permission_denied"
    type = "permission_error"


def parse_time(value: str | None, param: str, default: float) -> float:
    """Unix seconds, or an ISO 8601 date or time (UTC unless it names its offset)."""
    if value is None or value == "":
        return default
    bad = InvalidRequest(
        f"'{param}' must be Unix seconds or an ISO 8601 date or time, got '{value[:64]}'",
        param=param,
    )
    try:
        seconds = float(value)
    except ValueError:
        try:
            t = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise bad from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.timezone.utc)
        seconds = t.timestamp()
    if not math.isfinite(seconds) or abs(seconds) > MAX_SECONDS:
        raise bad
    return seconds


def _check_admin(request: Request) -> None:
    who = principal(request)
    if not who.admin:
        raise PermissionDenied("usage is for admin keys only")
    client = request.client.host if request.client is not None else ""
    if who is LOCAL_OPERATOR and not is_loopback(client):
        raise PermissionDenied(
            "usage without API keys configured answers loopback callers only; "
            "configure an admin key (security.api_keys) to read it from elsewhere"
        )


@router.get("/v1/usage", responses={**ok(UsageReport), **_REFUSALS})
async def get_usage(
    request: Request,
    start: str | None = Query(None, description="Unix seconds or ISO 8601; default 7 days ago"),
    end: str | None = Query(None, description="Unix seconds or ISO 8601; default now"),
    group_by: str = Query("key,model", description="key, model, both or none (comma-separated)"),
    bucket: Literal["hour", "day"] = Query("hour"),
) -> JSONResponse:
    """Usage per bucket (hour or day, UTC) and API key name and/or model."""
    _check_admin(request)
    store: UsageStore | None = getattr(request.app.state, "usage", None)
    if store is None:
        raise InvalidRequest("usage is not recorded on this server (usage.enabled is false)")
    groups = [g.strip() for g in group_by.split(",") if g.strip() and g.strip() != "none"]
    for g in groups:
        if g not in ("key", "model"):
            raise InvalidRequest(f"group_by takes key and model, got '{g}'", param="group_by")
    groups = list(dict.fromkeys(groups))
    now = time.time()
    t_end = parse_time(end, "end", now)
    t_start = parse_time(start, "start", t_end - DEFAULT_SPAN_S)
    if t_start > t_end:
        raise InvalidRequest("'start' is after 'end'", param="start")
    await asyncio.to_thread(store.flush)  # this front end's counts so far
    rows = await asyncio.to_thread(store.query, t_start, t_end, groups, bucket)
    return JSONResponse(
        {
            "object": "usage",
            "start": int(t_start),
            "end": int(t_end),
            "bucket": bucket,
            "group_by": groups,
            "data": rows,
        }
    )


def install_usage(app: FastAPI, store: UsageStore, every_s: float) -> Any:
    """The store on ``app.state`` and a lifespan part that flushes it every ``every_s``
    seconds and once more at shutdown."""
    app.state.usage = store

    @contextlib.asynccontextmanager
    async def flushing() -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(every_s)
                try:
                    await asyncio.to_thread(store.flush)
                except Exception:  # noqa: BLE001 - kept in memory; the next flush retries
                    log.exception("could not write usage to %s", store.path)

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            try:
                await asyncio.to_thread(store.flush)
            except Exception:  # noqa: BLE001 - shutting down: say so, do not fail the stop
                log.exception("could not write usage to %s at shutdown", store.path)
            store.close()

    return flushing
