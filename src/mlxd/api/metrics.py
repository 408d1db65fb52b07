"""``GET /metrics``: Prometheus text format from observability/metrics.py's registry.

Public unless ``metrics.require_key`` (the security middleware decides); also servable on a
port of its own (``metrics.port``, see :func:`start_metrics_port`), where no key applies:
bind that port where only your scraper reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from mlxd.observability.metrics import REGISTRY, MergedCollector, merged_text

if TYPE_CHECKING:
    from mlxd.config import Settings
    from mlxd.frontend.runtime import Runtime

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    if not request.app.state.settings.metrics.enabled:
        raise HTTPException(404, "metrics are disabled (metrics.enabled: false)")
    return Response(await render(request.app.state.runtime), media_type=CONTENT_TYPE_LATEST)


async def core_texts(runtime: Runtime) -> list[str]:
    """Each engine core's exposition, in core order ("" for a dead or busy core: the
    front end's own families and the other cores' still go out)."""
    texts = []
    for client, text in await runtime.cores.metrics_texts():
        if text is None:
            log.warning("could not read engine core %d's metrics", client.index)
        texts.append(text or "")
    return texts or [""]


async def render(runtime: Runtime) -> bytes:
    """The front end's families and the engine cores', in one exposition."""
    return merged_text(await core_texts(runtime))


class _WithCore:
    """For prometheus-client's own metrics server (a thread of its own): the front end's
    families and the engine core's, fetched through the front end's event loop."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        import asyncio

        rt = self.runtime
        texts = [""]
        loop = getattr(rt, "loop", None)
        if loop is not None:
            try:
                texts = asyncio.run_coroutine_threadsafe(core_texts(rt), loop).result(5)
            except Exception:  # noqa: BLE001 - busy cores: the front end's own still go
                log.warning("could not read the engine cores' metrics")
        yield from MergedCollector(texts).collect()


def start_metrics_port(settings: Settings, runtime: Runtime | None = None) -> object | None:
    """Serve the metrics on ``metrics.port`` from a daemon thread, the engine core's
    families included when ``runtime`` is given. The same Host and Origin checks as the main
    port (api/origin.py) guard it: no key applies there, so a rebinding page must not read
    it either."""
    m = settings.metrics
    if not m.enabled or not m.port:
        return None
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app

    from mlxd.api.origin import OriginMiddleware

    registry = REGISTRY
    if runtime is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_WithCore(runtime))
    metrics_app = make_wsgi_app(registry)
    guard = OriginMiddleware(None, settings)  # type: ignore[arg-type]  # its checks only

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        origins = [environ["HTTP_ORIGIN"]] if "HTTP_ORIGIN" in environ else []
        found = guard.problem(environ.get("HTTP_HOST"), origins)
        if found is not None:
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [found[1].encode() + b"\n"]
        return metrics_app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base's name
            pass

    server = make_server(settings.server.host, m.port, guarded, Server, Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", settings.server.host, m.port)
    return server
