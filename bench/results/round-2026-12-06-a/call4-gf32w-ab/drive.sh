#!/usr/bin/env bash
# A GPU call (carry [".whl", ".xb"], the branch gluon-f32-wide exported to .xb/gf32w; ~5 min):
# float32 products of the AG, main against the branch on one machine, both engines, with the
# Gluon GEMM alone (engine_alone) that the branch's first drive could not build under Triton
# 3.6 (fixed on the branch). The branch's first drive ran on an H100 and main's last numbers
# are from an H200: this call gives both trees' numbers on one card. Predicted: the branch's
# Gluon AG ~1.05-1.12 x cuBLAS (it measured 1.052 / 1.082 bf16, 1.079 / 1.184 fp8), main's
# ~1.40-1.51 (128x128 tiles).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-ab; rm -rf $X; mkdir -p $X/main $X/branch $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
S=4096x8192x8192,8192x4096x4096
for tree in main branch; do
  dir=$PWD; [[ $tree == branch ]] && dir=$PWD/.xb/gf32w
  for dt in bfloat16 float8_e4m3fn; do
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 75 python3 -m jax_autooverlap.bench ag --loopback \
      --dtype $dt --out-dtype float32 --shapes $S --rounds 3 --calls 10 --engines tl,gluon \
      --tag $tree-f32-$dt --out $X/$tree > $X/$tree-f32-ag-$dt.log 2>&1)
  done
done
tar czf $OUT/x.tgz -C $X .
for f in $X/*.log; do echo "== $(basename $f)"; grep -E "x cuBLAS|failed|rror" $f | cut -c1-160; done
