"""Chained hashes of a token sequence's whole blocks: the key under which the prefix cache
(both tiers, in the engine core) and the front ends' prefix-affinity routing find "the same
prefix". Block i's hash covers blocks 0..i, so equal hashes mean equal prefixes (up to
hash collisions, which every user confirms against the tokens or tolerates)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def chained_block_hashes(tokens: Sequence[int], block: int, *, seed: Hashable = 0,
                         limit: int | None = None) -> list[int]:
    """The hash of each whole block of ``tokens`` (of its first ``limit``; a partial last
    block has none), chained from ``seed`` (e.g. the model's name)."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    out: list[int] = []
    h = hash(seed)
    for start in range(0, n - n % block, block):
        h = hash((h, *tokens[start:start + block]))
        out.append(h)
    return out
