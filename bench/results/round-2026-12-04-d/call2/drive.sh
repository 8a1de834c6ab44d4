#!/usr/bin/env bash
# Seventeenth round, call 2 (carry [".whl"]): the shape list's entries whose bound the committed
# runs still leave unknown ("?": 71 after call 1 took 44), each with only the configs that ran
# ours/ours_tl there (--configs-from: cuBLAS, that tl config fused and alone), as call 1.
set -uo pipefail
X=${OUT:-/tmp/out}; mkdir -p $X
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=bench/results/shapes-runs.txt
timeout 560 python3 -m jax_autooverlap.bench shapes --loopback --bound-unknown-in $R \
  --configs-from $R --rounds 3 --calls 10 --time-budget 500 --tag unknown-2 --out $X \
  > $X/unknown-2.log 2>&1
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/unknown-2.log | cut -c1-200
