#!/usr/bin/env bash
# Fifteenth round, call 1: (1) the traced GPU tests (the FRAME stamps' order, first run);
# (2) the FRAME stamps' first timelines: Gluon AG 8192x4096x4096 w 2 in fp8 and bf16, and fp8
# GEMM+RS at the same shape: where do the ~2.5 us of a fused fp8 AG call outside its consumer
# partitions go (set-up before warp_specialize, the mover outliving the consumers, finish_call)?
# (3) the fp8 shape list at M <= 1024 and 4k/16k tokens (never run), sampled, time-bounded.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
TEST_TIMEOUT=150 TEST_ARGS="-k traced" bash bench/run_device.sh tests-loopback > $X/tests-traced.stdout 2>&1
tar xzf $OUT/all.tgz -C $X && rm -f $OUT/all.tgz
export PYTHONPATH=/tmp/site:$PWD
for dt in float8_e4m3fn bfloat16; do
  timeout 75 python3 -m jax_autooverlap.bench ag --loopback --dtype $dt --engines gluon --shapes 8192x4096x4096 \
    --trace --rounds 3 --calls 10 --tag ag-$dt --out $X > $X/ag-trace-$dt.log 2>&1
done
timeout 75 python3 -m jax_autooverlap.bench rs --loopback --dtype float8_e4m3fn --engines gluon --shapes 8192x4096x4096 \
  --variant gluon:wg_partitions=1 --trace --rounds 3 --calls 10 --tag rs-fp8 --out $X > $X/rs-trace-fp8.log 2>&1
for m in m1024 m512 m16384 m4096 m128; do
  timeout 75 python3 -m jax_autooverlap.bench shapes --loopback --dtype float8_e4m3fn --filter $m --max-shapes 6 \
    --rounds 3 --calls 10 --time-budget 60 --tag fp8-$m --out $X > $X/fp8-shapes-$m.log 2>&1
done
rm -f $X/*.npz $X/*.npz.tmp; tar czf $OUT/extra.tgz -C $X .
echo "== tests"; grep -E "passed|failed|Error" $X/tests-loopback.log | tail -5
for f in ag-trace-float8_e4m3fn ag-trace-bfloat16 rs-trace-fp8; do echo "== $f"; grep -E " x cuBLAS|timeline" $X/$f.log | sed -E "s/'main_us.remote[^}]*//" | cut -c1-700; done
for m in m1024 m512 m16384 m4096 m128; do echo "== $m"; tail -9 $X/fp8-shapes-$m.log | cut -c1-220; done
