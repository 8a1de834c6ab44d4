#!/usr/bin/env bash
# One device call: install the carried wheels, check the machine, run the GPU tests and the AG
# benchmark.  Logs and JSON go to $OUT.  Usage (device tool): bash bench/run_device.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  python3 -c "import jax, jaxlib, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__); print(jax.devices())"
  env | grep -E "NCCL|NVSHMEM|TORCH_SYMM|XLA" || true
} 2>&1 | tee "$OUT/machine.log"
if [[ $what == tests || $what == all ]]; then
  timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_ag.py -p no:cacheprovider -x ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-420} python3 -m jax_autooverlap.bench ag --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
