"""Fused kernels in loopback on ONE GPU (marked gpu; skipped without an NVIDIA GPU).

Rank 0 of a group of two, four or eight whose peers are buffers on the same
GPU (bench/loopback/): the output must match the unfused computation, what
rank 0 pushed into each peer's buffer must match what that peer needs, and a
second call (other parity slot) must give bit-identical results.  Every
engine the backend has, on shapes with full and ragged tiles, and on
per-rank shapes of tensor parallelism over 4 and 8 GPUs (bench/data/llm_shapes.json).
"""
import dataclasses

import jax
import numpy as np
import pytest

from jax_autooverlap.bench import loopback as lb

pytestmark = pytest.mark.gpu

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS:
  pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

# the Gluon engine is for sm_90 (wgmma, setmaxnreg)
ENGINES = ["tl"] + (["gluon"] if str(getattr(GPUS[0], "compute_capability", "")) == "9.0" else [])
SHAPES = {"ag": [(512, 1024, 1024), (600, 1024, 1280), (4096, 8192, 8192)],
          "rs": [(512, 1024, 1024), (1200, 1024, 1280), (4096, 8192, 8192)]}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op_shape", [(op, s) for op in SHAPES for s in SHAPES[op]],
                         ids=lambda x: f"{x[0]}-{'x'.join(map(str, x[1]))}")
def test_loopback_matches_unfused(engine, op_shape):
  from jax_autooverlap.runtime import cuda
  op, (m, k, n) = op_shape
  case = lb.Case(op, m, k, n)
  loop = lb.Loopback(case, GPUS[0], seed=m + k + n)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  program = lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id))
  res = loop.check(program)
  assert res["rel_err"] <= 2e-2, res
  assert res["push_rel_err"] <= (0.0 if op == "ag" else 1e-2), res  # ag pushes a copy of a
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("world,k", [(2, 416), (8, 8 * 3696)], ids=["w2-k208", "w8-k3696"])
def test_loopback_rs_with_a_ragged_k_matches_unfused(engine, dtype, world, k):
  """GEMM+RS with a per-GPU K that is not a multiple of the k-block (Qwen2-72B's down
  projection at TP = 8: 3696): the last k-block's TMA loads are zero-filled past K."""
  from jax_autooverlap.bench.loopback import cli
  from jax_autooverlap.runtime import cuda
  if dtype != "bfloat16" and str(getattr(GPUS[0], "compute_capability", "")) != "9.0":
    pytest.skip("fp8 wgmma kernels are for sm_90")
  case = lb.Case("rs", 1024, k, 1280, dtype=dtype, world=world)
  loop = lb.Loopback(case, GPUS[0], seed=k)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  res = loop.check(lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id),
                                    poison=True))
  tol = cli.max_rel_err(case)
  assert res["rel_err"] <= tol and res["push_rel_err"] <= tol, res
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_loopback_on_a_grown_workspace_matches_unfused(engine, op):
  """Workspaces grown for a larger call (runtime/workspace.py): parity slot 1 lies half-way
  through the buffer area, not right after slot 0; output, pushes and the second call (slot 1)
  as on an exactly sized workspace."""
  from jax_autooverlap.runtime import cuda
  case = lb.Case(op, 600 if op == "ag" else 1200, 1024, 1280, spare=3 * 4096 + 48)
  loop = lb.Loopback(case, GPUS[0], seed=7)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  res = loop.check(lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id),
                                    poison=True))
  assert res["rel_err"] <= 2e-2, res
  assert res["push_rel_err"] <= (0.0 if op == "ag" else 1e-2), res
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", [(600, 1024, 1280), (4096, 8192, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_loopback_ag_returns_the_gathered_shards(engine, shape):
  """With return_gathered the kernel also copies every shard, as it arrives, into `gathered`
  (the Gluon engine's mover does it with TMA box copies): own shard first (rank 0), then the
  peer's, bit for bit, in both parity slots."""
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import check_errors
  case = lb.Case("ag", *shape)
  loop = lb.Loopback(case, GPUS[0], seed=sum(shape))
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  program = lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id),
                             return_gathered=True)
  want = np.asarray(loop.gathered())
  for _ in range(2):
    _, gathered = program(*loop.fused_args())
    check_errors()
    np.testing.assert_array_equal(np.asarray(gathered), want)


# Global M x K x N of the list's projections (bench/data/llm_shapes.json) whose per-rank GEMMs
# at TP = 4 and 8 are narrow (Q/K/V, O), small-K (O, down), tiny-M (128 tokens: a shard of
# 16 rows at TP = 8) or wide (gate/up).
GROUP_SHAPES = {"ag": [(8192, 4096, 6144),      # Llama-3-8B Q/K/V, 8k tokens
                       (128, 8192, 10240),      # Llama-3-70B Q/K/V, M = 128
                       (1024, 8192, 57344)],    # Llama-3-70B gate/up, M = 1024
                "rs": [(8192, 4096, 4096),      # Llama-3-8B O, 8k tokens (K = 512 at TP = 8)
                       (128, 28672, 8192),      # Llama-3-70B down, M = 128
                       (4096, 6144, 6144)]}     # Mixtral-8x22B O, 4k tokens


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [4, 8], ids=["w4", "w8"])
@pytest.mark.parametrize("op_shape", [(op, s) for op in GROUP_SHAPES for s in GROUP_SHAPES[op]],
                         ids=lambda x: f"{x[0]}-{'x'.join(map(str, x[1]))}")
def test_loopback_in_groups_of_4_and_8_matches_unfused(engine, world, op_shape):
  """Rank 0 of a group of `world`: its output (poisoned before the call: every element must be
  written) against the unfused result on fresh random inputs, its push into each of the
  world - 1 peers' buffers, and a bit-identical second call."""
  from jax_autooverlap.runtime import cuda
  op, (m, k, n) = op_shape
  case = lb.Case(op, m, k, n, world=world)
  loop = lb.Loopback(case, GPUS[0], seed=m + k + n + world)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  program = lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id), poison=True)
  res = loop.check(program)
  assert res["rel_err"] <= 2e-2, res
  assert res["push_rel_err"] <= (0.0 if op == "ag" else 1e-2), res
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("wg_partitions", [False, True], ids=["gluon", "gluon_wg"])
@pytest.mark.parametrize("shape", [(8192, 14336, 4096), (4096, 28672, 8192)],
                         ids=["8b-down", "70b-down"])
def test_loopback_gluon_rs_at_tp8_down_projections(wg_partitions, shape):
  """Gluon GEMM+RS at the typical TP = 8 training shapes (Llama-3 down projections, K = 1792
  and 3584 per GPU, 1024 and 512 output rows per GPU): rank 0's output against the unfused
  result (poisoned first), its pushes, and a bit-identical second call."""
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.tuning.config import KernelConfig
  if "gluon" not in ENGINES:
    pytest.skip("the Gluon engine needs compute capability 9.0")
  m, k, n = shape
  case = lb.Case("rs", m, k, n, world=8)
  cfg = KernelConfig(engine="gluon", wg_partitions=wg_partitions)
  loop = lb.Loopback(case, GPUS[0], seed=m + k + wg_partitions)
  program = lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id), poison=True)
  res = loop.check(program)
  assert res["rel_err"] <= 2e-2, res
  assert res["push_rel_err"] <= 1e-2, res
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [4, 8], ids=["w4", "w8"])
def test_loopback_ag_in_groups_returns_every_gathered_shard(engine, world):
  """With return_gathered in a group of `world`: own shard first, then sources 1 .. world - 1,
  bit for bit, in both parity slots."""
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import check_errors
  case = lb.Case("ag", 1024, 4096, 6144, world=world)
  loop = lb.Loopback(case, GPUS[0], seed=world)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, [engine])[engine]
  program = lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id),
                             return_gathered=True, poison=True)
  want = np.asarray(loop.gathered())
  for _ in range(2):
    _, gathered = program(*loop.fused_args())
    check_errors()
    np.testing.assert_array_equal(np.asarray(gathered), want)


@pytest.mark.skipif("gluon" not in ENGINES, reason="a Gluon kernel (sm_90)")
@pytest.mark.parametrize("world", [4, 8], ids=["w4", "w8"])
def test_gluon_rs_with_warpgroup_partitions_in_groups_matches_unfused(world):
  from jax_autooverlap.runtime import cuda
  case = lb.Case("rs", 8192, 4096, 4096, world=world)
  loop = lb.Loopback(case, GPUS[0], seed=world + 3)
  cfg = dataclasses.replace(lb.kernel_configs(case, GPUS[0].device_kind, ["gluon"])["gluon"],
                            wg_partitions=True)
  res = loop.check(lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id),
                                    poison=True))
  assert res["rel_err"] <= 2e-2 and res["push_rel_err"] <= 1e-2, res
  assert res["bit_identical_repeat"], res


@pytest.mark.skipif("gluon" not in ENGINES, reason="a Gluon kernel (sm_90)")
@pytest.mark.parametrize("world", [4, 8], ids=["w4", "w8"])
@pytest.mark.parametrize("op,shape,movers", [("ag", (128, 8192, 10240), 64),
                                             ("rs", (128, 28672, 8192), 8)],
                         ids=["ag-128x8192x10240-m64", "rs-128x28672x8192"])
def test_gluon_push_descriptors_made_per_tile_match_unfused(op, shape, movers, world):
  """Small shards in groups of 4 and 8, where a pushing CTA pushes fewer tiles (RS) or units
  (AG's mover) than it has peers: a push descriptor made per tile, at the push
  (backends/gluon.py _fewer_than_peers), rewritten only after the stores that used it."""
  from jax_autooverlap.backends import gluon
  from jax_autooverlap.backends.launch import ag_grid, rs_grid
  from jax_autooverlap.runtime import cuda
  case = lb.Case(op, *shape, world=world)
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  cfg = dataclasses.replace(lb.kernel_configs(case, GPUS[0].device_kind, ["gluon"])["gluon"],
                            num_comm=movers)
  rows, k, n = case.a_shape[0], case.a_shape[1], case.b_shape[1]
  if op == "ag":
    tm, _, num_comm, _, _ = ag_grid(rows, n, world, cfg, sms)
    assert gluon._fewer_than_peers(gluon._push_units(k, world, tm), num_comm, world)
  else:
    _, tm, tn, ctas, _ = rs_grid(rows, n, world, cfg, sms)
    assert gluon._fewer_than_peers((world - 1) * tm * tn, ctas, world)
  loop = lb.Loopback(case, GPUS[0], seed=world + movers)
  res = loop.check(lb.fused_program(case, cfg, sms, poison=True))
  assert res["rel_err"] <= 2e-2, res
  assert res["push_rel_err"] <= (0.0 if op == "ag" else 1e-2), res
  assert res["bit_identical_repeat"], res
  if op == "ag":  # the gathered copy too
    program = lb.fused_program(case, cfg, sms, return_gathered=True, poison=True)
    _, gathered = program(*loop.fused_args())
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(loop.gathered()))


def _small_variants():
  """(entry label, global case, variant name) of every variant the shape list's entries add for
  small shapes (narrower tiles on both engines, split-K and packed shards on tl:
  bench/loopback/cli.py fused_variants), in bf16 and (on sm_90) fp8 e4m3, at the first entry
  that adds it, groups of 8 first."""
  from jax_autooverlap.bench import shapes
  from jax_autooverlap.runtime import cuda
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  sm90 = str(getattr(GPUS[0], "compute_capability", "")) == "9.0"
  out, seen = [], set()
  for dtype in ("bfloat16", "float8_e4m3fn") if sm90 else ("bfloat16",):
    for e in sorted(shapes.load(), key=lambda e: -e.world):
      case = e.case(dtype)
      for name, cfg in lb.fused_variants(case, GPUS[0].device_kind, ENGINES, sms).items():
        if name in ("tl", "gluon", "gluon_wg") or (e.op, dtype, cfg) in seen:
          continue
        seen.add((e.op, dtype, cfg))
        out.append((e.label, case, name))
  return out


@pytest.mark.parametrize("label_case_name", _small_variants(),
                         ids=lambda x: f"{x[0]}-{x[1].dtype}-{x[2]}")
def test_small_shape_variants_match_unfused(label_case_name):
  """Every small-shape config of the list (64-row Gluon tiles, narrower tl tiles, split-K,
  packed shards), bf16 and fp8, as rank 0 of its entry's group: output (poisoned first)
  against the unfused result on fresh random inputs (fp8: the f32 product of the fp8 values,
  within the formats' error: cli.max_rel_err), pushes into every peer (AG's: the bytes), a
  bit-identical second call (split-K sums its parts in a fixed order)."""
  from jax_autooverlap.bench.loopback import cli
  from jax_autooverlap.runtime import cuda
  label, case, name = label_case_name
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  cfg = lb.fused_variants(case, GPUS[0].device_kind, ENGINES, sms)[name]
  loop = lb.Loopback(case, GPUS[0], seed=case.m + case.k + case.n + cfg.split_k)
  res = loop.check(lb.fused_program(case, cfg, sms, poison=True))
  tol = cli.max_rel_err(case)
  assert res["rel_err"] <= tol, res
  assert res["push_rel_err"] <= (0.0 if case.op == "ag" else tol if case.fp8 else 1e-2), res
  assert res["bit_identical_repeat"], res


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("op,shape,world,dtype", [
    ("ag", (4096, 8192, 8192), 2, "bfloat16"), ("rs", (4096, 8192, 8192), 2, "bfloat16"),
    ("ag", (128, 4096, 6144), 8, "bfloat16"), ("rs", (128, 4096, 4096), 8, "bfloat16"),
    ("ag", (600, 1024, 1280), 4, "bfloat16"), ("rs", (1200, 1024, 1280), 4, "bfloat16"),
    ("ag", (4096, 8192, 8192), 2, "float8_e4m3fn"), ("rs", (4096, 8192, 8192), 2, "float8_e4m3fn")],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_float32_products_match_unfused(engine, op, shape, world, dtype):
  """A float32 product of bf16 or fp8 operands (preferred_element_type=float32): every config a
  first call times for it on this engine (select.default_kernel's 128x128 tiles and, at small
  M, the narrow tiles, split-K and packed shards), as rank 0 of its group: the output
  (poisoned first) in float32 within the operands' error of the f32 product, GEMM+RS's
  partials pushed and summed in float32, a bit-identical second call."""
  from jax_autooverlap.bench.loopback import cli
  from jax_autooverlap.runtime import cuda
  if dtype != "bfloat16" and "gluon" not in ENGINES:
    pytest.skip("fp8 wgmma kernels are for sm_90")
  case = lb.Case(op, *shape, dtype=dtype, world=world, out="float32")
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  variants = cli.first_call_variants(case, GPUS[0].device_kind, [engine])
  assert variants, "a first call times nothing"
  loop = lb.Loopback(case, GPUS[0], seed=sum(shape) + world)
  tol = cli.max_rel_err(case)
  for name, cfg in variants.items():
    program = lb.fused_program(case, cfg, sms, poison=True)
    assert jax.eval_shape(program, *loop.fused_args()).dtype == np.float32
    res = loop.check(program)
    assert res["rel_err"] <= tol and res["push_rel_err"] <= tol, (name, res)
    assert res["bit_identical_repeat"], (name, res)


@pytest.mark.parametrize("op,shape,world", [("ag", (128, 4096, 6144), 8), ("rs", (128, 4096, 4096), 8),
                                            ("ag", (1024, 8192, 10240), 2)],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_tl_variants_alone_in_a_group_of_one_match_unfused(op, shape, world):
  """The benchmark's engine_alone_tl: every tl variant of the case run alone (cli.alone_case,
  alone_config: no peers) computes the local GEMM, poisoned output first, and again bit for
  bit."""
  from jax_autooverlap.runtime import cuda
  case = lb.Case(op, *shape, world=world)
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  one = lb.alone_case(case)
  loop = lb.Loopback(one, GPUS[0], seed=sum(shape))
  configs = {lb.alone_config(case, c) for c in lb.fused_variants(case, GPUS[0].device_kind,
                                                                  ["tl"], sms).values()}
  assert configs - {None}
  for cfg in configs - {None}:
    res = loop.check(lb.fused_program(one, cfg, sms, poison=True))
    assert res["rel_err"] <= 2e-2 and res["bit_identical_repeat"], (cfg, res)


def test_loopback_benchmark_writes_records(tmp_path):
  rc = lb.main(["rs", "--loopback", "--shapes", "1024x2048x1024", "--rounds", "2", "--calls", "3",
                "--out", str(tmp_path)])
  assert rc == 0
  (path,) = tmp_path.glob("*-rs-loopback.json")
  import json
  records = json.loads(path.read_text())
  impls = {r["impl"] for r in records}
  assert {"gemm_alone", "ours", "ours_tl"} <= impls
  for r in records:
    assert r["mode"] == "loopback" and r["world_size"] == 2 and r["median_ms"] > 0
    assert (r["m"], r["k"], r["n"]) == (1024, 2048, 1024)


def test_loopback_benchmark_in_a_group_of_8_writes_its_world(tmp_path):
  rc = lb.main(["ag", "--loopback", "--world", "8", "--shapes", "1024x2048x2048", "--rounds", "2",
                "--calls", "3", "--out", str(tmp_path)])
  assert rc == 0
  (path,) = tmp_path.glob("*-ag-w8-loopback.json")
  import json
  records = json.loads(path.read_text())
  assert {"gemm_alone", "ours", "ours_tl", "engine_alone_tl"} <= {r["impl"] for r in records}
  for r in records:
    assert r["world_size"] == 8 and r["local_gemm"] == [1024, 2048, 256]
  (alone,) = [r for r in records if r["impl"] == "engine_alone_tl"]
  (tl,) = [r for r in records if r["impl"] == "ours_tl"]
  assert alone["alone_world"] == 1 and alone["rel_err"] <= 2e-2 and alone["bit_identical_repeat"]
  assert alone["kernel"] == {**tl["kernel"], "pack_shards": False}


@pytest.mark.skipif("gluon" not in ENGINES, reason="the timeline is the Gluon kernels'")
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_traced_gluon_kernel_computes_what_the_plain_one_does(op):
  """--trace builds (kernels/gluon_trace.py) only add clock stamps: the same output bit for bit
  as the plain build, a timeline row for every tile, and every CTA's FRAME: the kernel's first
  statement before its consumers start, its last after they end."""
  from jax_autooverlap.bench import timeline
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import check_errors
  case = lb.Case(op, 4096, 8192, 8192)
  loop = lb.Loopback(case, GPUS[0], seed=11)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, ["gluon"])["gluon"]
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  plain = np.asarray(lb.fused_program(case, cfg, sms)(*loop.fused_args()))
  out, trace = lb.fused_program(case, cfg, sms, trace=True)(*loop.fused_args())
  check_errors()
  np.testing.assert_array_equal(np.asarray(out), plain)
  rows, cols = case.m // 2, (case.n // 2 if op == "ag" else case.n)
  tiles = 2 * -(-rows // cfg.block_m) * -(-cols // cfg.block_n)
  assert sorted(r["tile"] for r in timeline.tiles(np.asarray(trace))) == list(range(tiles))
  frames = timeline.frames(np.asarray(trace))
  assert len(frames) == len(trace) and all(f["entry"] < f["start"] < f["end"] < f["exit"]
                                    for f in frames), frames[:2]


def test_traced_tl_ag_computes_what_the_plain_one_does():
  """--trace with a tl --variant (kernels/tl_trace.py), on the packed split-K AG that the
  split sweep times (Llama-3-70B Q/K/V, TP 8, 128 tokens): the same output bit for bit as the
  plain build, and a timeline row for every work unit (2 row tiles x 5 column tiles x 8
  parts)."""
  from jax_autooverlap.bench import timeline
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import check_errors
  from jax_autooverlap.tuning.config import KernelConfig
  case = lb.Case("ag", 128, 8192, 10240, world=8)
  loop = lb.Loopback(case, GPUS[0], seed=12)
  cfg = KernelConfig(engine="tl", block_m=64, block_n=256, num_warps=8, pack_shards=True,
                     split_k=8, num_comm=32)
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  plain = np.asarray(lb.fused_program(case, cfg, sms)(*loop.fused_args()))
  out, trace = lb.fused_program(case, cfg, sms, trace=True)(*loop.fused_args())
  check_errors()
  np.testing.assert_array_equal(np.asarray(out), plain)
  assert sorted(r["tile"] for r in timeline.tiles(np.asarray(trace))) == list(range(80))


@pytest.mark.parametrize("packed", [True, False], ids=["packed-split4-w8", "w2"])
def test_traced_tl_rs_computes_what_the_plain_one_does(packed):
  """--trace with a tl GEMM+RS --variant (kernels/tl_trace.py): the same output bit for bit as
  the plain build, and a timeline row for every work unit: Llama-3-8B down at TP 8, 128 tokens,
  owners' rows packed and split in 4 (32 column tiles x 4 parts), and an unpacked group of 2
  (2 owners x 2 row tiles x 4 column tiles).  The packed parts (Spread: each finishes its own
  rows) stamp their epilogue's steps in order: the other parts' arrival, the push, the end."""
  from jax_autooverlap.bench import timeline
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import check_errors
  from jax_autooverlap.tuning.config import KernelConfig
  if packed:
    case, units = lb.Case("rs", 128, 14336, 4096, world=8), 128
    cfg = KernelConfig(engine="tl", block_m=128, block_n=128, num_warps=8, pack_shards=True,
                       split_k=4, num_comm=32)
  else:
    case, units = lb.Case("rs", 512, 1024, 1024, world=2), 16
    cfg = KernelConfig(engine="tl", block_m=128, block_n=256, num_warps=8)
  loop = lb.Loopback(case, GPUS[0], seed=13)
  sms = cuda.sm_count(GPUS[0].local_hardware_id)
  plain = np.asarray(lb.fused_program(case, cfg, sms)(*loop.fused_args()))
  out, trace = lb.fused_program(case, cfg, sms, trace=True)(*loop.fused_args())
  check_errors()
  np.testing.assert_array_equal(np.asarray(out), plain)
  recs = timeline.tiles(np.asarray(trace))
  assert sorted(r["tile"] for r in recs) == list(range(units))
  if packed:
    assert all(r["main_done"] <= r["parts_in"] <= r["pushed"] <= r["epilogue_done"] for r in recs)
  else:
    assert all(r["parts_in"] is None and r["pushed"] is None for r in recs)


@pytest.mark.skipif("gluon" not in ENGINES, reason="a Gluon kernel (sm_90)")
@pytest.mark.parametrize("shape", SHAPES["rs"], ids=lambda s: "x".join(map(str, s)))
def test_gluon_rs_with_warpgroup_partitions_matches_unfused(shape):
  """GEMM+RS with a consumer partition per warpgroup (autotuning may pick it): output, push
  and repeat as the plain kernel, ragged tiles included."""
  from jax_autooverlap.runtime import cuda
  case = lb.Case("rs", *shape)
  loop = lb.Loopback(case, GPUS[0], seed=sum(shape) + 1)
  cfg = lb.kernel_configs(case, GPUS[0].device_kind, ["gluon"])["gluon"]
  cfg = dataclasses.replace(cfg, wg_partitions=True)
  res = loop.check(lb.fused_program(case, cfg, cuda.sm_count(GPUS[0].local_hardware_id)))
  assert res["rel_err"] <= 2e-2 and res["push_rel_err"] <= 1e-2, res
  assert res["bit_identical_repeat"], res


_UNARMED = """
import jax, numpy as np
from jax_autooverlap.backends import triton as backend
from jax_autooverlap.bench import loopback as lb
from jax_autooverlap.bench.loopback.fixture import np_dtype, workspace_bytes
from jax_autooverlap.runtime import cuda
from jax_autooverlap.runtime.errors import CollectiveTimeoutError, check_errors, register_op
from jax_autooverlap.tuning.config import KernelConfig
op = {op!r}
case = lb.Case(op, 128, 1024, 1024, world=8)
loop = lb.Loopback(case, jax.devices()[0])
cfg = KernelConfig(engine="tl", block_m=128, block_n=128, num_warps=8, pack_shards=True,
                   num_comm=8)
common = dict(world=8, kernel=cfg, out_dtype=np_dtype(case.out_dtype),
              timeout_s=0.5, num_sms=cuda.sm_count(jax.devices()[0].local_hardware_id),
              op_id=register_op("packed " + op + " without its peers"),
              workspace_bytes=workspace_bytes(case))
launch = ((lambda *x: backend.launch_ag_gemm(*x, return_gathered=False, **common)) if op == "ag"
          else (lambda *x: backend.launch_gemm_rs(*x, **common)))
try:  # no set-up kernel: the peers' counters stay zero
  jax.block_until_ready(jax.jit(launch)(*loop.fused_args()))
  print("NO ERROR")
except Exception as e:
  print("XLA ERROR:", type(e).__name__)
try:
  check_errors()
  print("NO RECORD")
except CollectiveTimeoutError as e:
  print("TIMEOUT:", e)
"""


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_packed_waits_for_every_peer_at_once_time_out_naming_one(op):
  """The packed kernels wait for a row tile's sources (AG) or the own rows' pushes (GEMM+RS)
  all at once (kernels/sync.py wait_all_at_least): with no peer's counter armed, the call
  fails and the record names the op and the lowest peer missing, not a hang.  In a process of
  its own: the trap leaves the GPU context unusable."""
  import os
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-c", _UNARMED.format(op=op)], capture_output=True,
                        text=True, timeout=240,
                        env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  out = proc.stdout
  assert "XLA ERROR:" in out and "TIMEOUT:" in out, out[-2000:] + proc.stderr[-2000:]
  assert f"packed {op} without its peers: rank 0 timed out waiting for chunk" in out, out
  assert "from peer rank 1 (arrival counter 0, expected 1)" in out, out
