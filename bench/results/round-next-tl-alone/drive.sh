#!/usr/bin/env bash
# First GPU call for the tl kernel alone (sixteenth round, built on CPU: engine_alone_tl, a tl
# config in a group of one on the same local GEMM). Carry [".whl"]. Correctness first (every tl
# variant of three cases alone against the unfused result; the group-of-8 benchmark test now
# also checks the engine_alone_tl record), then the shape list's M = 128 entries on both
# engines, straight under $OUT (what ran comes back if the call is cut), until the budget.
# Append the JSON to bench/results/shapes-runs.txt and rebuild the table: the "?" entries at
# M = 128 then say "engine" (the tl kernel by itself is over the target) or "fused".
set -uo pipefail
X=${OUT:-/tmp/out}; mkdir -p $X
# run_device.sh packs all of $OUT into $OUT/all.tgz: its output goes elsewhere first
TEST_TIMEOUT=200 TEST_ARGS="-k 'alone or group_of_8_writes' -rA" bash bench/run_device.sh tests-loopback > /tmp/tests.stdout 2>&1
cp /tmp/tests.stdout $X/tests.stdout
export PYTHONPATH=/tmp/site:$PWD
timeout 330 python3 -m jax_autooverlap.bench shapes --loopback --filter m128 --rounds 3 --calls 10 \
  --time-budget 300 --tag m128-alone --out $X > $X/m128-alone.log 2>&1
grep -E "^=== |passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -20
grep -hE "^\[shapes.*cuBLAS|budget" $X/m128-alone.log | cut -c1-220
