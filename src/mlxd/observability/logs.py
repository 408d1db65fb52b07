"""Structured logging: plain text for people, one JSON object per line for machines.

A record may carry ``extra={"fields": {...}}``: the JSON format puts those keys at the top
level of its object (the access log does: request_id, route, model, status, tokens...);
the text format shows only the message, which already says the same in key=value form.

Log lines carry what clients sent (a path, a ``user``, a model name, a request id): a
newline in one of them wrote a forged line into the text log. Both formats therefore keep
one record on one line whatever a value holds: the text format escapes control characters
in the message (:func:`escape_controls`; a traceback after it keeps its lines), the access
log quotes values that could pass for another field (:func:`log_value`), and the JSON
format escapes the line separators JSON itself leaves raw.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# C0 controls, DEL, C1 controls (NEL among them) and Unicode's line/paragraph separators:
# every character a terminal or a line-splitting reader (Python's str.splitlines) may take
# as a line break or a control sequence.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Characters that end a key=value token, or that would make a value read as something else.
_NEEDS_QUOTES = re.compile(r'[\s"=\\]')


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``,
    ``\\u2028``): one line, and no terminal escape sequences."""
    return _CONTROL.sub(_escape, text)


def log_value(value: object) -> str:
    """A value for a ``key=value`` log message: as is when it is one plain token, else
    double-quoted with ``"`` and ``\\`` escaped, so that ``user="a status=200"`` cannot
    pass for a second field; control characters escaped either way."""
    text = str(value)
    if text and not _NEEDS_QUOTES.search(text):
        return escape_controls(text)
    return '"' + escape_controls(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class TextFormatter(logging.Formatter):
    """The text format: the message with its control characters escaped (one line per
    record; an exception's traceback still follows on lines of its own)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # structured extras, e.g. the access log's
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # json.dumps escapes C0 controls but leaves these raw, and line readers split on them
        return (
            json.dumps(out, ensure_ascii=False)
            .replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029")
            .replace("\x85", "\\u0085")
        )


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # Our own access log says more (request id, latency); uvicorn's would repeat it.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
