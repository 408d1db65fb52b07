"""Server lifecycle: ``mlxd start | status | stop``.

``start`` spawns ``mlxd serve`` in the background (its own session, output appended to
``$MLXD_HOME/logs/mlxd-<port>.log``) and returns once ``/health`` answers 200; the server
writes ``$MLXD_HOME/run/mlxd-<port>.pid`` itself (see mlxd/process.py). ``stop`` sends
SIGTERM, which makes the server drain (new requests 503, in-flight ones finish within
``server.shutdown_grace_s``), and SIGKILLs only with ``--force``. Exit codes: 0 success /
running, 1 failure / not running, 2 configuration error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from mlxd.cli.common import CliError, ConfigOpt, JsonOpt, cli_errors, settings_for

PortOpt = Annotated[Optional[int], typer.Option(help="Server port (default: server.port).")]


def _health(url: str, timeout: float = 3.0) -> tuple[int, dict]:
    """(status code, body) of GET /health; (0, {}) when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, TimeoutError, ValueError):
        return 0, {}


def _human_duration(seconds: float) -> str:
    s = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    parts.append(f"{s}s")
    return " ".join(parts[:2])


# --------------------------------------------------------------------------------------- #
# start
# --------------------------------------------------------------------------------------- #


@cli_errors
def start(
    config: ConfigOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind.")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port.")] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help="Default chat model: a name, alias or directory."),
    ] = None,
    preload: Annotated[
        Optional[list[str]], typer.Option(help="Also load this model at start (repeatable).")
    ] = None,
    log_level: Annotated[Optional[str], typer.Option()] = None,
    log_format: Annotated[Optional[str], typer.Option(help="text|json")] = None,
    foreground: Annotated[
        bool, typer.Option("--foreground", "-f", help="Run in this terminal, as `mlxd serve` does.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for /health before giving up.")
    ] = 300.0,
) -> None:
    """Start the server in the background; returns once it answers /health."""
    if foreground:
        from mlxd.cli.serve import serve

        serve(
            config=config,
            host=host,
            port=port,
            model=model,
            preload=preload,
            log_level=log_level,
            log_format=log_format,
        )
        return
    from mlxd import process
    from mlxd.server import LOG_FILE_ENV

    overrides = {
        "server": {"host": host, "port": port},
        "models": {"default": model, "preload": preload or None},
        "log": {"level": log_level, "format": log_format},
    }
    settings = settings_for(config, overrides)  # a bad config fails here, exit 2
    h, p = settings.server.host, settings.server.port
    if p == 0:
        raise CliError("mlxd start needs a fixed port (server.port is 0)")
    found = process.find(p)
    if found.info is not None:
        raise CliError(
            f"already running on port {p} (pid {found.info.pid}) at "
            f"{found.info.url}; `mlxd stop --port {p}` stops it"
        )
    logfile = process.log_path(p)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "mlxd", "serve", "--port", str(p), "--host", h]
    if config is not None:
        argv += ["--config", str(Path(config).expanduser().resolve())]
    if model is not None:
        path = Path(model).expanduser()
        argv += ["--model", str(path.resolve()) if path.exists() else model]
    for name in preload or ():
        path = Path(name).expanduser()
        argv += ["--preload", str(path.resolve()) if path.exists() else name]
    if log_level:
        argv += ["--log-level", log_level]
    if log_format:
        argv += ["--log-format", log_format]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{LOG_FILE_ENV: str(logfile)})
    with open(logfile, "ab") as out:
        out.write(
            f"---- mlxd start {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(argv)}\n".encode()
        )
        out.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=str(Path.home()) if Path.home().is_dir() else None,
        )
    url = process.base_url(h, p)
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            typer.echo(
                f"mlxd: the server failed to start (exit code {code}); the end of "
                f"{logfile}:\n{process.tail(logfile)}",
                err=True,
            )
            raise typer.Exit(1)
        status, _ = _health(url, timeout=2)
        if status == 200:
            break
        if time.monotonic() > deadline:
            typer.echo(
                f"mlxd: no healthy answer from {url}/health after {timeout:.0f}s; the "
                f"server (pid {proc.pid}) is still starting or stuck. The end of "
                f"{logfile}:\n{process.tail(logfile)}",
                err=True,
            )
            raise typer.Exit(1)
        time.sleep(0.2)
    typer.echo(f"mlxd is running at {url} (pid {proc.pid})")
    typer.echo(f"  logs: {logfile}")
    typer.echo(f"  stop: mlxd stop{'' if p == 8000 else f' --port {p}'}")


# --------------------------------------------------------------------------------------- #
# status
# --------------------------------------------------------------------------------------- #


def _status_of(port: int) -> dict[str, Any]:
    from mlxd import process

    found = process.find(port)
    out: dict[str, Any] = {"port": port, "running": False, "pid_file": str(found.path)}
    if found.stale is not None:
        out["stale_pid_file_removed"] = found.stale.pid
    info = found.info
    if info is None:
        return out
    out.update(pid=info.pid, url=info.url, log=info.log, started_at=info.started_at)
    code, body = _health(info.url)
    out["health"] = body.get("status") if body else None
    if code == 0:
        out["state"] = "starting"  # the process lives, /health does not answer yet
    else:
        out["state"] = body.get("status") or ("ok" if code == 200 else "unhealthy")
    out["running"] = code == 200
    out["uptime_s"] = round(body.get("uptime_s") or (time.time() - info.started_at), 1)
    out["models"] = [m.get("name") for m in body.get("models") or []]
    out["requests_in_flight"] = body.get("requests_in_flight")
    return out


@cli_errors
def status(
    port: PortOpt = None,
    json_output: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Is the server running? (exit 0: running and healthy, 1: not)"""
    from mlxd import process

    p = port if port is not None else settings_for(config).server.port
    st = _status_of(p)
    others = [q for q in process.all_ports() if q != p]
    if json_output:
        st["other_ports"] = others
        typer.echo(json.dumps(st, indent=2))
        raise typer.Exit(0 if st["running"] else 1)
    if "stale_pid_file_removed" in st:
        typer.echo(
            f"removed a stale pid file (pid {st['stale_pid_file_removed']} is not an "
            "mlxd server any more)",
            err=True,
        )
    if "pid" not in st:
        typer.echo(f"mlxd is not running on port {p}")
    else:
        head = {"ok": "running", "starting": "starting"}.get(st["state"], st["state"])
        typer.echo(f"mlxd is {head} at {st['url']}")
        typer.echo(f"  pid:     {st['pid']}")
        typer.echo(f"  uptime:  {_human_duration(st['uptime_s'])}")
        typer.echo(f"  models:  {', '.join(st['models']) or '-'}")
        if st.get("log"):
            typer.echo(f"  log:     {st['log']}")
    if others:
        typer.echo(f"(pid files for other ports: {', '.join(map(str, others))}; --port chooses)")
    raise typer.Exit(0 if st["running"] else 1)


# --------------------------------------------------------------------------------------- #
# stop
# --------------------------------------------------------------------------------------- #


def _stop_one(port: int, force: bool, timeout: float | None) -> bool:
    from mlxd import process

    found = process.find(port)
    if found.stale is not None:
        typer.echo(f"port {port}: removed a stale pid file (pid {found.stale.pid} is gone)")
    info = found.info
    if info is None:
        typer.echo(f"mlxd is not running on port {port}")
        return True
    wait = timeout if timeout is not None else info.shutdown_grace_s + 10
    typer.echo(
        f"stopping mlxd on port {port} (pid {info.pid}); in-flight requests get up to "
        f"{info.shutdown_grace_s:.0f}s to finish..."
    )
    process.terminate(info.pid, signal.SIGTERM)
    if process.wait_gone(info.pid, wait):
        process.remove_pidfile(port, info.pid)
        typer.echo(f"stopped mlxd on port {port}")
        return True
    if not force:
        typer.echo(
            f"mlxd: pid {info.pid} is still running after {wait:.0f}s; "
            f"`mlxd stop --port {port} --force` kills it",
            err=True,
        )
        return False
    typer.echo(f"killing pid {info.pid} (SIGKILL)")
    process.terminate(info.pid, signal.SIGKILL)
    gone = process.wait_gone(info.pid, 10)
    if gone:
        process.remove_pidfile(port, info.pid)
        typer.echo(f"killed mlxd on port {port}")
    return gone


@cli_errors
def stop(
    port: PortOpt = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="SIGKILL the server if it has not exited after the wait."),
    ] = False,
    all_: Annotated[
        bool, typer.Option("--all", help="Stop every mlxd this MLXD_HOME runs.")
    ] = False,
    timeout: Annotated[
        Optional[float],
        typer.Option(help="Seconds to wait for the exit (default: its shutdown_grace_s + 10)."),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Stop the server: drain gracefully (SIGTERM); SIGKILL only with --force."""
    from mlxd import process

    if all_:
        ports = process.all_ports()
        if not ports:
            typer.echo("no mlxd server is running")
            return
    else:
        ports = [port if port is not None else settings_for(config).server.port]
    ok = [_stop_one(p, force, timeout) for p in ports]
    if not all(ok):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(start)
    app.command()(status)
    app.command()(stop)
