"""Ollama's keep_alive: a duration string ("5m", "1h30m", "10s"), seconds, -1 or 0."""

from __future__ import annotations

import re

from mlxd.core.errors import InvalidRequest

FOREVER = float("inf")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: str | int | float | None) -> float | None:
    """Seconds to stay loaded after the last request; FOREVER for negative; None if unset."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequest("keep_alive must be a duration or a number", param="keep_alive")
    if isinstance(value, (int, float)):
        return FOREVER if value < 0 else float(value)
    text = str(value).strip()
    try:
        num = float(text)
    except ValueError:
        pass
    else:
        return FOREVER if num < 0 else num
    if text.startswith("-"):
        return FOREVER
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise InvalidRequest(f"invalid keep_alive duration: {value!r}", param="keep_alive")
    return total
