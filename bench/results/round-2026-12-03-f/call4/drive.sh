#!/usr/bin/env bash
# Thirteenth round, call 4: the column-block GEMM+RS sum with real waits (in loopback every
# peer's counter is already set): processes sharing the GPU run the Gluon kernels as every rank
# of groups of 8 and 4 (kernels scenario), then the nested TP+SP training step with a consumer
# partition per warpgroup in a group of 8.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
HARNESS_TIMEOUT=150 HARNESS_ARGS="--scenario kernels --engine gluon --world 8,4 --budget-s 140" \
  bash bench/run_device.sh two-process > $X/kernels-gluon.stdout 2>&1
mkdir -p $X/kernels-gluon && tar xzf $OUT/all.tgz -C $X/kernels-gluon && rm -f $OUT/all.tgz
HARNESS_TIMEOUT=120 HARNESS_ARGS="--scenario nested_step --engine gluon --wg-partitions --world 8 --budget-s 110" \
  bash bench/run_device.sh two-process > $X/nested-gluon-wg.stdout 2>&1
mkdir -p $X/nested-gluon-wg && tar xzf $OUT/all.tgz -C $X/nested-gluon-wg && rm -f $OUT/all.tgz
tar czf $OUT/extra.tgz -C $X .
for f in kernels-gluon nested-gluon-wg; do echo "== $f"; tail -14 $X/$f.stdout | cut -c1-220; done
