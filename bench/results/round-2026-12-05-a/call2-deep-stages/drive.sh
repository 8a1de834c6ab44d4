#!/usr/bin/env bash
# First GPU call of the next session (carry [".whl"]), on main: deeper operand pipelines at small M.
# The entries the list misses at small M are bound by the kernel alone (121 of 209), and the
# kernel alone loses to cuBLAS by 1.1-2.25 x even where its tiles fill every SM (one wave of 128
# 128x128 tiles, 70B down TP 8 M = 256: 35.6 us against 22.9). cuBLAS runs those GEMMs with
# 64-row tiles and 4-8 operand stages (nvjet_sm90_tss_128x64_64x8, _256x64_64x5,
# _320x64_64x4: ~190-200 KB in flight per SM); ours run 3 stages (96-120 KB). The records say
# our loop waits: the kernel alone takes ~0.58 us a k-block at 128x128 and 64x256 and 0.72 at
# 128x256 (twice the MMA work; tensor cores: 0.28 and 0.56), ~1.1 us a stage's round trip with
# two loads ahead. Predicted: the tl kernel alone at these entries -25...-45 % with 5-6 stages
# (128x128: 0.58 -> ~0.30 us a k-block), ours with it; no change where the loop does not wait.
# `bench shapes --configs-from RUNS --stages 4,5,6,8`: each entry's recorded ours/ours_tl
# configs (3 stages) and each again in 4, 5, 6 and 8 stages where its shared memory fits
# (select.shared_memory), every variant checked against the unfused result before it is timed,
# each tl variant alone too; 22 small-M entries of TP 4 and 8 spread over the list.
set -uo pipefail
OUT=${OUT:-/tmp/out}; X=/tmp/x-deep-stages; rm -rf $X; mkdir -p $X $OUT
OUT=/tmp/o-deep SHAPES_TIMEOUT=540 SHAPES_ARGS="--configs-from bench/results/shapes-runs.txt \
  --stages 4,5,6,8 --filter small --filter 'w4|w8' --max-shapes 22 --rounds 3 --calls 10 \
  --time-budget 480 --tag deep-stages" bash bench/run_device.sh shapes > $X/shapes.stdout 2>&1
cp /tmp/o-deep/all.tgz $OUT/shapes.tgz
mkdir -p $X/o && tar xzf /tmp/o-deep/all.tgz -C $X/o
grep -E "WRONG|failed|budget" $X/shapes.stdout | cut -c1-200 | tail -8
# per entry: each recorded config's time / cuBLAS at each depth (s3: as recorded), and alone
python3 - $X/o/*-shapes-loopbackdeep-stages.json <<'PY'
import json, re, sys
for r in json.load(open(sys.argv[1])):
  if r["impl"] == "gemm_alone":
    gemm = r["median_ms"]
  if r["impl"] != "ours":
    continue
  rows = {}
  for name, ms in r["variants_ms"].items():
    base, depth = (re.fullmatch(r"(.*)-s(\d+)", name) or re.fullmatch(r"(.*)()", name)).groups()
    rows.setdefault(base, {})[int(depth or 3)] = ms / gemm
  for base, by in rows.items():
    print(f"{r['model']:>13} {r['projection']:>7} {r['op']} w{r['world_size']} m{r['m']:<5} "
          f"cuBLAS {gemm * 1e3:6.1f} us {base:>18}: "
          + "  ".join(f"s{d} {v:.3f}" for d, v in sorted(by.items())))
PY
