#!/usr/bin/env bash
# Profile mlxd under load with py-spy (front end and engine-core process, --subprocesses):
# usage profile_server.sh MODEL_DIR C SECONDS OUTDIR
set -euo pipefail
model=$1; c=$2; secs=$3; out=$4
port=8799
python3 -m mlxd serve --model "$model" --port $port --max-num-seqs 64 --log-level warning > "$out/profiled-server.log" 2>&1 &
pid=$!
for _ in $(seq 1 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 1; done
python3 "$(dirname "$0")/serve_bench.py" --url http://127.0.0.1:$port --model "$(basename "$model")" \
  --concurrency "$c" --requests-per-client 6 --max-tokens 128 > "$out/profiled-bench-c$c.json" 2>&1 &
bench=$!
sleep 8
m0=$(curl -s localhost:$port/metrics | awk '/^mlxd:generation_tokens_total/ {s+=$2} END {print s}')
t0=$(date +%s.%N)
py-spy record -p $pid --subprocesses -d "$secs" -r 200 -f raw -o "$out/pyspy-c$c.txt" --threads --nonblocking --idle >/dev/null 2>&1 || true
m1=$(curl -s localhost:$port/metrics | awk '/^mlxd:generation_tokens_total/ {s+=$2} END {print s}')
t1=$(date +%s.%N)
python3 -c "print('server-side generation tok/s during the profile:', ($m1 - $m0) / ($t1 - $t0))" | tee "$out/server-side-c$c.txt"
wait $bench || true
kill $pid; wait $pid || true
