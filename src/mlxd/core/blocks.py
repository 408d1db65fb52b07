"""Chained hashes of a token sequence's whole blocks: the key under which the prefix cache
(both tiers, in the engine core) and the front ends' prefix-affinity routing find "the same
prefix". Block i's hash covers blocks 0..i, so equal hashes mean equal prefixes (up to
hash collisions, which every user confirms against the tokens or tolerates).

A cache salt (:func:`cache_salt`) seeds the chain from the first block, as vLLM's
``cache_salt`` does: two prompts share cached KV only when their salts are equal too."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence


def chained_block_hashes(
    tokens: Sequence[int], block: int, *, seed: Hashable = 0, limit: int | None = None
) -> list[int]:
    """The hash of each whole block of ``tokens`` (of its first ``limit``; a partial last
    block has none), chained from ``seed`` (e.g. the model's name)."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    out: list[int] = []
    h = hash(seed)
    for start in range(0, n - n % block, block):
        h = hash((h, *tokens[start : start + block]))
        out.append(h)
    return out


def cache_salt(owner: str | None, salt: str | None) -> str | None:
    """The prefix-cache partition of a request: None (the shared one) when neither an owner
    (``security.prefix_cache_isolation: per_key``) nor a request's ``cache_salt`` names
    one; else a digest of both, so the caller's text never reaches the engine core's disk
    tier and an owner cannot pick a ``cache_salt`` that lands in another owner's partition."""
    if owner is None and salt is None:
        return None
    h = hashlib.sha256(b"mlxd-cache-salt")
    for part in (owner, salt):  # length-prefixed: ("ab", "c") and ("a", "bc") differ
        raw = b"" if part is None else part.encode()
        h.update(b"\0" if part is None else b"\1" + len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()[:32]
