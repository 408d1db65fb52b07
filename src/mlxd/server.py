"""Run the HTTP server for a Settings object (``mlxd serve``, and what ``mlxd start`` spawns).

Process duties besides serving:

* a pid file per port (``$MLXD_HOME/run/mlxd-<port>.pid``, see process.py), written at
  start and removed at exit; a second server on the same port is refused;
* a graceful drain on SIGTERM/SIGINT (drain.py), in every front end: stop admitting
  (every new request gets 503 while the listening socket stays open, ``/health`` says
  "draining"), wait up to ``server.shutdown_grace_s`` for the requests in flight, then end
  what is left with an error in its dialect and exit. A second signal skips the rest of
  the wait;
* the metrics port (``metrics.port``), when set.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import uvicorn

from mlxd.config import ConfigError, Settings
from mlxd.drain import DrainingServer
from mlxd.frontend import tokenizer_side
from mlxd.observability.logs import setup_logging

log = logging.getLogger(__name__)

LOG_FILE_ENV = "MLXD_LOG_FILE"  # set by `mlxd start` for the child: recorded in the pid file


def run(settings: Settings) -> int:
    # No BLAS preload here: front ends never compute; the engine core loads it (core.py).
    # Nor MLX: mlx-lm's tokenizer side without its package's imports (frontend/tokenizer_side.py)
    tokenizer_side.register_without_init()
    setup_logging(settings.log.level, settings.log.format)
    from mlxd import process

    host, port = settings.server.host, settings.server.port
    use_pidfile = port != 0
    if use_pidfile:
        found = process.find(port)
        if found.info is not None:
            log.error(
                "mlxd is already running on port %d (pid %d); `mlxd stop --port %d` stops it",
                port,
                found.info.pid,
                port,
            )
            return 1
        if found.stale is not None:
            log.info("removed a stale pid file %s (pid %s is gone)", found.path, found.stale.pid)
    if port and process.port_in_use(host, port):
        log.error(
            "cannot listen on %s:%d: the address is in use by another program "
            "(--port chooses another)",
            host,
            port,
        )
        return 1
    if use_pidfile:
        process.write_pidfile(
            port,
            host,
            shutdown_grace_s=settings.server.shutdown_grace_s,
            log=os.environ.get(LOG_FILE_ENV),
        )

    def cleanup() -> None:
        if use_pidfile:
            process.remove_pidfile(port, os.getpid())

    try:
        from mlxd.api.app import create_app
        from mlxd.api.metrics import start_metrics_port

        # The serving process never computes (and must not touch the GPU): the engine core
        # reports the MLX backend and the BLAS it loaded when it starts.
        try:
            if settings.server.api_workers > 1:
                return _run_workers(settings, host, port)
            app = create_app(settings)
        except ConfigError as exc:
            log.error("configuration error: %s", exc)
            return 2
        try:
            start_metrics_port(settings, app.state.runtime)
        except OSError as exc:
            log.error("cannot serve metrics on port %s: %s", settings.metrics.port, exc)
            return 1
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            log_level=settings.log.level,
            access_log=False,  # our AccessMiddleware logs each request with more detail
            timeout_graceful_shutdown=2,  # after our own drain (DrainingServer)
        )
        server = DrainingServer(config, app, settings.server.shutdown_grace_s, on_exit=cleanup)
        log.info("mlxd starting on http://%s:%d (pid %d)", host, port, os.getpid())
        server.run()
        return 0 if server.started else 1
    finally:
        cleanup()


def _run_workers(settings: Settings, host: str, port: int) -> int:
    """``--api-workers N``: the engine cores (one per device), N front-end processes on one
    listening socket (workers.py), each connected to every core; on SIGTERM they
    drain together, each as a single front end does."""
    from mlxd.enginecore.supervisor import supervisors_for
    from mlxd.frontend.runtime import CORE_DIR_ENV
    from mlxd.observability.metrics import MULTIPROC_ENV
    from mlxd.workers import FrontEnds

    if settings.metrics.enabled and settings.metrics.port:
        log.warning(
            "metrics.port is not served with --api-workers %d: scrape /metrics on "
            "port %d (any front end answers with all of them)",
            settings.server.api_workers,
            port,
        )
    supervisors = supervisors_for(settings)
    for sup in supervisors:
        sup.start()
    os.environ[CORE_DIR_ENV] = os.pathsep.join(str(s.run_dir) for s in supervisors)
    # one directory of metric files for all front ends, so that any of them answers a
    # scrape with the sum over all (observability/metrics.py); empty at every start
    metrics_dir = tempfile.mkdtemp(prefix="mlxd-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    sock = None
    try:
        config = uvicorn.Config(
            "mlxd.workers:app_factory",
            factory=True,
            host=host,
            port=port,
            workers=settings.server.api_workers,
            log_config=None,
            log_level=settings.log.level,
            access_log=False,
            timeout_graceful_shutdown=2,  # after each front end's own drain (drain.py)
        )
        sock = config.bind_socket()
        log.info(
            "mlxd starting on http://%s:%d with %d front ends (pid %d)",
            host,
            port,
            settings.server.api_workers,
            os.getpid(),
        )
        FrontEnds(config, [sock], settings.server.shutdown_grace_s).run()
        return 0
    finally:
        if sock is not None:
            sock.close()  # refused from now on, rather than queued while the cores stop
        for sup in supervisors:
            sup.stop()
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
