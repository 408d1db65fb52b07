"""Model names, validated so that no name can reach outside the store directory."""

from __future__ import annotations

import re

from mlxd.core.errors import InvalidRequest

# "name", "name:tag" or "org/name:tag"; each part starts with an alphanumeric, so "..",
# absolute paths, backslashes and NUL can never form a name.
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME = re.compile(rf"^{_PART}(/{_PART})?(:[A-Za-z0-9][A-Za-z0-9._-]{{0,63}})?$")


def validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise InvalidRequest(f"invalid model name: {name!r}", param="model")
    return name


def dir_name(name: str) -> str:
    """The store directory for a (validated) name: one level, no separators."""
    return validate_name(name).replace("/", "--").replace(":", "__")
