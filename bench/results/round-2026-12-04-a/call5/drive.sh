#!/usr/bin/env bash
# Fourteenth round, call 5 (the last ~4 minutes of device time): per-tile timelines of the Gluon
# AG at 8192x4096x4096, w = 2, fp8 and bf16: where does fp8's 8 % over its engine go, now that
# the push is not the limit (call 3)? Hypothesis: a peer tile's chunk poll (system-scope acquire)
# and its first loads outlast the producer's 3-stage lead, which lasts half as long in fp8.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
for dt in float8_e4m3fn bfloat16; do
  timeout 70 python3 -m jax_autooverlap.bench ag --loopback --dtype $dt --engines gluon --shapes 8192x4096x4096 \
    --trace --rounds 3 --calls 10 --tag $dt --out $X > $X/ag-trace-$dt.log 2>&1
done
rm -f $X/*.npz.tmp; tar czf $OUT/extra.tgz -C $X .
for dt in float8_e4m3fn bfloat16; do echo "== $dt"; grep -E " x cuBLAS|timeline" $X/ag-trace-$dt.log | cut -c1-900; done
