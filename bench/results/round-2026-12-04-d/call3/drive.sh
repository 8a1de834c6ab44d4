#!/usr/bin/env bash
# Seventeenth round, call 3 (carry [".whl"]). Two cuts of system-scope releases in the packed tl
# kernels:
# - GEMM+RS signals a finished tile's peer owners together (kernels/sync.signal_add_all: one
#   instruction, a release per thread). Before, seven releases one after the other cost each
#   tile-finishing unit ~17 us (call 1's timeline of Llama-3-8B down at TP 8, M = 128).
#   Predicted: that entry 26.0 -> ~11-12 us (2.65 -> ~1.2 x cuBLAS); the other packed GEMM+RS
#   entries ~2.4 us per peer owner past the first.
# - AG counts the own shard's copied parts with a GPU-scope release (signal_add_gpu: only this
#   GPU's CTAs read that counter). Predicted: packed AG at M = 128 -0.5...-1.5 us.
# Correctness first (the list's small-shape variants, packed among them, and the traced tl
# kernels; -v: what passed shows if the step is cut), the RS timeline again, then the list's
# TP 8 entries at M = 128 and 256 on both engines with every variant (the best config may
# change), then the nested training step in 8 processes sharing the GPU, every rank packed and
# split 4 (real signals between processes, against a host reference).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x; mkdir -p $X $OUT
OUT=/tmp/o1 TEST_TIMEOUT=170 TEST_ARGS="-v -k 'small_shape_variants or traced_tl'" \
  bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 50 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes 128x14336x4096 \
  --engines tl --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
  --rounds 3 --calls 10 --tag rs-trace --out $X > $X/rs-trace.log 2>&1
timeout 210 python3 -m jax_autooverlap.bench shapes --loopback --filter w8 --filter 'm128|m256' \
  --rounds 3 --calls 10 --time-budget 170 --tag w8-m128-256 --out $OUT \
  > $X/w8-m128-256.log 2>&1
OUT=/tmp/o2 AO_STEP_DIMS=4096,2048,128,2 HARNESS_TIMEOUT=100 \
  HARNESS_ARGS="--scenario nested_step --packed --split-k 4 --world 8 --budget-s 90" \
  bash bench/run_device.sh two-process > $X/harness.stdout 2>&1
cp /tmp/o2/all.tgz $X/harness.tgz
tar czf $OUT/x.tgz -C $X .
grep -cE "PASSED" $X/tests.stdout; grep -E "FAILED|ERROR|passed|failed" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "timeline|x cuBLAS" $X/rs-trace.log | cut -c1-420
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/w8-m128-256.log | cut -c1-220
grep -E "PASS|FAIL" $X/harness.stdout | tail -6
