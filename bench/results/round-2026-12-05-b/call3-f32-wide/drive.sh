#!/usr/bin/env bash
# A GPU call on branch f32-wide, or main with f32-wide.patch applied (carry [".whl"]): float32
# products (preferred_element_type=float32 of bf16/fp8 operands) in tl's 128x256 tiles, the AG
# storing the tile in column halves through one 64 KB buffer, GEMM+RS summing and storing its own
# tiles in halves (main ran them in 128x128: 1.51-1.94 x cuBLAS's float32-output GEMM in loopback,
# the kernel alone 1.34-1.62 x, twentieth session). Predicted: the tl kernel alone at 128x256 near
# its bf16 output's 1.01-1.07 x plus the second store's wait, ~1.05-1.12 x; ours 1.08-1.20 x.
# Also bf16 outputs in 128x128 tiles at the same shapes (--variant tl:block_n=128): how much of
# main's loss was the tile and how much the float32 epilogue.
# 1. GPU tests of float32 products (both engines, groups of 2/4/8; tl now 128x256).
# 2. loopback --out-dtype float32, bf16 and fp8, two shapes, tl at 128x256 and 128x128, Gluon.
# 3. loopback bf16 output with tl 128x128 beside the usual 128x256.
# Everything goes into ONE tarball under $OUT (the tool returns at most 8 files).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-f32w; rm -rf $X; mkdir -p $X/json $OUT
OUT=/tmp/o1 TEST_TIMEOUT=200 TEST_ARGS="-k float32_products" \
  bash bench/run_device.sh test:tests/test_gpu_loopback.py > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=4096x8192x8192,8192x4096x4096
for op in ag rs; do
  for dt in bfloat16 float8_e4m3fn; do
    timeout 60 python3 -m jax_autooverlap.bench $op --loopback --dtype $dt --out-dtype float32 \
      --shapes $S --rounds 3 --calls 10 --variant tl:block_n=128 --tag f32w-$dt --out $X/json \
      > $X/f32-$op-$dt.log 2>&1
  done
  timeout 45 python3 -m jax_autooverlap.bench $op --loopback --dtype bfloat16 --engines tl \
    --shapes $S --rounds 3 --calls 10 --variant tl:block_n=128 --tag bf16-128 --out $X/json \
    > $X/bf16-$op.log 2>&1
done
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "x cuBLAS|WRONG|failed|rror" $X/f32-*.log $X/bf16-*.log | cut -c1-200
