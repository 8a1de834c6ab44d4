#!/usr/bin/env bash
# Thirteenth round, call 2: the shape list's 14 TP 4 AG entries at M = 128 / 256 (never run with
# the spread combine), then its 6 TP 8 GEMM+RS entries at 8k tokens with the column-block sum
# (Gluon, both partitionings).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
SHAPES_TIMEOUT=300 SHAPES_ARGS="--filter w4 --filter 'm128|m256' --filter ag --time-budget 265 --tag w4-small-ag" \
  bash bench/run_device.sh shapes > $X/w4-small-ag.stdout 2>&1
mkdir -p $X/w4-small-ag && tar xzf $OUT/all.tgz -C $X/w4-small-ag && rm -f $OUT/all.tgz
SHAPES_TIMEOUT=190 SHAPES_ARGS="--filter w8 --filter rs --filter step --filter m8192 --engines gluon --variant gluon:wg_partitions=1 --time-budget 160 --tag w8-rs-8k" \
  bash bench/run_device.sh shapes > $X/w8-rs-8k.stdout 2>&1
mkdir -p $X/w8-rs-8k && tar xzf $OUT/all.tgz -C $X/w8-rs-8k && rm -f $OUT/all.tgz
tar czf $OUT/extra.tgz -C $X .
for d in w4-small-ag w8-rs-8k; do echo "== $d"; tail -22 $X/$d.stdout | cut -c1-200; done
