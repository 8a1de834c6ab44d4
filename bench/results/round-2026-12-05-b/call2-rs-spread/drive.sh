#!/usr/bin/env bash
# Branch rs-spread (or main with `git apply bench/results/round-next-rs-spread/rs-spread.patch`),
# first GPU call (carry [".whl"]): split_k.Spread for the packed tl GEMM+RS
# (each split part finishes its own rows: push and signal the peers', sum the own ones), built on
# CPU in the seventeenth round (the interpreter cannot run it: it runs CTAs one after another,
# and Spread's parts wait for each other). Predicted: Llama-3-8B down, TP 8, M = 128
# (tl-128x128-k4-p) 22.6 -> ~11-13 us (the tile-finishing units' ~16 us epilogue spread over 4
# CTAs); the list's packed split GEMM+RS entries alike. Correctness first: the list's
# small-shape GEMM+RS variants (every packed split one spreads), the traced tl GEMM+RS, GEMM+RS
# in groups of 4 and 8; the timeline; the TP 8 and TP 4 GEMM+RS entries at M = 128/256 (main's
# same-day numbers: round-2026-12-04-d/call3-4); then the nested step with every rank packed and
# split 4 in 8 and 2 processes sharing the GPU (at 2, an owner's 64 rows span two parts:
# OWNER_SIGNALS = 2).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-rs-spread; rm -rf $X; mkdir -p $X $OUT
OUT=/tmp/o1 TEST_TIMEOUT=200 TEST_ARGS="-k 'small_shape_variants and rs or traced_tl_rs or groups_of_4_and_8 and rs'" \
  bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 50 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes 128x14336x4096 \
  --engines tl --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
  --rounds 3 --calls 10 --tag rs-trace --out $X > $X/rs-trace.log 2>&1
timeout 170 python3 -m jax_autooverlap.bench shapes --loopback --filter rs --filter 'w8|w4' \
  --filter 'm128|m256' --rounds 3 --calls 10 --time-budget 140 --tag rs-spread --out $OUT \
  > $X/rs-spread.log 2>&1
OUT=/tmp/o2 AO_STEP_DIMS=4096,2048,128,2 HARNESS_TIMEOUT=110 \
  HARNESS_ARGS="--scenario nested_step --packed --split-k 4 --world 8,2 --budget-s 100" \
  bash bench/run_device.sh two-process > $X/harness.stdout 2>&1
cp /tmp/o2/all.tgz $X/harness.tgz
rm -f $X/*.npz
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "timeline|x cuBLAS" $X/rs-trace.log | cut -c1-420
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/rs-spread.log | cut -c1-220
grep -E "PASS|FAIL" $X/harness.stdout | tail -8
