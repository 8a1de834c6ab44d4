#!/usr/bin/env bash
# A GPU call on main (carry [".whl"]; ~2 min): where the spread GEMM+RS's epilogue goes. The
# packed tl GEMM+RS now stamps each split part's steps (kernels/tl_trace.py PARTS_IN, PUSHED;
# bench/timeline.py epilogue_steps): main loop's end -> the tile's other parts counted
# (parts_wait) -> the parts' rows summed, pushed to their owners and signalled (push) -> the
# own rows' wait and sum (own). round-2026-12-05-b/call2: the typical part's epilogue 7.7 us
# (was 3.1 us for the last part alone before Spread), the call 16.1 us at Llama-3-8B down TP 8
# M = 128 (tl-128x128-k4-p), 14.3 us at 8B o. Expected: parts_wait small (the 4 parts of a
# tile start within one claim round of each other), push the largest (the system-scope release
# after the stores), own ~1-2 us (the peers' pushes are in place in loopback). Whichever step
# holds the 7.7 us is the next change's target (docs/NOTES.md Open).
# 1. the traced tl GEMM+RS GPU test (checks the steps' order); 2. loopback --trace at both
# shapes, 3 and 4 stages (the deep pipelines merged since that call).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-rs-steps; rm -rf $X; mkdir -p $X $OUT
OUT=/tmp/o1 TEST_TIMEOUT=120 TEST_ARGS="-k traced_tl_rs" \
  bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for s in 128x14336x4096 128x4096x4096; do
  timeout 60 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $s --engines tl \
    --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
    --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4,num_stages=4 \
    --rounds 3 --calls 10 --tag rs-steps --out $X > $X/rs-steps-$s.log 2>&1
done
rm -f $X/*.npz
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -4
grep -hE "timeline|x cuBLAS" $X/rs-steps-*.log | cut -c1-600
