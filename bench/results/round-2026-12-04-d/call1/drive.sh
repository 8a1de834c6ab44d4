#!/usr/bin/env bash
# Seventeenth round, call 1: the tl kernel alone (built on CPU last round: engine_alone_tl, a tl
# config in a group of one on the same local GEMM). Carry [".whl"]. Correctness first (every tl
# variant of three cases alone against the unfused result; the group-of-8 benchmark test checks
# the engine_alone_tl record; the traced tl GEMM+RS bit-identical to the plain one), the tl
# GEMM+RS timeline of Llama-3-8B down at TP 8, M = 128, then the shape list's entries whose bound
# the committed runs leave unknown ("?", 115), each with only the configs that ran ours/ours_tl
# there (--configs-from: cuBLAS, that tl config fused and alone), straight under $OUT until the
# budget. Append the JSON to bench/results/shapes-runs.txt; the next call takes the rest.
set -uo pipefail
X=${OUT:-/tmp/out}; mkdir -p $X
# run_device.sh packs all of $OUT into $OUT/all.tgz: its output goes elsewhere first
TEST_TIMEOUT=180 TEST_ARGS="-k 'alone or group_of_8_writes or traced_tl' -rA" bash bench/run_device.sh tests-loopback > /tmp/tests.stdout 2>&1
cp /tmp/tests.stdout $X/tests.stdout
export PYTHONPATH=/tmp/site:$PWD
# the tl GEMM+RS timeline (new): where Llama-3-8B down's 2.3 x at TP 8, M = 128 goes
timeout 80 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes 128x14336x4096 \
  --engines tl --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
  --rounds 3 --calls 10 --tag rs-trace --out $X > $X/rs-trace.log 2>&1
R=bench/results/shapes-runs.txt
timeout 280 python3 -m jax_autooverlap.bench shapes --loopback --bound-unknown-in $R \
  --configs-from $R --rounds 3 --calls 10 --time-budget 230 --tag unknown-1 --out $X \
  > $X/unknown-1.log 2>&1
grep -E "^=== |passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -20
grep -hE "timeline|x cuBLAS" $X/rs-trace.log | cut -c1-300
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/unknown-1.log | cut -c1-220
