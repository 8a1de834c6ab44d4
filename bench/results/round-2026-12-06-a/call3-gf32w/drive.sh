#!/usr/bin/env bash
# A GPU call on branch gluon-f32-wide (or main after `git apply
# bench/results/round-next-gluon-f32-wide/gluon-f32-wide.patch`; carry [".whl"]; ~6 min): float32
# products (preferred_element_type=float32 of bf16/fp8 operands) in the Gluon AG's 128x256 tiles,
# the tile stored in two column halves through one 64 KB buffer (gluon_engine.out_block_n; the
# Gluon GEMM+RS keeps 128x128). Main (round-2026-12-05-b/call3): the Gluon AG in 128x128 took
# 1.495 / 1.479 x cuBLAS's float32-output GEMM (bf16; 4096x8192x8192 / 8192x4096x4096) and
# 1.509 / 1.404 (fp8), tl in 128x256 1.059 / 1.309 and 1.098 / 1.455. Predicted: the Gluon AG
# near its bf16-output ratio plus the second half's store, ~1.05-1.12, so the first call's
# Gluon candidate wins 8192x4096x4096, where tl stays at 1.31-1.46.
# 1. GPU tests of float32 products (both engines, groups of 2/4/8; the Gluon AG now 128x256).
# 2. loopback AG --out-dtype float32, bf16 and fp8, two shapes, both engines; and the bf16
#    output's AG on both engines at the same shapes (the halves' own cost).
# Everything goes into ONE tarball under $OUT (the tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-gf32w; rm -rf $X; mkdir -p $X/json $OUT
OUT=/tmp/o1 TEST_TIMEOUT=200 TEST_ARGS="-k float32_products" \
  bash bench/run_device.sh test:tests/test_gpu_loopback.py > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=4096x8192x8192,8192x4096x4096
for dt in bfloat16 float8_e4m3fn; do
  timeout 70 python3 -m jax_autooverlap.bench ag --loopback --dtype $dt --out-dtype float32 \
    --shapes $S --rounds 3 --calls 10 --engines tl,gluon --tag gf32w-$dt --out $X/json \
    > $X/f32-ag-$dt.log 2>&1
done
timeout 60 python3 -m jax_autooverlap.bench ag --loopback --dtype bfloat16 --engines tl,gluon \
  --shapes $S --rounds 3 --calls 10 --tag bf16 --out $X/json > $X/bf16-ag.log 2>&1
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "x cuBLAS|WRONG|failed|rror" $X/f32-*.log $X/bf16-*.log | cut -c1-200
