import glob, json, statistics as st, sys, bisect
tag = sys.argv[1]
for side in "AB":
    steps = []
    for f in glob.glob(f"/tmp/s11/{tag}-{side}.[0-9]*.jsonl"):
        steps += [json.loads(l) for l in open(f)]
    ins, lsteps = [], []
    for f in glob.glob(f"/tmp/s11/{tag}-{side}.ins.*.jsonl"):
        for l in open(f):
            r = json.loads(l)
            (ins if r[0] == "ins" else lsteps).append(r)
    steps.sort(); ins.sort(); lsteps.sort()
    its = [r[1] for r in ins]
    dec = {}
    post = {}
    prev_end = None
    for s in steps:
        t0, ms, gb, pb, up, pt, ga = s[:7]
        pure = pb == 0 and up == 0 and pt == 0 and gb == ga and gb > 0
        had = False
        if prev_end is not None:
            i = bisect.bisect_left(its, prev_end)
            had = i < len(its) and its[i] < t0
        if pure:
            dec.setdefault(gb, []).append(ms)
            post.setdefault((gb, had), []).append(ms)
        prev_end = t0 + ms / 1000
    print(f"== {side}: {len(steps)} _next calls, {len(ins)} inserts, median insert ms "
          f"{st.median([r[2] for r in ins]) if ins else 0:.3f}, p90 "
          f"{sorted([r[2] for r in ins])[int(len(ins)*0.9)] if ins else 0:.3f}, max entries {max([r[4] for r in ins] or [0])}")
    tot_next = sum(s[1] for s in steps); tot_step = sum(r[2] for r in lsteps)
    span = (steps[-1][0] - steps[0][0]) if steps else 0
    print(f"   total _next {tot_next/1000:.1f}s, LLMEngine._step {tot_step/1000:.1f}s, span {span:.1f}s")
    for gb in sorted(dec):
        if len(dec[gb]) < 20: continue
        a = post.get((gb, True), []); b = post.get((gb, False), [])
        print(f"   B={gb:2d} n={len(dec[gb]):4d} med {st.median(dec[gb]):6.1f} ms | after insert n={len(a)} "
              f"{st.median(a) if a else float('nan'):6.1f} | without n={len(b)} {st.median(b) if b else float('nan'):6.1f}")
