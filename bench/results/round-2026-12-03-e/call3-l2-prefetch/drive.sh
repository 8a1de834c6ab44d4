#!/usr/bin/env bash
# Twelfth round, call 3: every peer's partial of an own tile prefetched into L2 at the start of
# its epilogue (pf: owner-major order, this tree; ordpf: with rs_tile_of's chunk order,
# .old/ordpf), against call 2's numbers; the GEMM+RS Gluon loopback tests on both.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
W8=8192x14336x4096,8192x28672x8192,8192x8192x8192
W4=8192x14336x4096,8192x8192x8192
BENCH_TIMEOUT=120 BENCH_ARGS="--world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag pf" \
  bash bench/run_device.sh loopback-rs > $X/pf-w8.stdout 2>&1
mv $OUT/all.tgz $X/pf-w8.tgz
export PYTHONPATH=/tmp/site:$PWD
timeout 60 python3 -m jax_autooverlap.bench rs --loopback --world 4 --shapes $W4 --engines gluon --rounds 3 --tag pf-w4 --out $X > $X/pf-w4.log 2>&1
( cd .old/ordpf && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag ordpf --out $X > $X/ordpf-w8.log 2>&1 )
( cd .old/ordpf && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m jax_autooverlap.bench rs --loopback --world 4 --shapes $W4 --engines gluon --rounds 3 --tag ordpf-w4 --out $X > $X/ordpf-w4.log 2>&1 )
timeout 75 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -x \
  -k 'rs and gluon' > $X/tests-pf.log 2>&1
( cd .old/ordpf && PYTHONPATH=/tmp/site:$PWD timeout 75 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -x -k 'rs and gluon' > $X/tests-ordpf.log 2>&1 )
tar czf $OUT/extra.tgz -C $X .
for f in pf-w8.stdout ordpf-w8.log pf-w4.log ordpf-w4.log; do echo "== $f"; grep -E " gluon(_wg)?: |ours timeline|FAIL|Error|error" $X/$f | sed -E "s/'main_us.remote.*//" | cut -c1-260 | tail -9; done
for f in tests-pf.log tests-ordpf.log; do echo "== $f"; tail -2 $X/$f | cut -c1-300; done
