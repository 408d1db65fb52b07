"""Sum up step traces (sitecustomize.py beside this file): per process, the time in prefill
steps, join steps (newcomers moving into the decode batch), leave steps (finished rows
filtered out of it) and plain decode steps, the decode steps' median by batch size, and (in
traces that record it) by the CPU the step ran on.

    python benchmarks/step_trace/summary.py PREFIX
"""

import collections
import glob
import json
import statistics
import sys


def main() -> None:
    for path in sorted(glob.glob(sys.argv[1] + ".*.jsonl")):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        if len(rows) < 50:
            continue
        kinds = collections.defaultdict(list)
        decode_by_batch = collections.defaultdict(list)
        decode_by_cpu = collections.defaultdict(list)
        for row in rows:
            _t0, ms, rows_before, _prompting, _queued, prompt_tokens, rows_after = row[:7]
            if prompt_tokens > 0:
                kinds["prefill"].append(ms)
            elif rows_after > rows_before:
                kinds["join"].append(ms)
            elif rows_after < rows_before:
                kinds["leave"].append(ms)
            elif rows_before > 0:
                kinds["decode"].append(ms)
                decode_by_batch[rows_before].append(ms)
                if len(row) > 7:
                    decode_by_cpu[row[7]].append(ms)
            else:
                kinds["other"].append(ms)
        span = rows[-1][0] + rows[-1][1] / 1000 - rows[0][0]
        inside = sum(r[1] for r in rows) / 1000
        print(f"== {path}: {len(rows)} steps over {span:.2f} s, {inside / span:.1%} inside")
        for k, v in kinds.items():
            p90 = sorted(v)[int(0.9 * (len(v) - 1))]
            print(f"  {k:8s} n={len(v):5d} total {sum(v) / 1000:6.2f} s  median "
                  f"{statistics.median(v):7.2f} ms  p90 {p90:7.2f}")
        common = sorted(decode_by_batch.items(), key=lambda kv: -len(kv[1]))[:8]
        print("  decode ms by batch:", ", ".join(
            f"B={b}: {statistics.median(v):.2f} (n={len(v)})" for b, v in sorted(common)))
        if decode_by_cpu:
            print("  decode ms by cpu:", ", ".join(
                f"{c}: {statistics.median(v):.2f} (n={len(v)})"
                for c, v in sorted(decode_by_cpu.items()) if len(v) >= 5))


if __name__ == "__main__":
    main()
