"""The decode batch's KV cache with room for rows: joins and leaves copy what moves.

mlx-lm's ``BatchKVCache`` holds exactly the batch's rows. A group of newcomers joining
the decode batch (``extend``) pads every running row's keys and values and concatenates
them with the newcomers', two copies of the whole batch's cache; rows leaving
(``filter``) gather every row that stays into new arrays. On a CPU a row's KV is memory
bandwidth: with SmolLM2-135M's cache at 16 rows a group of 8 joining cost 130-172 ms in
the cache alone and 25-32 ms here (medians of 7 on a 2-core CPU), and a server's decode
batch is joined and left all the time.

:class:`RowPoolKVCache` keeps its arrays with more rows than the batch has (``capacity``):
the live rows are the first ``rows``, the rest are spare. A group joins by writing its
rows into spare ones, right-aligned on the batch's end index as mlx-lm aligns them;
rows leave by moving the last live rows into the holes they leave (the batch's order of
rows follows: see ``ServingGenerationBatch.filter``). The model only ever sees the live
rows. The arrays are rebuilt, in one copy, only when a group does not fit (more rows
than the capacity, or a prompt longer than the batch's end index), which is when the
capacity grows to what the batch holds then. So a batch's cache is never larger than
its high-water mark of rows; it gives spare rows back when it grows along the sequence
anyway (a copy) with fewer than half its rows live, or when fewer than a quarter are.

The rows' left padding is also kept on the host: mlx-lm reads it back from the device to
shift padding away after a filter and to extract a finished row, and on a GPU that read
waits for the decode step just dispatched.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll


def poolable(cache: Any) -> bool:
    """Whether a layer's batch cache is plain KV (sliding windows, recurrent state and
    quantized caches keep mlx-lm's own join)."""
    return type(cache) in (BatchKVCache, RowPoolKVCache)


class RowPoolKVCache(BatchKVCache):
    """A ``BatchKVCache`` whose arrays hold ``capacity`` rows, the first ``rows`` live.

    Invariants: ``keys``/``values`` are ``[capacity, heads, length, dim]``; row ``i`` holds
    positions ``[left[i], _idx)``; ``offset[i] == _idx - left[i]`` (mlx-lm's own
    invariant, which lets offsets be rebuilt from the host's padding).
    """

    # mlx-lm's BatchKVCache starts them as None (no update yet); a pool always holds arrays
    keys: mx.array  # type: ignore[assignment]
    values: mx.array  # type: ignore[assignment]

    def __init__(self, left: list[int], idx: int, keys: mx.array, values: mx.array) -> None:
        super().__init__([0] * len(left))
        self.keys, self.values, self._idx = keys, values, idx
        self._set_left(left)

    def _set_left(self, left: list[int]) -> None:
        self.left = left
        self.left_padding = mx.array(left)
        self.offset = mx.array([self._idx - p for p in left])

    @property
    def rows(self) -> int:
        return len(self.left)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[0])

    # -- what the model calls ------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, prev = keys.shape[2], self._idx
        if prev + n > self.keys.shape[2]:
            self._grow(prev + n)
        b = self.rows
        self.offset = self.offset + n
        self._idx += n
        self.keys[:b, :, prev : self._idx, :] = keys
        self.values[:b, :, prev : self._idx, :] = values
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        b = self.rows
        return self.keys[:b, :, : self._idx, :], self.values[:b, :, : self._idx, :]

    def _grow(self, need: int) -> None:
        """More positions: one copy, as mlx-lm's grow makes, which gives back spare rows
        when fewer than half the capacity is live."""
        rows = self.capacity if self.rows * 2 > self.capacity else max(self.rows, 1)
        length = -(-need // self.step) * self.step
        self.keys = _placed(self.keys[:rows, :, : self._idx, :], length)
        self.values = _placed(self.values[:rows, :, : self._idx, :], length)

    # -- the batch's reshapes ------------------------------------------------------------

    def join(self, other: BatchKVCache) -> bool:
        """Write ``other``'s rows into spare rows, right-aligned on this batch's end
        index; ``False`` (nothing changed) when they do not fit."""
        other_left = _host_left(other)
        b, m = self.rows, len(other_left)
        if b + m > self.capacity or other._idx > self._idx:
            return False
        shift = self._idx - other._idx
        if self._idx:  # the spare rows' earlier contents are overwritten, padding with 0s
            self.keys[b : b + m, :, : self._idx, :] = _left_aligned(
                other, "keys", self.keys, m, shift
            )
            self.values[b : b + m, :, : self._idx, :] = _left_aligned(
                other, "values", self.values, m, shift
            )
        self._set_left(self.left + [p + shift for p in other_left])
        return True

    def filter(self, batch_indices: list[int]) -> None:
        """Keep the rows listed, in that order: row ``j`` of the result is row
        ``batch_indices[j]`` (see :func:`filter_pools`)."""
        filter_pools([self], batch_indices)

    def _shrink_to(self, keep: list[int]) -> None:
        index = mx.array(keep)
        self.keys, self.values = self.keys[index], self.values[index]

    def _write_rows(
        self, runs: list[tuple[int, int, int]], keys: mx.array, values: mx.array
    ) -> None:
        for dst, start, stop in runs:
            self.keys[dst : dst + stop - start] = keys[start:stop]
            self.values[dst : dst + stop - start] = values[start:stop]

    def _keep_left(self, keep: list[int]) -> None:
        left = [self.left[i] for i in keep]
        cut = min(left, default=0)
        if cut and cut * 4 >= self._idx:
            # Shift left to drop padding every row has, as mlx-lm's filter does, only when
            # it is a good part of the batch's span: the shifted view is copied whole by
            # the next write into it.
            self.keys = self.keys[..., cut:, :]
            self.values = self.values[..., cut:, :]
            self._idx -= cut
            left = [p - cut for p in left]
        self._set_left(left)

    def extend(self, other: BatchKVCache) -> None:
        if not self.join(other):
            rebuilt = join_caches(self, other)
            self.keys, self.values, self._idx = rebuilt.keys, rebuilt.values, rebuilt._idx
            self._set_left(rebuilt.left)

    def extract(self, idx: int) -> KVCache:
        cache = KVCache()
        start = self.left[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, start : self._idx])
        cache.offset = cache.keys.shape[2]
        return cache

    # -- the rest of mlx-lm's protocol, on the live rows ---------------------------------

    def prepare(
        self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None
    ) -> None:
        if left_padding is not None:
            raise ValueError("Left padding can only be added to an empty BatchKVCache")
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self) -> None:
        """Roll each live row right by its right padding, which becomes left padding (how
        speculative decoding drops a row's rejected tail)."""
        if self._right_padding is None:
            return
        pad, b = self._right_padding, self.rows
        self._right_padding = None
        shifts = mx.array(pad)[:, None]
        self.keys[:b] = dynamic_roll(self.keys[:b], shifts, axis=2)
        self.values[:b] = dynamic_roll(self.values[:b], shifts, axis=2)
        self._set_left([p + r for p, r in zip(self.left, pad, strict=True)])

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self._set_left(self.left)
        return n

    @property
    def state(self) -> tuple[Any, ...]:
        keys, values = self.keys_and_values()
        return keys, values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, _, left_padding, self._idx = v
        self.keys, self.values = keys, values
        self._set_left([int(p) for p in left_padding.tolist()])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


def filter_pools(caches: list[RowPoolKVCache], keep: list[int]) -> None:
    """Keep the rows listed in every layer's pool, row ``j`` becoming row ``keep[j]``.

    Only rows whose place changes are copied (``ServingGenerationBatch.filter`` orders
    ``keep`` so that the last rows fill the holes), unless fewer than a quarter of a pool's
    capacity stays: then its arrays shrink to the rows kept. The rows that move are read
    out of every layer and evaluated together before they are written: MLX writes into an
    array in place only when nothing else still reads it, and a move read from the array
    it writes made every move a copy of the whole array. That evaluation waits for the
    step in flight, once per filter that moves rows, where mlx-lm's filter reads the
    padding back.
    """
    keep = list(keep)
    shrink = [bool(keep) and len(keep) * 4 < c.capacity for c in caches]
    moved = [(j, i) for j, i in enumerate(keep) if i != j]
    movers = [c for c, small in zip(caches, shrink, strict=True) if not small and moved]
    if movers:
        src = mx.array([i for _, i in moved])
        rows = [(c.keys[src], c.values[src]) for c in movers]
        mx.eval(rows)
        runs = _runs([j for j, _ in moved])
        for c, (k, v) in zip(movers, rows, strict=True):
            c._write_rows(runs, k, v)
    for c, small in zip(caches, shrink, strict=True):
        if small:
            c._shrink_to(keep)
        c._keep_left(keep)


def _runs(dst: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive destinations as ``(first destination, start, stop)`` into the list of
    rows read out: one write per run."""
    runs: list[tuple[int, int, int]] = []
    for n, j in enumerate(dst):
        if runs and runs[-1][0] + n - runs[-1][1] == j:
            runs[-1] = (runs[-1][0], runs[-1][1], n + 1)
        else:
            runs.append((j, n, n + 1))
    return runs


def join_caches(a: BatchKVCache, b: BatchKVCache) -> RowPoolKVCache:
    """``a``'s live rows then ``b``'s in new arrays, right-aligned on the later end index:
    one copy of each (mlx-lm's extend pads, then concatenates: two)."""
    la, lb = _host_left(a), _host_left(b)
    idx = max(a._idx, b._idx)
    length = (idx // a.step + 1) * a.step  # room for the next decode steps
    ref = a if a.keys is not None else b
    if ref.keys is None:
        raise ValueError("joining two empty caches: nothing to place")
    heads, dk, dv = ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3]
    rows = len(la) + len(lb)
    keys = mx.zeros((rows, heads, length, dk), dtype=ref.keys.dtype)
    values = mx.zeros((rows, heads, length, dv), dtype=ref.values.dtype)
    start = 0
    for c, n in ((a, len(la)), (b, len(lb))):
        if c.keys is not None and c._idx:
            keys[start : start + n, :, idx - c._idx : idx, :] = c.keys[:n, :, : c._idx, :]
            values[start : start + n, :, idx - c._idx : idx, :] = c.values[:n, :, : c._idx, :]
        start += n
    left = [p + idx - a._idx for p in la] + [p + idx - b._idx for p in lb]
    return RowPoolKVCache(left, idx, keys, values)


def _left_aligned(
    cache: BatchKVCache, part: str, like: mx.array, rows: int, shift: int
) -> mx.array:
    """A joining group's keys or values over the batch's positions ``[0, end)``: zeros,
    then the group's ``[0, its end)``. Zeros and not whatever a spare row held before: a
    masked position weighs 0, and 0 times a stale inf would be NaN."""
    x = getattr(cache, part)
    if x is None or not cache._idx:
        return mx.zeros((rows, like.shape[1], shift, like.shape[3]), dtype=like.dtype)
    x = x[..., : cache._idx, :]
    return mx.pad(x, [(0, 0), (0, 0), (shift, 0), (0, 0)]) if shift else x


def _placed(x: mx.array, length: int) -> mx.array:
    """``x`` at the start of zeroed arrays ``length`` positions long."""
    out = mx.zeros((*x.shape[:2], length, x.shape[3]), dtype=x.dtype)
    out[:, :, : x.shape[2], :] = x
    return out


def _host_left(cache: BatchKVCache) -> list[int]:
    """A cache's left padding on the host. A prefilled group's was evaluated with its
    state (``PromptProcessingBatch.prompt``), so this does not wait for the device."""
    if isinstance(cache, RowPoolKVCache):
        return list(cache.left)
    return [int(p) for p in cache.left_padding.tolist()]
