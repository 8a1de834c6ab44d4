#!/usr/bin/env bash
# First GPU call for the tl kernel alone (sixteenth round, built on CPU: engine_alone_tl, a tl
# config in a group of one on the same local GEMM). Carry [".whl"]. Correctness first (every tl
# variant of three cases alone against the unfused result; the group-of-8 benchmark test now
# also checks the engine_alone_tl record; the traced tl GEMM+RS, new too), the tl GEMM+RS
# timeline of Llama-3-8B down at TP 8, M = 128, then the shape list's TP 8 M = 128 entries whose
# bound the committed runs leave unknown ("?"), on both engines, straight under $OUT (what ran comes back if the call is cut), until the budget.
# Append the JSON to bench/results/shapes-runs.txt and rebuild the table: the "?" entries at
# M = 128 then say "engine" (the tl kernel by itself is over the target) or "fused".
set -uo pipefail
X=${OUT:-/tmp/out}; mkdir -p $X
# run_device.sh packs all of $OUT into $OUT/all.tgz: its output goes elsewhere first
TEST_TIMEOUT=240 TEST_ARGS="-k 'alone or group_of_8_writes or traced_tl' -rA" bash bench/run_device.sh tests-loopback > /tmp/tests.stdout 2>&1
cp /tmp/tests.stdout $X/tests.stdout
export PYTHONPATH=/tmp/site:$PWD
# the tl GEMM+RS timeline (new): where Llama-3-8B down's 2.3 x at TP 8, M = 128 goes
timeout 90 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes 128x14336x4096 \
  --engines tl --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
  --rounds 3 --calls 10 --tag rs-trace --out $X > $X/rs-trace.log 2>&1
timeout 250 python3 -m jax_autooverlap.bench shapes --loopback --filter w8 --filter m128 \
  --bound-unknown-in bench/results/shapes-runs.txt --rounds 3 --calls 10 \
  --time-budget 220 --tag w8-m128-alone --out $X > $X/w8-m128-alone.log 2>&1
grep -E "^=== |passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -20
grep -hE "timeline|x cuBLAS" $X/rs-trace.log | cut -c1-300
grep -hE "^\[shapes.*cuBLAS|budget" $X/w8-m128-alone.log | cut -c1-220
