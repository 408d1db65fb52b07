"""Per pass of a server, medians of each request's way through the engine core, from the
request log that benchmarks/step_trace writes with STEP_TRACE_REQS=1 (PREFIX.req.PID.jsonl):
handed to the device thread -> queued there (drain) -> given to mlx-lm (hold) -> first token.
Run in the folder of the logs: python requests_summary.py PID [PID...]."""
import json, sys, statistics as st
def load(pid):
    adm = {}; first = {}
    groups = []
    for line in open(f"t.req.{pid}.jsonl"):
        r = json.loads(line)
        if r[0] == "admit":
            _, t, running, left, took = r
            groups.append((t, running, left, len(took)))
            for sid, arr, added in took:
                adm[sid] = (arr, added, t, running, len(took))
        else:
            first[r[2]] = r[1]
    rows = []
    for sid, (arr, added, t, running, g) in adm.items():
        if sid in first:
            rows.append((arr, added - arr, t - added, first[sid] - t, g, running))
    rows.sort()
    return rows, groups
def passes(rows, gap=1.0):
    out = []; cur = []
    for r in rows:
        if cur and r[0] - cur[-1][0] > gap:
            out.append(cur); cur = []
        cur.append(r)
    if cur: out.append(cur)
    return out
for pid in sys.argv[1:]:
    rows, groups = load(pid)
    print("== pid", pid, len(rows))
    for p in passes(rows):
        n = len(p)
        if n < 3: continue
        med = lambda i: round(1000 * st.median([r[i] for r in p]), 1)
        mean = lambda i: round(1000 * st.mean([r[i] for r in p]), 1)
        gs = [r[4] for r in p]
        print(f"n={n:3d} drain {med(1):5} hold med {med(2):5} mean {mean(2):5} admit->first med {med(3):6} mean {mean(3):6} | total med {round(1000*st.median([r[1]+r[2]+r[3] for r in p]),1)} | groups of {sorted(set(gs))} running@admit {sorted(set(r[5] for r in p))[:6]}")
