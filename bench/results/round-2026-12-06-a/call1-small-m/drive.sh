#!/usr/bin/env bash
# A GPU call on main (carry [".whl"]): the shape list's small-M entries of TP 4 and 8 again, now
# that their small-shape configs run the deepest fitting pipeline up to 6 stages (merged in the
# twentieth session; select.MAX_STAGES). 14 of the 108 entries, spread over the list, each
# timing what a first call would (--first-call-candidates) beside the tuner's configs.
# Predicted from the deep-stages call (round-2026-12-05-a/call2): ours -10...-30 % where a
# part's k-loop has >= 16 k-blocks, unchanged (+-3 %) on the short split parts and the o
# projections. Afterwards: commit the records in a round directory, add them to
# bench/results/shapes-runs.txt, rebuild the table (`python -m jax_autooverlap.bench shapes
# --loopback --table-from bench/results/shapes-runs.txt`) and re-run `--first-call-coverage`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
OUT=/tmp/o-small SHAPES_TIMEOUT=380 SHAPES_ARGS="--filter small --filter 'w4|w8' \
  --max-shapes 14 --first-call-candidates --rounds 3 --calls 10 --time-budget 330 \
  --tag small-deep" bash bench/run_device.sh shapes > /tmp/small.stdout 2>&1
cp /tmp/o-small/all.tgz $OUT/shapes.tgz
grep -E "WRONG|failed|budget|target met" /tmp/small.stdout | cut -c1-200 | tail -8
