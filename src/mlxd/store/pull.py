"""The store's public operations: pull, ensure (pull on first use), remove, quantize.

The runtime, the HTTP layer and the CLI call these; every write goes through
``ModelStore.install`` (temp dir + rename, per-name lock), so nothing here can leave a half
model behind or touch anything outside the store directory.

Progress events are Ollama's ``/api/pull`` stream objects::

    {"status": "pulling manifest"}
    {"status": "downloading <what>", "digest": "...", "total": int, "completed": int}
    {"status": "verifying sha256 digest", "total": int, "completed": int}
    {"status": "writing manifest"}
    {"status": "success"}

plus status-only lines for the steps in between ("importing x.gguf", "using installed
pkg==1.0", ...). Byte events for one transfer share one ``digest``.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.config import ModelSettings
from mlxd.core.errors import (
    InvalidRequest,
    MlxdError,
    ModelLoadError,
    ModelNotFound,
    Unavailable,
    UpstreamUnavailable,
)
from mlxd.store.adapters import (
    AdapterEntry,
    AdapterRegistry,
    adapter_format,
    base_hints,
    import_adapter,
)
from mlxd.store.aliases import BUILTIN_ALIASES, EMBEDDED_DEFAULTS, KINDS
from mlxd.store.hf_cache import find_cached_model
from mlxd.store.inspect import infer_kind
from mlxd.store.local import HF_CACHE_DIR, IntegrityError, ModelStore
from mlxd.store.names import validate_name
from mlxd.store.progress import ProgressFn, ProgressLog, emitter, tee
from mlxd.store.sources import SourceUnavailable, fetch_into, hub_cache_folder

__all__ = [
    "ProgressFn",
    "Resolved",
    "ensure_model",
    "infer_kind",
    "pull",
    "quantize",
    "remove",
    "resolve",
]

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


class KindUnknown(InvalidRequest):
    code = "model_kind_unknown"


@dataclass(frozen=True)
class Resolved:
    """What a name given to ``pull`` stands for.

    ``origin`` is "alias" (built-in), "user-alias" (``models.aliases``), "hub" (a repo id),
    "pypi" (a ``pypi:`` spec) or "local" (a path on this machine). Callers taking names
    from the network should refuse "pypi" and "local" (``ensure_model`` does).
    """

    name: str  # the store name it lands under
    sources: tuple[str, ...]
    kind: str | None
    origin: str


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", ".\\"))
        or name.endswith(".gguf")
        or name in (".", "..")
    )


def _source_of(value: str) -> str:
    """A user alias's value as a source string."""
    value = value.strip()
    if value.startswith(("hf:", "pypi:")):
        return value
    if _HUB_ID.match(value) and not Path(value).expanduser().exists():
        return "hf:" + value
    return str(Path(value).expanduser().resolve())


def resolve(name: object, settings: ModelSettings, *, allow_local: bool = True) -> Resolved:
    """Map a name (alias, hub id, ``hf:``/``pypi:`` spec, path) to its store name and sources.

    Raises ModelNotFound for anything that is none of these. With ``allow_local=False``
    (names that come over the network) paths and ``pypi:`` specs are not accepted; aliases
    the operator configured may still point at them.
    """
    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise ModelNotFound(f"invalid model name: {name!r}", param="model")
    if name in settings.aliases:
        return Resolved(name, (_source_of(settings.aliases[name]),), None, "user-alias")
    alias = BUILTIN_ALIASES.get(name)
    if alias is not None:
        return Resolved(name, alias.sources, alias.kind, "alias")
    if name.startswith("hf:"):
        repo = name[3:]
        if not _HUB_ID.match(repo):
            raise ModelNotFound(
                f"not a Hugging Face repo id: {repo!r} (expected org/name)", param="model"
            )
        return Resolved(repo, (name,), None, "hub")
    if name.startswith("pypi:"):
        if not allow_local:
            raise ModelNotFound(f"model '{name}' not found", param="model")
        spec, _, member = name[5:].partition("#")
        package = re.split(r"[=<>!~;\[ ]", spec, maxsplit=1)[0].strip()
        if not package or not member:
            raise ModelNotFound(
                f"not a PyPI model source: {name!r} (expected pypi:PACKAGE==VERSION#path/in/wheel)",
                param="model",
            )
        return Resolved(re.sub(r"[-_.]+", "-", package).lower(), (name,), None, "pypi")
    if allow_local:
        p = Path(name).expanduser()
        if p.exists() or _looks_like_path(name):
            if p.is_file() and p.suffix == ".gguf":
                return Resolved(p.stem, (str(p.resolve()),), "chat", "local")
            if p.is_dir():
                return Resolved(p.resolve().name, (str(p.resolve()),), None, "local")
            raise ModelNotFound(f"{name}: no such model directory or .gguf file", param="model")
    if _HUB_ID.match(name):
        return Resolved(name, ("hf:" + name,), None, "hub")
    raise ModelNotFound(
        f"model '{name}' not found: not in the store, not an alias, not a Hugging Face "
        "repo id (org/name)" + (", a pypi: spec or a local path" if allow_local else ""),
        param="model",
    )


def _store_name(target: str, explicit: bool) -> str:
    try:
        return validate_name(target)
    except InvalidRequest:
        hint = "" if explicit else "; choose one with --as NAME"
        raise InvalidRequest(f"invalid model name: {target!r}{hint}", param="model") from None


def pull(
    store: ModelStore,
    name: str,
    settings: ModelSettings,
    *,
    kind: str | None = None,
    as_name: str | None = None,
    force: bool = False,
    base: str | None = None,
    progress: ProgressFn | None = None,
) -> dict:
    """Fetch ``name`` into the store and return its manifest.

    A model already in the store under the target name is kept (its manifest returned) when
    it came from one of the name's sources, unless ``force``; a different model there is an
    error without ``force``. Sources are tried in order; ModelLoadError lists each failure.
    A LoRA adapter (found by its files, or ``kind="adapter"``) is stored in mlx-lm's format
    and registered as a model name on its base (``base``, else what its config names).
    """
    # the caller's view (CLI bar, HTTP stream) and the server log see the same events
    emit = tee(emitter(progress), ProgressLog(log, f"pull {name}"))
    if kind is not None and kind not in (*KINDS, "adapter"):
        raise InvalidRequest(
            f"unknown model type {kind!r}; choose one of {', '.join(KINDS)}, adapter",
            param="type",
        )
    if as_name is not None:
        _store_name(as_name, True)
    r = resolve(name, settings)
    target = _store_name(as_name or r.name, as_name is not None)
    registry = AdapterRegistry(store.root)
    loaded = registry.get(target)
    if loaded is not None and loaded.path != str(store.path(target)) and not force:
        raise InvalidRequest(
            f"'{target}' already names a LoRA adapter (loaded from {loaded.path}); pass "
            "--force to replace it or --as to choose another name",
            param="model",
        )
    find_base = _base_finder(store, settings, target, base)
    store.clean_temp()
    emit({"status": "pulling manifest"})
    with store.lock(
        target, on_wait=lambda: emit({"status": f"waiting for another write of {target}"})
    ):
        existing = store.manifest(target) if store.exists(target) else None
        if existing is not None and existing.get("kind") != "adapter" and store.get(target) is None:
            existing = None  # a model directory without its config.json: written again
        if existing is not None and not force:
            if existing.get("source") in r.sources:
                _register(registry, store, existing)
                emit({"status": "success"})
                return existing
            raise InvalidRequest(
                f"'{target}' already exists (from {existing.get('source')}); pass --force to "
                "replace it or --as to choose another name",
                param="model",
            )
        failures: list[tuple[str, type[MlxdError]]] = []
        for source in r.sources:
            try:
                manifest = _pull_source(
                    store,
                    target,
                    source,
                    settings,
                    kind=kind or r.kind,
                    name=name,
                    emit=emit,
                    find_base=find_base,
                )
            except InvalidRequest:
                raise
            except Exception as exc:  # noqa: BLE001 - each failure is reported, next source
                log.info("source %s for %s failed: %s", source, name, exc)
                failures.append((f"{source}: {_reason(exc)}", _meaning(exc, source)))
                continue
            _register(registry, store, manifest)
            emit({"status": "success"})
            return manifest
    raise _pull_error(name, failures)


def _register(registry: AdapterRegistry, store: ModelStore, manifest: dict) -> None:
    """An adapter in the store is a model name on its base for every front end at once."""
    if manifest.get("kind") == "adapter" and manifest.get("base"):
        name = str(manifest["name"])
        path = str(store.path(name))
        have = registry.get(name)
        if have is None or have.path != path or have.base != manifest["base"]:
            registry.add(AdapterEntry(name, str(manifest["base"]), path, int(time.time())))


def _base_finder(
    store: ModelStore, settings: ModelSettings, name: str, base: str | None
) -> Callable[[dict[str, Any], str], str]:
    """What names an adapter's base model: ``base`` when it is a model this server knows
    (in the store, an alias, a configured directory), else the model its config names when
    that is one (or is the source a store entry was pulled from); else a 400 asking for it."""

    def known(model: str) -> bool:
        if model in settings.aliases or model in BUILTIN_ALIASES:
            return True
        for p in (settings.default, *settings.preload):  # as ModelCatalog names directories
            if ("/" in p or p.startswith(".")) and Path(p).expanduser().is_dir():
                if Path(p).expanduser().resolve().name == model:
                    return True
        try:
            return store.get(model) is not None
        except InvalidRequest:
            return False

    def pulled_from(hint: str) -> str | None:
        sources = {hint, "hf:" + hint}
        if Path(hint).expanduser().is_dir():
            sources.add(str(Path(hint).expanduser().resolve()))
        for m in store.list():
            if m.get("kind") != "adapter" and m.get("source") in sources:
                return str(m["name"])
        return None

    def find(config: dict[str, Any], fmt: str) -> str:
        if base is not None:
            if not known(base):
                raise InvalidRequest(
                    f"--base '{base}' is not a model in the store nor an alias (see `mlxd list`)",
                    param="base",
                )
            return base
        hints = base_hints(config, fmt)
        for hint in hints:
            found = hint if known(hint) else pulled_from(hint)
            if found is not None:
                return found
        said = f" (its config names '{hints[0]}', which is not in the store)" if hints else ""
        raise InvalidRequest(
            f"cannot tell which model the adapter '{name}' adapts{said}; pass --base NAME "
            "(a model in the store or an alias)",
            param="base",
        )

    return find


def _meaning(exc: Exception, source: str) -> type[MlxdError]:
    """What one source's failure tells a caller (see SourceUnavailable)."""
    if isinstance(exc, SourceUnavailable):
        return exc.error
    if isinstance(exc, IntegrityError) and source.startswith("hf:"):
        return UpstreamUnavailable  # the hub sent bytes other than those it listed
    return ModelLoadError


def _pull_error(name: str, failures: list[tuple[str, type[MlxdError]]]) -> MlxdError:
    """One error for a pull whose every source failed, with the status that tells the truth:
    the caller's (404, 400) when every source says so, else the first upstream failure
    (502, 503, 504: the model may well exist behind it), else this server's (500)."""
    message = f"could not pull '{name}': " + "; ".join(text for text, _ in failures)
    kinds = [kind for _, kind in failures]
    if kinds and all(k.status < 500 for k in kinds):
        return kinds[0](message, param="model")
    upstream = [k for k in kinds if issubclass(k, (UpstreamUnavailable, Unavailable))]
    return (upstream[0] if upstream else ModelLoadError)(message)


def _hint(name: str, source: str) -> str:
    if source.startswith("hf:"):
        return source[3:]
    if source.startswith("pypi:"):
        return source.partition("#")[2] or name
    return f"{name} {Path(source).name}"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:400]


def _pull_source(
    store: ModelStore,
    target: str,
    source: str,
    settings: ModelSettings,
    *,
    kind: str | None,
    name: str,
    emit: ProgressFn,
    find_base: Callable[[dict[str, Any], str], str],
) -> dict:
    cache_dir = store.root / HF_CACHE_DIR
    is_hub = source.startswith("hf:")
    local = None if is_hub or source.startswith("pypi:") else Path(source)

    def build(out: Path) -> dict:
        if local is not None and (kind == "adapter" or adapter_format(local)):
            emit({"status": f"importing adapter {local.name}"})
            return import_adapter(local, out, target, find_base)
        info = fetch_into(
            source,
            out,
            dtype=settings.dtype,
            hub_timeout_s=settings.hub_timeout_s,
            pip_index_url=settings.pip_index_url,
            cache_dir=cache_dir,
            progress=emit,
        )
        if kind == "adapter" or (adapter_format(out) and not (out / "config.json").is_file()):
            fetched = out.with_name(out.name + "-src")  # a temp name too: swept if we die
            out.rename(fetched)
            out.mkdir()
            try:
                return import_adapter(fetched, out, target, find_base)
            finally:
                shutil.rmtree(fetched, ignore_errors=True)
        k = kind or info.get("kind") or infer_kind(out, hint=_hint(name, source))
        if k is None:
            raise KindUnknown(
                f"cannot tell what kind of model '{name}' is from its config.json; pass "
                f"--type ({' | '.join(KINDS)})",
                param="type",
            )
        info["kind"] = k
        return info

    try:
        store.install(target, build, kind=kind, source=source, progress=emit)
    except IntegrityError:
        if is_hub:  # never reuse a blob that failed its check
            shutil.rmtree(hub_cache_folder(cache_dir, source[3:]), ignore_errors=True)
        raise
    if is_hub:  # the store holds (hard links to) the files now; the cache has done its job
        shutil.rmtree(hub_cache_folder(cache_dir, source[3:]), ignore_errors=True)
    manifest = store.manifest(target)
    if manifest is None:  # pragma: no cover - install just wrote it
        raise ModelLoadError(f"'{target}' vanished right after it was written")
    return manifest


def _in_hf_cache(r: Resolved) -> Path | None:
    """The snapshot of the first hub source of ``r`` found in the local Hugging Face cache."""
    for source in r.sources:
        if source.startswith("hf:"):
            cached = find_cached_model(source[3:])
            if cached is not None:
                return cached.path
    return None


def ensure_model(store: ModelStore, name: str, settings: ModelSettings) -> Path:
    """The store path of ``name``, pulling it first when the settings allow.

    A hub id (or an alias's hub source) whose snapshot is in the local Hugging Face cache
    (``store.hf_cache``) is served from there: no download, no copy. Otherwise built-in
    defaults (smollm2-135m-instruct, all-minilm-l6-v2) follow ``auto_download_defaults``,
    anything else (other aliases, hub ids) ``auto_download``.
    Names from requests never reach local paths or ``pypi:`` specs. Invalid names raise
    InvalidRequest, unknown ones ModelNotFound, failing sources ModelLoadError.
    """
    if name.startswith("hf:"):
        r = resolve(name, settings, allow_local=False)
    else:
        found = store.get(name)  # validates the name: nothing outside the store is read
        if found is not None:
            return found
        r = resolve(name, settings, allow_local=False)
    found = store.get(r.name)
    if found is not None:
        return found
    cached = _in_hf_cache(r)
    if cached is not None:  # already on this machine: serve it in place, whatever the policy
        log.info("serving %s from the local Hugging Face cache: %s", name, cached)
        return cached
    allowed = (
        settings.auto_download_defaults if name in EMBEDDED_DEFAULTS else settings.auto_download
    )
    if not allowed:
        raise ModelNotFound(
            f"model '{name}' is not installed; run `mlxd pull {name}`", param="model"
        )
    manifest = pull(store, name, settings)
    return store.path(manifest["name"])


def remove(store: ModelStore, name: str) -> None:
    """Delete ``name`` from the store (ModelNotFound if absent, InvalidRequest if invalid);
    a LoRA adapter leaves the registry first, so no front end sends a request to files on
    their way out (an engine core keeps the arrays it loaded for requests in flight)."""
    validate_name(name)
    if AdapterRegistry(store.root).remove(name) and not store.exists(name):
        return
    store.remove(name)


def quantize(
    store: ModelStore,
    name: str,
    *,
    bits: int = 4,
    group_size: int = 64,
    as_name: str | None = None,
    progress: ProgressFn | None = None,
) -> dict:
    """Quantize a chat model with mlx-lm into a new store entry (``{name}-{bits}bit``)."""
    emit = tee(emitter(progress), ProgressLog(log, f"quantize {name}"))
    if bits not in QUANT_BITS:
        raise InvalidRequest(f"bits must be one of {QUANT_BITS}, got {bits}", param="bits")
    if group_size not in QUANT_GROUP_SIZES:
        raise InvalidRequest(
            f"group size must be one of {QUANT_GROUP_SIZES}, got {group_size}", param="group_size"
        )
    if as_name is not None:
        _store_name(as_name, True)
    validate_name(name)
    src = store.get(name)
    if src is None:
        raise ModelNotFound(f"model '{name}' not found", param="model")
    manifest = store.manifest(name) or {}
    if (manifest.get("kind") or "chat") != "chat":
        raise InvalidRequest(
            f"'{name}' is a {manifest['kind']} model; only chat models "
            "(mlx-lm architectures) can be quantized",
            param="model",
        )
    from mlxd.store.inspect import quantization, read_config

    q = quantization(read_config(src))
    if q is not None:
        raise InvalidRequest(
            f"'{name}' is already quantized ({q['bits']}-bit); quantize a full-precision model",
            param="model",
        )
    target = _store_name(as_name or f"{name}-{bits}bit", as_name is not None)
    store.clean_temp()
    with store.lock(target):
        if store.exists(target):
            raise InvalidRequest(
                f"'{target}' already exists; remove it first or choose another name with --as",
                param="model",
            )

        def build(out: Path) -> dict:
            from mlxd.store.convert import quantize_dir

            try:
                quantize_dir(src, out, bits=bits, group_size=group_size, progress=emit)
            except Exception as exc:  # noqa: BLE001 - mlx-lm's errors, as one clear error
                raise ModelLoadError(f"could not quantize '{name}': {_reason(exc)}") from exc
            return {"format": "mlx", "parent": name, "parent_digest": manifest.get("digest")}

        t0 = time.perf_counter()
        store.install(
            target,
            build,
            kind="chat",
            source=f"quantize:{name}?bits={bits}&group_size={group_size}",
            progress=emit,
        )
        log.info("quantized %s -> %s in %.1fs", name, target, time.perf_counter() - t0)
    emit({"status": "success"})
    out = store.manifest(target)
    assert out is not None
    return out
