"""``mlxd usage``: a running server's tokens, requests and errors per API key name and model.

Asks the server (``GET /v1/usage``, an admin key or, without keys, from loopback) as
``mlxd ps`` does, and totals the days of the period per key and/or model.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Optional

import typer

from mlxd.cli.common import CliError, ConfigOpt, JsonOpt, cli_errors, client_headers, settings_for

_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str) -> float:
    """'7d', '12h', '30m', '2w' -> seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([mhdw])\s*", text)
    if m is None:
        raise CliError(f"--since takes a number and a unit (m, h, d or w), like 7d; got '{text}'")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _fetch(base: str, query: str, headers: dict[str, str]) -> Any:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{base}/v1/usage?{query}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()[:300].decode(errors="replace")
        try:
            body = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise CliError(f"the server at {base} answered {exc.code} to /v1/usage: {body}") from None
    except (urllib.error.URLError, OSError, TimeoutError):
        raise CliError(
            f"no mlxd server answers at {base} (is `mlxd serve` running? "
            "--host/--port choose another)"
        ) from None
    except ValueError:
        raise CliError(f"the server at {base} sent something that is not JSON") from None


def totals(rows: list[dict[str, Any]], groups: list[str]) -> list[dict[str, Any]]:
    """The period's rows summed per group (the buckets folded), largest token count first."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        k = tuple(r.get(g) for g in groups)
        t = out.setdefault(
            k,
            {
                **{g: r.get(g) for g in groups},
                "requests": 0,
                "errors": 0,
                "input_tokens": 0,
                "output_tokens": 0,
            },
        )
        for n in ("requests", "errors", "input_tokens", "output_tokens"):
            t[n] += int(r.get(n) or 0)
    return sorted(out.values(), key=lambda t: (-(t["input_tokens"] + t["output_tokens"]), str(t)))


@cli_errors
def usage(
    since: Annotated[
        str, typer.Option(help="How far back: a number and m, h, d or w (7d, 12h).")
    ] = "7d",
    by: Annotated[
        Optional[str],
        typer.Option(help="key or model (default: both, one row per key and model)."),
    ] = None,
    host: Annotated[
        Optional[str], typer.Option(help="Server address (default: server.host).")
    ] = None,
    port: Annotated[Optional[int], typer.Option(help="Server port (default: server.port).")] = None,
    json_output: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Tokens, requests and errors per API key name and model (a running server's)."""
    if by not in (None, "key", "model"):
        raise CliError(f"--by takes key or model, got '{by}'")
    groups = [by] if by else ["key", "model"]
    span = parse_since(since)
    settings = settings_for(config, {"server": {"host": host, "port": port}})
    h = settings.server.host
    h = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(h, h)
    base = f"http://{'[' + h + ']' if ':' in h else h}:{settings.server.port}"
    now = time.time()
    query = f"start={int(now - span)}&end={int(now) + 1}&group_by={','.join(groups)}&bucket=day"
    data = _fetch(base, query, client_headers(settings))
    rows = totals(data.get("data") or [], groups)
    if json_output:
        typer.echo(json.dumps({"start": data.get("start"), "end": data.get("end"), "data": rows}))
        return
    if not rows:
        typer.echo(f"no usage in the last {since}")
        return
    headers = [g.upper() for g in groups] + ["REQUESTS", "ERRORS", "INPUT", "OUTPUT"]
    table = [
        [str(r[g] or "-") for g in groups]
        + [str(r[n]) for n in ("requests", "errors", "input_tokens", "output_tokens")]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(headers, *table, strict=False)]
    for line in [headers, *table]:
        typer.echo("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
