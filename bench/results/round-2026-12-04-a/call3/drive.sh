#!/usr/bin/env bash
# Fourteenth round, call 3: the Gluon AG mover's staging boxes at 8 KB in fp8 too (128 columns;
# they were 64 columns, 4 KB, so fp8 pushed at half bf16's rate per mover while its GEMM runs
# twice as fast). Correctness first (loopback fp8 tests, AG Gluon loopback tests, the fp8
# TP+SP step in 4 processes sharing the GPU on the Gluon engine), then fp8 AG this tree ("new")
# against HEAD before it (.old/base) at w2 and w4, then the fp8 shape list's AG entries at TP 4/8.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_fp8.py -p no:cacheprovider -k "ag and gluon" > $X/tests-fp8-ag-gluon.log 2>&1
timeout 90 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -k "ag and gluon" > $X/tests-loopback-ag-gluon.log 2>&1
HARNESS_TIMEOUT=100 HARNESS_ARGS="--scenario fp8_step --engine gluon --world 4 --budget-s 90" \
  bash bench/run_device.sh two-process > $X/fp8-step-gluon-w4.stdout 2>&1
mkdir -p $X/fp8-step && tar xzf $OUT/all.tgz -C $X/fp8-step && rm -f $OUT/all.tgz
F8=float8_e4m3fn
for tree in . .old/base; do
  tag=$([[ $tree == . ]] && echo new || basename $tree)
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 75 python3 -m jax_autooverlap.bench ag --loopback --dtype $F8 --engines gluon \
      --shapes 8192x4096x4096,4096x8192x8192 --first-call-candidates --rounds 3 --calls 10 --tag $tag-w2 --out $X > $X/$tag-w2.log 2>&1 )
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m jax_autooverlap.bench ag --loopback --world 4 --dtype $F8 --engines gluon \
      --shapes 8192x4096x6144 --rounds 3 --calls 10 --tag $tag-w4 --out $X > $X/$tag-w4.log 2>&1 )
done
timeout 130 python3 -m jax_autooverlap.bench shapes --loopback --dtype $F8 --filter 'w4|w8' --filter m8192 --filter ag \
  --engines tl,gluon --rounds 3 --calls 10 --time-budget 110 --tag fp8-ag-w4-w8-8k-boxes --out $X > $X/fp8-shapes-ag.log 2>&1
tar czf $OUT/extra.tgz -C $X .
for f in tests-fp8-ag-gluon tests-loopback-ag-gluon; do echo "== $f"; tail -2 $X/$f.log | cut -c1-200; done
echo "== fp8 step"; tail -8 $X/fp8-step-gluon-w4.stdout | cut -c1-200
for f in new-w2 base-w2 new-w4 base-w4; do echo "== $f"; grep -E " x cuBLAS|FAIL|Error" $X/$f.log | cut -c1-160; done
echo "== shapes"; tail -12 $X/fp8-shapes-ag.log | cut -c1-200
