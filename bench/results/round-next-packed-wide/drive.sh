#!/usr/bin/env bash
# A GPU call on branch packed-256 (export; carry [".whl", ".xb"]; ~7 min): packed tl tiles of
# 128x256 (select.PACKED_WIDE), offered where the packed 128x128 tiles exceed one wave (M = 512
# at TP 8, N > 4224: 64-row owners; 256 tiles of 128x128 at N = 8192 run 2 waves, 128 of
# 128x256 one). The packed GEMM+RS finishes them in column halves (ptxas: 0 spills at 254 / 249
# registers, where the whole tile spilled 632 / 396 bytes). (1) the small-shape variants' GPU
# tests at 128x256 (packed ones new); (2) the 8 entries of TP 8, M = 512 of the 70B-class
# models' o/down/gate_up with every first-call candidate, bf16 then fp8.
# Predicted: at the 7 entries with the wide candidate, packed 128x256 beats packed 128x128 by
# 10-30 % where the main loop dominates (down, gate_up: K per rank 3584-3696 / 8192) and
# little at o (K per rank 1024, the epilogue's share larger); best config -5...-20 % there.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/x-pw; rm -rf $X; mkdir -p $X $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -k "small_shape_variants and 128x256" \
  -p no:cacheprovider > $X/tests.log 2>&1
for dt in bfloat16 float8_e4m3fn; do
  OUT=/tmp/o-$dt SHAPES_TIMEOUT=230 SHAPES_ARGS="--filter m512 --filter w8 \
    --filter 'llama3-70b|qwen2-72b|mixtral-8x22b' --filter 'o|down|gate_up' --dtype $dt \
    --first-call-candidates --rounds 3 --calls 10 --time-budget 190 --tag pw-$dt" \
    bash bench/run_device.sh shapes > $X/shapes-$dt.stdout 2>&1
  cp /tmp/o-$dt/all.tgz $X/shapes-$dt.tgz
done
tar czf $OUT/x.tgz -C $X .
tail -3 $X/tests.log | cut -c1-300
for dt in bfloat16 float8_e4m3fn; do echo "== $dt"; grep -E "WRONG|failed|budget|target met|128x256-p|x cuBLAS" $X/shapes-$dt.stdout | cut -c1-220 | tail -40; done
