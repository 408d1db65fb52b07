"""Starts the engine core as a child process and starts it again when it dies.

The core is a fresh interpreter (``python -m mlxd.enginecore``; never a fork, which would
inherit a parent that may already hold MLX, Metal or CUDA state, and threads; and not
multiprocessing's spawn, which re-imports the parent's main module), reading its settings
from a pickle in the run directory. Each start gets a new ``epoch``; front ends
learn it from the core's heartbeat and drop anything meant for an older one. A core that
keeps dying is restarted with a growing delay (doubling up to ``max_delay``), reset once
it has stayed up for ``stable_after`` seconds.

With ``engine.devices`` naming several devices there is one supervisor per device
(:func:`supervisors_for`), each with its own run directory (sockets), epochs and restart
delays: one core's death and restarts never touch another's.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mlxd.backend_env import core_env
from mlxd.config import ConfigError, Settings
from mlxd.core.devices import DEFAULT, Device, resolve
from mlxd.observability.metrics import MULTIPROC_ENV

if TYPE_CHECKING:
    from mlxd.enginecore import group

log = logging.getLogger(__name__)


class CoreSupervisor:
    def __init__(
        self,
        settings: Settings,
        *,
        device: Device = DEFAULT,
        index: int = 0,
        first_delay: float = 0.2,
        max_delay: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        self.settings = settings
        self.device = device
        self.index = index  # this core's place among the host's engine cores
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"mlxd-core{index}-"))
        self.epoch = 0
        self.restarts = 0
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.stable_after = stable_after
        self._proc: subprocess.Popen | group.RankGroup | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_death: list = []  # callables(exitcode), run on the supervisor thread

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        self._spawn()
        self._thread = threading.Thread(
            target=self._watch, name="mlxd-core-supervisor", daemon=True
        )
        self._thread.start()

    def _spawn(self) -> None:
        self.epoch += 1
        settings_file = self.run_dir / "settings.pkl"
        settings_file.write_bytes(pickle.dumps(self.settings))
        env = {
            **os.environ,
            **self.device.env,
            **core_env(self.settings.backend),
            "PYTHONUNBUFFERED": "1",
        }
        # the front ends' shared metric files (--api-workers N) are theirs alone: the core
        # serves its own families, which every front end fetches and labels
        env.pop(MULTIPROC_ENV, None)
        if self.settings.engine.rank_group_size > 1:  # a group of rank processes
            from mlxd.enginecore import group

            self._proc = group.spawn(self.settings, self.run_dir, self.epoch, env)
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "mlxd.enginecore", str(self.run_dir), str(self.epoch)],
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self._started = time.monotonic()
        log.info(
            "engine core %d on %s: epoch %d started (pid %d)",
            self.index,
            self.device.name,
            self.epoch,
            self._proc.pid,
        )

    def _watch(self) -> None:
        quick_deaths = 0  # in a row, each within stable_after of its start
        while not self._stopping.is_set():
            proc = self._proc
            assert proc is not None
            code = proc.wait()
            if self._stopping.is_set():
                return
            quick_deaths = (
                0 if time.monotonic() - self._started > self.stable_after else quick_deaths + 1
            )
            delay = min(self.first_delay * 2 ** max(quick_deaths - 1, 0), self.max_delay)
            log.error(
                "engine core %d on %s (epoch %d, pid %s) died with exit code %s; "
                "starting a new one in %.1fs",
                self.index,
                self.device.name,
                self.epoch,
                proc.pid,
                code,
                delay,
            )
            for cb in list(self.on_death):
                try:
                    cb(code)
                except Exception:  # noqa: BLE001 - a callback must not stop the restarts
                    log.exception("core death callback failed")
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            from mlxd.observability.metrics import worker_restarts_total

            worker_restarts_total.inc()
            self._spawn()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def supervisors_for(settings: Settings) -> list[CoreSupervisor]:
    """One supervisor per device of ``engine.devices`` (not started yet); ConfigError for
    devices this host does not have."""
    try:
        devices = resolve(
            settings.engine.devices, gpu_count, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if settings.engine.devices == "all" and devices[0].kind == "cpu":
        log.info("engine.devices all: MLX sees no GPU, so one engine core on the CPU (cpu:0)")
    if len(devices) > 1 and settings.engine.rank_group_size > 1:
        # each rank takes the next GPU of CUDA_VISIBLE_DEVICES, which a per-device core
        # narrows to its own one: groups of devices per core are not built yet
        raise ConfigError(
            f"engine.devices (several engine cores) and engine."
            f"{settings.engine.parallel_mode}_parallel > 1 cannot be combined "
            "yet: choose one"
        )
    return [CoreSupervisor(settings, device=d, index=i) for i, d in enumerate(devices)]


GPU_PROBE = (
    "import mlx.core as mx; print(mx.device_count(mx.gpu) if mx.is_available(mx.gpu) else 0)"
)


def gpu_count(python: str | None = None, timeout: float = 120) -> int:
    """The GPUs MLX sees, asked of a throwaway interpreter (``python``, by default this
    one): this process (a front end) never initialises MLX, whose Metal/CUDA state the
    cores must not inherit. The count is the probe's last line (MLX or a BLAS may print
    warnings before it). A probe that fails, hangs or prints no count means none: the
    caller then serves on the CPU (``all``) or names the GPU it lacks, and the warning says
    why."""
    try:
        out = subprocess.run(
            [python or sys.executable, "-c", GPU_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
        count = int(out.strip().splitlines()[-1])
        if count < 0:
            raise ValueError(f"a negative count: {count}")
        return count
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        log.warning("could not count the GPUs (%s); assuming none", exc)
        return 0
