#!/usr/bin/env bash
# Ran: branch packed-256 at cb74fa6 (git archive into .xb/p256), on one H100; merged without the
# GEMM+RS 128x256 form (f7e2034), which lost at Llama-3-70B o below.
# A GPU call on branch packed-256 (export; carry [".whl", ".xb"]; ~4.5 min): two new packed tl
# candidates of small shapes (select.packed_configs).
# - GEMM+RS 128x64 whole (PACKED_NARROW): round-2026-12-06-b call 1 (parts-wait) timed it as a
#   --variant: 128x4096x4096 w = 8 11.7 us against 14.3 for the first call's best (128x128 split
#   in 4), 256x4096x4096 13.4 against 16.8-17.4; equal at 128x14336x4096.
# - 128x256 (PACKED_WIDE) where the packed 128x128 tiles exceed one wave (M = 512 at TP 8,
#   N > 4224); the packed GEMM+RS finishes it in column halves (ptxas: 0 spills at 254 / 249
#   registers, where the whole tile spilled 632 / 396 bytes).
# (1) their small-shape variant GPU tests; (2) Llama-3-8B o/down at TP 8, M = 128/256/512 (the
# narrow candidate) and the 70B-class o/down/gate_up at TP 8, M = 512 (the wide one), bf16,
# each with every first-call candidate, as many as 80 s each allow.
# Predicted: the narrow one best at 8B o (K = 512 per rank: -15...-20 % on the call) and at par
# on down; the wide one -10...-30 % against packed 128x128 at down/gate_up (K per rank 3584+),
# little at o.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/x-pw; rm -rf $X; mkdir -p $X $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 75 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py \
  -k "small_shape_variants and (128x64-p or 128x256-p)" -p no:cacheprovider > $X/tests.log 2>&1
shapes() {  # tag, timeout, shapes args
  OUT=/tmp/o-$1 SHAPES_TIMEOUT=$2 SHAPES_ARGS="$3 --first-call-candidates --rounds 3 --calls 10 --tag $1" \
    bash bench/run_device.sh shapes > $X/shapes-$1.stdout 2>&1
  cp /tmp/o-$1/all.tgz $X/shapes-$1.tgz
}
shapes narrow-bf16 110 "--filter llama3-8b --filter w8 --filter rs --filter 'm128|m256|m512' --time-budget 80"
shapes wide-bf16 80 "--filter m512 --filter w8 --filter 'llama3-70b|qwen2-72b' --filter 'o|down|gate_up' --time-budget 40"
tar czf $OUT/x.tgz -C $X .
tail -3 $X/tests.log | cut -c1-300
for t in narrow-bf16 wide-bf16; do echo "== $t"; grep -E "WRONG|failed|budget|target met" $X/shapes-$t.stdout | cut -c1-200 | tail -4; done
