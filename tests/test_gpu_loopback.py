"""Fused kernels in loopback on ONE GPU (marked gpu; skipped without an NVIDIA GPU).

Rank 0 of a group of two whose peer is a second buffer on the same GPU
(bench/loopback.py): the output must match the unfused computation, what
rank 0 pushed into the peer's buffer must match what the peer needs, and a
second call (other parity slot) must give bit-identical results.  Every
engine the backend has, on shapes with full and ragged tiles.
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
  want = np.concatenate([np.asarray(loop.a), np.asarray(loop.peer)])
  for _ in range(2):
    _, gathered = program(*loop.fused_args())
    check_errors()
    np.testing.assert_array_equal(np.asarray(gathered), want)


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


@pytest.mark.skipif("gluon" not in ENGINES, reason="the timeline is the Gluon kernels'")
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_traced_gluon_kernel_computes_what_the_plain_one_does(op):
  """--trace builds (kernels/gluon_trace.py) only add clock stamps: the same output bit for bit
  as the plain build, and a timeline row for every tile."""
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
