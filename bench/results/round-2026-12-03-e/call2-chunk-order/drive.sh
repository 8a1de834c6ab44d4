#!/usr/bin/env bash
# Twelfth round, call 2: GEMM+RS in rs_tile_of's chunk-by-chunk order (new) against the
# owner-major order (old: .old/base = a977d69), then the loopback GPU tests of GEMM+RS.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
W8=8192x14336x4096,8192x28672x8192,8192x8192x8192
W4=8192x14336x4096,8192x8192x8192
BENCH_TIMEOUT=150 BENCH_ARGS="--world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag new" \
  bash bench/run_device.sh loopback-rs > $X/new-w8.stdout 2>&1
mv $OUT/all.tgz $X/new-w8.tgz
export PYTHONPATH=/tmp/site:$PWD
timeout 80 python3 -m jax_autooverlap.bench rs --loopback --world 4 --shapes $W4 --engines gluon,tl --rounds 3 --tag new-w4 --out $X > $X/new-w4.log 2>&1
( cd .old/base && PYTHONPATH=/tmp/site:$PWD timeout 130 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag old --out $X > $X/old-w8.log 2>&1 )
( cd .old/base && PYTHONPATH=/tmp/site:$PWD timeout 80 python3 -m jax_autooverlap.bench rs --loopback --world 4 --shapes $W4 --engines gluon,tl --rounds 3 --tag old-w4 --out $X > $X/old-w4.log 2>&1 )
timeout ${TEST_T:-130} python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider \
  -k 'rs or traced' > $X/tests.log 2>&1
tar czf $OUT/extra.tgz -C $X .
for f in new-w8.stdout old-w8.log new-w4.log old-w4.log; do echo "== $f"; grep -E "x cuBLAS|ours timeline|FAIL|Error|error" $X/$f | sed -E "s/'first_tile_at_us.*//" | cut -c1-300 | tail -12; done
tail -5 $X/tests.log
