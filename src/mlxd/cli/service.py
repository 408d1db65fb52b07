"""``mlxd service install|uninstall|start|stop|status|enable|disable``.

A per-user service: a systemd *user* unit on Linux (``~/.config/systemd/user/mlxd.service``,
logs in the journal) and a launchd agent on macOS
(``~/Library/LaunchAgents/io.mlxd.server.plist``, logs in ``$MLXD_HOME/logs``). Both run
this very interpreter: ``<python> -m mlxd serve --config <file>`` with ``MLXD_HOME`` set,
restart on failure, and give the server its ``server.shutdown_grace_s`` to drain on stop.

``install`` writes the file (``--dry-run`` prints it instead) and, when the config file does
not exist yet, writes a commented one with every default (``mlxd config --example``) so the
service has a file to read and you have one to edit. ``MLXD_*`` variables set while
installing are copied into the service, except API keys (put those in
``security.api_key_file``). Without a systemd user instance (containers, some CI) install
still writes the unit and says how to enable it; start/stop/status say systemd is not
available instead of failing obscurely.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from mlxd.cli.common import CliError, ConfigOpt, cli_errors

if TYPE_CHECKING:
    from mlxd.config import Settings

app = typer.Typer(
    help="Run mlxd as a per-user service (systemd on Linux, launchd on macOS).",
    no_args_is_help=True,
)

UNIT_NAME = "mlxd.service"
LAUNCHD_LABEL = "io.mlxd.server"
_SECRET_ENV = ("MLXD_API_KEYS", "MLXD_SECURITY__API_KEYS", "MLXD_SECURITY")
_INTERNAL_ENV = ("MLXD_LOG_FILE",)

PlatformOpt = Annotated[
    Optional[str],
    typer.Option("--platform", help="linux (systemd) or macos (launchd); default: this machine's."),
]


def _platform(choice: str | None) -> str:
    p = (choice or ("macos" if sys.platform == "darwin" else "linux")).lower()
    if p in ("darwin", "mac", "osx"):
        p = "macos"
    if p not in ("linux", "macos"):
        raise CliError(f"unknown platform '{choice}' (linux or macos)", 2)
    return p


def unit_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user" / UNIT_NAME


def plist_path() -> Path:
    return Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"


def _config_path(config: Path | None) -> Path:
    from mlxd.config import default_config_path

    return (Path(config).expanduser() if config else default_config_path()).resolve()


def _service_env() -> dict[str, str]:
    from mlxd.config import mlxd_home

    env = {"MLXD_HOME": str(mlxd_home().resolve()), "PYTHONUNBUFFERED": "1"}
    for k, v in sorted(os.environ.items()):
        if k.startswith("MLXD_") and k not in env and k not in _SECRET_ENV + _INTERNAL_ENV:
            env[k] = v
    return env


def _exec_args(config_file: Path) -> list[str]:
    return [sys.executable, "-m", "mlxd", "serve", "--config", str(config_file)]


# -- systemd --------------------------------------------------------------------------------


def _sd_quote(arg: str) -> str:
    """A systemd command-line word: specifiers (%) and variables ($) escaped, quoted if need be."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(config_file: Path, settings: Settings) -> str:
    env = _service_env()
    stop_timeout = int(settings.server.shutdown_grace_s) + 15
    lines = [
        "# Written by `mlxd service install`; `mlxd service install` again rewrites it.",
        "[Unit]",
        f"Description=mlxd model server (MLX) on {settings.server.host}:{settings.server.port}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_sd_quote(a) for a in _exec_args(config_file)),
        *(f"Environment={_sd_quote(f'{k}={v}')}" for k, v in env.items()),
        # a path setting: taken verbatim (spaces fine, no quotes), only % is special
        f"WorkingDirectory={env['MLXD_HOME'].replace('%', '%%')}",
        "Restart=on-failure",
        "RestartSec=5",
        # SIGTERM starts mlxd's drain (new requests 503, in-flight ones finish)
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={stop_timeout}",
        "StandardOutput=journal",
        "StandardError=journal",
        "SyslogIdentifier=mlxd",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def _systemd_available() -> tuple[bool, str]:
    if shutil.which("systemctl") is None:
        return False, "systemctl is not installed"
    try:
        r = subprocess.run(
            ["systemctl", "--user", "show-environment"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return False, why[-1] if why else f"systemctl --user exited {r.returncode}"
    return True, ""


def _systemctl(*args: str, check: bool = True) -> int:
    r = subprocess.run(["systemctl", "--user", *args], text=True)
    if check and r.returncode != 0:
        raise CliError(f"systemctl --user {' '.join(args)} failed (exit code {r.returncode})")
    return r.returncode


def _need_systemd(verb: str) -> None:
    ok, why = _systemd_available()
    if ok:
        return
    where = unit_path()
    state = "installed at" if where.exists() else "not installed (mlxd service install) at"
    raise CliError(
        f"cannot {verb} the service: systemd (user instance) is not available here ({why}). "
        f"The unit is {state} {where}; on a machine with systemd: "
        f"systemctl --user daemon-reload && systemctl --user {verb} {UNIT_NAME}. "
        "Meanwhile `mlxd start` / `mlxd stop` run the server without systemd."
    )


# -- launchd --------------------------------------------------------------------------------


def launchd_plist(config_file: Path, settings: Settings) -> bytes:
    env = _service_env()
    log = str(Path(env["MLXD_HOME"]) / "logs" / "mlxd-service.log")
    data = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": _exec_args(config_file),
        "EnvironmentVariables": env,
        "WorkingDirectory": env["MLXD_HOME"],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart when it fails, not when stopped
        "ThrottleInterval": 5,
        "ExitTimeOut": int(settings.server.shutdown_grace_s) + 15,
        "StandardOutPath": log,
        "StandardErrorPath": log,
        "ProcessType": "Interactive",  # Apple's hint for latency-sensitive work
    }
    return plistlib.dumps(data, fmt=plistlib.FMT_XML, sort_keys=False)


def _launchctl(*args: str, check: bool = True) -> int:
    if shutil.which("launchctl") is None:
        raise CliError("launchctl is not available on this machine")
    r = subprocess.run(["launchctl", *args], text=True)
    if check and r.returncode != 0:
        raise CliError(f"launchctl {' '.join(args)} failed (exit code {r.returncode})")
    return r.returncode


def _domain() -> str:
    return f"gui/{os.getuid()}"


# -- commands -------------------------------------------------------------------------------


@app.command()
@cli_errors
def install(
    config: ConfigOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the unit/plist on stdout instead of installing it."),
    ] = False,
    platform: PlatformOpt = None,
) -> None:
    """Write the service definition from the current configuration."""
    from mlxd.cli.config_cmd import example_yaml
    from mlxd.config import load_settings

    plat = _platform(platform)
    cfg = _config_path(config)
    settings = load_settings(cfg if cfg.is_file() else None)
    if plat == "linux":
        text: bytes = systemd_unit(cfg, settings).encode()
        target = unit_path()
    else:
        text = launchd_plist(cfg, settings)
        target = plist_path()
    if dry_run:
        sys.stdout.buffer.write(text)
        sys.stdout.flush()
        typer.echo(f"# (dry run: would write {target})", err=True)
        return
    skipped = [k for k in _SECRET_ENV if k in os.environ]
    if skipped:
        typer.echo(
            f"note: {', '.join(skipped)} not copied into the service (secrets); use "
            "security.api_key_file in the config",
            err=True,
        )
    if not cfg.is_file():
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(example_yaml())
        typer.echo(f"wrote {cfg} (every setting at its default; edit it)")
    (Path(settings.home) / "logs").mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(text)
    os.replace(tmp, target)
    typer.echo(f"wrote {target}")
    if plat == "macos":
        typer.echo(
            "start it now and at every login: mlxd service enable "
            f"(launchctl bootstrap {_domain()} {target})"
        )
        return
    ok, why = _systemd_available()
    if ok:
        _systemctl("daemon-reload")
        typer.echo(
            "start it at login: mlxd service enable; now: mlxd service start; "
            f"logs: journalctl --user -u {UNIT_NAME} -f"
        )
        typer.echo("(to keep it running after you log out: loginctl enable-linger $USER)")
    else:
        typer.echo(
            f"systemd (user instance) is not available here ({why}); on a machine "
            f"with it run: systemctl --user daemon-reload && systemctl --user enable "
            f"--now {UNIT_NAME}"
        )


@app.command()
@cli_errors
def uninstall(platform: PlatformOpt = None) -> None:
    """Stop and remove the service definition."""
    plat = _platform(platform)
    if plat == "macos":
        target = plist_path()
        if shutil.which("launchctl"):
            _launchctl("bootout", f"{_domain()}/{LAUNCHD_LABEL}", check=False)
    else:
        target = unit_path()
        ok, _ = _systemd_available()
        if ok and target.exists():
            _systemctl("disable", "--now", UNIT_NAME, check=False)
    if not target.exists():
        typer.echo(f"not installed ({target} does not exist)")
        return
    target.unlink()
    if plat == "linux" and _systemd_available()[0]:
        _systemctl("daemon-reload", check=False)
    typer.echo(f"removed {target}")


def _verb(verb: str, platform: str | None) -> None:
    plat = _platform(platform)
    if plat == "macos":
        target = plist_path()
        if not target.exists():
            raise CliError(f"not installed ({target}); run: mlxd service install")
        svc = f"{_domain()}/{LAUNCHD_LABEL}"
        if verb in ("start", "enable"):
            if verb == "enable":
                _launchctl("enable", svc)
            _launchctl("bootstrap", _domain(), str(target), check=False)  # 'already loaded' ok
            _launchctl("kickstart", svc)
        elif verb in ("stop", "disable"):
            if verb == "disable":
                _launchctl("disable", svc)
            _launchctl("bootout", svc, check=False)
        else:
            raise typer.Exit(_launchctl("print", svc, check=False))
        return
    _need_systemd(verb)
    if not unit_path().exists():
        raise CliError(f"not installed ({unit_path()}); run: mlxd service install")
    if verb == "status":
        raise typer.Exit(_systemctl("status", "--no-pager", UNIT_NAME, check=False))
    _systemctl(verb, UNIT_NAME)
    typer.echo(f"{verb}: done ({UNIT_NAME})")


@app.command("start")
@cli_errors
def start_(platform: PlatformOpt = None) -> None:
    """Start the service now."""
    _verb("start", platform)


@app.command("stop")
@cli_errors
def stop_(platform: PlatformOpt = None) -> None:
    """Stop the service (it drains in-flight requests first)."""
    _verb("stop", platform)


@app.command("status")
@cli_errors
def status_(platform: PlatformOpt = None) -> None:
    """The service manager's view of the service."""
    _verb("status", platform)


@app.command()
@cli_errors
def enable(platform: PlatformOpt = None) -> None:
    """Start the service at login (launchd: also now)."""
    _verb("enable", platform)


@app.command()
@cli_errors
def disable(platform: PlatformOpt = None) -> None:
    """Do not start the service at login (launchd: also stop it)."""
    _verb("disable", platform)
