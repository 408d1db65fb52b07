"""Model names as the server sees them: the store, plus directories named in the config.

Both sides of the process boundary need it: front ends to list, describe and resolve
models without asking the core, the core to find what to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.core.errors import InvalidRequest
from mlxd.store.hf_cache import find_cached_model, list_cached_models
from mlxd.store.local import ModelStore
from mlxd.store.names import validate_name


class ModelCatalog:
    def __init__(self, models_dir: Path, default: str, preload: list[str]) -> None:
        self.store = ModelStore(models_dir)
        self.paths: dict[str, Path] = {}  # models served straight from a directory
        self.default_name = self._register(default)
        self.preload_names = [self._register(n) for n in preload]

    @classmethod
    def from_settings(cls, settings: Any) -> ModelCatalog:
        m = settings.models
        return cls(settings.models_dir, m.default, list(m.preload))

    def _register(self, name_or_path: str) -> str:
        """A filesystem path (from config or flags) is served under its directory name."""
        p = Path(name_or_path).expanduser()
        if ("/" in name_or_path or name_or_path.startswith(".")) and p.is_dir():
            name = p.resolve().name
            self.paths[name] = p.resolve()
            return name
        return name_or_path

    def resolve(self, name: str | None) -> str:
        """None or "default": the default model. An empty or blank name is refused: it
        must never silently mean the default (an unload of "" unloaded it)."""
        if name is None or name == "default":
            return self.default_name
        if not name.strip():
            raise InvalidRequest("a model name must not be empty or blank", param="model")
        return name

    @property
    def pinned(self) -> list[str]:
        return list(dict.fromkeys([self.default_name, *self.preload_names]))

    def path(self, name: str) -> Path | None:
        """Where ``name`` lives on disk, if it is installed or in the local Hugging Face
        cache (no pull, no load)."""
        name = self.resolve(name)
        if name in self.paths:
            return self.paths[name]
        validate_name(name)
        found = self.store.get(name)
        if found is None and "/" in name:
            cached = find_cached_model(name)
            found = cached.path if cached is not None else None
        return found

    def installed(self) -> list[dict[str, Any]]:
        """The store's models, directories named in the config, and the MLX-loadable models
        of the local Hugging Face cache (served in place, as mlx-vlm's server lists them)."""
        # LoRA adapters are listed as adapters (store/adapters.py), never as models
        out = [m for m in self.store.list() if m.get("kind") != "adapter"]
        known = {m["name"] for m in out}
        for name, path in self.paths.items():
            if name not in known:
                known.add(name)
                out.append(
                    {
                        "name": name,
                        "kind": "chat",
                        "source": str(path),
                        "format": "mlx",
                        "size": sum(f.stat().st_size for f in path.glob("*") if f.is_file()),
                    }
                )
        for cached in list_cached_models():
            if cached.name not in known:
                out.append(
                    {
                        "name": cached.name,
                        "kind": cached.kind or "chat",
                        "source": f"hf-cache:{cached.revision}",
                        "format": "mlx",
                        "size": cached.size,
                        "path": str(cached.path),
                    }
                )
        return out

    def kind(self, name: str) -> str | None:
        """The kind of an installed model, without loading it (None when unknown)."""
        name = self.resolve(name)
        manifest = self.store.manifest(name) if name not in self.paths else None
        if manifest and manifest.get("kind"):
            return manifest["kind"]
        path = self.path(name)
        if path is not None:
            from mlxd.store.inspect import infer_kind

            return infer_kind(path)
        return None
