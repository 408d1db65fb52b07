"""Host names and web origins, parsed and written one way for the settings and the server.

``server.allowed_hosts`` and ``server.allowed_origins`` are normalised when the settings are
read, and each request's ``Host`` and ``Origin`` headers the same way when they are judged
(api/origin.py), so that ``HTTP://Example.com:80`` and ``http://example.com`` compare equal.
No imports from mlxd: config.py uses it.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple
from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _canonical_name(name: str) -> str:
    """Lower case without a trailing dot; IP addresses in their one written form (::1)."""
    name = name.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (``name``, ``name:port``, ``[v6]:port``) -> (name, port or None);
    None when it is not one."""
    v = value.strip()
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        name, port_s = v[1:end], rest[1:]
    elif v.count(":") == 1:
        name, port_s = v.split(":")
    else:  # a name, or an IPv6 address without brackets
        name, port_s = v, ""
    name = _canonical_name(name)
    if not name or any(c in name for c in "/@?#\\ \t"):
        return None
    if not port_s:
        return name, None
    if not (port_s.isascii() and port_s.isdigit()) or int(port_s) > 65535:
        return None
    return name, int(port_s)


def host_pattern(value: str) -> str:
    """One ``server.allowed_hosts`` entry: ``*``, ``*.example.com`` or a name or address
    (ports are not checked, so none may be given); ValueError says what is wrong."""
    v = value.strip().lower()
    if v == "*":
        return v
    wild = v.startswith("*.")
    parsed = split_host(v[2:] if wild else v)
    if parsed is None or "*" in parsed[0] or "://" in v:
        raise ValueError(
            f"{value!r} is not a host name ('example.com', '*.example.com', "
            "'10.0.0.5' or '*'; no scheme, port or path)"
        )
    if parsed[1] is not None:
        raise ValueError(f"{value!r}: any port is accepted, give the name alone")
    return ("*." if wild else "") + parsed[0]


def host_matches(name: str, patterns: frozenset[str]) -> bool:
    """Whether a canonical name is among the patterns (``*.x`` matches below x, not x)."""
    if "*" in patterns or name in patterns:
        return True
    return any(p.startswith("*.") and name.endswith(p[1:]) for p in patterns)


class Origin(NamedTuple):
    """A web origin; ``port`` is the scheme's default when the origin names none."""

    scheme: str
    host: str
    port: int | None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        shown = self.port is not None and self.port != DEFAULT_PORTS.get(self.scheme)
        return f"{self.scheme}://{host}{f':{self.port}' if shown else ''}"


def parse_origin(value: str) -> Origin | None:
    """``scheme://host[:port]`` (what browsers send in ``Origin``) or None."""
    try:
        parts = urlsplit(value.strip())
    except ValueError:
        return None
    if (
        not parts.scheme
        or not parts.netloc
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "@" in parts.netloc
    ):
        return None
    host = split_host(parts.netloc)
    if host is None:
        return None
    scheme = parts.scheme.lower()
    return Origin(scheme, host[0], host[1] if host[1] is not None else DEFAULT_PORTS.get(scheme))


def origin_entry(value: str) -> str:
    """One ``server.allowed_origins`` entry, normalised: ``*``, ``null`` (the origin of
    sandboxed frames and files) or an origin; ValueError says what is wrong."""
    v = value.strip()
    if v in ("*", "null"):
        return v
    origin = parse_origin(v)
    if origin is None:
        raise ValueError(
            f"{value!r} is not an origin (scheme://host[:port], e.g. "
            "'https://app.example.com'; no path), '*' or 'null'"
        )
    return str(origin)
