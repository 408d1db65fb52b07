"""The model store on disk: one directory per model with a manifest beside standard MLX files.

Every write lands in a hidden temp directory inside the store and is renamed into place,
so a pull or import killed halfway never leaves a half model where a load would find it.
Temp directories carry the writer's pid: leftovers of dead writers are swept away, those
of live ones (another pull in progress, in this process or another) are left alone. A
per-name file lock serialises writers of one name across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlxd.core.errors import InvalidRequest, ModelLoadError, ModelNotFound
from mlxd.store.names import dir_name
from mlxd.store.progress import ProgressFn

MANIFEST = "mlxd.json"
_TMP_PREFIX = ".tmp-"
_TMP_PID = re.compile(r"^\.tmp-(\d+)-")
LOCKS_DIR = ".locks"
HF_CACHE_DIR = ".hf-cache"  # huggingface_hub's cache for pulls in progress (resumable)


class IntegrityError(ModelLoadError):
    """A downloaded file does not hash to what its source promised."""


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # -- reading ---------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """The directory for ``name`` (validated): always a direct child of the root."""
        p = self.root / dir_name(name)
        if p.parent != self.root:  # dir_name never yields a separator; keep it that way
            raise InvalidRequest(f"invalid model name: {name!r}", param="model")
        return p

    def get(self, name: str) -> Path | None:
        p = self.path(name)
        return p if (p / "config.json").is_file() else None

    def exists(self, name: str) -> bool:
        p = self.path(name)
        return p.is_dir() or p.is_symlink()

    def manifest(self, name: str) -> dict[str, Any] | None:
        p = self.path(name) / MANIFEST
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

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
        return sorted(out, key=lambda m: str(m.get("name", "")))

    # -- housekeeping ----------------------------------------------------------------------
    def clean_temp(self) -> None:
        """Remove leftovers of writes whose writer died: they were never visible as models."""
        if not self.root.is_dir():
            return
        for d in self.root.glob(_TMP_PREFIX + "*"):
            m = _TMP_PID.match(d.name)
            if m is not None and _pid_alive(int(m.group(1))):
                continue
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)

    def temp_dir(self, tag: str = "") -> Path:
        """A fresh hidden directory inside the store (same filesystem: renames are atomic)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_TMP_PREFIX}{os.getpid()}-{tag}{uuid.uuid4().hex}"
        tmp.mkdir()
        return tmp

    @contextlib.contextmanager
    def lock(self, name: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Exclusive, cross-process lock on one model name (flock; released on exit/death)."""
        locks = self.root / LOCKS_DIR
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{dir_name(name)}.lock", "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # -- writing ---------------------------------------------------------------------------
    def install(
        self,
        name: str,
        build: Callable[[Path], dict[str, Any]],
        *,
        kind: str | None,
        source: str,
        progress: ProgressFn | None = None,
    ) -> Path:
        """``build(tmp_dir)`` writes the model files and returns manifest fields.

        Recognised fields: ``format``, ``quantization``, ``dtype``, ``kind`` (overrides the
        argument), ``expected_sha256`` ({relative path: hex}, checked, not stored) and any
        other JSON-able extras (``revision``, ``parent``...) stored as they are.
        """
        final = self.path(name)
        tmp = self.temp_dir()
        try:
            info = dict(build(tmp) or {})
            kind = info.pop("kind", None) or kind
            if not kind:
                raise ValueError(f"no kind for model '{name}'")
            expected = info.pop("expected_sha256", None) or {}
            files = _hash_files(tmp, progress)
            by_name = {f["name"]: f for f in files}
            for rel, want in expected.items():
                got = by_name.get(rel, {}).get("sha256")
                if got is not None and got != want:
                    raise IntegrityError(f"{rel}: sha256 {got} does not match the source's {want}")
            from mlxd.store.inspect import summarize

            summary = summarize(tmp)
            manifest = {
                "name": name,
                "kind": kind,
                "source": source,
                "format": info.pop("format", "mlx"),
                "quantization": info.pop("quantization", None) or summary["quantization"],
                "dtype": info.pop("dtype", None) or summary["dtype"],
                "size": sum(f["size"] for f in files),
                "digest": _digest(files),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "architecture": summary["architecture"],
                "model_type": summary["model_type"],
                "num_parameters": summary["num_parameters"],
                "context_length": summary["context_length"],
                **{k: v for k, v in info.items() if not k.startswith("_")},
                "files": files,
            }
            if progress is not None:
                progress({"status": "writing manifest"})
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if final.exists() or final.is_symlink():
                old = self.root / f"{_TMP_PREFIX}{os.getpid()}-old-{uuid.uuid4().hex}"
                final.rename(old)
                tmp.rename(final)
                _rmtree(old)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def remove(self, name: str) -> None:
        """Delete one model: renamed out of sight first, so no reader sees half of it."""
        p = self.path(name)
        if not (p.exists() or p.is_symlink()):
            raise ModelNotFound(f"model '{name}' not found", param="model")
        with self.lock(name):
            if p.is_symlink():  # a link someone put here: drop the link, never its target
                p.unlink()
                return
            if not p.exists():
                raise ModelNotFound(f"model '{name}' not found", param="model")
            trash = self.root / f"{_TMP_PREFIX}{os.getpid()}-rm-{uuid.uuid4().hex}"
            p.rename(trash)
            _rmtree(trash)


def _rmtree(d: Path) -> None:
    if d.is_symlink():
        d.unlink()
    else:
        shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _hash_files(d: Path, progress: ProgressFn | None) -> list[dict[str, Any]]:
    """Size and sha256 of every file below ``d`` (what ``show`` lists and pulls verify)."""
    paths = sorted(
        (f for f in d.rglob("*") if f.is_file() and f.name != MANIFEST),
        key=lambda f: f.relative_to(d).as_posix(),
    )
    total = sum(f.stat().st_size for f in paths)
    done, last = 0, 0.0
    if progress is not None:
        progress({"status": "verifying sha256 digest", "total": total, "completed": 0})
    out = []
    for f in paths:
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(functools.partial(fh.read, 1 << 22), b""):
                h.update(chunk)
                done += len(chunk)
                now = time.monotonic()
                if progress is not None and now - last > 0.1:
                    last = now
                    progress(
                        {"status": "verifying sha256 digest", "total": total, "completed": done}
                    )
        out.append(
            {"name": f.relative_to(d).as_posix(), "size": f.stat().st_size, "sha256": h.hexdigest()}
        )
    if progress is not None:
        progress({"status": "verifying sha256 digest", "total": total, "completed": total})
    return out


def _digest(files: list[dict[str, Any]]) -> str:
    """One sha256 naming the model: over the sorted (sha256, path) list of its weight files
    (all files when it has no ``.safetensors``), so two stores holding the same weights agree
    on it whatever their manifests say."""
    chosen = [f for f in files if f["name"].endswith(".safetensors")] or files
    h = hashlib.sha256()
    for f in chosen:
        h.update(f"{f['sha256']}  {f['name']}\n".encode())
    return "sha256:" + h.hexdigest()
