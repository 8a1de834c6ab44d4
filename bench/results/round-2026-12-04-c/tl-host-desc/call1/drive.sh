#!/usr/bin/env bash
# First GPU call for branch tl-host-desc (built on CPU in the fifteenth round, never run on a
# GPU): the tl kernels' operand descriptors made on the host, as the Gluon kernels' since
# 0e7b2cc. Carry [".whl", ".old"] with .old/base = main (git archive main jax_autooverlap).
# Correctness first (the tl GPU tests of both ops, fp8, capture, the loopback tl tests), then
# this tree against main at small M where the tl kernels run (predicted: -1.4 us per call, so
# 70B Q/K/V TP 8 M = 128 ~18 -> ~16.5 us; the large shapes unchanged within noise).
set -uo pipefail
X=/tmp/extra; mkdir -p $X
TEST_TIMEOUT=120 TEST_ARGS="-k 'tl and not gluon'" bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
tar xzf ${OUT:-/tmp/out}/all.tgz -C $X && rm -f ${OUT:-/tmp/out}/all.tgz
TEST_TIMEOUT=60 TEST_ARGS="-k tl" bash bench/run_device.sh test:tests/test_gpu_fp8.py >> $X/tests.stdout 2>&1
tar xzf ${OUT:-/tmp/out}/all.tgz -C $X && rm -f ${OUT:-/tmp/out}/all.tgz
TEST_TIMEOUT=60 bash bench/run_device.sh test:tests/test_gpu_capture.py >> $X/tests.stdout 2>&1
tar xzf ${OUT:-/tmp/out}/all.tgz -C $X && rm -f ${OUT:-/tmp/out}/all.tgz
export PYTHONPATH=/tmp/site:$PWD
for tree in . .old/base; do
  tag=$([[ $tree == . ]] && echo new || basename $tree)
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m jax_autooverlap.bench shapes --loopback --filter m128 \
      --filter w8 --engines tl --max-shapes 6 --rounds 3 --calls 10 --tag $tag-m128 --out $X > $X/$tag-m128.log 2>&1 )
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m jax_autooverlap.bench ag --loopback --engines tl \
      --shapes 8192x4096x4096 --rounds 3 --calls 10 --tag $tag-ag --out $X > $X/$tag-ag.log 2>&1 )
done
tar czf ${OUT:-/tmp/out}/extra.tgz -C $X .
grep -E "^=== |passed|failed" $X/tests.stdout | cut -c1-200
for t in new base; do echo "== $t"; grep -hE "^\[shapes.*cuBLAS| x cuBLAS" $X/$t-m128.log $X/$t-ag.log | cut -c1-180; done
