"""The web UI's routes: the page at ``/`` and ``/ui/``, its files under ``/ui/static/``,
and three small JSON endpoints the page reads (``/ui/api/*``; they need an API key when
keys are configured, as every data route does). Off with ``server.ui: false`` (404). The
request list shows a key only its own requests, an admin key (and, with no keys
configured, the local operator) everyone's.

Everything else the page shows comes from the public API itself (``/health``,
``/api/pull``, ``/v1/chat/completions``...), so the UI exercises what clients use.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from mlxd import __version__
from mlxd.api.common import runtime
from mlxd.api.owner import principal
from mlxd.observability.history import StatsSampler
from mlxd.ui import STATIC_DIR, is_ui_route

router = APIRouter(include_in_schema=False)
# Starlette's file serving (safe paths, ETag, conditional GET) behind a route rather than a
# mount: a route has a template, which the metrics and the access history label it by
_files = StaticFiles(directory=STATIC_DIR)

# The page loads nothing from elsewhere: a CDN or an injected script would be refused.
_CSP = (
    "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def _page() -> FileResponse:
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type="text/html",
        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"},
    )


@router.get("/")
async def root() -> FileResponse:
    return _page()


@router.get("/ui")
async def ui_no_slash() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui/")
async def ui_page() -> FileResponse:
    return _page()


@router.get("/ui/static/{path:path}")
async def static_file(path: str, request: Request) -> Response:
    response = await _files.get_response(path, request.scope)
    # revalidate (ETag) on every load: after an upgrade the page never mixes old modules
    response.headers["Cache-Control"] = "no-cache"
    return response


@router.get("/ui/api/overview")
async def overview(request: Request) -> dict[str, Any]:
    """What the overview shows that /health does not: version, backend, BLAS, the store."""
    rt = runtime(request)
    store = [
        {
            "name": m["name"],
            "kind": m.get("kind", "chat"),
            "size": m.get("size") or 0,
            "source": m.get("source", ""),
            "format": m.get("format", "mlx"),
            "created": m.get("created"),
        }
        for m in rt.models.installed()
    ]
    return {
        "version": __version__,
        "backend": rt.backend,
        "blas": rt.blas,
        "health": await rt.status(),
        "store": store,
        # LoRA adapters: chat models of their own in the playground's picker
        "adapters": [{"name": a.name, "kind": "chat", "parent": a.base} for a in rt.adapters.all()],
        "key_name": getattr(request.state, "key_name", None),
        "admin": principal(request).admin,
    }


@router.get("/ui/api/stats")
async def stats(request: Request, since: float = Query(0.0, ge=0)) -> dict[str, Any]:
    sampler: StatsSampler = request.app.state.ui_stats
    return {"interval_s": sampler.interval, "points": sampler.series(since)}


@router.get("/ui/api/requests")
async def requests(request: Request, limit: int = Query(200, ge=1, le=100_000)) -> dict[str, Any]:
    """The last finished requests the caller may see, newest first, each with its
    access-log line; ``scope`` says whether that is every caller's (``all``) or its own."""
    who = principal(request)
    return {
        "scope": "all" if who.admin else "own",
        "requests": request.app.state.recent_requests.recent(limit, who.may_audit),
    }


def install_ui(app: FastAPI) -> StatsSampler:
    """Routes and the stats sampler (started and stopped by the app's lifespan)."""
    app.state.ui_stats = sampler = StatsSampler(is_ui_route)
    app.include_router(router)
    return sampler
