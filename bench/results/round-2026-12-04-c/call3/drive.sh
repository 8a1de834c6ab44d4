#!/usr/bin/env bash
# The TP 8 entries at M = 128 not yet re-measured on main with every descriptor made on the
# host (round-2026-12-04-c/tl-host-desc/call2 measured the first 5), then M = 256, until the budget.
# Writes straight under $OUT (what ran comes back even if the call is cut).
set -uo pipefail
X=${OUT:-/tmp/out}; mkdir -p $X
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
timeout 190 python3 -m jax_autooverlap.bench shapes --loopback --filter m128 --filter w8 --rounds 3 --calls 10 \
  --skip-measured bench/results/round-2026-12-04-c/tl-host-desc/call2/files/NVIDIA-H200-x1-2026-12-04-shapes-loopbackm128-both.json \
  --time-budget 165 --tag w8-m128-rest --out $X > $X/w8-m128-rest.log 2>&1
timeout 80 python3 -m jax_autooverlap.bench shapes --loopback --filter m256 --filter w8 --rounds 3 --calls 10 \
  --time-budget 55 --tag w8-m256 --out $X > $X/w8-m256.log 2>&1
grep -hE "^\[shapes.*cuBLAS|budget" $X/w8-m128-rest.log $X/w8-m256.log | cut -c1-200
