"""What one finished request's insert into the prefix cache costs the device thread, by
how many entries the cache holds (no model: the cost is bookkeeping, not arithmetic).

    PYTHONPATH=src python benchmarks/prefix_insert.py [--entries 250 1000 4000]

Every entry shares a 32-token preamble (a chat template's) and then differs, as fresh chat
prompts do; each measured insert is another such prompt. Prints milliseconds per insert
(the mean of ``--inserts``) for the memory tier (engines/prefix_cache.py).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxd.engines.prefix_cache import PrefixCache


def kv(n: int, layers: int = 2) -> list[KVCache]:
    out = []
    for _ in range(layers):
        c = KVCache()
        c.keys = c.values = mx.zeros((1, 1, n, 4))
        c.offset = n
        out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[250, 1000, 4000])
    ap.add_argument("--inserts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=300, help="tokens after the preamble")
    args = ap.parse_args()
    preamble = list(range(5000, 5032))
    for n in args.entries:
        pc = PrefixCache(1 << 40)
        for i in range(n):
            pc.insert(preamble + [10_000 + i] * args.tokens, kv(32 + args.tokens))
        t0 = time.perf_counter()
        for j in range(args.inserts):
            pc.insert(preamble + [50_000 + j] * args.tokens, kv(32 + args.tokens))
        ms = (time.perf_counter() - t0) / args.inserts * 1e3
        print(f"{n} entries: {ms:.3f} ms per insert", flush=True)


if __name__ == "__main__":
    main()
