"""Which engine core serves a request: prefix affinity first, load when it is lopsided.

Each core keeps its own prefix cache (the KV of finished requests, by token prefix), so a
conversation's next turn, whose prompt starts with the previous turn's, is cheapest on
the core that served the previous one. The front end cannot see those caches; it
remembers instead where it sent each prompt: the prompt's tokens cut in blocks of
:data:`BLOCK` and hashed in a chain (each block's hash covers everything before it, as the
cores' own prefix indexes do), every block hash mapped to the core that last received
it. A new prompt's deepest known block names the core holding the longest shared prefix.
The chain starts from the model's name and the request's cache salt (core/blocks.py), as
the cores' indexes do: a prefix only pulls toward a core whose cache would serve it.

Affinity yields to load: when the preferred core has more than ``slack`` requests in
flight beyond the least busy one, the least busy one takes the request (a shared system
prompt must not pin every conversation to one core). Without a usable prefix the least
busy core wins, ties broken in turn so idle cores share a burst.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mlxd.core.blocks import chained_block_hashes

BLOCK = 32  # tokens per hashed block
MAX_ENTRIES = 1 << 17  # block hashes remembered (least recently used out first)


def block_hashes(
    model: str, tokens: Sequence[int], block: int = BLOCK, salt: str | None = None
) -> list[int]:
    """The chained hash of each whole block of ``tokens``, per model and cache salt (a
    partial last block: none)."""
    return chained_block_hashes(tokens, block, seed=model if salt is None else (model, salt))


class PrefixRouter:
    def __init__(
        self,
        *,
        slack: int,
        min_tokens: int = BLOCK,
        block: int = BLOCK,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.slack = slack
        self.min_blocks = max(1, -(-min_tokens // block))  # shorter shared prefixes: no pull
        self.block = block
        self.max_entries = max_entries
        self._where: OrderedDict[int, int] = OrderedDict()
        self._turn = 0

    def preferred(self, hashes: list[int]) -> int | None:
        """The core that last received the longest known prefix of these blocks."""
        where = self._where
        for depth in range(len(hashes) - 1, self.min_blocks - 2, -1):
            core = where.get(hashes[depth])
            if core is not None:
                return core
        return None

    def choose(self, loads: Sequence[int | None], hashes: list[int]) -> int:
        """The core for a request: ``loads[i]`` is core i's requests in flight, None for a
        core that cannot serve now (at least one must). Remembers the choice."""
        least = self.least(loads)
        least_load = loads[least] or 0  # least() picks a core that can serve
        preferred = self.preferred(hashes)
        preferred_load = loads[preferred] if preferred is not None else None
        if (
            preferred is not None
            and preferred_load is not None
            and (preferred_load <= least_load + self.slack)
        ):
            pick = preferred
        else:
            pick = least
            self._turn = (least + 1) % len(loads)  # the next tie: the core after this one
        self.remember(hashes, pick)
        return pick

    def least(self, loads: Sequence[int | None]) -> int:
        """The least busy core that can serve; among equals, the next in turn (what
        :meth:`choose` picks for a prompt without a known prefix, so a model's first load
        and its first request land on the same core)."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no engine core can serve")
        n = len(loads)
        return min(live, key=lambda i: (loads[i], (i - self._turn) % n))

    def remember(self, hashes: list[int], core: int) -> None:
        where = self._where
        for h in hashes:
            where[h] = core
            where.move_to_end(h)
        while len(where) > self.max_entries:
            where.popitem(last=False)
