"""Give freed C-heap memory back to the operating system after one-off bursts.

Loading a tokenizer parses its ``tokenizer.json`` more than once (mlx-lm reads it as
Python objects to choose a detokenizer, the Rust tokenizer reads it again) and builds and
drops large temporary maps. glibc keeps the freed pages in its arenas, so a front end's RSS
stayed ~30 MB above what it uses (SmolLM2's 49k-token vocabulary, measured RSS).
``malloc_trim`` returns them; it is a no-op where the C library has none (macOS's
allocator and musl return memory on their own).

``malloc_trim`` cannot return the free top of a worker thread's arena, though (glibc trims
only the main arena's top; a thread heap's top shrinks when a free finds more than
``M_TRIM_THRESHOLD`` there). glibc raises that threshold, and the mmap threshold with it,
each time a large block is freed, up to 32/64 MB: after the tokenizer load's large
temporaries, the loader thread's arena kept ~16 MB free but resident in every front end
(152k-token vocabulary, measured RSS). :func:`cap_thresholds` pins both thresholds
low instead, for the front end's process only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = getattr(_libc, "malloc_trim", None)
except OSError:  # no C library by that name: nothing to call
    pass
if _trim is not None:
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
_mallopt = getattr(_libc, "mallopt", None) if _trim is not None else None
if _mallopt is not None:
    _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _mallopt.restype = ctypes.c_int
M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3


def release_free_memory() -> bool:
    """Return the C heap's free pages (every arena) to the OS; True when something was
    released. Cheap enough after a model load, not meant for a hot path."""
    if _trim is None:
        return False
    try:
        return bool(_trim(0))
    except Exception:  # noqa: BLE001 - purely an optimisation
        log.debug("malloc_trim failed", exc_info=True)
        return False


def cap_thresholds(mmap_bytes: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold at ``mmap_bytes`` and its trim threshold at twice that
    (the ratio glibc's own adjustment keeps), instead of letting them grow to 32/64 MB.

    Then blocks of ``mmap_bytes`` or more are mapped and unmapped on their own, and a
    thread arena's free top above twice that is given back when freed into, so one-off
    bursts in worker threads (a tokenizer load) do not stay resident. The price is an
    mmap/munmap per such block; a front end allocates few (request bodies and token lists
    of long prompts), the engine core's MLX buffers many, so only front ends call this.
    True when both were set; a no-op without glibc's ``mallopt``.
    """
    if _mallopt is None:
        return False
    try:
        return bool(_mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(
            _mallopt(M_TRIM_THRESHOLD, 2 * mmap_bytes)
        )
    except Exception:  # noqa: BLE001 - purely an optimisation
        log.debug("mallopt failed", exc_info=True)
        return False
