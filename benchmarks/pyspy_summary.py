"""Summarise one thread of a raw py-spy profile (``py-spy record -f raw --threads``).

    python benchmarks/pyspy_summary.py PROFILE.txt THREAD_NAME_PART [TOP]

Prints each frame's inclusive share of that thread's samples, then the leaf frames' shares.
"""

from __future__ import annotations

import collections
import sys


def load(path: str) -> list[tuple[list[str], int]]:
    rows = []
    for line in open(path):
        line = line.rstrip()
        if not line:
            continue
        stack, cnt = line.rsplit(" ", 1)
        rows.append((stack.split(";"), int(cnt)))
    return rows


def main() -> None:
    rows = load(sys.argv[1])
    want = sys.argv[2]  # a part of the thread's name
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    sel = [(f, c) for f, c in rows if any(want in x for x in f[:3])]
    n = sum(c for _, c in sel)
    print("samples", n)
    incl: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    for f, c in sel:
        for x in set(f):
            incl[x[:120]] += c
        leaves[f[-1][:120]] += c
    for k, v in incl.most_common(top):
        print(f"{v / n:6.1%} {k}")
    print("--- leaves")
    for k, v in leaves.most_common(15):
        print(f"{v / n:6.1%} {k}")


if __name__ == "__main__":
    main()
