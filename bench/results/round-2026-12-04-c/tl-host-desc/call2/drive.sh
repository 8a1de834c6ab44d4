#!/usr/bin/env bash
# Second call for branch tl-host-desc: call 1's tl loopback and fp8 tests ran out of their
# 120 / 60 s (23 and 9 passed, none failed): the same selections with room, test names shown,
# then the traced tl test; then TP 8 M = 128 entries on both engines (this tree only).
set -uo pipefail
X=/tmp/extra; mkdir -p $X
TEST_TIMEOUT=300 TEST_ARGS="-k 'tl and not gluon' -rA --durations=5" bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
tar xzf ${OUT:-/tmp/out}/all.tgz -C $X && rm -f ${OUT:-/tmp/out}/all.tgz
TEST_TIMEOUT=120 TEST_ARGS="-k tl -rA --durations=5" bash bench/run_device.sh test:tests/test_gpu_fp8.py >> $X/tests.stdout 2>&1
tar xzf ${OUT:-/tmp/out}/all.tgz -C $X && rm -f ${OUT:-/tmp/out}/all.tgz
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m jax_autooverlap.bench shapes --loopback --filter m128 --filter w8 --rounds 3 --calls 10 \
  --time-budget 80 --tag m128-both --out $X > $X/m128-both.log 2>&1
tar czf ${OUT:-/tmp/out}/extra.tgz -C $X .
grep -E "^=== |passed|failed|PASSED|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -80
grep -hE "^\[shapes.*cuBLAS" $X/m128-both.log | cut -c1-180
