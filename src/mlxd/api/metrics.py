"""``GET /metrics``: Prometheus text format from observability/metrics.py's registry.

Public unless ``metrics.require_key`` (the security middleware decides); also servable on a
port of its own (``metrics.port``, see :func:`start_metrics_port`), where no key applies:
bind that port where only your scraper reaches it.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mlxd.observability.metrics import REGISTRY, merged_text

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    if not request.app.state.settings.metrics.enabled:
        raise HTTPException(404, "metrics are disabled (metrics.enabled: false)")
    return Response(await render(request.app.state.runtime), media_type=CONTENT_TYPE_LATEST)


async def render(runtime) -> bytes:
    """The front end's families and the engine core's, in one exposition."""
    core = b""
    if runtime.client.alive:
        try:
            core = await runtime.client.call("metrics")
        except Exception:  # noqa: BLE001 - a dead or busy core: the front end's own still go
            log.warning("could not read the engine core's metrics")
    return merged_text(core.decode())


class _WithCore:
    """For prometheus-client's own metrics server (a thread of its own): the front end's
    families and the engine core's, fetched through the front end's event loop."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def collect(self):
        import asyncio

        from prometheus_client.parser import text_string_to_metric_families

        from mlxd.observability.metrics import CORE_FAMILIES

        rt = self.runtime
        core = b""
        loop = getattr(rt, "loop", None)
        if loop is not None and rt.client.alive:
            try:
                core = asyncio.run_coroutine_threadsafe(rt.client.call("metrics"), loop
                                                        ).result(5)
            except Exception:  # noqa: BLE001 - a dead or busy core: the front end's still go
                log.warning("could not read the engine core's metrics")
        for family in REGISTRY.collect():
            if family.name not in CORE_FAMILIES:
                yield family
        for family in text_string_to_metric_families(core.decode()):
            if family.name in CORE_FAMILIES:
                yield family


def start_metrics_port(settings, runtime=None) -> object | None:
    """Serve the metrics on ``metrics.port`` from a daemon thread (prometheus-client's),
    the engine core's families included when ``runtime`` is given."""
    m = settings.metrics
    if not m.enabled or not m.port:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    registry = REGISTRY
    if runtime is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_WithCore(runtime))  # type: ignore[arg-type]
    server = start_http_server(m.port, addr=settings.server.host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", settings.server.host, m.port)
    return server
