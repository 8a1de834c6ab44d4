#!/usr/bin/env bash
# Fourteenth round, call 4 (the session's last device time): the rest of the fp8 shape list at
# 8k tokens (TP 2, and the TP 4/8 entries calls 1-3 did not reach), with the 8 KB mover boxes.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=bench/results/round-2026-12-04-a
timeout 420 python3 -m jax_autooverlap.bench shapes --loopback --dtype float8_e4m3fn --filter m8192 \
  --skip-measured $R/call1/files/*shapes-loopback*.json $R/call2/files/*shapes-loopback*.json $R/call3/files/*shapes-loopback*.json \
  --rounds 3 --calls 10 --time-budget 370 --tag fp8-8k-rest --out $X > $X/fp8-shapes-rest.log 2>&1
tar czf $OUT/extra.tgz -C $X .
tail -24 $X/fp8-shapes-rest.log | cut -c1-200
