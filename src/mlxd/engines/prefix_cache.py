"""Reuse of KV caches across requests that share a token prefix (one per loaded model).

When a sequence finishes, the batch hands back its KV cache (mlx-lm extracts it from the
batched cache as a plain per-sequence ``KVCache``) together with every token it holds:
prompt plus generated text. The next request whose prompt starts the same way (the next
turn of a chat resends the history; agents resend a long system prompt and tool list)
takes the longest cached prefix and only prefills the rest: mlx-lm's
``BatchGenerator.insert(caches=..., all_tokens=...)`` merges it into the batch.

Matching goes through a token-block hash index (as vLLM's and mlx-vlm's block hashing
do): each entry's prompt is cut into blocks of :data:`BLOCK` tokens, each block hashed
together with the blocks before it, so a lookup hashes the new prompt's blocks and walks
the index to the deepest block it shares with an entry, in time proportional to the
prompt, not to the number of entries; the exact common prefix is then measured against
that one entry. A hit shorter than ``min_hit_tokens`` is ignored: merging a cached prefix
into the batch costs more than prefilling a few dozen tokens (every chat request shares
the ~30 tokens of its template's preamble). Nothing here synchronises the device: an
insert schedules the extracted cache's copy (``mx.async_eval``) and returns.

An entry longer than the match is cut back: a request gets slices of the cached arrays
(no copy; merging into the batch copies them, and nothing ever writes into a cached array).
At least one prompt token is always left to run, since its logits start the generation.

Models with recurrent or sliding-window layers (``ArraysCache``, ``RotatingKVCache``)
cannot cut those layers back: their state at token n is not in the state at token m > n.
Their prefill leaves checkpoints instead (engines/serving_batch.py: a copy of each such
layer's state at chunk boundaries ``engine.hybrid_checkpoint_tokens`` apart and at the
prompt's end), kept with the entry and counted in its bytes. A prompt that shares a prefix
with such an entry resumes from its deepest checkpoint at or before the divergence: the
plain KV layers as slices of the entry's, the others from the checkpoint. An agent's next
turn re-renders the previous reply (or drops its reasoning), so the cached sequence is not
a prefix of it, but the previous prompt is, and its end is a checkpoint.

Bounded by bytes (``engine.prefix_cache_bytes``), least recently used first out; an
entry that is a prefix of a newer one is dropped (the newer one serves it too).

Every entry belongs to one cache salt (core/blocks.py's ``cache_salt``: a request's
``cache_salt``, its API key's owner under ``security.prefix_cache_isolation: per_key``, or
none): the salt seeds the block hash chain and is compared with the tokens, so a request
never reuses, evicts as redundant, or learns of, another salt's prefix.

Once the tier is full, a sequence gets in only if it shows reuse: it started from a cached
prefix, or its first ``min_hit_tokens`` (at least one block) are those of an entry or of a
sequence the tier recently turned away or evicted (a "ghost", one hash each, as admission
filters such as TinyLFU's doorkeeper do). A chat's first turn is turned away, its second
turn gets in, its third hits. Two reasons: a flood of one-off prompts (a batch job, a
benchmark of fresh prompts) no longer evicts the conversations and system prompts that do
get reused, and a full tier stops copying the KV of every finished request only to free
another's (on a CPU, servers whose full tier churned ran 6-12% below servers without a
prefix cache at 16 clients, in interleaved pairs).
Only the device worker thread touches this object.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
)

from mlxd.core.blocks import chained_block_hashes
from mlxd.engines.kv_quant import kv_size
from mlxd.observability import metrics

BLOCK = 16
_CANDIDATES = 4  # entries compared at the deepest shared block (the most recent ones)
GHOSTS = 16384  # turned-away or evicted sequences remembered for admission (a hash each)


@dataclass
class _Entry:
    tokens: np.ndarray
    cache: list[Any]
    nbytes: int
    trimmable: bool
    hashes: list[int]
    salt: str | None = None
    # position -> per-layer state there (None: a plain KV layer, sliced from ``cache``)
    checkpoints: dict[int, list[Any]] = field(default_factory=dict)
    whole: bool = True  # ``cache`` itself serves the whole sequence

    def served(self, n: int) -> int:
        """The longest prefix of at most ``n`` tokens this entry can resume from."""
        if self.trimmable or (self.whole and n >= len(self.tokens)):
            return min(n, len(self.tokens))
        return max((p for p in self.checkpoints if p <= n), default=0)


def _owned(cache: Any) -> Any:
    """``cache`` over copies of its arrays: a checkpoint must not keep a whole batch's buffer
    (a row's slice is a view of it) nor see a later write into it."""
    cache.state = tree_map(
        lambda v: mx.contiguous(v) if isinstance(v, mx.array) else v, cache.state
    )
    return cache


def snapshot_row(batch_cache: list[Any], row: int) -> list[Any]:
    """Row ``row``'s state in a prompt batch's caches as a checkpoint: None for the plain
    KV layers (the finished sequence's own KV serves any point of them), a copy of the
    state for the others."""
    out = [None if type(c) is BatchKVCache else _owned(c.extract(row)) for c in batch_cache]
    mx.async_eval(arrays(out))
    return out


def arrays(tree: Any) -> list[mx.array]:
    """Every array in ``tree`` (cache objects' states, lists, None)."""
    found: list[mx.array] = []
    for item in tree if isinstance(tree, list) else [tree]:
        if item is None:
            continue
        state = item.state if hasattr(item, "state") else item
        found += [kv[1] for kv in tree_flatten(state) if isinstance(kv[1], mx.array)]
    return found


_PLAIN = (KVCache, QuantizedKVCache)  # KV of every token, which a view can cut anywhere


def servable_checkpoints(
    cache: list[Any], length: int, checkpoints: dict[int, list[Any]] | None
) -> tuple[bool | None, dict[int, list[Any]]]:
    """(whether a finished sequence's ``cache`` serves its ``length`` tokens whole, the
    ``checkpoints`` it can resume from); None first when its plain KV misses tokens (the
    checkpoints slice it). A sliding-window cache that no longer holds the whole sequence
    serves only from checkpoints; a recurrent state always stands for the whole sequence."""
    if any(kv_size(c) != length for c in cache if type(c) in _PLAIN):
        return None, {}
    whole = all(kv_size(c) == length for c in cache if not isinstance(c, ArraysCache))
    if can_trim_prompt_cache(cache):
        return whole, {}
    kept = {
        p: s
        for p, s in (checkpoints or {}).items()
        if 0 < p < length
        and len(s) == len(cache)
        and all(x is not None or type(c) in _PLAIN for x, c in zip(s, cache, strict=True))
    }
    return whole, kept


def checkpoint_nbytes(states: list[Any]) -> int:
    return sum(v.nbytes for v in arrays(states))


def block_hashes(tokens: Any, limit: int | None = None, salt: str | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (of its first ``limit`` tokens),
    seeded with the cache salt (None: the unsalted chain)."""
    seq = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
    return chained_block_hashes(seq, BLOCK, seed=0 if salt is None else ("salt", salt), limit=limit)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _restore(entry: _Entry, n: int) -> list[Any]:
    """The entry's state after ``n`` tokens: a checkpoint's layers, the KV ones sliced."""
    if entry.trimmable or (entry.whole and n == len(entry.tokens)):
        return _view(entry.cache, n)
    states = entry.checkpoints[n]
    kv = iter(_view([c for c, s in zip(entry.cache, states, strict=True) if s is None], n))
    return [next(kv) if s is None else copy.deepcopy(s) for s in states]


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
        elif isinstance(c, QuantizedKVCache):  # a quantized KV cache's triples, the same way
            held: Any = c
            q: Any = QuantizedKVCache(group_size=held.group_size, bits=held.bits)
            q.keys = tuple(x[..., :length, :] for x in held.keys)
            q.values = tuple(x[..., :length, :] for x in held.values)
            q.offset = length
            out.append(q)
        else:  # other cache kinds: a private copy, trimmed if it has to be
            d = copy.deepcopy(c)
            extra = d.size() - length if hasattr(d, "size") else 0
            if extra > 0:
                d.trim(extra)
            out.append(d)
    return out


def unindex(index: dict[Any, list[Any]], hashes: Iterable[Any], key: Any) -> None:
    """Take ``key`` out of a block-hash index under each of its ``hashes`` (a hash left
    with no entry goes too). Shared by the memory tier and the disk tier."""
    for h in hashes:
        keys = index.get(h)
        if keys is not None:
            if key in keys:
                keys.remove(key)
            if not keys:
                del index[h]


class PrefixCache:
    def __init__(self, max_bytes: int, min_hit_tokens: int = 0, model: str | None = None) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.model = model  # the metrics' label; None: no metrics
        self.min_hit_tokens = max(0, int(min_hit_tokens))
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[int, list[int]] = {}  # block hash -> entry keys holding it
        # last full block's hash -> entry keys ending there: the entries that may be a
        # prefix of a newcomer, found without walking the entries that only share its first
        # blocks (every entry shares a chat template's preamble)
        self._ends: dict[int, list[int]] = {}
        self._short: set[int] = set()  # entries shorter than a block (the index misses them)
        self._next_key = 0
        # admission hashes (see _admission_hash) of sequences turned away or evicted, oldest
        # first: a newcomer sharing one has shown reuse
        self._ghosts: OrderedDict[int, None] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.skipped = 0  # finished sequences a full tier turned away (no reuse shown)
        self.checkpoint_hits = 0  # lookups resumed from a checkpoint
        # lookups that shared a useful prefix with an entry but found no checkpoint at or
        # before their divergence (more would have served them)
        self.checkpoint_misses = 0
        self.checkpoint_count = 0
        self.checkpoint_bytes = 0
        self._bytes_shown = False  # the bytes gauge has this model's label
        # checkpoints by id: [entries holding it, its bytes, it]; an entry resumed from
        # another's checkpoint inherits the earlier ones, whose bytes count once
        self._ck_refs: dict[int, list[Any]] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_saved": self.tokens_saved,
            "skipped": self.skipped,
            "hybrid_checkpoints": {
                "count": self.checkpoint_count,
                "bytes": self.checkpoint_bytes,
                "hits": self.checkpoint_hits,
                "misses": self.checkpoint_misses,
            },
        }

    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[list[Any] | None, int]:
        """(cache holding the first n prompt tokens, n); (None, 0) without a useful match
        among the entries of ``salt``."""
        best_key, best_n, unserved = self._best(tokens, salt)
        if best_key is None:
            if self.enabled:
                self.misses += 1
            if unserved >= max(self.min_hit_tokens, BLOCK):
                self.checkpoint_misses += 1
                if self.model is not None:
                    metrics.prefix_checkpoint_misses.labels(self.model).inc()
            return None, 0
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_saved += best_n
        if not entry.trimmable and not (entry.whole and best_n == len(entry.tokens)):
            self.checkpoint_hits += 1
            if self.model is not None:
                metrics.prefix_checkpoint_hits.labels(self.model).inc()
        return _restore(entry, best_n), best_n

    def peek(self, tokens: list[int], salt: str | None = None) -> int:
        """How many prompt tokens :meth:`lookup` would serve now (no statistics, no LRU
        touch): the disk tier reads a prefix only when it beats this."""
        return self._best(tokens, salt)[1]

    def _best(self, tokens: list[int], salt: str | None) -> tuple[int | None, int, int]:
        """(the entry of ``salt`` serving the longest useful prefix of ``tokens``, its
        length, the longest prefix an entry shared but could not resume from)."""
        if not self._entries or len(tokens) < 2:
            return None, 0, 0
        limit = len(tokens) - 1  # the last prompt token always runs
        level, keys = self._walk(tokens, limit, salt)
        # A match ends within the block after the deepest shared one: if even that cannot
        # reach min_hit_tokens, no entry is worth comparing (the common case: prompts that
        # share only a chat template's preamble).
        candidates = keys[-_CANDIDATES:] if (level + 1) * BLOCK - 1 >= self.min_hit_tokens else []
        if self.min_hit_tokens < BLOCK:
            candidates = [*candidates, *self._short]
        want = np.asarray(tokens, dtype=np.int64) if candidates else None
        best_key, best_n, unserved = None, 0, 0
        for key in candidates:
            e = self._entries[key]
            if e.salt != salt:
                continue  # another salt's entry: a short one, or a hash collision
            shared = min(common_prefix(e.tokens, want), limit)
            n = e.served(shared)  # recurrent layers: the deepest checkpoint up to there
            if n < shared:
                unserved = max(unserved, shared)
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None or best_n == 0 or best_n < self.min_hit_tokens:
            return None, 0, unserved
        return best_key, best_n, 0

    def _walk(self, tokens: list[int], limit: int, salt: str | None) -> tuple[int, list[int]]:
        """(the deepest block level ``tokens`` shares with an entry of ``salt``, the entries
        sharing it, oldest first)."""
        level, found = 0, []
        for lv, h in enumerate(block_hashes(tokens, limit, salt), 1):
            keys = self._index.get(h)
            if not keys:
                break
            level, found = lv, keys
        return level, found

    def _admission_hash(self, hashes: list[int]) -> int | None:
        """The chained hash of the first ``min_hit_tokens`` (rounded up to whole blocks, at
        least one): two sequences that share it share a prefix long enough to be a hit."""
        level = max(1, -(-self.min_hit_tokens // BLOCK))
        return hashes[level - 1] if len(hashes) >= level else None

    def _remember(self, h: int | None) -> None:
        if h is None:
            return
        self._ghosts[h] = None
        self._ghosts.move_to_end(h)
        if len(self._ghosts) > GHOSTS:
            self._ghosts.popitem(last=False)

    def insert(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        reused: bool = False,
        salt: str | None = None,
        checkpoints: dict[int, list[Any]] | None = None,
    ) -> bool:
        """Keep a finished sequence's KV under its cache ``salt``; True if kept. ``reused``:
        it started from a cached prefix, or a request is waiting for it (a disk-tier read),
        so a full tier takes it without the admission test. ``checkpoints``: its recurrent
        and sliding-window layers' states at points of its prompt (:func:`snapshot_row`)."""
        if not self.enabled or not cache or len(tokens) < 2:
            return False
        whole, kept = servable_checkpoints(cache, len(tokens), checkpoints)
        if whole is None:
            return False
        arr = np.asarray(tokens, dtype=np.int64)
        hashes = block_hashes(arr, salt=salt)
        trimmable = can_trim_prompt_cache(cache)
        if not whole and not kept:
            return False
        cache_bytes = sum(c.nbytes for c in cache)
        refs = self._ck_refs
        nbytes = cache_bytes + sum(
            checkpoint_nbytes(st) for st in kept.values() if id(st) not in refs
        )
        if nbytes > self.max_bytes:
            return False
        if not reused and self.nbytes + nbytes > self.max_bytes:
            h = self._admission_hash(hashes)
            if h is None or (h not in self._index and h not in self._ghosts):
                # full, and nothing says this prefix comes back: its KV is never copied
                self._remember(h)
                self.skipped += 1
                return False
        # Drop entries that this one makes redundant: the same tokens, or a prefix of them
        # (when this one can be cut back to serve it). Such an entry holds every one of its
        # full blocks in common with this one, its last among them: only entries ending at
        # one of this one's blocks (or inside the first) are compared, never the thousands
        # that share just the preamble (once a cost per insert that grew with the cache).
        ending = [k for h in hashes for k in self._ends.get(h, ())]
        for key in dict.fromkeys([*ending, *self._short]):
            e = self._entries[key]
            if e.salt != salt:
                continue
            n = common_prefix(e.tokens, arr)
            if n == len(e.tokens) and (trimmable or n == len(arr)):
                self._drop(key)
        key = self._next_key
        self._next_key += 1
        # Materialise the extracted cache without waiting for it: until then its lazy copy
        # would keep the whole batch's KV buffer referenced, and every later in-place update
        # of the batch would have to copy that buffer instead of writing into it.
        mx.async_eval(arrays(cache))
        self._entries[key] = _Entry(arr, cache, cache_bytes, trimmable, hashes, salt, kept, whole)
        self.nbytes += cache_bytes
        for st in kept.values():  # shared with the entries it inherited them from
            held = refs.get(id(st))
            if held is None:
                held = refs[id(st)] = [0, checkpoint_nbytes(st), st]
                self.checkpoint_bytes += held[1]
                self.nbytes += held[1]
            held[0] += 1
        self.checkpoint_count = len(refs)
        self._report_bytes()
        if not hashes:
            self._short.add(key)
        else:
            self._ends.setdefault(hashes[-1], []).append(key)
        for h in hashes:
            self._index.setdefault(h, []).append(key)
        while self.nbytes > self.max_bytes and self._entries:
            oldest = next(iter(self._entries))
            self._remember(self._admission_hash(self._entries[oldest].hashes))
            self._drop(oldest)
        return True

    def inherit(
        self, tokens: list[int], checkpoints: dict[int, list[Any]] | None, salt: str | None
    ) -> dict[int, list[Any]]:
        """A finished sequence's ``checkpoints`` with those of the entries sharing the most
        blocks with it, up to where each shares its tokens: a sequence resumed from a
        checkpoint prefilled only what followed, so its own start there (an agent's turn n
        carries turn 1's, and a prompt parting early from it still finds one)."""
        if checkpoints is None:
            return {}  # a model without checkpoints
        arr = np.asarray(tokens, dtype=np.int64)
        keys: list[int] = []
        for h in block_hashes(arr, salt=salt):
            found = self._index.get(h)
            if not found:
                break
            keys = found
        out: dict[int, list[Any]] = {}
        for key in keys[-_CANDIDATES:]:
            e = self._entries[key]
            if e.salt != salt or not e.checkpoints:
                continue
            shared = common_prefix(e.tokens, arr)
            out.update((p, st) for p, st in e.checkpoints.items() if p <= shared)
        return {**out, **checkpoints}

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes
        for st in e.checkpoints.values():
            held = self._ck_refs[id(st)]
            held[0] -= 1
            if held[0] == 0:  # no other entry shares it
                del self._ck_refs[id(st)]
                self.checkpoint_bytes -= held[1]
                self.nbytes -= held[1]
        self.checkpoint_count = len(self._ck_refs)
        self._report_bytes()
        self._short.discard(key)
        unindex(self._index, e.hashes, key)
        unindex(self._ends, e.hashes[-1:], key)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._ends.clear()
        self._short.clear()
        self._ghosts.clear()
        self._ck_refs.clear()
        self.nbytes = 0
        self.checkpoint_count = 0
        self.checkpoint_bytes = 0
        self._report_bytes()

    def _report_bytes(self) -> None:
        """The bytes gauge, for a model that has held checkpoints."""
        if self.model is not None and (self.checkpoint_bytes or self._bytes_shown):
            metrics.prefix_checkpoint_bytes.labels(self.model).set(self.checkpoint_bytes)
            self._bytes_shown = True
