"""Models already in the local Hugging Face cache, served in place without a pull.

People who used ``transformers``, ``mlx_lm`` or ``huggingface-cli download`` have models in
``$HF_HUB_CACHE`` (``models--ORG--NAME/snapshots/<rev>/``). Like mlx-vlm's server, mlxd
lists the MLX-loadable ones (``config.json`` plus complete ``.safetensors`` weights) and
resolves a repo id to its snapshot with no network and no copy into the store.

The cache location is read from the environment at each call (``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ``~/.cache/huggingface/hub``), not from ``huggingface_hub.constants``
which freezes it at import time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mlxd.store.inspect import infer_kind

__all__ = ["CachedModel", "find_cached_model", "hf_hub_cache", "list_cached_models"]


@dataclass(frozen=True)
class CachedModel:
    """One servable snapshot: what ``GET /v1/models``-style listings need."""

    name: str  # the repo id, ORG/NAME
    kind: str | None  # chat / vision / embedding / reranker; None when the files do not say
    path: Path  # the snapshot directory, loadable as it is
    size: int  # bytes on disk of this revision's files
    revision: str


def hf_hub_cache() -> Path:
    """The hub cache directory the environment selects, as huggingface_hub computes it."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def _is_loadable(snapshot: Path) -> bool:
    """config.json and every safetensors file present (dangling links = a partial download)."""
    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return bool(shards) and all((snapshot / s).is_file() for s in shards)
    return any(p.is_file() for p in snapshot.glob("*.safetensors"))


def _snapshot(repo_dir: Path) -> tuple[str, Path] | None:
    """The revision ``refs/main`` points at, else the newest snapshot, if it is loadable."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    candidates: list[Path] = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text(encoding="utf-8").strip())
    if snapshots.is_dir():
        candidates += sorted(
            (p for p in snapshots.iterdir() if p.is_dir()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
    for snap in candidates:
        if snap.is_dir() and _is_loadable(snap):
            return snap.name, snap
    return None


def _size(snapshot: Path) -> int:
    # files are links into blobs/: count what they point at, each blob once
    blobs = {p.resolve() for p in snapshot.rglob("*") if p.is_file()}
    return sum(b.stat().st_size for b in blobs)


def find_cached_model(repo_id: str, cache_dir: Path | None = None) -> CachedModel | None:
    """``repo_id``'s loadable snapshot in the local cache, or None; never touches the network."""
    org, sep, name = repo_id.partition("/")
    if not sep or not org or not name or "/" in name or ".." in (org, name):
        return None
    repo_dir = Path(cache_dir or hf_hub_cache()) / f"models--{org}--{name}"
    found = _snapshot(repo_dir) if repo_dir.is_dir() else None
    if found is None:
        return None
    revision, snap = found
    return CachedModel(repo_id, infer_kind(snap, hint=repo_id), snap, _size(snap), revision)


def list_cached_models(cache_dir: Path | None = None) -> list[CachedModel]:
    """Every model repo in the cache with a loadable snapshot, sorted by name.

    Repos are found the way ``huggingface_hub.scan_cache_dir`` names them (``models--*``);
    datasets, spaces and snapshots without safetensors weights are left out.
    """
    root = Path(cache_dir or hf_hub_cache())
    if not root.is_dir():
        return []
    out = []
    for repo_dir in sorted(root.glob("models--*--*")):
        org, _, name = repo_dir.name[len("models--") :].partition("--")
        model = find_cached_model(f"{org}/{name}", root)
        if model is not None:
            out.append(model)
    return out
