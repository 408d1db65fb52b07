"""The front-end processes of ``--api-workers N``: each one's app, and their supervisor.

The ``mlxd serve`` process starts the engine cores and :class:`FrontEnds` (uvicorn's process
manager); each worker runs the drain a single front end runs (drain.py), builds its app
here from the settings the cores were started with and connects to every core
(``MLXD_CORE_DIR``: their run directories) instead of starting its own.

On SIGTERM/SIGINT the supervisor starts the front ends' drain by closing the write end
of a pipe they all read (a multiprocessing Event would hang its setter on a waiter that
died), rather than by a signal: one sent to the whole process group (a terminal's Ctrl-C)
reaches them too, and a second signal would cut their drain short. The pipe closes when
the supervisor dies as well (kill -9), so no front end outlives it. It then waits for
them to exit; a second signal to it forwards SIGTERM, which skips their wait. Whenever a
front end has ended (exited, crashed or killed) the supervisor drops its live gauges from
the shared metric files; one that died while serving is replaced and counted
(``/health``'s ``front_ends``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from uvicorn.config import STARTUP_FAILURE, Config
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from mlxd.drain import CUT_WAIT_S, DrainingServer

if TYPE_CHECKING:
    from fastapi import FastAPI

# A spawned worker imports this module before its health-check thread runs: what it
# imports at the top stays light (the app's imports come with app_factory), or the
# supervisor takes a slow start for a hung worker.

log = logging.getLogger(__name__)

# After the grace and the cut requests' own wait: uvicorn's shutdown and the app's
# lifespan end, before a front end that is still there is killed.
_EXIT_SLACK_S = 15.0


class FrontEndShared:
    """What the supervisor shares with its front ends; each gets it when it is spawned.
    ``drain``: the read end of the supervisor's drain pipe (it keeps the write end)."""

    def __init__(self, workers: int, grace: float, drain: Connection) -> None:
        ctx = multiprocessing.get_context("spawn")  # uvicorn's workers are spawned
        self.drain = drain
        self.grace = grace
        self._workers = ctx.RawValue("i", workers)  # written by the supervisor only
        self._restarts = ctx.RawValue("i", 0)

    def wait_for_drain(self) -> None:
        """Returns once the supervisor has started the drain, or is gone."""
        supervisor = os.getppid()
        try:
            while True:
                self.drain.recv_bytes()
        except (EOFError, OSError):
            pass
        if os.getppid() != supervisor:
            log.warning(
                "the front ends' supervisor (pid %d) is gone; this front end drains and exits",
                supervisor,
            )

    def count_restart(self) -> None:
        self._restarts.value += 1

    def set_workers(self, n: int) -> None:
        self._workers.value = n

    def view(self) -> dict[str, int]:
        """``/health``'s ``front_ends``."""
        return {"workers": self._workers.value, "restarts": self._restarts.value}


def app_factory(shared: FrontEndShared | None = None) -> FastAPI:
    from mlxd.frontend import tokenizer_side

    tokenizer_side.register_without_init()  # before anything imports mlx-lm
    from mlxd.api.app import create_app
    from mlxd.frontend.runtime import CORE_DIR_ENV, Runtime
    from mlxd.observability.logs import setup_logging

    run_dirs = [Path(d) for d in os.environ[CORE_DIR_ENV].split(os.pathsep)]
    settings = pickle.loads((run_dirs[0] / "settings.pkl").read_bytes())
    setup_logging(settings.log.level, settings.log.format)
    return create_app(settings, Runtime(settings, core_dirs=run_dirs, front_ends=shared))


class FrontEndProcess(Process):
    """One worker: uvicorn's, running a DrainingServer on the app it builds."""

    def __init__(
        self, config: Config, sockets: list[socket.socket], shared: FrontEndShared
    ) -> None:
        self.shared = shared
        super().__init__(config, sockets)

    @property
    def server(self) -> DrainingServer:
        if self._server is None:
            self._server = DrainingServer(
                self.config, None, self.shared.grace, drain_when=self.shared.wait_for_drain
            )
        return self._server  # type: ignore[return-value]

    def target(self, sockets: list[socket.socket] | None = None) -> None:
        server, shared = self.server, self.shared

        def build() -> FastAPI:
            server.app = app_factory(shared)
            return server.app

        self.config.app = build  # loaded as uvicorn loads a factory: its errors, its exit code
        super().target(sockets)

    def join(self) -> None:
        from mlxd.observability.metrics import MULTIPROC_ENV, front_end_exited

        super().join()
        if self.pid is not None and os.environ.get(MULTIPROC_ENV):
            front_end_exited(self.pid)


class FrontEnds(Multiprocess):
    """uvicorn's process manager for :class:`FrontEndProcess` workers, draining them
    together and cleaning up after each one that ends."""

    def __init__(self, config: Config, sockets: list[socket.socket], grace: float) -> None:
        super().__init__(config, sockets)
        drain, self._drain_w = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self.shared = FrontEndShared(config.workers, grace, drain)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)

    def _on_stop_signal(self, sig: int, frame: object) -> None:
        """uvicorn's handler (queue the signal for the loop), and the drain's start right
        here: the front ends answer 503 "draining" from the signal on, not from the loop's
        next turn."""
        self.signal_queue.append(sig)
        self._drain_w.close()  # idempotent; the loop's _drain closes it again

    def _spawn(self) -> FrontEndProcess:
        process = FrontEndProcess(self.config, self.sockets, self.shared)
        process.start()
        return process

    def init_processes(self) -> None:
        for _ in range(self.processes_num):
            self.processes.append(self._spawn())

    def run(self) -> None:
        log.info("front-end supervisor started (pid %d)", os.getpid())
        self.init_processes()
        checked = time.monotonic()
        # signals every 50 ms (a drain starts at once), the front ends' health every 0.5 s
        while not self.should_exit.wait(0.05):
            self.handle_signals()
            if time.monotonic() - checked >= 0.5:
                self.keep_subprocess_alive()
                checked = time.monotonic()
        self._drain()
        self.join_all()

    def _drain(self) -> None:
        """The front ends drain at once and exit on their own; a second SIGINT/SIGTERM
        skips their wait, and one still there long after its grace is killed."""
        self._drain_w.close()  # every front end reads its end of the pipe
        deadline = time.monotonic() + self.shared.grace + CUT_WAIT_S + _EXIT_SLACK_S
        forwarded = False
        while any(p.process.is_alive() for p in self.processes):
            again = [s for s in self.signal_queue if s in (signal.SIGINT, signal.SIGTERM)]
            self.signal_queue.clear()
            if again and not forwarded:
                log.info("a second signal: the front ends stop without waiting")
                self.terminate_all()
                forwarded = True
            if time.monotonic() > deadline:
                for p in self.processes:
                    if p.process.is_alive():
                        log.error(
                            "front end (pid %s) did not exit after the drain; killing it", p.pid
                        )
                        p.kill()
                break
            time.sleep(0.1)

    def keep_subprocess_alive(self) -> None:
        """uvicorn's, counting each front end that died and was replaced."""
        if self.should_exit.is_set():
            return
        for idx, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # hung, or already gone
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                log.error("front end (pid %s) failed to start; stopping", process.pid)
                self.should_exit.set()
                return
            if self.should_exit.is_set():
                return
            log.warning(
                "front end (pid %s) ended (exit code %s); starting another",
                process.pid,
                process.exitcode,
            )
            self.shared.count_restart()
            self.processes[idx] = self._spawn()

    def restart_all(self) -> None:
        """SIGHUP: uvicorn's rolling replacement, each old front end draining as it goes."""
        for idx, old in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new = self._spawn()
            if not new.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                new.kill()
                new.join()
                if not self.should_exit.is_set():
                    log.error(
                        "new front end (pid %s) was not ready in time; keeping "
                        "pid %s and stopping the restart",
                        new.pid,
                        old.pid,
                    )
                return
            old.terminate()
            old.join()
            self.processes[idx] = new

    def handle_ttin(self) -> None:
        log.info("SIGTTIN: one more front end")
        self.processes_num += 1
        self.shared.set_workers(self.processes_num)
        self.processes.append(self._spawn())

    def handle_ttou(self) -> None:
        super().handle_ttou()
        self.shared.set_workers(self.processes_num)
