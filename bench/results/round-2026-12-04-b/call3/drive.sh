#!/usr/bin/env bash
# Fifteenth round, call 3: (1) call 2's capture-test failure (world-1 AG: "ZeroDivisionError"
# inside the rewrite): the AG at world 1 called directly, with its traceback, in this tree, and
# the capture tests on HEAD before the host descriptors (.old/base): is it new?
# (2) the fp8 TP+SP step in 4 processes sharing the GPU on the Gluon kernels (host descriptors
# across processes); (3) fp8 loopback on issue 28's reference shapes with the host descriptors.
# (agw1.py, a 20-line helper calling ao.ag_matmul / ao.matmul_rs at world 1 in shard_map with
# impl="triton", printing each traceback: it failed here for lack of `jax.set_mesh`; call 4 ran
# it with the mesh; git keeps it, commit 20b0209)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 bench/results/round-2026-12-04-b/call3/agw1.py > $X/agw1-new.log 2>&1
( cd .old/base && cp -r ../../tests . 2>/dev/null; PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m pytest -q -m gpu tests/test_gpu_capture.py \
    -p no:cacheprovider > $X/tests-capture-base.log 2>&1 )
HARNESS_TIMEOUT=110 HARNESS_ARGS="--scenario fp8_step --engine gluon --world 4 --budget-s 100" \
  bash bench/run_device.sh two-process > $X/fp8-step-gluon-w4.stdout 2>&1
mkdir -p $X/fp8-step && tar xzf $OUT/all.tgz -C $X/fp8-step && rm -f $OUT/all.tgz
F8=float8_e4m3fn
timeout 110 python3 -m jax_autooverlap.bench rs --loopback --dtype $F8 --engines gluon --variant gluon:wg_partitions=1 \
  --rounds 3 --calls 10 --tag fp8-rs --out $X > $X/fp8-rs.log 2>&1
timeout 60 python3 -m jax_autooverlap.bench ag --loopback --dtype $F8 --engines gluon --shapes 4096x8192x8192 \
  --rounds 3 --calls 10 --tag fp8-ag --out $X > $X/fp8-ag.log 2>&1
rm -f $X/*.npz $X/*.npz.tmp; tar czf $OUT/extra.tgz -C $X .
echo "== agw1 new"; grep -vE "Warning|warn" $X/agw1-new.log | tail -25 | cut -c1-220
echo "== capture base"; tail -n 4 $X/tests-capture-base.log | cut -c1-250
echo "== fp8 step"; tail -6 $X/fp8-step-gluon-w4.stdout | cut -c1-200
for f in fp8-rs fp8-ag; do echo "== $f"; grep -E " x cuBLAS|FAIL|Error" $X/$f.log | cut -c1-160; done
