"""The model store on disk: one directory per model with a manifest beside standard MLX files.

Every write lands in a hidden temp directory inside the store and is renamed into place,
so a pull or import killed halfway never leaves a half model where a load would find it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxd.store.names import dir_name

MANIFEST = "mlxd.json"
_TMP_PREFIX = ".tmp-"


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / dir_name(name)

    def get(self, name: str) -> Path | None:
        p = self.path(name)
        return p if (p / "config.json").is_file() else None

    def manifest(self, name: str) -> dict[str, Any] | None:
        p = self.path(name) / MANIFEST
        if not p.is_file():
            return None
        return json.loads(p.read_text())

    def list(self) -> list[dict[str, Any]]:
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / MANIFEST).is_file():
                continue
            try:
                out.append(json.loads((d / MANIFEST).read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        return out

    def clean_temp(self) -> None:
        """Remove leftovers of writes that were killed: they were never visible as models."""
        if self.root.is_dir():
            for d in self.root.glob(_TMP_PREFIX + "*"):
                shutil.rmtree(d, ignore_errors=True)

    def install(
        self,
        name: str,
        build: Callable[[Path], dict[str, Any]],
        *,
        kind: str,
        source: str,
    ) -> Path:
        """``build(tmp_dir)`` writes the model files and returns manifest fields."""
        final = self.path(name)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            info = build(tmp) or {}
            manifest = {
                "name": name,
                "kind": kind,
                "source": source,
                "format": info.get("format", "mlx"),
                "quantization": info.get("quantization"),
                "dtype": info.get("dtype"),
                "size": _dir_size(tmp),
                "digest": _digest(tmp),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists():
                old = self.root / f"{_TMP_PREFIX}old-{uuid.uuid4().hex}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final


def _dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _digest(d: Path) -> str:
    """sha256 over the weight files, so two stores can tell whether they hold the same model."""
    h = hashlib.sha256()
    for f in sorted(d.rglob("*.safetensors")):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()
