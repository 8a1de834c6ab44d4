#!/usr/bin/env bash
# A GPU call on main (carry [".whl"]; ~3 min): round-2026-12-06-a call 2 (rs-steps) found a
# spread split part's wait for its tile's other parts the largest step of the packed tl GEMM+RS's epilogue (4.8 us
# of 8.4 at 128x4096x4096 and 128x14336x4096, w = 8, tl-128x128-k4-p; push 3.3, own 0.06),
# where it was predicted small. The timeline now splits that wait (timeline.parts_wait_steps)
# into the skew (this part's main-loop end to the last one among its tile's parts) and the
# release (that end to this part's PARTS_IN: the last part's 64 KB fp32 partial stored,
# counted with an acq_rel add, and seen by this part's poll). Expected: release ~4 us (the
# parts start within 0.3 us of each other and their main loops take the same time), skew < 1.
# Beside it, fewer parts: select.split_parts fills one wave (128 CTAs: split 4 of the 32 packed
# 128x128 tiles), so at K = 512 per rank (128x4096x4096, 8 k-blocks) each part runs 2 k-blocks
# and the parts' fp32 partials (8 MB written, 8 MB read) outweigh B (4 MB). Predicted: split 2
# faster than split 4 there (~11-12 us against 15.5), split 4 still best at K = 1792
# (128x14336x4096); also 128x8192x8192 (K = 1024 per rank) and 256x4096x4096; unsplit 128x128 and 128x64 (64 CTAs, no split: its 64 tiles exceed the
# 62 split counters) between. If so, split_parts should keep a part's k-loop long enough.
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-parts; rm -rf $X; mkdir -p $X $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for s in 128x14336x4096 128x4096x4096 128x8192x8192 256x4096x4096; do
  timeout 120 python3 -m jax_autooverlap.bench rs --loopback --world 8 --shapes $s --engines tl \
    --trace --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=4 \
    --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=2 \
    --variant tl:block_m=128,block_n=128,pack_shards=1,split_k=1 \
    --variant tl:block_m=128,block_n=64,num_warps=4,pack_shards=1,split_k=1 \
    --rounds 3 --calls 10 --tag parts-wait-$s --out $X > $X/parts-wait-$s.log 2>&1
done
tar czf $OUT/x.tgz -C $X .
grep -hE "timeline|x cuBLAS|rror" $X/parts-wait-*.log | grep -E "ours-|rror" | cut -c1-900
