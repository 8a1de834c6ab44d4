#!/usr/bin/env bash
# Seventeenth round, call 4 (carry [".whl"]; the last ~200 s of the session's device time, the
# machine still warm): the two traced tl GEMM+RS tests call 3's test step had no time for, then
# TP 8 M = 128 GEMM+RS entries call 3 did not reach, on both engines, until the budget.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 70 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider \
  -k traced_tl_rs -rA > $OUT/tests.log 2>&1
timeout 90 python3 -m jax_autooverlap.bench shapes --loopback --filter w8 --filter m128 \
  --filter rs --skip-measured bench/results/round-2026-12-04-d/call3/files/*loopbackw8-m128-256.json \
  --rounds 3 --calls 10 --time-budget 60 --tag w8-m128-rs --out $OUT > $OUT/w8-m128-rs.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | cut -c1-160
grep -hE "^\[shapes.*cuBLAS|budget|failed" $OUT/w8-m128-rs.log | cut -c1-220
