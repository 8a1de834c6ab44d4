#!/usr/bin/env bash
# Fifteenth round, call 4: (1) why bf16 GEMM+RS 1024x8192x8192 (128x256) dropped 25 us with the
# host descriptors (call 2: 0.1213 -> 0.0956 ms) when ~2-3 us was predicted: timelines of this
# tree and HEAD before it (.old/base); (2) the capture tests' world-1 AG failure (also on HEAD
# before: call 3) with its traceback; (3) a sample of the bf16 shape list at M = 128 and 1024
# with the host descriptors (compare: round-2026-12-03-f/shapes-table-all-measured.txt).
# (agw1.py: call 3's helper under `with jax.set_mesh(mesh)`; git keeps it, commit 20b0209)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; X=/tmp/extra; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
for tree in . .old/base; do
  tag=$([[ $tree == . ]] && echo new || basename $tree)
  ( cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 50 python3 -m jax_autooverlap.bench rs --loopback --engines gluon \
      --shapes 1024x8192x8192 --trace --rounds 3 --calls 10 --tag $tag-rssmall --out $X > $X/$tag-rssmall-trace.log 2>&1 )
done
JAX_TRACEBACK_FILTERING=off timeout 60 python3 bench/results/round-2026-12-04-b/call4/agw1.py > $X/agw1.log 2>&1
for m in m128 m1024; do
  timeout 110 python3 -m jax_autooverlap.bench shapes --loopback --filter $m --max-shapes 8 \
    --rounds 3 --calls 10 --time-budget 95 --tag bf16-$m --out $X > $X/bf16-shapes-$m.log 2>&1
done
rm -f $X/*.npz $X/*.npz.tmp; tar czf $OUT/extra.tgz -C $X .
for t in new base; do echo "== $t"; grep -E " x cuBLAS|timeline" $X/$t-rssmall-trace.log | grep -E "gluon:|timeline" | sed -E "s/'main_us.remote[^}]*//" | cut -c1-760; done
echo "== agw1"; grep -vE "Warning|warn" $X/agw1.log | grep -E "ok|FAILED|Error|File \"/work" | tail -14 | cut -c1-200
for m in m128 m1024; do echo "== $m"; tail -n 11 $X/bf16-shapes-$m.log | cut -c1-200; done
