"""What a decode batch's join and leave cost in its KV cache: mlx-lm's ``BatchKVCache``
against mlxd's ``RowPoolKVCache`` (engines/kv_rows.py), side by side in one run.

The caches have a real model's shape (default SmolLM2-135M: 30 layers, 3 KV heads of 64,
float32) and are filled with random keys and values; each case is timed from the call to
the evaluation of every layer's arrays, on fresh caches each repeat, and the median is
reported. A join: ``--rows`` running rows of ``--length`` positions take ``--group``
newcomers of ``--prompt`` positions. A leave: one row, then a quarter of the rows, leave.

    python benchmarks/kv_join_copy.py [--layers 30 --heads 3 --dim 64 --rows 16 ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxd.engines.kv_rows import RowPoolKVCache, filter_pools, join_caches
from mlxd.engines.serving_batch import fill_order


def group(a: argparse.Namespace, rows: int, length: int) -> list[BatchKVCache]:
    out = []
    for _ in range(a.layers):
        c = BatchKVCache([0] * rows)
        k = mx.random.normal((rows, a.heads, length, a.dim))
        c.update_and_fetch(k, mx.random.normal(k.shape))
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def pool(a: argparse.Namespace, spare: int) -> list[RowPoolKVCache]:
    """Running rows in a pool with ``spare`` rows free, as after rows left."""
    caches = [join_caches(x, y) for x, y in zip(
        group(a, a.rows, a.length), group(a, spare, a.length), strict=True)]
    if spare:
        filter_pools(caches, list(range(a.rows)))
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def timed(prepare: Callable[[], object], act: Callable[[object], list], repeats: int
          ) -> float:
    times = []
    for _ in range(repeats):
        state = prepare()
        gc.collect()
        t = time.perf_counter()
        caches = act(state)
        mx.eval([(c.keys, c.values) for c in caches])
        times.append(time.perf_counter() - t)
        del state, caches
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 30), ("heads", 3), ("dim", 64), ("rows", 16),
                          ("length", 120), ("group", 8), ("prompt", 60), ("repeats", 7)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    n = a.rows
    quarter = list(range(n // 4, n))

    def join(s):  # the class decides: mlx-lm's extend or the pool's
        for x, y in zip(*s, strict=True):
            x.extend(y)
        return s[0]

    def stock_leave(keep):
        def act(caches):
            for c in caches:
                c.filter(keep)
            return caches
        return act

    def pool_leave(keep):
        def act(caches):
            filter_pools(caches, fill_order(keep))
            return caches
        return act

    cases = {
        "join: mlx-lm extend": (lambda: (group(a, n, a.length), group(a, a.group, a.prompt)),
                                join),
        "join: pool, spare rows": (lambda: (pool(a, a.group), group(a, a.group, a.prompt)),
                                   join),
        "join: pool, rebuilt": (lambda: (pool(a, 0), group(a, a.group, a.prompt)), join),
        "one row leaves: mlx-lm filter": (lambda: group(a, n, a.length),
                                          stock_leave(list(range(1, n)))),
        "one row leaves: pool": (lambda: pool(a, 0), pool_leave(list(range(1, n)))),
        "a quarter leave: mlx-lm filter": (lambda: group(a, n, a.length),
                                           stock_leave(quarter)),
        "a quarter leave: pool": (lambda: pool(a, 0), pool_leave(quarter)),
    }
    results = {name: round(timed(prep, act, a.repeats), 2)
               for name, (prep, act) in cases.items()}
    print(json.dumps({"args": vars(a), "median_ms": results}, indent=1))


if __name__ == "__main__":
    main()
