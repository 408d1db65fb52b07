"""The LoRA adapters a request may name, as vLLM serves them: ``model: "<adapter>"`` (or
``"<base>:<adapter>"``) decodes on the base model with that adapter, in the same batch as
every other request to the base (engines/lora.py).

Registered at run time (``POST /v1/load_lora_adapter``) and kept in
``$MLXD_HOME/lora-adapters.json``, so every front end of a server (``--api-workers N``)
resolves the same names, and a restart keeps them. The engine core loads an adapter when
the first request that names it arrives (and again after its base model was unloaded).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FILE = "lora-adapters.json"


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    base: str
    path: str
    created: int


class AdapterRegistry:
    def __init__(self, home: Path) -> None:
        self.file = Path(home) / FILE
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._entries: dict[str, AdapterEntry] = {}

    def all(self) -> list[AdapterEntry]:
        self._refresh()
        return list(self._entries.values())

    def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter ``model`` names (its name, or ``base:name``), else None."""
        if not model:
            return None
        self._refresh()
        entry = self._entries.get(model)
        if entry is not None:
            return entry
        base, sep, name = model.rpartition(":")
        entry = self._entries.get(name) if sep else None
        return entry if entry is not None and entry.base == base else None

    def add(self, entry: AdapterEntry) -> None:
        with self._lock:
            self._refresh()
            self._write({**self._entries, entry.name: entry})

    def remove(self, name: str) -> bool:
        with self._lock:
            self._refresh()
            if name not in self._entries:
                return False
            self._write({k: v for k, v in self._entries.items() if k != name})
            return True

    def _refresh(self) -> None:
        try:
            mtime = self.file.stat().st_mtime_ns
        except FileNotFoundError:
            self._entries, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        try:
            raw = json.loads(self.file.read_text())
            self._entries = {
                k: AdapterEntry(k, v["base"], v["path"], int(v.get("created", 0)))
                for k, v in raw.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._entries = {}
        self._mtime = mtime

    def _write(self, entries: dict[str, AdapterEntry]) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        data = {
            k: {"base": e.base, "path": e.path, "created": e.created or int(time.time())}
            for k, e in entries.items()
        }
        fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".lora-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.file)
        self._mtime = None
        self._refresh()
