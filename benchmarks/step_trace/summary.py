"""Sum up step traces (sitecustomize.py beside this file): per process, the time in prefill
steps, join steps (newcomers moving into the decode batch), leave steps (finished rows
filtered out of it) and plain decode steps, the decode steps' median by batch size, and (in
traces that record it) by the CPU the step ran on.

    python benchmarks/step_trace/summary.py PREFIX
    python benchmarks/step_trace/summary.py PREFIX --runs   # also: each benchmark run

With ``--runs`` each process's trace is also cut into runs where the device loop sat idle
for more than 30 ms (serve_compare's warm-up run, then its measured run), and the last run
is listed step by step apart from plain decode steps: how the prefill groups formed, when
rows joined and left. The engine alone and mlxd serve the same requests, so their last
runs compare directly (span, time inside steps, the steps that reshape the batch).
"""

import collections
import glob
import json
import statistics
import sys


def kind(row: list) -> str:
    _t0, _ms, rows_before, _prompting, _queued, prompt_tokens, rows_after = row[:7]
    if prompt_tokens > 0:
        return "prefill"
    if rows_after > rows_before:
        return "join"
    if rows_after < rows_before:
        return "leave"
    return "decode" if rows_before > 0 else "other"


def runs(rows: list[list], idle_s: float = 0.03) -> list[list[list]]:
    """The trace cut where the loop sat idle longer than ``idle_s``; runs of 100+ steps."""
    out, cur = [], [rows[0]]
    for a, b in zip(rows, rows[1:]):
        if b[0] - (a[0] + a[1] / 1000) > idle_s:
            out.append(cur)
            cur = []
        cur.append(b)
    out.append(cur)
    return [r for r in out if len(r) >= 100]


def show_runs(rows: list[list]) -> None:
    found = runs(rows)
    for i, run in enumerate(found):
        span = run[-1][0] + run[-1][1] / 1000 - run[0][0]
        by = collections.defaultdict(list)
        for row in run:
            by[kind(row)].append(row[1])
        parts = ", ".join(f"{k} {len(v)} ({sum(v) / 1000:.3f} s)" for k, v in by.items())
        print(
            f"  run {i}: {len(run)} steps over {span:.3f} s, "
            f"{sum(r[1] for r in run) / 1000:.3f} s inside: {parts}"
        )
    if not found:
        return
    last = found[-1]
    t0 = last[0][0]
    for row in last:
        k = kind(row)
        if k != "decode":
            print(
                f"    {(row[0] - t0) * 1000:8.1f} ms {k:7s} {row[1]:6.1f} ms rows "
                f"{row[2]}->{row[6]} queued {row[4]} prompt tokens {row[5]}"
            )


def main() -> None:
    for path in sorted(glob.glob(sys.argv[1] + ".*.jsonl")):
        if ".req." in path:  # STEP_TRACE_REQS's request log, not steps
            continue
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        if len(rows) < 50:
            continue
        kinds = collections.defaultdict(list)
        decode_by_batch = collections.defaultdict(list)
        decode_by_cpu = collections.defaultdict(list)
        for row in rows:
            ms, rows_before, k = row[1], row[2], kind(row)
            kinds[k].append(ms)
            if k == "decode":
                decode_by_batch[rows_before].append(ms)
                if len(row) > 7:
                    decode_by_cpu[row[7]].append(ms)
        span = rows[-1][0] + rows[-1][1] / 1000 - rows[0][0]
        inside = sum(r[1] for r in rows) / 1000
        print(f"== {path}: {len(rows)} steps over {span:.2f} s, {inside / span:.1%} inside")
        for k, v in kinds.items():
            p90 = sorted(v)[int(0.9 * (len(v) - 1))]
            print(
                f"  {k:8s} n={len(v):5d} total {sum(v) / 1000:6.2f} s  median "
                f"{statistics.median(v):7.2f} ms  p90 {p90:7.2f}"
            )
        common = sorted(decode_by_batch.items(), key=lambda kv: -len(kv[1]))[:8]
        print(
            "  decode ms by batch:",
            ", ".join(f"B={b}: {statistics.median(v):.2f} (n={len(v)})" for b, v in sorted(common)),
        )
        if decode_by_cpu:
            print(
                "  decode ms by cpu:",
                ", ".join(
                    f"{c}: {statistics.median(v):.2f} (n={len(v)})"
                    for c, v in sorted(decode_by_cpu.items())
                    if len(v) >= 5
                ),
            )
        if "--runs" in sys.argv[2:]:
            show_runs(rows)


if __name__ == "__main__":
    main()
