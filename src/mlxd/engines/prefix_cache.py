"""Reuse of KV caches across requests that share a token prefix (one per loaded model).

When a sequence finishes, the batch hands back its KV cache (mlx-lm extracts it from the
batched cache as a plain per-sequence ``KVCache``) together with every token it holds:
prompt plus generated text. The next request whose prompt starts the same way (the next
turn of a chat resends the history; agents resend a long system prompt and tool list)
takes the longest cached prefix and only prefills the rest: mlx-lm's
``BatchGenerator.insert(caches=..., all_tokens=...)`` merges it into the batch.

Matching is by longest common token prefix over all entries. An entry longer than the
match is cut back: a request gets slices of the cached arrays (no copy; merging into the
batch copies them, and nothing ever writes into a cached array).
Models whose caches cannot be trimmed (recurrent layers) only reuse entries that are a
whole prefix of the prompt. At least one prompt token is always left to run, since its
logits start the generation.

Bounded by bytes (``engine.prefix_cache_bytes``), least recently used first out; an
entry that is a prefix of a newer one is dropped (the newer one serves it too).
Only the device worker thread touches this object.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache


@dataclass
class _Entry:
    tokens: np.ndarray
    cache: list[Any]
    nbytes: int
    trimmable: bool


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _view(cache: list[Any], length: int) -> list[Any]:
    """The first ``length`` tokens of ``cache`` as new cache objects over the same arrays."""
    out = []
    for c in cache:
        if type(c) is KVCache:
            # New array objects over the same buffers: an in-place update of the view
            # (``keys[...] = x`` rebinds that object) can never reach the cached entry.
            v = KVCache()
            v.keys, v.values = c.keys[..., :length, :], c.values[..., :length, :]
            v.offset = length
            out.append(v)
        else:  # other cache kinds: a private copy, trimmed if it has to be
            d = copy.deepcopy(c)
            extra = d.size() - length if hasattr(d, "size") else 0
            if extra > 0:
                d.trim(extra)
            out.append(d)
    return out


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.nbytes,
                "max_bytes": self.max_bytes, "hits": self.hits, "misses": self.misses,
                "tokens_saved": self.tokens_saved}

    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """(cache holding the first n prompt tokens, n); (None, 0) without a useful match."""
        if not self._entries or len(tokens) < 2:
            if self.enabled:
                self.misses += 1
            return None, 0
        want = np.asarray(tokens, dtype=np.int64)
        limit = len(tokens) - 1  # the last prompt token always runs
        best_key, best_n = None, 0
        for key, e in self._entries.items():
            n = min(_common_prefix(e.tokens, want), limit)
            if not e.trimmable and n < len(e.tokens):
                continue  # only a whole entry can serve, and only if it fits
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None or best_n == 0:
            self.misses += 1
            return None, 0
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_saved += best_n
        return _view(entry.cache, best_n), best_n

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        if not self.enabled or not cache or len(tokens) < 2:
            return
        sizes = {c.size() for c in cache if hasattr(c, "size")}
        if sizes and sizes != {len(tokens)}:
            return  # a sliding-window cache that no longer holds the whole sequence
        mx.eval([c.state for c in cache])
        nbytes = sum(c.nbytes for c in cache)
        if nbytes > self.max_bytes:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        trimmable = can_trim_prompt_cache(cache)
        # Drop entries that this one makes redundant: the same tokens, or a prefix of them
        # (when this one can be cut back to serve it).
        for key, e in list(self._entries.items()):
            n = _common_prefix(e.tokens, arr)
            if n == len(e.tokens) and (trimmable or n == len(arr)):
                self._drop(key)
        key = self._next_key
        self._next_key += 1
        self._entries[key] = _Entry(arr, cache, nbytes, trimmable)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
