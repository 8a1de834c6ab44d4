#!/usr/bin/env bash
# Fifteenth round, call 2: the Gluon kernels' operand descriptors made on the host (jax-triton
# TensorDescriptor, encoded into the launch's parameters) and every other descriptor made by
# the partition that uses it. Call 1's FRAME stamps: kernel entry to the consumers' start is
# 3.0-4.0 us in the engine alone and 4.9-6.2 us in the fused AG, of which ~0.7 us per
# descriptor made on the device (3 in the engine, 5 in the AG, before warp_specialize).
# Predicted: entry-to-consumers ~1-1.5 us everywhere; fp8 AG 8192x4096x4096 1.129 -> ~1.10,
# engine -1..-2 %, small shapes more. Correctness first (engine, loopback Gluon tests, fp8,
# CUDA-graph capture), then this tree ("new") against HEAD (.old/base), then new's timelines.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
T() { local t=$1 f=$2; shift 2; timeout $t python3 -m pytest -q -m gpu "$@" -p no:cacheprovider > $X/$f.log 2>&1; }
T 100 tests-gluon-gemm tests/test_gpu_gluon_gemm.py
T 150 tests-loopback-gluon tests/test_gpu_loopback.py -k gluon
T 60 tests-fp8-gluon tests/test_gpu_fp8.py -k gluon
T 60 tests-capture tests/test_gpu_capture.py
F8=float8_e4m3fn
for tree in . .old/base; do
  tag=$([[ $tree == . ]] && echo new || basename $tree)
  ( cd $tree && export PYTHONPATH=/tmp/site:$PWD
    timeout 45 python3 -m jax_autooverlap.bench ag --loopback --dtype $F8 --engines gluon --shapes 8192x4096x4096 \
      --rounds 3 --calls 10 --tag $tag-ag8 --out $X > $X/$tag-ag8.log 2>&1
    timeout 45 python3 -m jax_autooverlap.bench rs --loopback --dtype $F8 --engines gluon --shapes 8192x4096x4096 \
      --variant gluon:wg_partitions=1 --rounds 3 --calls 10 --tag $tag-rs8 --out $X > $X/$tag-rs8.log 2>&1
    timeout 45 python3 -m jax_autooverlap.bench ag --loopback --engines gluon --shapes 1024x8192x8192 \
      --rounds 3 --calls 10 --tag $tag-agsmall --out $X > $X/$tag-agsmall.log 2>&1
    timeout 45 python3 -m jax_autooverlap.bench rs --loopback --engines gluon --shapes 1024x8192x8192 \
      --variant gluon:wg_partitions=1 --rounds 3 --calls 10 --tag $tag-rssmall --out $X > $X/$tag-rssmall.log 2>&1 )
done
timeout 45 python3 -m jax_autooverlap.bench ag --loopback --dtype $F8 --engines gluon --shapes 8192x4096x4096 \
  --trace --rounds 3 --calls 10 --tag trace-ag8 --out $X > $X/trace-ag8.log 2>&1
rm -f $X/*.npz $X/*.npz.tmp; tar czf $OUT/extra.tgz -C $X .
for f in tests-gluon-gemm tests-loopback-gluon tests-fp8-gluon tests-capture; do echo "== $f"; tail -n 2 $X/$f.log | cut -c1-200; done
for s in ag8 rs8 agsmall rssmall; do echo "== $s"; grep -hE " x cuBLAS|FAIL|Error" $X/new-$s.log $X/base-$s.log | cut -c1-160; done
echo "== trace"; grep -E "timeline" $X/trace-ag8.log | sed -E "s/'main_us.remote[^}]*//" | cut -c1-900
