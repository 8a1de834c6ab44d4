#!/usr/bin/env bash
# Fourteenth round, call 1: (1) the rest of the own-tile round's background table
# (own_round.py --background-only: halves beside loaders, unpaced loaders, from L2);
# (2) fp8 loopback after the column-block sum (never re-measured): GEMM+RS on the four reference
# shapes with the engine's and the fused kernel's timelines, AG on the two that missed or were
# closest; (3) the shape list in fp8 at TP 8, 8k tokens (never run in fp8).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
SCRIPT_TIMEOUT=100 SCRIPT_ARGS=--background-only bash bench/run_device.sh bench/own_round.py > $X/own_round.stdout 2>&1
tar xzf $OUT/all.tgz -C $X && rm -f $OUT/all.tgz
export PYTHONPATH=/tmp/site:$PWD
F8=float8_e4m3fn
timeout 190 python3 -m jax_autooverlap.bench rs --loopback --dtype $F8 --engines tl,gluon \
  --variant gluon:wg_partitions=1 --trace --rounds 3 --calls 10 --tag fp8-rs --out $X > $X/fp8-rs.log 2>&1
timeout 120 python3 -m jax_autooverlap.bench ag --loopback --dtype $F8 --engines tl,gluon \
  --shapes 8192x4096x4096,4096x8192x8192 --first-call-candidates --rounds 3 --calls 10 --tag fp8-ag --out $X > $X/fp8-ag.log 2>&1
timeout 150 python3 -m jax_autooverlap.bench shapes --loopback --dtype $F8 --filter w8 --filter m8192 \
  --variant gluon:wg_partitions=1 --rounds 3 --calls 10 --time-budget 120 --tag fp8-w8-8k --out $X > $X/fp8-shapes-w8-8k.log 2>&1
tar czf $OUT/extra.tgz -C $X .
grep "own_round\]" $X/own_round.log | cut -c1-140 | tail -12
for f in fp8-rs fp8-ag; do echo "== $f"; grep -E " x cuBLAS|timeline|FAIL|Error|error" $X/$f.log | sed -E "s/'main_us.remote.*//" | cut -c1-200 | tail -24; done
echo "== shapes"; tail -22 $X/fp8-shapes-w8-8k.log | cut -c1-200
