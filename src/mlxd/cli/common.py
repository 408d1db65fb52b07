"""What every ``mlxd`` command shares: option types, the one-line error contract, settings.

The command modules (models, daemon, config_cmd, service, serve, doctor) import from here
and never from each other's private names, so ``cli/`` has no import cycle: this module
imports nothing from ``mlxd.cli``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

from mlxd.config import ConfigError, Settings, load_settings

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]

F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """A failure the user can act on: printed as one ``mlxd: ...`` line, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def cli_errors(fn: F) -> F:
    """One clear line on stderr and a non-zero exit for every failure, no traceback.

    Exit codes: 2 for configuration errors, 130 for Ctrl-C, ``CliError.code`` for
    ``CliError``, 1 for everything else.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mlxd.core.errors import MlxdError

        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except CliError as exc:
            message, code = str(exc), exc.code
        except ConfigError as exc:
            message, code = f"configuration error:\n{exc}", 2
        except MlxdError as exc:
            message, code = exc.message, 1
        except KeyboardInterrupt:
            message, code = "interrupted", 130
        except OSError as exc:
            message, code = (
                f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""),
                1,
            )
        except Exception as exc:  # noqa: BLE001 - the promise is: never a traceback
            message, code = f"unexpected error: {type(exc).__name__}: {exc}", 1
        typer.echo(f"mlxd: {message}", err=True)
        raise typer.Exit(code)

    return wrapper  # type: ignore[return-value]


def settings_for(config: Path | None, overrides: dict | None = None) -> Settings:
    """The effective settings for a command: file, environment, then the command's flags."""
    return load_settings(config, overrides)


def client_headers(settings: Settings) -> dict[str, str]:
    """An API key for CLI commands that call the server (``mlxd ps``): ``MLXD_API_KEY``,
    else the first key the configuration gives the server itself."""
    key = os.environ.get("MLXD_API_KEY")
    if not key:
        try:
            from mlxd.api.security import KeyRing

            keys = KeyRing(settings).keys
            key = keys[0].secret.decode() if keys else None
        except Exception:  # noqa: BLE001 - no key is fine; the server will say 401
            key = None
    return {"Authorization": f"Bearer {key}"} if key else {}
