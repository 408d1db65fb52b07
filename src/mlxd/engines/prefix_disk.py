"""The prefix cache's disk tier: KV caches of long prefixes kept across restarts.

The memory tier (engines/prefix_cache.py) forgets everything when the server stops and
drops its least recently used entries when full. Here the KV cache of a finished sequence
of at least ``min_tokens`` tokens that the engine hands over (by default one that started
from a cached prefix: engines/llm.py's ``_keep``) is also written to a file
(write-through, so a crash loses at most the writes in flight), and a later request whose
prompt starts the same way reads it back instead of prefilling: for a long prefix a read
is cheaper than a prefill.

Files are mlx-lm's prompt-cache format (``save_prompt_cache``: safetensors, the cache
classes and scalars in its metadata, so KVCache, RotatingKVCache, QuantizedKVCache and
ArraysCache all round-trip), loadable with ``mlx_lm.models.cache.load_prompt_cache``. Our
own metadata rides along: the format, the mlxd version, the model fingerprint (see
:func:`model_fingerprint`), the tokens (base64 int32) and a CRC-32 of the cache's arrays.
One folder per model fingerprint; files are written to a temporary name, fsynced and
renamed (``os.replace``), so a reader never sees half a file.

At start the index is rebuilt from the files' safetensors headers alone (no array data
read): a file of another format, version or fingerprint, a truncated file, or one whose
header does not parse is deleted. The CRC is checked when a file is read back; a mismatch
deletes it and the request prefills as if there had been no hit.

Matching uses the memory tier's chained block hashes, seeded with the entry's cache salt
(engines/prefix_cache.py): a file belongs to one salt, its metadata names it (a digest the
front end made, never a caller's text), its name hashes it with the tokens, and a request
with another salt neither reads it nor makes it redundant. Bounded by bytes on disk, least
recently used out first (a hit touches the file's mtime, so the order survives a restart).

Threads: the device thread decides (``match``, ``spill``, ``load``) under a lock and never
waits for I/O; one writer thread serialises and writes (it reads arrays the device thread
already scheduled with ``mx.async_eval``, so the device thread never waits for it; on CUDA
that host read moves the arrays into managed memory, which is why the engine hands over
only reused prefixes by default), one reader thread reads. A sequence whose prefix is
being read waits outside the batch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, load_prompt_cache, save_prompt_cache

from mlxd import __version__
from mlxd.engines.kv_quant import kv_size
from mlxd.engines.prefix_cache import BLOCK, block_hashes, common_prefix, unindex
from mlxd.observability import metrics

log = logging.getLogger(__name__)

FORMAT = "mlxd-prefix-cache/1"
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp" + SUFFIX
_STALE_TMP_S = 3600.0  # a temporary file this old is a crashed write, not one in flight
_MAX_QUEUED_BYTES = 1 << 30  # writes waiting beyond this are dropped, never queued forever
_NEAR = BLOCK  # an entry this close to being a prefix of a newer one goes (see _write)
# An entry within _NEAR tokens of being a prefix of a newer one shares all its full blocks
# but the last ceil(_NEAR / BLOCK) with it: indexing each entry under its last blocks'
# hashes finds every such entry from the newer one's hashes alone (see _write).
_TAIL = -(-_NEAR // BLOCK) + 1
_SAMPLE = 1 << 16
_WHOLE_FILE = 16 << 20


@dataclass
class DiskEntry:
    key: str
    tokens: np.ndarray
    nbytes: int
    trimmable: bool
    hashes: list[int]
    salt: str | None = None


def entry_key(tokens: np.ndarray, salt: str | None) -> str:
    """A file's name: a hash of its tokens, and of its salt when it has one."""
    h = hashlib.sha1()
    if salt is not None:
        h.update(b"salt\0" + salt.encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def model_fingerprint(path: Path, extra: dict[str, Any]) -> str:
    """What the KV cache of a token sequence depends on: the model's files and ``extra``
    (dtype, KV bound, adapter...). Small files are hashed whole; large ones (weights) by
    name, size, safetensors header and spread samples of their bytes, so a fingerprint
    costs milliseconds, not a read of every weight."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _WHOLE_FILE:
                h.update(fh.read())
                continue
            head = fh.read(8)
            h.update(head)
            n = struct.unpack("<Q", head)[0] if f.suffix == SUFFIX else 0
            if 0 < n < size:
                h.update(fh.read(n))
            for i in range(16):
                fh.seek(size * i // 16)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()[:24]


def cache_checksum(cache: list[Any]) -> str:
    """CRC-32 of every array and scalar of the caches' state, in ``tree_flatten`` order
    (the same order on the way out and back in)."""
    crc = 0
    for name, v in tree_flatten([c.state for c in cache]):
        crc = zlib.crc32(name.encode(), crc)
        if isinstance(v, mx.array):
            crc = zlib.crc32(f"{v.dtype}{v.shape}".encode(), crc)
            crc = zlib.crc32(memoryview(mx.contiguous(v) if v.size else v), crc)
        else:
            crc = zlib.crc32(repr(v).encode(), crc)
    return f"{crc:08x}"


def read_header(path: Path) -> dict[str, str]:
    """The mlxd metadata of a cache file from its safetensors header, after checking that
    the file is as long as the header says (a truncated file raises ValueError)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("no header")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 64 << 20):
            raise ValueError("header longer than the file")
        header = json.loads(f.read(n))
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"file is {size} bytes, its header says {8 + n + end}")
    meta = header.get("__metadata__") or {}
    # save_prompt_cache flattens [metadata, classes, scalars]: ours is under "0."
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def _encode_tokens(tokens: np.ndarray) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode()


def _decode_tokens(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").astype(np.int64)


class DiskPrefixCache:
    """One model's disk tier (see the module docstring)."""

    def __init__(
        self, root: Path, fingerprint: str, max_bytes: int, min_tokens: int, model: str
    ) -> None:
        self.dir = Path(root).expanduser() / fingerprint
        self.fingerprint = fingerprint
        self.max_bytes = max(0, int(max_bytes))
        self.min_tokens = max(BLOCK, int(min_tokens))
        self.model = model
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # least recent first
        self._index: dict[int, list[str]] = {}  # block hash -> keys of entries holding it
        self._tails: dict[int, list[str]] = {}  # the same for each entry's last _TAIL blocks
        self._loads: dict[str, Future] = {}
        self._queued_bytes = 0
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.dropped = 0
        self.bytes_read = self.bytes_written = 0
        self.removed_bad = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mlxd-prefix-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxd-prefix-read")
        if self.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "evictions": self.evictions,
            "removed_invalid": self.removed_bad,
            "writes_pending": self._queued_bytes > 0,
            "writes_dropped": self.dropped,
        }

    # -- start -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the files' headers; delete what cannot be used."""
        found = []
        for f in self.dir.iterdir():
            if not f.name.endswith(SUFFIX):
                continue
            if f.name.endswith(TMP_SUFFIX):
                try:
                    if time.time() - f.stat().st_mtime > _STALE_TMP_S:
                        f.unlink()
                except OSError:
                    pass
                continue
            try:
                meta = read_header(f)
                self._check(meta)
                tokens = _decode_tokens(meta["tokens"])
                salt = meta.get("salt") or None
                if (
                    f.stem != meta["key"]
                    or len(tokens) < self.min_tokens
                    or meta["key"] != entry_key(tokens, salt)
                ):
                    raise ValueError(
                        "its name, key, tokens and salt disagree, or it is "
                        "shorter than prefix_cache_disk_min_tokens"
                    )
                st = f.stat()
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._remove_bad(f, exc)
                continue
            found.append(
                (
                    st.st_mtime,
                    DiskEntry(
                        meta["key"],
                        tokens,
                        st.st_size,
                        meta.get("trimmable") == "1",
                        block_hashes(tokens, salt=salt),
                        salt,
                    ),
                )
            )
        for _, e in sorted(found, key=lambda x: x[0]):
            self._add(e)
        self._evict()
        metrics.prefix_disk_bytes.labels(self.model).set(self.nbytes)
        if found:
            log.info(
                "prefix cache on disk for %s: %d entries, %d bytes (%s)",
                self.model,
                len(self._entries),
                self.nbytes,
                self.dir,
            )

    def _check(self, meta: dict[str, str]) -> None:
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {FORMAT}")
        if meta.get("mlxd_version") != __version__:
            raise ValueError(f"written by mlxd {meta.get('mlxd_version')}, this is {__version__}")
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another model (fingerprint differs)")

    def _remove_bad(self, f: Path, why: Exception) -> None:
        log.warning("prefix cache on disk: removing %s: %s", f.name, why)
        self.removed_bad += 1
        try:
            f.unlink()
        except OSError:
            pass

    # -- the index (callers hold the lock, or are the constructor) --------------------------
    def _add(self, e: DiskEntry) -> None:
        if e.key in self._entries:
            self._forget(e.key)
        self._entries[e.key] = e
        for h in e.hashes:
            self._index.setdefault(h, []).append(e.key)
        for h in e.hashes[-_TAIL:]:
            self._tails.setdefault(h, []).append(e.key)
        self.nbytes += e.nbytes

    def _forget(self, key: str) -> DiskEntry | None:
        e = self._entries.pop(key, None)
        if e is None:
            return None
        self.nbytes -= e.nbytes
        unindex(self._index, e.hashes, key)
        unindex(self._tails, e.hashes[-_TAIL:], key)
        return e

    def _delete(self, key: str) -> None:
        if self._forget(key) is not None:
            try:
                (self.dir / (key + SUFFIX)).unlink()
            except OSError:
                pass

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self._entries:
            self._delete(next(iter(self._entries)))
            self.evictions += 1
            metrics.prefix_disk_evictions.labels(self.model).inc()

    def _best(
        self, tokens: np.ndarray, limit: int, salt: str | None
    ) -> tuple[DiskEntry | None, int]:
        level, keys = 0, []
        for lv, h in enumerate(block_hashes(tokens, limit, salt), 1):
            found = self._index.get(h)
            if not found:
                break
            level, keys = lv, found
        best, best_n = None, 0
        if level * BLOCK + BLOCK - 1 < self.min_tokens:
            return None, 0
        for key in keys[-4:]:
            e = self._entries[key]
            if e.salt != salt:
                continue  # a hash collision across salts
            n = min(common_prefix(e.tokens, tokens), limit)
            if not e.trimmable and n < len(e.tokens):
                continue
            if n > best_n:
                best, best_n = e, n
        return (best, best_n) if best_n >= self.min_tokens else (None, 0)

    # -- the device thread's calls ----------------------------------------------------------
    def match(self, tokens: list[int], salt: str | None = None) -> tuple[DiskEntry | None, int]:
        """(the entry of ``salt`` serving the longest prefix of ``tokens`` of at least
        ``min_tokens``, how many tokens it serves); the last prompt token always runs."""
        if not self.enabled or len(tokens) <= self.min_tokens:
            return None, 0
        arr = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            return self._best(arr, len(tokens) - 1, salt)

    def count_miss(self) -> None:
        self.misses += 1
        metrics.prefix_disk_misses.labels(self.model).inc()

    def load(self, entry: DiskEntry) -> Future:
        """Read ``entry`` on the reader thread; the Future gives (tokens, cache), or None when
        the file turned out to be unusable (it is deleted then). One read per entry at a
        time: sequences sharing a prefix share its read."""
        with self._lock:
            fut = self._loads.get(entry.key)
            if fut is None:
                fut = self._loads[entry.key] = self._reader.submit(self._read, entry)
            return fut

    def spill(self, tokens: list[int], cache: list[Any], salt: str | None = None) -> bool:
        """Queue a finished sequence's cache for writing under its cache ``salt``; False
        when it is not worth it (short, already on disk, too big) or the writer is too far
        behind."""
        if not self.enabled or len(tokens) < self.min_tokens or not cache:
            return False
        sizes = {kv_size(c) for c in cache if hasattr(c, "size")}
        if sizes and sizes != {len(tokens)}:
            return False  # a sliding window that no longer holds the whole sequence
        nbytes = sum(c.nbytes for c in cache)
        if nbytes > self.max_bytes:
            return False
        arr = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            have, n = self._best(arr, len(arr), salt)
            if have is not None and n == len(arr):
                self._entries.move_to_end(have.key)  # already on disk (as a prefix or whole)
                return False
            if self._queued_bytes + nbytes > _MAX_QUEUED_BYTES:
                self.dropped += 1
                return False
            self._queued_bytes += nbytes
        mx.async_eval([c.state for c in cache])  # already scheduled by the memory tier
        self._writer.submit(self._write, arr, cache, nbytes, salt)
        return True

    # -- the I/O threads -------------------------------------------------------------------
    def _write(
        self, tokens: np.ndarray, cache: list[Any], nbytes: int, salt: str | None = None
    ) -> None:
        key = entry_key(tokens, salt)
        tmp = self.dir / f"{key}-{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
        final = self.dir / (key + SUFFIX)
        try:
            trimmable = can_trim_prompt_cache(cache)
            meta = {
                "format": FORMAT,
                "mlxd_version": __version__,
                "fingerprint": self.fingerprint,
                "key": key,
                "tokens": _encode_tokens(tokens),
                "trimmable": "1" if trimmable else "0",
                "checksum": cache_checksum(cache),
                "salt": salt or "",
            }
            save_prompt_cache(str(tmp), cache, meta)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            size = final.stat().st_size
        except Exception as exc:  # noqa: BLE001 - a full disk must not fail requests
            log.warning("prefix cache on disk: could not write %s: %s", final.name, exc)
            try:
                tmp.unlink()
            except OSError:
                pass
            with self._lock:
                self._queued_bytes -= nbytes
            return
        entry = DiskEntry(key, tokens, size, trimmable, block_hashes(tokens, salt=salt), salt)
        with self._lock:
            self._queued_bytes -= nbytes
            # Entries this one makes redundant (when it can be cut back): its prefixes, and
            # near-prefixes that differ only in their last few tokens. The next turn of a
            # chat re-tokenizes the previous answer and closes it with the template's end
            # tokens, so turn n+1 rarely extends turn n token for token; keeping every
            # turn would grow the disk quadratically with the conversation. Candidates come
            # from the tail index: the whole index would hand over every entry sharing the
            # chat template's preamble, compared one by one under the lock match() waits on.
            if trimmable:
                candidates = {k for h in entry.hashes for k in self._tails.get(h, ())}
                for k in candidates:
                    e = self._entries.get(k)
                    if (
                        e is not None
                        and k != key
                        and e.salt == salt
                        and len(e.tokens) <= len(tokens)
                        and common_prefix(e.tokens, tokens) >= len(e.tokens) - _NEAR
                    ):
                        self._delete(k)
            self._add(entry)
            self.bytes_written += size
            self._evict()
            stored = self.nbytes
        metrics.prefix_disk_written.labels(self.model).inc(size)
        metrics.prefix_disk_bytes.labels(self.model).set(stored)

    def _read(self, entry: DiskEntry) -> tuple[np.ndarray, list[Any]] | None:
        f = self.dir / (entry.key + SUFFIX)
        try:
            try:
                meta = read_header(f)
                self._check(meta)
                cache = load_prompt_cache(str(f))
                mx.eval([c.state for c in cache])
                if cache_checksum(cache) != meta.get("checksum"):
                    raise ValueError("checksum mismatch")
                if (
                    not np.array_equal(_decode_tokens(meta["tokens"]), entry.tokens)
                    or (meta.get("salt") or None) != entry.salt
                ):
                    raise ValueError("tokens or salt differ from the index")
            except FileNotFoundError:
                with self._lock:
                    self._forget(entry.key)
                return None
            except Exception as exc:  # noqa: BLE001 - any unreadable file is dropped
                with self._lock:
                    self._forget(entry.key)
                    self.removed_bad += 1
                log.warning("prefix cache on disk: removing %s: %s", f.name, exc)
                try:
                    f.unlink()
                except OSError:
                    pass
                return None
            try:
                os.utime(f)  # the LRU order survives a restart
            except OSError:
                pass
            with self._lock:
                if entry.key in self._entries:
                    self._entries.move_to_end(entry.key)
                self.bytes_read += entry.nbytes
            metrics.prefix_disk_read.labels(self.model).inc(entry.nbytes)
            return entry.tokens, cache
        finally:
            with self._lock:
                self._loads.pop(entry.key, None)

    def count_hit(self) -> None:
        self.hits += 1
        metrics.prefix_disk_hits.labels(self.model).inc()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Finish the queued writes (they are what a restart finds) and stop the threads."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for fam in (metrics.prefix_disk_bytes,):
            try:
                fam.remove(self.model)
            except KeyError:
                pass


def _fsync_dir(path: Path) -> None:
    """Make the rename itself durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
