"""Reading a GGUF file's header with llama.cpp's own ``gguf`` package.

The importer's parts (weights, config, tokenizer) each need the metadata as plain Python
values; this module turns ``gguf.GGUFReader`` fields into those once, and owns the error
type every part raises, so callers catch one thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

__all__ = ["GGUFImportError", "meta", "open_gguf", "read_metadata"]


class GGUFImportError(Exception):
    """Raised when a GGUF file cannot be turned into a correct MLX model.

    A distinct type lets callers tell "this file is not something we can serve"
    (report to the user) apart from I/O or programming errors (bugs).
    """


def open_gguf(path: Path) -> GGUFReader:
    """Open ``path`` read-only (memory-mapped); anything unreadable is a GGUFImportError."""
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError, EOFError) as e:
        raise GGUFImportError(f"{path} is not a GGUF file or is corrupt: {e}") from e


def _text(raw: np.ndarray) -> str:
    # Some vocabularies carry invalid UTF-8 pieces; gguf's contents() would raise on them.
    return bytes(raw).decode("utf-8", errors="replace")


def _field_value(field: Any) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.STRING:
        return _text(field.parts[field.data[0]])
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [_text(field.parts[i]) for i in field.data]
        if len(types) > 2:  # nested arrays: nothing the importer reads
            return field.contents()
        if not field.data:
            return np.zeros(0)
        return np.concatenate([field.parts[i] for i in field.data])
    value = field.parts[field.data[0]][0]
    if types[0] == GGUFValueType.FLOAT32:
        # Shortest float32 repr, so config.json says 1e-05 rather than 9.9999997e-06.
        return float(str(np.float32(value)))
    return value.item()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value of the header (``GGUF.*`` bookkeeping fields left out)."""
    return {
        name: _field_value(field)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def meta(md: dict[str, Any], key: str, default: Any = ...) -> Any:
    """``md[key]``; without a default a missing key is a GGUFImportError naming it."""
    if key in md:
        value = md[key]
        return value.item() if isinstance(value, np.generic) else value
    if default is ...:
        raise GGUFImportError(f"GGUF metadata is missing required key {key!r}")
    return default
