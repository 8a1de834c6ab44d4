#!/usr/bin/env bash
# Thirteenth round, call 1: the own-tile round in isolation (bench/own_round.py, with the new
# halves / quarters modes), then Gluon GEMM+RS with the peers' partials in column blocks
# (SUM_PARTS 2: this tree, "halves"; 4: .old/quarters) against HEAD (.old/base), timelines at
# world 8; then the loopback RS Gluon tests on this tree.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
SCRIPT_TIMEOUT=90 bash bench/run_device.sh bench/own_round.py > $X/own_round.stdout 2>&1
tar xzf $OUT/all.tgz -C $X && rm -f $OUT/all.tgz
export PYTHONPATH=/tmp/site:$PWD
W8=8192x14336x4096,8192x28672x8192,8192x8192x8192
W4=8192x14336x4096,8192x8192x8192
for tree in . .old/base .old/quarters; do
  tag=$([[ $tree == . ]] && echo halves || basename $tree)
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 110 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $W8 --engines gluon --trace --rounds 3 --tag $tag --out $X > $X/$tag-w8.log 2>&1 )
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m jax_autooverlap.bench rs --loopback --world 4 --shapes $W4 --engines gluon --rounds 3 --tag $tag-w4 --out $X > $X/$tag-w4.log 2>&1 )
done
timeout 90 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -x \
  -k 'rs and gluon' > $X/tests-halves.log 2>&1
tar czf $OUT/extra.tgz -C $X .
grep "own_round\]" $X/own_round.log | cut -c1-120
for f in halves-w8 base-w8 quarters-w8 halves-w4 base-w4 quarters-w4; do echo "== $f"; grep -E " gluon(_wg)?: |ours timeline|FAIL|Error|error" $X/$f.log | sed -E "s/'main_us.remote.*//" | cut -c1-230 | tail -9; done
echo "== tests"; tail -2 $X/tests-halves.log | cut -c1-300
