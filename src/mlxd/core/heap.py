"""Give freed C-heap memory back to the operating system after one-off bursts.

Loading a tokenizer parses its ``tokenizer.json`` more than once (mlx-lm reads it as
Python objects to choose a detokenizer, the Rust tokenizer reads it again) and builds and
drops large temporary maps. glibc keeps the freed pages in its arenas, so a front end's RSS
stayed ~30 MB above what it uses (SmolLM2's 49k-token vocabulary, docs/benchmarks.md).
``malloc_trim`` returns them; it is a no-op where the C library has none (macOS's
allocator and musl return memory on their own).
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
