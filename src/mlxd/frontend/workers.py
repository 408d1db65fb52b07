"""The app of one front-end process among ``--api-workers N`` (uvicorn's worker processes).

The ``mlxd serve`` process starts the engine cores and uvicorn's process manager; each
worker builds its app here from the settings the cores were started with and connects to
every core (``MLXD_CORE_DIR``: their run directories) instead of starting its own.
"""

from __future__ import annotations

import atexit
import os
import pickle
from pathlib import Path

from fastapi import FastAPI

from mlxd.frontend import tokenizer_side
from mlxd.frontend.runtime import CORE_DIR_ENV, Runtime
from mlxd.observability.metrics import MULTIPROC_ENV, front_end_exited


def app_factory() -> FastAPI:
    tokenizer_side.register_without_init()  # before anything imports mlx-lm
    from mlxd.api.app import create_app
    from mlxd.observability.logs import setup_logging

    run_dirs = [Path(d) for d in os.environ[CORE_DIR_ENV].split(os.pathsep)]
    settings = pickle.loads((run_dirs[0] / "settings.pkl").read_bytes())
    setup_logging(settings.log.level, settings.log.format)
    if os.environ.get(MULTIPROC_ENV):  # metrics shared by the front ends
        atexit.register(front_end_exited, os.getpid())
    return create_app(settings, Runtime(settings, core_dirs=run_dirs))
