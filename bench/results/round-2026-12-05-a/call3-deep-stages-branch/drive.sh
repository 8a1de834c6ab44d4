#!/usr/bin/env bash
# Ran 2026-12-05 (bench/results/round-2026-12-05-a/call3-deep-stages-branch/); the branch is merged
# (MAX_STAGES = 6) and its patch removed (git show fa0ffcb:bench/results/round-next-deep-stages/).
# Second GPU call of the next session, only if drive.sh (on main) showed deeper pipelines faster
# at small M (carry [".whl"]), on branch deep-stages (or main with `git apply
# bench/results/round-next-deep-stages/deep-stages.patch`): the small-shape configs
# (select.small_shape_configs: narrower tiles, split-K, packed) in their deepest fitting pipeline
# (select.deepest_stages, up to 8 stages), so the first call and the benchmark time those.
# Correctness first: the list's small-shape variants in loopback (both ops, both engines, every
# deep config against the unfused result, poisoned outputs, a bit-identical second call), the
# traced tl kernels, groups of 4 and 8; then the TP 8 / TP 4 entries at M = 128 and 256 with
# every variant (compare with drive.sh's same-day numbers), then the nested training step in 8
# processes sharing the GPU with every rank packed and split 4 (its explicit config: 3 stages).
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-deep-branch; rm -rf $X; mkdir -p $X $OUT
OUT=/tmp/o1 TEST_TIMEOUT=240 TEST_ARGS="-k 'small_shape_variants or traced_tl or groups_of_4_and_8'" \
  bash bench/run_device.sh tests-loopback > $X/tests.stdout 2>&1
cp /tmp/o1/all.tgz $X/tests.tgz
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m jax_autooverlap.bench shapes --loopback --filter 'w8|w4' \
  --filter 'm128|m256' --rounds 3 --calls 10 --time-budget 160 --tag deep-branch --out $OUT \
  > $X/shapes.log 2>&1
OUT=/tmp/o2 AO_STEP_DIMS=4096,2048,128,2 HARNESS_TIMEOUT=100 \
  HARNESS_ARGS="--scenario nested_step --packed --split-k 4 --world 8 --budget-s 90" \
  bash bench/run_device.sh two-process > $X/harness.stdout 2>&1
cp /tmp/o2/all.tgz $X/harness.tgz
rm -f $X/*.npz
tar czf $OUT/x.tgz -C $X .
grep -E "passed|failed|FAILED|ERROR" $X/tests.stdout | cut -c1-160 | tail -8
grep -hE "^\[shapes.*cuBLAS|budget|failed" $X/shapes.log | cut -c1-220
grep -E "PASS|FAIL" $X/harness.stdout | tail -6
