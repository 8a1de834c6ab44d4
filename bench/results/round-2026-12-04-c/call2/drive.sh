#!/usr/bin/env bash
# The shape list's 8k-token training entries at TP 8, then TP 4, re-measured on both engines
# with every operand descriptor made on the host (Gluon 0e7b2cc, tl 70cd1e6): their last full
# measurement is the thirteenth round's (round-2026-12-03-f/shapes-table-all-measured.txt).
set -uo pipefail
X=/tmp/extra; mkdir -p $X
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv > $X/machine.log
python3 -c "import jax, triton, jax_triton; print(jax.__version__, triton.__version__, jax_triton.__version__)" >> $X/machine.log 2>&1
timeout 330 python3 -m jax_autooverlap.bench shapes --loopback --filter m8192 --filter w8 --rounds 3 --calls 10 \
  --time-budget 290 --tag w8-8k --out $X > $X/w8-8k.log 2>&1
timeout 200 python3 -m jax_autooverlap.bench shapes --loopback --filter m8192 --filter w4 --rounds 3 --calls 10 \
  --time-budget 160 --tag w4-8k --out $X > $X/w4-8k.log 2>&1
tar czf ${OUT:-/tmp/out}/extra.tgz -C $X .
grep -hE "^\[shapes.*cuBLAS|budget" $X/w8-8k.log $X/w4-8k.log | cut -c1-200
