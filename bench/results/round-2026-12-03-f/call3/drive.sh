#!/usr/bin/env bash
# Thirteenth round, call 3: the twelfth round's chunk-by-chunk GEMM+RS tile order
# (round-2026-12-03-e/call2-chunk-order/rs_tile_of.patch) again, now on top of the column-block
# sum (.old/order), against HEAD (.old/base = this tree's kernels), world 8 with timelines; then
# the shape list's other TP 8 GEMM+RS training entries (4k and 16k tokens) on this tree.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
W8=8192x14336x4096,8192x28672x8192,8192x8192x8192
for tree in .old/base .old/order; do
  tag=$(basename $tree)
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag $tag --out $X > $X/$tag-w8.log 2>&1 )
done
SHAPES_TIMEOUT=230 SHAPES_ARGS="--filter w8 --filter rs --filter step --filter 'm4096|m16384|m1024|m2048' --engines gluon --variant gluon:wg_partitions=1 --time-budget 200 --tag w8-rs-4k-16k" \
  bash bench/run_device.sh shapes > $X/w8-rs-4k-16k.stdout 2>&1
mkdir -p $X/w8-rs-4k-16k && tar xzf $OUT/all.tgz -C $X/w8-rs-4k-16k && rm -f $OUT/all.tgz
tar czf $OUT/extra.tgz -C $X .
for f in base-w8 order-w8; do echo "== $f"; grep -E " gluon(_wg)?: [0-9]|ours timeline" $X/$f.log | sed -E "s/'main_us.remote.*//" | cut -c1-200; done
echo "== w8-rs-4k-16k"; tail -16 $X/w8-rs-4k-16k.stdout | cut -c1-200
