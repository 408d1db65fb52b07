"""Run the HTTP server for a Settings object (used by ``mlxd serve``)."""

from __future__ import annotations

import logging

import uvicorn

from mlxd.config import Settings
from mlxd.observability.logs import setup_logging

log = logging.getLogger(__name__)


def run(settings: Settings) -> int:
    from mlxd import blas

    info = blas.preload(settings.backend.blas)  # before anything imports MLX
    setup_logging(settings.log.level, settings.log.format)
    from mlxd.api.app import create_app
    from mlxd.engines.backend import backend_name

    backend = backend_name()
    if backend == "cpu":
        (log.info if info.loaded else log.warning)("BLAS: %s", info.describe())
    log.info("MLX backend: %s", backend)

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,
        log_level=settings.log.level,
        access_log=False,  # our RequestIdMiddleware logs each request with more detail
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    log.info("mlxd starting on http://%s:%d", settings.server.host, settings.server.port)
    server.run()
    return 0 if server.started else 1
