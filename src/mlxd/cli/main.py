"""The ``mlxd`` command line."""

from __future__ import annotations

import typer

from mlxd.cli.bench import bench
from mlxd.cli.config_cmd import register as register_config_command
from mlxd.cli.daemon import register as register_daemon_commands
from mlxd.cli.doctor import doctor
from mlxd.cli.models import register as register_model_commands
from mlxd.cli.serve import serve
from mlxd.cli.service import app as service_app
from mlxd.cli.usage_cmd import usage

app = typer.Typer(
    name="mlxd",
    help="A model server on MLX: chat, completions and more on one port.",
    no_args_is_help=True,
    add_completion=False,
)
app.command()(serve)  # first in --help, as the command most people want


def _print_version(value: bool) -> None:
    if value:
        version()
        raise typer.Exit()


@app.callback()
def _options(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """A model server on MLX: chat, completions and more on one port."""


@app.command()
def version() -> None:
    """Print the version."""
    from mlxd import __version__

    typer.echo(__version__)


register_model_commands(app)  # pull, list, show, rm, quantize, ps
register_daemon_commands(app)  # start, status, stop
register_config_command(app)  # config
app.add_typer(service_app, name="service")  # service install|uninstall|start|stop|...
app.command()(doctor)
app.command()(usage)  # usage per API key name and model
app.command()(bench)


def main() -> None:
    app()
