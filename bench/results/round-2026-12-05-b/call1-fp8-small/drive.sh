#!/usr/bin/env bash
# A GPU call for branch fp8-small (or main with `git apply
# bench/results/round-next-fp8-small/fp8-small.patch`; carry [".whl"]): fp8 at small M gets the
# small-shape configs bf16 has (select.small_shape_configs: narrower tiles on both engines,
# split-K and packed shards on tl, K tiles of 128), so a first call and the benchmark time them.
# Before, fp8 timed only its 128x256x128 tiles at every M: the fp8 list's entries at M <= 1024
# met 0 of 16 (1.07-3.24 x XLA's fp8 GEMM, bound by the kernel alone in most; fifteenth round,
# round-2026-12-04-b). At M = 128 and TP 8 a 128-row tile holds a 16-row shard: 7/8 of its MMA
# rows are empty and B is read once per source, which the packed configs cure. Predicted: the
# fp8 entries at M = 128/256 of TP 4/8 toward bf16's ratios at the same entries (1.2-1.8 x
# cuBLAS with these configs), from 2-3 x.
# Correctness first: every fp8 small-shape variant of the list in loopback (62: poisoned output
# against the f32 product of the fp8 values within the formats' error, the pushes, a
# bit-identical second call); then 16 fp8 entries at M <= 1024 of TP 4 and 8 with every
# variant (compare with round-2026-12-04-b's fp8 samples and bf16's table).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-fp8-small; rm -rf $X; mkdir -p $X $OUT
OUT=/tmp/o1 TEST_TIMEOUT=260 TEST_ARGS="-k 'small_shape_variants and float8'" \
  bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 280 python3 -m jax_autooverlap.bench shapes --loopback --dtype float8_e4m3fn \
  --filter small --filter 'w4|w8' --max-shapes 16 --rounds 3 --calls 10 --time-budget 240 \
  --tag fp8-small --out $OUT > $X/shapes.log 2>&1
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/shapes.log | cut -c1-220
