"""The app of one front-end process among ``--api-workers N`` (uvicorn's worker processes).

The ``mlxd serve`` process starts the engine core and uvicorn's process manager; each
worker builds its app here from the settings the core was started with and connects to
that core (``MLXD_CORE_DIR``) instead of starting one of its own.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from fastapi import FastAPI

from mlxd.frontend.runtime import CORE_DIR_ENV, Runtime


def app_factory() -> FastAPI:
    from mlxd.api.app import create_app
    from mlxd.observability.logs import setup_logging

    run_dir = Path(os.environ[CORE_DIR_ENV])
    settings = pickle.loads((run_dir / "settings.pkl").read_bytes())
    setup_logging(settings.log.level, settings.log.format)
    return create_app(settings, Runtime(settings, core_dir=run_dir))
