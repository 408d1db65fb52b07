"""``mlxd bench``: mlxd against a peer server on the same model (mlxd.bench does the work)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxd.cli.common import CliError, cli_errors, client_headers, settings_for


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise CliError(f"--concurrency takes positive integers, comma-separated: {text!r}", 2)
    return levels


def _peer(text: str) -> str:
    if text in ("mlx_lm", "engine", "none") or text.startswith(("http://", "https://")):
        return text
    raise CliError(f"--peer takes mlx_lm, engine, none or an http(s) URL, not {text!r}", 2)


def _model(text: str) -> str:
    if text.startswith(("/", ".", "~")) and not Path(text).expanduser().is_dir():
        raise CliError(f"no model directory at {text}", 2)
    return text


@cli_errors
def bench(
    model: Annotated[str, typer.Argument(help="A store name, alias or model directory.")],
    peer: Annotated[
        str,
        typer.Option(
            help="What to compare with: mlx_lm (mlx-lm's server, started on the same model "
            "directory), engine (mlx-lm's BatchGenerator alone, no HTTP, in a process of its "
            "own on the same directory), an OpenAI-compatible URL already running, or none.",
        ),
    ] = "mlx_lm",
    concurrency: Annotated[
        str, typer.Option(help="Closed-loop clients per level, comma-separated.")
    ] = "1,4,16",
    pairs: Annotated[int, typer.Option(min=1, help="Interleaved pairs of passes per level.")] = 10,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of every request.")] = 128,
    prompt_tokens: Annotated[
        int, typer.Option(min=1, help="Prompt length (about one token per word).")
    ] = 256,
    requests_per_client: Annotated[
        int, typer.Option(min=1, help="Requests each client sends in one pass.")
    ] = 2,
    json_out: Annotated[
        Optional[Path], typer.Option("--json", help="Write the results here as JSON.")
    ] = None,
    server_args: Annotated[
        str, typer.Option(help="More `mlxd serve` arguments, as one string.")
    ] = "",
    peer_args: Annotated[
        str, typer.Option(help="More arguments for the peer mlx_lm server, as one string.")
    ] = "",
    peer_blas: Annotated[
        bool,
        typer.Option(
            help="Linux CPU, --peer mlx_lm: preload the BLAS mlxd loads into the peer too "
            "(MLX's own is ~20x slower at float32 matmuls), so the servers differ, not the BLAS.",
        ),
    ] = False,
    seed: Annotated[
        Optional[int], typer.Option(help="Prompt seed (default: a random one, recorded).")
    ] = None,
) -> None:
    """Benchmark mlxd against a peer server: interleaved passes, a table and JSON."""
    from mlxd.bench.runner import BenchOptions, run, table
    from mlxd.bench.servers import BenchError

    opts = BenchOptions(
        model=_model(model),
        peer=_peer(peer),
        concurrency=_levels(concurrency),
        pairs=pairs,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        requests_per_client=requests_per_client,
        server_args=server_args,
        peer_args=peer_args,
        peer_blas=peer_blas,
        seed=seed,
        json_path=json_out,
        command=shlex.join(["mlxd", *sys.argv[1:]]),
        mlxd_headers=client_headers(settings_for(None)),
    )
    try:
        results = run(opts, say=lambda line: typer.echo(line, err=True))
    except BenchError as exc:
        raise CliError(str(exc)) from None
    typer.echo(table(results))
