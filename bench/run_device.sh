#!/usr/bin/env bash
# One device call: install the carried wheels, log the machine, then run the steps asked for.
# Usage (device tool, carry [".whl"]): bash bench/run_device.sh STEP...
#   (TRITON39=1 and carry [".whl", ".t39"]: the steps run under Triton 3.9: bench/triton39.sh)
#   tests-ag | tests-rs   the GPU tests of one kernel (pytest -m gpu; TEST_ARGS passed on)
#   bench-ag | bench-rs | bench-model   python -m jax_autooverlap.bench ag|rs|model (BENCH_ARGS passed on)
#   test:tests/FILE.py    pytest -m gpu on one test file (TEST_ARGS passed on)
#   launch-cost           python -m jax_autooverlap.bench.launch_cost (host cost of a launch)
#   tests-loopback | tests-gluon_gemm   one-GPU tests: fused kernels in loopback, the Gluon engine's GEMM
#   loopback-ag | loopback-rs   python -m jax_autooverlap.bench ag|rs --loopback (one GPU; BENCH_ARGS)
#   ab-ag | ab-rs         loopback-ag|rs in this tree (tag "new") and in each tree of AB_TREES (space-
#                         separated dirs holding an older jax_autooverlap/, carried, e.g. made by
#                         `git archive REV jax_autooverlap | tar -x -C .old/base`; tag: the dir's
#                         name), one after the other in one call, each bounded by BENCH_TIMEOUT;
#                         then every tree's ratio lines, grouped by shape
#   shapes                python -m jax_autooverlap.bench shapes --loopback (the LLM shape list;
#                         SHAPES_ARGS, split like BENCH_ARGS: filters, rounds; its table last)
#   engine                python -m jax_autooverlap.bench.engine (one GPU; BENCH_ARGS)
#   ncu-engine            bench/ncu_engine.py: hardware counters, engine vs cuBLAS (BENCH_ARGS)
#   first-call            tests/gpu_two_process.py --scenario first_call --parallel: groups of WORLDS
#                         (default 8,4,2) processes sharing the GPU, all at once, the default
#                         config's first-call measurement, run twice on one cache per group;
#                         bounded by FIRST_CALL_BUDGET_S (default 270); the table last;
#                         FIRST_CALL_SERIAL=1: one group size after the other
#   two-process           tests/gpu_two_process.py with HARNESS_ARGS (split like BENCH_ARGS; e.g.
#                         "--scenario nested_step --packed --world 8,4,2"; AO_STEP_DIMS passed on),
#                         bounded by HARNESS_TIMEOUT (default 330)
#   any/path.py           a Python script run in the same environment (experiments; SCRIPT_ARGS
#                         passed on, e.g. SCRIPT_ARGS=--background-only for bench/own_round.py)
# TEST_ARGS, BENCH_ARGS and SCRIPT_ARGS are split as a shell would split them: TEST_ARGS="-k 'a or b'" works.
# Logs and JSON go to $OUT (returned as $OUT/all.tgz); each step is bounded by `timeout`.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# TRITON39=1 (carry .t39 too, made by `bash bench/triton39.sh pack`): Triton 3.9 ahead of the machine's 3.6
if [[ -n ${TRITON39:-} ]]; then . bench/triton39.sh install || exit 1; fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  python3 -c "import jax, jaxlib, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__); print(jax.devices())"
  env | grep -E "NCCL|NVSHMEM|TORCH_SYMM|XLA" || true
} 2>&1 | tee "$OUT/machine.log"
eval "test_args=(${TEST_ARGS:-})" && eval "bench_args=(${BENCH_ARGS:-})" || exit 2
eval "shapes_args=(${SHAPES_ARGS:-})" || exit 2
eval "harness_args=(${HARNESS_ARGS:-})" || exit 2
eval "script_args=(${SCRIPT_ARGS:-})" || exit 2
rc=0
for step in "$@"; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    tests-ag|tests-rs|tests-loopback|tests-gluon_gemm)
      timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu "tests/test_gpu_${step#tests-}.py" \
        -p no:cacheprovider "${test_args[@]}" 2>&1 | tee "$OUT/$step.log" ;;
    bench-ag|bench-rs|bench-model)
      timeout ${BENCH_TIMEOUT:-420} python3 -m jax_autooverlap.bench "${step#bench-}" --out "$OUT" \
        "${bench_args[@]}" 2>&1 | tee "$OUT/$step.log" ;;
    test:*)
      f=${step#test:}
      timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu "$f" -p no:cacheprovider \
        "${test_args[@]}" 2>&1 | tee "$OUT/$(basename "$f" .py).log" ;;
    launch-cost)
      timeout ${BENCH_TIMEOUT:-420} python3 -m jax_autooverlap.bench.launch_cost --out "$OUT" \
        2>&1 | tee "$OUT/launch-cost.log" ;;
    loopback-ag|loopback-rs)
      timeout ${BENCH_TIMEOUT:-420} python3 -m jax_autooverlap.bench "${step#loopback-}" --loopback \
        --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/$step.log" ;;
    ab-ag|ab-rs)
      op=${step#ab-}
      for tree in . ${AB_TREES:-}; do
        tag=$([[ $tree == . ]] && echo new || basename "$tree")
        mkdir -p "$OUT/ab-$tag"
        ( cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout ${BENCH_TIMEOUT:-420} python3 -m \
            jax_autooverlap.bench "$op" --loopback --out "$OUT/ab-$tag" --tag "$tag" \
            "${bench_args[@]}" ) > "$OUT/ab-$tag/loopback-$op.log" 2>&1
        s=$?; [[ $s != 0 ]] && { echo "=== ab: $tree failed: rc $s"; rc=$s; }
      done
      # "TAG SHAPE ENGINE: ms (ratio x cuBLAS)", grouped by shape
      grep -H " x cuBLAS" "$OUT"/ab-*/loopback-"$op".log \
        | sed -E 's#^.*/ab-([^/]+)/[^:]*:\[loopback [0-9:]+\] [a-z]+ #\1 #' \
        | sort -s -k2,2 | tee "$OUT/ab-$op.txt"
      (exit $rc) ;;
    shapes)
      timeout ${SHAPES_TIMEOUT:-${BENCH_TIMEOUT:-420}} python3 -m jax_autooverlap.bench shapes \
        --loopback --out "$OUT" "${shapes_args[@]}" 2>&1 | tee "$OUT/shapes.log" ;;
    engine)
      timeout ${BENCH_TIMEOUT:-420} python3 -m jax_autooverlap.bench.engine --out "$OUT" \
        "${bench_args[@]}" 2>&1 | tee "$OUT/engine.log" ;;
    ncu-engine)
      timeout ${BENCH_TIMEOUT:-420} python3 bench/ncu_engine.py --out "$OUT" "${bench_args[@]}" \
        2>&1 | tee "$OUT/ncu-engine.log" ;;
    first-call)
      timeout $(( ${FIRST_CALL_BUDGET_S:-270} + 30 )) python3 tests/gpu_two_process.py \
        $([[ -n ${FIRST_CALL_SERIAL:-} ]] || echo --parallel) \
        --scenario first_call --world "${WORLDS:-8,4,2}" --budget-s "${FIRST_CALL_BUDGET_S:-270}" \
        --log "$OUT/first-call.log" 2>&1 | tee "$OUT/first-call.stdout" | tail -40 ;;
    two-process)
      timeout ${HARNESS_TIMEOUT:-330} python3 tests/gpu_two_process.py "${harness_args[@]}" \
        --log "$OUT/two-process.log" 2>&1 | tee "$OUT/two-process.stdout" | tail -40 ;;
    *.py)
      timeout ${SCRIPT_TIMEOUT:-300} python3 "$step" "${script_args[@]}" 2>&1 \
        | tee "$OUT/$(basename "$step" .py).log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  s=${PIPESTATUS[0]}; [[ $s != 0 ]] && { echo "=== $step failed: rc $s"; rc=$s; }
done
# The device tool brings back at most 8 files: everything goes back as one archive.
tar czf /tmp/all.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/all.tgz "$OUT/all.tgz"
exit $rc
