"""Scratch: decode-step medians (batch >= 14, no prefill in the call) per minute of each
server's trace, the steps right after rows left against the others, insert times."""
import glob, json, statistics as st, sys
tag = sys.argv[1] if len(sys.argv) > 1 else "t1"
for side in "AB":
    steps = sorted(json.loads(l) for f in glob.glob(f"/tmp/s11/{tag}-{side}.[0-9]*.jsonl") for l in open(f))
    t00 = steps[0][0]
    by, post = {}, {}
    for prev, s in zip(steps, steps[1:]):
        t0, ms, gb, pb, up, pt, ga = s[:7]
        if pb == 0 and up == 0 and pt == 0 and gb == ga and gb > 0:
            post.setdefault((gb, prev[6] < prev[2]), []).append(ms)
            if gb >= 14:
                by.setdefault(int((t0 - t00) // 60), []).append(ms)
    print(side, "B>=14 decode step median ms by minute:",
          {k: round(st.median(v), 1) for k, v in sorted(by.items()) if len(v) >= 10})
    for gb in sorted({k[0] for k in post}):
        a, b = post.get((gb, True), []), post.get((gb, False), [])
        if len(a) >= 5 and len(b) >= 10:
            print(f"  B={gb:2d} after rows left n={len(a):3d} {st.median(a):6.1f} ms, others n={len(b):3d} {st.median(b):6.1f} ms")
