"""``mlxd config``: the effective configuration and where each value came from.

``--example`` prints a fully commented config.yaml generated from the Settings model itself
(field descriptions become comments, defaults become values), so it cannot drift from the
code; ``--path`` prints where the config file is looked for.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from pydantic import BaseModel

from mlxd.cli.common import CliError, ConfigOpt, JsonOpt, cli_errors
from mlxd.config import drop_none

SECRET_FIELDS = {("security", "api_keys")}


# --------------------------------------------------------------------------------------- #
# The example file
# --------------------------------------------------------------------------------------- #


def _flow(value: Any) -> str:
    """One YAML line for a value ('[]', '{}', 'null', 'text', '30.0', '[a, b]')."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000)
    text = text.strip()
    if text.endswith("\n..."):
        text = text[:-4].strip()
    return text.removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    out = []
    for para in text.splitlines() or [""]:
        wrapped = textwrap.wrap(para, width=88 - len(indent) - 2) or [""]
        out += [f"{indent}# {line}".rstrip() for line in wrapped]
    return out


def _section_doc(model: type[BaseModel]) -> str | None:
    doc = model.__doc__
    if not doc or doc.strip().startswith(("A base class", "Usage docs")):
        return None
    return " ".join(doc.strip().split())


def example_yaml() -> str:
    """A commented config.yaml holding every setting at its default."""
    from mlxd.config import Settings

    lines = [
        "# mlxd configuration: every setting at its default (`mlxd config --example`).",
        "# Precedence, lowest first: built-in defaults < this file < environment",
        "# (MLXD_<SECTION>__<KEY>, e.g. MLXD_SERVER__PORT=9000) < command-line flags.",
        "# Keep only what you change; `mlxd config` shows the effective values and sources.",
    ]
    for name, field in Settings.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        lines.append("")
        doc = field.description or _section_doc(section)
        if doc:
            lines += _comment(doc, "")
        lines.append(f"{name}:")
        default = section()
        for key, sub in section.model_fields.items():
            if sub.description:
                lines += _comment(sub.description, "  ")
            for ex in sub.examples or []:
                dumped = yaml.safe_dump({key: ex}, default_flow_style=False, sort_keys=False)
                lines.append("  # for example:")
                lines += [f"  #   {line}" for line in dumped.rstrip().splitlines()]
            value = getattr(default, key)
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json")
            else:
                value = _jsonable(value)
            lines.append(f"  {key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------- #
# Sources
# --------------------------------------------------------------------------------------- #


def _env_sources() -> dict[tuple[str, str], str]:
    """(section, key) -> the environment variable that set it."""
    from mlxd.config import FLAT_ENV, Settings

    out: dict[tuple[str, str], str] = {}
    env = {k.upper(): v for k, v in os.environ.items()}
    for section, field in Settings.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        if f"MLXD_{section.upper()}" in env:  # a whole section as JSON
            for key in model.model_fields:
                out[(section, key)] = f"MLXD_{section.upper()}"
        for key in model.model_fields:
            var = f"MLXD_{section.upper()}__{key.upper()}"
            if var in env:
                out[(section, key)] = var
    import mlxd.config as cfg

    flat = {**FLAT_ENV, **getattr(cfg, "FLAT_SCALAR_ENV", {})}
    for var, (section, key) in flat.items():
        if var in os.environ:
            out[(section, key)] = var
    return out


def explain(config_file: Path | None, overrides: dict | None = None) -> dict[str, Any]:
    """The effective settings with a source for each (section, key)."""
    from mlxd.config import Settings, default_config_path, load_settings, read_yaml

    settings = load_settings(config_file, overrides)
    path = Path(config_file).expanduser() if config_file else default_config_path()
    file_data = read_yaml(path) if path.is_file() else {}
    flags = drop_none(overrides or {})
    env = _env_sources()
    sections: dict[str, dict[str, Any]] = {}
    for section in Settings.model_fields:
        value = getattr(settings, section)
        if not isinstance(value, BaseModel):
            continue
        out = sections[section] = {}
        for key in type(value).model_fields:
            v = _jsonable(getattr(value, key))
            if (section, key) in SECRET_FIELDS:
                v = [{**k, "key": "***"} for k in v]
            if key in flags.get(section, {}):
                src = "flag"
            elif (section, key) in env:
                src = f"env {env[(section, key)]}"
            elif isinstance(file_data.get(section), dict) and key in file_data[section]:
                src = "file"
            else:
                src = "default"
            out[key] = {"value": v, "source": src}
    extra = {}
    if os.environ.get("MLXD_API_KEYS"):
        n = len([x for x in os.environ["MLXD_API_KEYS"].split(",") if x.strip()])
        extra["MLXD_API_KEYS"] = f"{n} more API key(s) from the environment"
    return {
        "config_file": str(path),
        "config_file_exists": path.is_file(),
        "home": str(settings.home),
        "settings": sections,
        "notes": extra,
    }


def _render(data: dict[str, Any]) -> str:
    exists = "" if data["config_file_exists"] else " (not found: defaults apply)"
    lines = [
        f"# config file: {data['config_file']}{exists}",
        f"# MLXD_HOME:   {data['home']}",
        "# sources: default < file < env < flag",
    ]
    for var, note in data["notes"].items():
        lines.append(f"# {var}: {note}")
    for section, values in data["settings"].items():
        lines.append(f"{section}:")
        rows = [(f"  {k}: {_flow(v['value'])}", v["source"]) for k, v in values.items()]
        width = min(max(len(r[0]) for r in rows) + 2, 60)
        lines += [f"{text.ljust(width)}# {src}" for text, src in rows]
    return "\n".join(lines)


@cli_errors
def config(
    config: ConfigOpt = None,
    example: Annotated[
        bool,
        typer.Option(
            "--example", help="Print a fully commented example config.yaml (all defaults)."
        ),
    ] = False,
    path: Annotated[bool, typer.Option("--path", help="Print the config file's location.")] = False,
    json_output: JsonOpt = False,
    host: Annotated[Optional[str], typer.Option(help="As `mlxd serve --host`.")] = None,
    port: Annotated[Optional[int], typer.Option(help="As `mlxd serve --port`.")] = None,
    model: Annotated[
        Optional[str], typer.Option("--model", "-m", help="As `mlxd serve --model`.")
    ] = None,
    log_level: Annotated[Optional[str], typer.Option()] = None,
    log_format: Annotated[Optional[str], typer.Option()] = None,
) -> None:
    """Show the effective configuration and where each value comes from."""
    from mlxd.config import default_config_path

    if example:
        typer.echo(example_yaml(), nl=False)
        return
    if path:
        p = Path(config).expanduser().resolve() if config else default_config_path()
        typer.echo(str(p))
        return
    overrides = {
        "server": {"host": host, "port": port},
        "models": {"default": model},
        "log": {"level": log_level, "format": log_format},
    }
    if config is not None and not Path(config).expanduser().is_file():
        raise CliError(f"config file not found: {config}", 2)
    data = explain(config, overrides)
    if json_output:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(_render(data))


def register(app: typer.Typer) -> None:
    app.command()(config)
