#!/usr/bin/env bash
# Twelfth round, call 1: the round stamps on HEAD, the all-peers-wait candidate (467b548) A/B, tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
S=8192x14336x4096,8192x28672x8192
BENCH_TIMEOUT=150 BENCH_ARGS="--world 8 --shapes $S --engines gluon --trace --rounds 3 --tag head" \
  bash bench/run_device.sh loopback-rs > $X/head-w8.stdout 2>&1
mv $OUT/all.tgz $X/head-w8.tgz
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -k 'traced_gluon' > $X/tests-head.log 2>&1
( cd .old/rounds && PYTHONPATH=/tmp/site:$PWD timeout 130 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $S --engines gluon --trace --rounds 3 --tag rounds --out $X/rounds > $X/rounds-w8.log 2>&1 )
( cd .old/rounds && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_loopback.py -p no:cacheprovider -k '(rs and gluon) or traced_gluon or tp8_down' > $X/tests-rounds.log 2>&1 )
tar czf $OUT/extra.tgz -C $X .
for f in head-w8.stdout rounds-w8.log; do echo "== $f"; grep -E "x cuBLAS|round_us|timeline|FAIL|Error|error" $X/$f | cut -c1-400 | tail -14; done
echo "== tests head"; tail -3 $X/tests-head.log; echo "== tests rounds"; tail -5 $X/tests-rounds.log
