#!/usr/bin/env bash
# Split-K factor sweep at M = 128, w = 8 (loopback, tl packed tiles): the tuner splits each
# packed tile into min(8, SMs // tiles, k-blocks) parts (tuning/select.py), e.g. 6 tiles x 8 =
# 48 CTAs for Llama-3-8B Q/K/V. Do more parts (up to ~1 wave, or past it) beat that?
set -uo pipefail
X=/tmp/extra; mkdir -p $X
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
v() { for t in "128,128" "64,256"; do for k in "$@"; do
  echo --variant "tl:block_m=${t%,*},block_n=${t#*,},pack_shards=1,split_k=$k"; done; done; }
run() { op=$1 shape=$2; shift 2
  timeout 90 python3 -m jax_autooverlap.bench $op --loopback --world 8 --engines tl --shapes $shape \
    --rounds 3 --calls 10 $(v "$@") --tag $op-$shape --out $X > $X/$op-$shape.log 2>&1; }
run ag 128x4096x6144 8 12 16 22
run ag 128x8192x10240 8 13 16
run ag 128x4096x28672 4 8
run rs 128x14336x4096 4 8 16
run rs 128x4096x4096 4 8
tar czf ${OUT:-/tmp/out}/extra.tgz -C $X .
grep -hE " x cuBLAS|skipped|Error" $X/*.log | cut -c1-170
