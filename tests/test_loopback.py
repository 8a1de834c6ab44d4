"""The one-GPU loopback benchmark's host side, on CPU: shapes, workspace image, device timing,
records and table.

(The kernels themselves run in tests/test_gpu_loopback.py, and compile in
tests/test_kernel_compile.py.)
"""
import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_autooverlap.bench import timing
from conftest import notebook_cell
from jax_autooverlap.bench.loopback import cli, fixture, programs
from jax_autooverlap.runtime import workspace
from jax_autooverlap.tuning.config import KernelConfig


def test_local_gemm_of_each_op_is_one_gpus_share():
  ag = fixture.Case("ag", 4096, 8192, 8192)
  assert ag.world == 2
  assert ag.local_gemm == (4096, 8192, 4096)          # gathered rows x this GPU's columns
  assert (ag.a_shape, ag.b_shape, ag.out_shape) == ((2048, 8192), (8192, 4096), (4096, 4096))
  rs = fixture.Case("rs", 16384, 8192, 28672)
  assert rs.local_gemm == (16384, 4096, 28672)        # this GPU's share of K
  assert (rs.a_shape, rs.b_shape, rs.out_shape) == ((16384, 4096), (4096, 28672), (8192, 28672))
  assert rs.piece_shape == rs.out_shape               # a peer's partial of rank 0's rows


@pytest.mark.parametrize("world", [4, 8])
def test_local_gemm_in_larger_groups_is_a_tp_ranks_gemm(world):
  """Llama-3-8B at 8k tokens: Q/K/V 8192x4096x6144 gathers, O 8192x4096x4096 scatters."""
  ag = fixture.Case("ag", 8192, 4096, 6144, world=world)
  assert ag.local_gemm == (8192, 4096, 6144 // world)
  assert (ag.a_shape, ag.b_shape, ag.out_shape) == ((8192 // world, 4096), (4096, 6144 // world),
                                                    (8192, 6144 // world))
  assert ag.piece_shape == ag.a_shape
  rs = fixture.Case("rs", 8192, 4096, 4096, world=world)
  assert rs.local_gemm == (8192, 4096 // world, 4096)
  assert (rs.a_shape, rs.b_shape, rs.out_shape) == ((8192, 4096 // world), (4096 // world, 4096),
                                                    (8192 // world, 4096))
  assert rs.piece_shape == rs.out_shape


def test_fp8_case_stores_b_k_major_and_scales_in_the_epilogue():
  """fp8 (bench --dtype float8_e4m3fn): b as [N, K] (what fp8 wgmma and cuBLASLt read), bf16
  products and RS partials, the epilogue scale (1/sqrt(local K), a power of two) in the
  table's spare word."""
  ag = fixture.Case("ag", 4096, 8192, 8192, dtype="float8_e4m3fn")
  assert ag.fp8 and ag.out_dtype == "bfloat16" and ag.piece_dtype == "float8_e4m3fn"
  assert (ag.a_shape, ag.b_shape) == ((2048, 8192), (4096, 8192))
  rs = fixture.Case("rs", 4096, 8192, 8192, dtype="float8_e5m2", b_dtype="float8_e4m3fn")
  assert rs.b_shape == (8192, 4096) and rs.piece_dtype == "bfloat16"
  assert ag.scale == 2.0 ** -6 and rs.scale == 2.0 ** -6 and fixture.Case("ag", 8, 8, 8).scale == 1
  table = fixture.address_table([0x1_0000_0010, 0x2_0000_0020], scale=ag.scale)
  assert table[4].view(np.float32) == ag.scale and table[5] == 0
  assert fixture.workspace_bytes(rs) == workspace.required_bytes(2, 2048 * 8192 * 2)
  assert 0 < cli.max_rel_err(rs) < cli.max_rel_err(ag) < 0.1  # rs: half the K, two partials
  cfgs = cli.kernel_configs(ag, "NVIDIA H200", ["tl", "gluon"])
  assert [(c.engine, c.block_k) for c in cfgs.values()] == [("tl", 128), ("gluon", 128)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_float32_product_case_pushes_and_sums_float32_partials(dtype):
  """`--out-dtype float32` (preferred_element_type=float32): the product, GEMM+RS's partials in
  the workspaces and XLA's GEMM are float32; the AG still pushes the operands; tl and the
  Gluon AG keep their 128x256 tiles (stored, and tl GEMM+RS's own ones summed, in column
  halves), the Gluon GEMM+RS takes 128x128 (it stages and sums the whole float32 tile, which
  would not fit its shared memory at 128x256)."""
  ag, rs = (fixture.Case(op, 4096, 8192, 8192, dtype=dtype, out="float32") for op in ("ag", "rs"))
  assert ag.out_dtype == rs.out_dtype == rs.piece_dtype == "float32" and ag.piece_dtype == dtype
  assert fixture.piece_bytes(rs) == 2 * fixture.piece_bytes(fixture.Case("rs", 4096, 8192, 8192))
  assert ag.label == "4096x8192x8192->float32"
  for case in (ag, rs):
    cfgs = cli.kernel_configs(case, "NVIDIA H200", ["tl", "gluon"])
    gluon_n = 256 if case.op == "ag" else 128
    assert {e: (c.block_m, c.block_n) for e, c in cfgs.items()} == {"tl": (128, 256),
                                                                    "gluon": (128, gluon_n)}
    a = jax.ShapeDtypeStruct(case.a_shape, fixture.np_dtype(case.dtype))
    b = jax.ShapeDtypeStruct(case.b_shape, fixture.np_dtype(case.dtype))
    assert jax.eval_shape(programs.gemm_program(case), a, b).dtype == np.float32
  with pytest.raises(ValueError, match="narrower than the operands"):
    fixture.Case("ag", 64, 64, 64, dtype="float32", out="bfloat16")
  args = cli.parse_args(["rs", "--loopback", "--dtype", dtype, "--out-dtype", "float32"])
  assert args.out_dtype == "float32"


def test_case_rejects_shapes_the_group_cannot_split():
  with pytest.raises(ValueError, match="n=4097 must be divisible by the group size 2"):
    fixture.Case("ag", 4096, 8192, 4097)
  with pytest.raises(ValueError, match="k=4097"):
    fixture.Case("rs", 4096, 4097, 8192)
  with pytest.raises(ValueError, match="m=4100 must be divisible by the group size 8"):
    fixture.Case("rs", 4100, 4096, 8192, world=8)
  with pytest.raises(ValueError, match="op='xx'"):
    fixture.Case("xx", 2, 2, 2)
  with pytest.raises(ValueError, match="world=0"):
    fixture.Case("ag", 2, 2, 2, world=0)


def _pieces(case):
  """Distinct bf16 pieces of sources 1 .. world - 1."""
  size = int(np.prod(case.piece_shape))
  return [np.asarray(jnp.asarray(np.arange(size, dtype=np.float32).reshape(case.piece_shape)
                                 + 1000 * src, jnp.bfloat16)) for src in range(1, case.world)]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_rank0_workspace_holds_each_peers_piece_in_both_parity_slots(op, world):
  case = fixture.Case(op, 64, 128, 96 if world == 2 else 128, world=world)
  pieces = _pieces(case)
  nbytes = pieces[0].nbytes
  host = fixture.rank0_workspace(case, pieces, err_address=0x7F00_1234_5678)
  assert host.size == workspace.required_bytes(world, nbytes) == fixture.workspace_bytes(case)
  expected = np.zeros_like(host)
  slot = workspace.ERROR_SLOT_OFFSET
  assert int(host[slot:slot + 8].view(np.uint64)[0]) == 0x7F00_1234_5678
  expected[slot:slot + 8] = host[slot:slot + 8]
  for src, piece in enumerate(pieces, start=1):
    for parity in (0, 1):
      # exactly sized: slot 1 follows slot 0 (runtime/workspace.py parity_bytes)
      off = workspace.buffer_offset(world) + (parity * world + src) * nbytes
      assert fixture.piece_offset(case, parity, src) == off
      got = host[off:off + nbytes].view(piece.dtype).reshape(piece.shape)
      np.testing.assert_array_equal(got, piece)
      expected[off:off + nbytes] = host[off:off + nbytes]
  # epoch, counters and rank 0's own slots start at zero; the header holds the error record
  np.testing.assert_array_equal(host, expected)
  with pytest.raises(ValueError, match=f"{world - 2} peer pieces for a group of {world}"):
    fixture.rank0_workspace(case, pieces[1:])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_peers_workspaces_are_disjoint_aligned_and_hold_what_kernels_address(world):
  """The table names rank 0's workspace, then each peer's in the peers' buffer; each peer's
  slot for rank 0's pushes (both parities) lies inside its own workspace, so no two peers'
  pushes overlap, and every start is aligned for TMA."""
  case = fixture.Case("rs", 1024, 2048, 768, world=world)
  stride = fixture.peer_stride(case)
  assert stride % fixture.PEER_ALIGN == 0 and stride >= fixture.workspace_bytes(case)
  addrs = fixture.group_addresses(case, 0x7F00_0000_0000, 0x7E00_0000_1000)
  assert len(addrs) == world and addrs[0] == 0x7F00_0000_0000
  assert [a - addrs[1] for a in addrs[1:]] == [i * stride for i in range(world - 1)]
  table = fixture.address_table(addrs)
  assert [int(table[2 * i]) | int(table[2 * i + 1]) << 32 for i in range(world + 1)] == [*addrs, 0]
  spans = []
  for r in range(1, world):
    base = (r - 1) * stride
    for parity in (0, 1):
      off = base + fixture.piece_offset(case, parity, 0)
      assert off % 16 == 0
      spans.append((off, off + fixture.piece_bytes(case)))
      assert base <= off and off + fixture.piece_bytes(case) <= base + fixture.workspace_bytes(case)
  spans.sort()
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_address_table_is_lo_hi_pairs_then_a_zero_pair():
  addrs = (0x7F12_3456_7890, 0x7F00_0000_1000)
  t = fixture.address_table(addrs)
  assert t.dtype == np.uint32 and t.shape == (6,)
  assert [int(t[2 * i]) | int(t[2 * i + 1]) << 32 for i in range(3)] == [*addrs, 0]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_references_are_the_unfused_group_result(op, world):
  """What rank 0 must compute and push: ag, the gathered rows (own shard, then sources 1 ..
  world - 1) @ b, and its shard to every peer; rs, its rows of its partial plus every peer's
  partial, and peer r's rows of its partial to peer r."""
  case = fixture.Case(op, 64, 128, 64, world=world)
  rng = np.random.default_rng(world)
  a = rng.standard_normal(case.a_shape).astype(np.float32)
  b = rng.standard_normal(case.b_shape).astype(np.float32)
  peers = [rng.standard_normal(case.piece_shape).astype(np.float32) for _ in range(world - 1)]
  out, pushes = fixture.references(case, a, b, peers)
  assert out.shape == case.out_shape and len(pushes) == world - 1
  if op == "ag":
    np.testing.assert_allclose(out, np.concatenate([a, *peers]) @ b, rtol=1e-4, atol=1e-4)
    for p in pushes:
      np.testing.assert_array_equal(p, a)
  else:
    rows = case.m // world
    partial = a @ b
    np.testing.assert_allclose(out, partial[:rows] + sum(peers), rtol=1e-4, atol=1e-4)
    for r, p in enumerate(pushes, start=1):
      np.testing.assert_allclose(p, partial[r * rows:(r + 1) * rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fp8_references_are_the_f32_product_of_the_fp8_values(op):
  """fp8: b comes as [N, K]; the reference is the f32 product of the exact values, scaled
  (Case.scale), plus (rs) the peers' partials."""
  case = fixture.Case(op, 64, 128, 64, dtype="float8_e4m3fn", world=4)
  rng = np.random.default_rng(3)
  e4 = lambda shape: jnp.asarray(rng.standard_normal(shape) * 4, jnp.float8_e4m3fn)
  a, b = e4(case.a_shape), e4(case.b_shape)
  peers = [jnp.asarray(rng.standard_normal(case.piece_shape),
                       fixture.np_dtype(case.piece_dtype)) for _ in range(3)]
  out, pushes = fixture.references(case, a, b, peers)
  f64 = lambda x: np.asarray(x, np.float64)
  if op == "ag":
    want = np.concatenate([f64(a), *map(f64, peers)]) @ f64(b).T * case.scale
  else:
    partial = f64(a) @ f64(b).T * case.scale
    want = partial[:16] + sum(map(f64, peers))
    np.testing.assert_allclose(pushes[0], partial[16:32], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_per_call_time_counts_only_the_contestants_kernels():
  events = [("loopback_arm_kernel", 0.003), ("ag_gemm_kernel", 0.30), ("loopback_arm_kernel", 0.003),
            ("ag_gemm_kernel", 0.32), ("Memset 3", 0.002), ("nvjet_tst_256x128", 0.01)]
  assert timing.per_call_ms(events, ("ag_gemm_kernel",), calls=2) == pytest.approx(0.31)
  # None: every kernel but the set-up one and memsets (the cuBLAS GEMM alone may be several kernels)
  assert timing.per_call_ms(events, None, calls=2) == pytest.approx((0.62 + 0.01) / 2)
  # kernels recorded but none the contestant's: an error naming them, not a wall-clock fallback
  with pytest.raises(ValueError, match=r"none of the profiled kernels \['ag_gemm_kernel', "
                                       r"'nvjet_tst_256x128'\] matches \['gluon_ag_gemm_kernel'\]"):
    timing.per_call_ms(events, ("gluon_ag_gemm_kernel",), calls=2)
  assert timing.per_call_ms([("loopback_arm_kernel", 0.003)], ("ag_gemm_kernel",), calls=2) is None
  assert timing.per_call_ms([], ("ag_gemm_kernel",), calls=2) is None


def test_cpu_trace_has_no_device_kernels(tmp_path):
  f = jax.jit(lambda x: x @ x)
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(x).block_until_ready()
  assert timing.device_kernel_events(tmp_path) == []  # -> the benchmark falls back to wall clock


def test_kernel_configs_are_the_tuners_pick_with_each_engine():
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import OverlapConfig
  case = fixture.Case("ag", 4096, 8192, 8192)
  cfgs = cli.kernel_configs(case, "NVIDIA H200", ["tl", "gluon"])
  assert [c.engine for c in cfgs.values()] == ["tl", "gluon"]
  picked = select.choose_ag(OverlapConfig(autotune=False), "NVIDIA H200", 2, 2048, 8192, 4096,
                            jnp.bfloat16, jnp.bfloat16).kernel
  fixed = select.default_candidates("ag", 2, jnp.bfloat16, "9.0")
  picked = picked or fixed[0]  # no verdict: the group's first (tl) first-call candidate
  tl, gl = cfgs["tl"], cfgs["gluon"]
  assert (tl.chunks, tl.num_comm, tl.block_n) == (picked.chunks, picked.num_comm, picked.block_n)
  if picked.engine == "gluon":
    assert gl == picked
  else:  # a tl pick's movers are CTAs; the Gluon variant takes the group's Gluon movers (warps)
    first = [c for c in fixed if c.engine == "gluon"][0]
    assert (gl.chunks, gl.num_comm, gl.block_n) == (first.chunks, first.num_comm, picked.block_n)
  # a group of 8: the tuner's pick for that group (no cost model there: the group's first
  # first-call candidates, not the default config's 8 movers)
  cfgs = cli.kernel_configs(fixture.Case("rs", 8192, 4096, 4096, world=8), "NVIDIA H200",
                            ["tl", "gluon"])
  assert {e: c.block_m for e, c in cfgs.items()} == {"tl": 128, "gluon": 128}
  cfgs = cli.kernel_configs(fixture.Case("ag", 8192, 4096, 6144, world=8), "NVIDIA H200",
                            ["tl", "gluon"])
  firsts = {c.engine: c for c in reversed(select.default_candidates("ag", 8, jnp.bfloat16, "9.0"))}
  assert cfgs == firsts and cfgs["tl"].num_comm > select.default_kernel(jnp.bfloat16).num_comm
  # float32 has no Gluon path: skipped with the tuner's reason
  assert list(cli.kernel_configs(fixture.Case("rs", 1024, 2048, 1024, "float32"), "NVIDIA H200",
                                ["tl", "gluon"])) == ["tl"]


def test_table_and_records():
  base = {"op": "rs", "m": 4096, "k": 8192, "n": 8192, "world_size": 2, "mode": "loopback",
          "local_gemm": [4096, 4096, 8192], "sm_clock_mhz_min": 1755.0}
  records = [dict(base, impl="gemm_alone", median_ms=0.2),
             dict(base, impl="ours", median_ms=0.21, engine="gluon"),
             dict(base, impl="ours_tl", median_ms=0.25, engine="tl"),
             dict(base, impl="engine_alone", median_ms=0.205, engine="gluon"),
             dict(base, impl="engine_alone_tl", median_ms=0.22, engine="tl", alone_world=1)]
  table = cli.format_table("rs", records)
  row = table.splitlines()[-1].split()
  assert row[:7] == ["4096x8192x8192", "4096x4096x8192", "0.2000", "0.2100", "gluon", "0.2500",
                     "0.2050"]
  assert row[7:11] == ["1.050", "1.250", "1.025", "1.100"]  # ... the tl kernel alone: 1.1 x
  assert "tl alone/gemm" in table.splitlines()[1]
  json.dumps(records)
  records[1]["kernel"] = {"engine": "gluon", "wg_partitions": True}  # the partitioned GEMM+RS
  assert cli.format_table("rs", records).splitlines()[-1].split()[4] == "gluon_wg"
  records[1]["kernel"] = {"engine": "tl", "block_m": 64, "block_n": 128, "split_k": 3}
  assert cli.format_table("rs", records).splitlines()[-1].split()[4] == "tl-64x128-k3"
  # what a run did not time (--engines gluon: no tl, no tl alone) is "-", not nan
  row = cli.format_table("rs", records[:2] + records[3:4]).splitlines()[-1].split()
  assert row[5] == "-" and row[8] == "-" and row[10] == "-" and "nan" not in row


def test_a_tl_variant_alone_is_its_config_on_the_local_gemm_in_a_group_of_one():
  """engine_alone_tl: the tl kernel with the fastest tl variant's tiles, split and movers on the
  same local GEMM in a group of one (no peers, no pushes): packed shards unpacked (one shard
  per tile), the same tile count where the packed shards filled the tiles."""
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import KernelConfig
  case = fixture.Case("ag", 128, 4096, 6144, world=8)  # Llama-3-8B Q/K/V, TP 8, M = 128
  one = cli.alone_case(case)
  assert (one.world, one.local_gemm, one.a_shape, one.b_shape) == (
      1, case.local_gemm, (128, 4096), case.b_shape)
  assert one.out_shape == case.out_shape and one.piece_shape == one.a_shape
  rs = fixture.Case("rs", 128, 4096, 4096, world=8)
  assert (cli.alone_case(rs).a_shape, cli.alone_case(rs).out_shape) == ((128, 512), (128, 4096))
  packed = KernelConfig(engine="tl", block_m=128, block_n=128, num_warps=8, split_k=8,
                        pack_shards=True, num_comm=32)
  alone = cli.alone_config(case, packed)
  assert alone == dataclasses.replace(packed, pack_shards=False)
  assert select.fused_tiles(1, 128, 768, alone) == select.fused_tiles(8, 16, 768, packed) == 6
  # a group of one with no room for its split's parts: not run, said why
  assert cli.alone_config(case, dataclasses.replace(packed, split_k=128)) is None
  with pytest.raises(ValueError, match="world=0 must be an int >= 1"):
    fixture.Case("ag", 128, 4096, 6144, world=0)
  assert fixture.rank0_workspace(one, []).size == fixture.workspace_bytes(one)


def test_parse_args_requires_loopback_flag():
  args = cli.parse_args(["ag", "--loopback", "--shapes", "8192x4096x4096", "--rounds", "3"])
  assert (args.op, args.shapes, args.rounds, args.engines) == ("ag", "8192x4096x4096", 3, "tl,gluon")
  assert args.world == 2
  assert cli.parse_args(["rs", "--loopback", "--world", "8"]).world == 8
  assert (args.tag, args.trace) == ("", False)
  args = cli.parse_args(["ag", "--loopback", "--tag", "_c4", "--trace"])
  assert (args.tag, args.trace) == ("_c4", True)
  with pytest.raises(SystemExit):
    cli.parse_args(["ag"])


def test_wg_partitions_are_for_gemm_rs_only():
  with pytest.raises(ValueError, match="GEMM\\+RS only"):
    programs.fused_program(fixture.Case("ag", 512, 256, 512),
                     KernelConfig(engine="gluon", wg_partitions=True), 132)


def test_kernel_lines_are_the_stream_lines_else_all_but_xlas_derived_ones():
  from types import SimpleNamespace as L
  lines = [L(name="XLA Modules"), L(name="XLA Ops"), L(name="Stream #13(Compute)")]
  assert [x.name for x in timing.kernel_lines(lines)] == ["Stream #13(Compute)"]
  lines = [L(name="XLA Ops"), L(name="Steps"), L(name="gpu kernels")]
  assert [x.name for x in timing.kernel_lines(lines)] == ["gpu kernels"]


def test_interleaved_timing_falls_back_to_wall_clock_without_device_events():
  f = jax.jit(lambda x: x @ x)
  x = jnp.ones((32, 32))
  out = timing.time_interleaved({"a": (f, (x,), None), "b": (f, (x,), ("nothing",))}, rounds=2, calls=2)
  for impl in "ab":
    ms, info = out[impl]
    assert ms > 0 and info["timing"] == "wall_clock" and len(info["round_ms"]) == 2


def test_tl_and_gluon_timelines_share_one_layout():
  """bench/timeline.py reads both kernels' traces, and launch.trace_out_type sizes both."""
  from jax_autooverlap.kernels import gluon_trace, tl_trace
  names = ("SLOTS", "FIELDS", "GOT_TILE", "MAIN_DONE", "EPILOGUE_DONE", "TILE_SLOTS")
  assert ([getattr(tl_trace, n).value for n in names]
          == [getattr(gluon_trace, n).value for n in names] == [256, 6, 1, 2, 3, 255])
  # the tl kernels' epilogue steps take the last two fields (timeline.epilogue_steps)
  assert (tl_trace.PARTS_IN.value, tl_trace.PUSHED.value) == (4, 5)
  # tiles take rows 1 .. SLOTS - 1, the last row is the Gluon kernels' FRAME (timeline.frames)
  assert gluon_trace.FRAME.value == gluon_trace.SLOTS.value == gluon_trace.TILE_SLOTS.value + 1


def test_timeline_turns_clock_stamps_into_tiles_and_a_summary():
  """bench/timeline.py on a synthetic trace: two CTAs at 2 cycles/ns, the second starting 1 µs
  later; CTA 0 runs tiles 0 and 2, CTA 1 tile 1 (rows after a CTA's last tile stay zero)."""
  from jax_autooverlap.bench import timeline
  trace = np.zeros((2, 5, 4), np.int64)
  # row 0: (globaltimer at start, clock at start, globaltimer at end, clock at end); real
  # %globaltimer values are ~1.8e18 ns, beyond float64's ns resolution

  trace[0, 0] = (1_800_000_000_000_010_000, 1_000, 1_800_000_000_000_040_000, 61_000)
  trace[1, 0] = (1_800_000_000_000_011_000, 5_000, 1_800_000_000_000_040_000, 63_000)
  # tiles: (tile, clock when its number came, main loop done, epilogue issued); ns from CTA 0's start
  trace[0, 1] = (0, 3_000, 23_000, 25_000)    # ns: 1000, 11000, 12000
  trace[0, 2] = (2, 27_000, 47_000, 49_000)   # ns: 13000, 23000, 24000
  trace[1, 1] = (1, 9_000, 29_000, 31_000)    # ns: 3000, 13000, 14000
  recs = timeline.tiles(trace)
  assert [(r["cta"], r["tile"]) for r in recs] == [(0, 0), (0, 2), (1, 1)]
  assert [r["got"] for r in recs] == [1_000, 13_000, 3_000]
  s = timeline.summarize(trace, kind=lambda t: "even" if t % 2 == 0 else "odd")
  assert s["ctas"] == 2 and s["tiles"] == 3 and s["tiles_per_cta"] == [1, 2]
  assert s["sm_clock_ghz"] == 2.0
  assert s["main_us[even]"] == 10.0 and s["epilogue_us[odd]"] == 1.0
  assert s["gap_us_median"] == 1.0  # CTA 0: tile 0's epilogue at 22 µs, tile 2's number at 23 µs
  assert s["first_tile_at_us"] == [1.0, 2.0, 3.0] and s["last_epilogue_at_us"] == [14.0, 19.0, 24.0]
  assert s["last_cta"] == {"tiles": 2, "first_tile_at_us": 1.0, "main_us_sum": 20.0,
                           "epilogue_us_sum": 2.0, "gap_us_sum": 1.0, "end_at_us": 24.0}
  assert timeline.summarize(np.zeros((2, 5, 4), np.int64)) == {"ctas": 0}
  assert "kernel_span_us" not in s  # no FRAME stamps (the tl kernels, older traces)
  # the FRAME row (last): the clock at the kernel's first and last statement
  trace[0, -1, :2] = (0 + 1_000 - 2_000, 61_000 + 3_000)  # 1 µs before its consumers, 1.5 µs after
  trace[1, -1, :2] = (5_000 - 1_000, 63_000 + 1_000)      # 0.5 µs before, 0.5 µs after
  s = timeline.summarize(trace)
  assert s["entry_to_consumers_us"] == [0.5, 0.75, 1.0]
  assert s["consumers_to_exit_us"] == [0.5, 1.0, 1.5]
  # CTA 0 enters at -1 µs, the first; both CTAs' consumers end at 30 µs; CTA 0 exits at 31.5 µs
  assert s["kernel_span_us"] == 32.5
  assert [(r["cta"], r["tile"]) for r in timeline.tiles(trace)] == [(0, 0), (0, 2), (1, 1)]


def test_timeline_splits_a_tl_epilogue_into_its_stamped_steps():
  """Six fields (kernels/tl_trace.py): a spread split part's wait for its tile's other parts
  (PARTS_IN), the push of the peers' rows (PUSHED), then the own rows; a unit without those
  stamps (zeros) has no steps, and the four-field traces of older runs read as before."""
  from jax_autooverlap.bench import timeline
  trace = np.zeros((1, 5, 6), np.int64)
  trace[0, 0, :4] = (1_800_000_000_000_010_000, 1_000, 1_800_000_000_000_040_000, 61_000)
  # (unit, claimed, main loop done, epilogue done, parts in, pushed): 2 cycles per ns
  trace[0, 1] = (0, 3_000, 23_000, 35_000, 27_000, 31_000)  # waits 2 µs, pushes 2, own 2
  trace[0, 2] = (5, 37_000, 47_000, 53_000, 49_000, 0)      # waits 1 µs, then 2 (AG: stores)
  trace[0, 3] = (9, 55_000, 57_000, 59_000, 0, 0)           # no steps stamped
  recs = timeline.tiles(trace)
  assert [timeline.epilogue_steps(r) for r in recs] == [
      {"parts_wait": 2_000, "push": 2_000, "own": 2_000}, {"parts_wait": 1_000, "own": 2_000}, {}]
  s = timeline.summarize(trace)
  assert s["epilogue_us[all]"] == 3.0  # 6, 3 and 1 µs
  assert (s["parts_wait_us[all]"], s["push_us[all]"], s["own_us[all]"]) == (1.5, 2.0, 2.0)
  assert s["last_cta"]["parts_wait_us_sum"] == 3.0 and s["last_cta"]["own_us_sum"] == 4.0
  old = timeline.summarize(trace[:, :, :4])
  assert "parts_wait_us[all]" not in old and old["epilogue_us[all]"] == 3.0
  assert all(r["parts_in"] is None and r["pushed"] is None for r in timeline.tiles(trace[:, :, :4]))


def test_timeline_splits_a_spread_parts_wait_into_skew_and_release():
  """A Spread part's parts_wait (kernels/split_k.py sum_own_rows) = its skew (to the last main-
  loop end among its tile's parts; unit u = tile * split_k + part) + the release (from that end
  to its PARTS_IN: the last part's partial stored and counted, and seen); reported only where
  the tl config's split_k is given."""
  from jax_autooverlap.bench import timeline
  trace = np.zeros((2, 3, 6), np.int64)
  trace[:, 0, :4] = (1_800_000_000_000_010_000, 1_000, 1_800_000_000_000_040_000, 61_000)
  # (unit, claimed, main loop done, epilogue done, parts in, pushed): 2 cycles per ns
  trace[0, 1] = (0, 3_000, 23_000, 35_000, 27_000, 31_000)  # main ends at 11 µs, in at 13
  trace[1, 1] = (1, 3_000, 25_000, 36_000, 28_000, 32_000)  # main ends at 12 µs, in at 13.5
  steps = timeline.parts_wait_steps(timeline.tiles(trace), 2)
  assert steps == {(0, 0): {"skew": 1_000, "release": 1_000},
                   (1, 0): {"skew": 0, "release": 1_500}}
  s = timeline.summarize(trace, split_k=2)
  assert (s["parts_wait_us[all]"], s["skew_us[all]"], s["release_us[all]"]) == (1.75, 0.5, 1.25)
  assert s["last_cta"]["release_us_sum"] == 1.5 and s["last_cta"]["skew_us_sum"] == 0.0
  assert "skew_us[all]" not in timeline.summarize(trace)
  # units of different tiles are not each other's parts
  assert timeline.parts_wait_steps(timeline.tiles(trace), 1) == {
      (0, 0): {"skew": 0, "release": 2_000}, (1, 0): {"skew": 0, "release": 1_500}}


def test_engine_benchmark_table_and_config_names(capsys):
  from jax_autooverlap.bench import engine
  recs = [{"local_gemm": [256, 128, 512], "config": "gemm_alone", "median_ms": 0.2,
           "sm_clock_mhz_min": 1980.0},
          {"local_gemm": [256, 128, 512], "config": "coop-128x256-s3", "median_ms": 0.21,
           "sm_clock_mhz_min": 1980.0}]
  table = engine.format_table(recs, ["coop-128x256-s3", "coop-128x128-s4"])
  row = table.splitlines()[-1].split()
  assert row[:4] == ["256x128x512", "0.2000", "1.050", "-"]
  for fields in engine.CONFIGS.values():  # every named config is a Gluon KernelConfig
    KernelConfig(engine="gluon", **fields)
  with pytest.raises(SystemExit):
    engine.main(["--configs", "nope"])
  assert "unknown config" in capsys.readouterr().err


def test_notebook_timeline_cell_plots_the_newest_trace(tmp_path, monkeypatch, capsys):
  """The notebook's timeline cell says when there is no trace, else plots one bar per main loop
  and per epilogue of the first 16 CTAs and prints each contestant's summary."""
  import sys
  import unittest.mock
  cell = notebook_cell("-timeline.npz")
  monkeypatch.chdir(tmp_path)
  exec(cell, {})
  assert "no *-timeline.npz results yet" in capsys.readouterr().out
  trace = np.zeros((2, 3, 4), np.int64)
  trace[:, 0] = (1_000, 0, 21_000, 40_000)  # 2 cycles per ns
  trace[:, 1] = (0, 2_000, 20_000, 22_000)
  (tmp_path / "bench" / "results" / "run").mkdir(parents=True)
  np.savez(tmp_path / "bench" / "results" / "run" / "x-rs-loopback-timeline.npz",
           **{"8192x4096x4096/ours": trace})
  plt = unittest.mock.MagicMock()
  ax = unittest.mock.MagicMock()
  axes = np.empty((1, 1), dtype=object)  # (np.array would unpack the mock as a sequence)
  axes[0, 0] = ax
  plt.subplots.return_value = (unittest.mock.MagicMock(), axes)
  monkeypatch.setitem(sys.modules, "matplotlib", unittest.mock.MagicMock(pyplot=plt))
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
  exec(cell, {})
  out = capsys.readouterr().out
  assert "8192x4096x4096/ours: 2 tiles on 2 CTAs, last epilogue at 11.0 us" in out
  assert ax.barh.call_count == 4 and plt.show.called  # main loop + epilogue per tile


def test_ncu_engine_summary_reads_one_row_per_kernel_and_skips_rule_rows():
  """bench/ncu_engine.py's CSV reader: ncu's preamble lines before the header are skipped, every
  metric row lands in its kernel's entry (launch order kept), rule rows (no metric) are not."""
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parents[1] / "bench" / "ncu_engine.py"
  spec = importlib.util.spec_from_file_location("ncu_engine", path)
  ncu = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ncu)
  head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type",'
          '"Estimated Speedup"\n')
  def row(i, name, metric, value):
    return (f'"{i}","1","python3","h","{name}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"GPU Speed Of Light Throughput","{metric}","x","{value}",\n')
  text = ("==PROF== Connected to process 1\nsome program output\n" + head
          + row(0, "gluon_gemm_kernel", "Duration", "346,592")
          + row(0, "gluon_gemm_kernel", "SM Frequency", "1,607,911,102.97")
          + '"0","1","python3","h","gluon_gemm_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0",'
            '"9.0","SpeedOfLight","","","","SOLBottleneck","INF","text","",""\n'
          + row(1, "nvjet_sm90_tst_256x128", "Duration", "340,384"))
  got = ncu.summarise(text)
  assert [name for name, _ in got] == ["gluon_gemm_kernel", "nvjet_sm90_tst_256x128"]
  assert got[0][1] == {"Duration": "346,592", "SM Frequency": "1,607,911,102.97"}
  assert got[1][1] == {"Duration": "340,384"}


def test_fused_variants_are_the_tuners_configs_then_the_small_shape_ones():
  """What the benchmark times per case: the tuner's config on each engine, GEMM+RS's warpgroup
  partitions, and for small shapes (fewer than two waves of 128x256 tiles) the narrower tiles
  on both engines, split-K on tl and (AG) the shards packed into the row tiles; none of those
  for a large shape."""
  small = fixture.Case("rs", 128, 4096, 4096, world=8)  # 16 output rows per owner
  got = cli.fused_variants(small, "NVIDIA H200", ["tl", "gluon"], 132)
  # each small config in its deepest pipeline up to select.MAX_STAGES = 6 (deepest_stages:
  # 64x256 fits 5 in tl, whose GEMM+RS keeps no output tile in shared memory, 4 in Gluon)
  assert list(got) == ["tl", "gluon", "gluon_wg", "tl-128x128-s6", "tl-64x256-s5",
                       "tl-64x128-s6", "gluon-128x128-s6", "gluon-64x256-s4", "gluon-64x128-s6",
                       "tl-128x128-k4-p-s6", "tl-64x256-k4-p-s5", "tl-128x64-p-s6"]
  assert [got[n].num_warps for n in ("tl-64x256-s5", "tl-64x128-s6", "gluon-64x256-s4")] == [
      8, 4, 4]
  # 8 x 1 x 16 = 128 tiles of 64x128 tiles: too many for split-K's counters; packed, the 8
  # owners' 16 rows are 32 tiles of 128x128 (x 4 parts) or 64x256
  assert all(c.split_k == 1 for c in got.values() if not c.pack_shards)
  qkv = fixture.Case("ag", 128, 4096, 6144, world=8)  # 16-row shards, 768 columns
  got = cli.fused_variants(qkv, "NVIDIA H200", ["tl"], 132)
  assert list(got)[-3:] == ["tl-64x128-k2-s6", "tl-128x128-k8-p-s6", "tl-64x256-k8-p-s5"]
  assert got["tl-64x128-k2-s6"].split_k == 2 and got["tl-128x128-k8-p-s6"].pack_shards
  assert list(cli.fused_variants(fixture.Case("ag", 16384, 8192, 8192), "NVIDIA H200",
                                 ["tl", "gluon"], 132)) == ["tl", "gluon"]
  assert cli.variant_name(KernelConfig(engine="gluon", wg_partitions=True)) == "gluon_wg"
  # a mover sweep (AG only): each engine's config at each other count, the rest unchanged
  ag = fixture.Case("ag", 16384, 8192, 8192, world=8)
  base = cli.fused_variants(ag, "NVIDIA H200", ["tl", "gluon"], 132)
  swept = cli.fused_variants(ag, "NVIDIA H200", ["tl", "gluon"], 132,
                             {"tl": (base["tl"].num_comm, 48), "gluon": (132,)})
  assert list(swept) == ["tl", "gluon", "tl-m48", "gluon-m132"]
  assert swept["tl-m48"] == dataclasses.replace(base["tl"], num_comm=48)
  assert swept["gluon-m132"] == dataclasses.replace(base["gluon"], num_comm=132)
  assert list(cli.fused_variants(fixture.Case("rs", 16384, 8192, 8192, world=8), "NVIDIA H200",
                                 ["tl"], 132, {"tl": (48,)})) == ["tl"]
  # first_call: also what a first call would time (no verdict for this shape), each config once
  from jax_autooverlap.tuning import select
  first = cli.first_call_variants(ag, "NVIDIA H200", ["tl", "gluon"])
  assert set(first.values()) == set(select.default_candidates("ag", 8, jnp.bfloat16, "9.0"))
  assert list(first)[:2] == ["tl-c4m32", "tl-c4m48"]
  both = cli.fused_variants(ag, "NVIDIA H200", ["tl", "gluon"], 132, first_call=True)
  assert set(both.values()) == set(base.values()) | set(first.values())
  assert len(both) == len(set(both.values()))
  rs = cli.first_call_variants(fixture.Case("rs", 16384, 8192, 8192, world=8), "NVIDIA H200",
                               ["tl"])
  assert list(rs) == ["tl-c2", "tl-c4"]
  assert cli.variant_name({"engine": "tl", "block_m": 64, "block_n": 256, "split_k": 3}) == (
      "tl-64x256-k3")
  assert cli.variant_name(KernelConfig(split_k=2, split_tail=60)) == "tl-k2-t60"


def test_explicit_variants_replace_fields_of_each_engines_config(capsys):
  """--variant ENGINE:FIELD=V,...: the engine's config with those fields (the tiles' warps
  where the tiles change), named as given; skipped with the reason where the
  engine is not timed or the kernel cannot run it; bad specs name the flag."""
  qkv = fixture.Case("ag", 128, 8192, 10240, world=8)  # Llama-3-70B Q/K/V, TP 8, M = 128
  base = cli.fused_variants(qkv, "NVIDIA H200", ["tl"], 132)
  extra = cli.parse_variants(["tl:block_m=128,block_n=128,pack_shards=1,split_k=2",
                              "tl:block_m=128,block_n=128,pack_shards=1,split_k=2,num_comm=8",
                              "gluon:block_n=128", "tl:block_n=64,split_k=2"])
  got = cli.fused_variants(qkv, "NVIDIA H200", ["tl"], 132, extra=extra)
  added = {n: c for n, c in got.items() if n not in base}
  tl = base["tl"]
  assert added == {
      "tl:block_m=128,block_n=128,pack_shards=1,split_k=2": dataclasses.replace(
          tl, block_m=128, block_n=128, pack_shards=True, split_k=2, num_warps=8),
      "tl:block_m=128,block_n=128,pack_shards=1,split_k=2,num_comm=8": dataclasses.replace(
          tl, block_m=128, block_n=128, pack_shards=True, split_k=2, num_warps=8, num_comm=8)}
  err = capsys.readouterr().err
  assert "engine gluon is not timed" in err
  assert "split_k=2 takes at most 64 output tiles per call, this shape has 160" in err
  # a variant equal to a timed one is not timed twice
  again = cli.fused_variants(qkv, "NVIDIA H200", ["tl"], 132,
                             extra=cli.parse_variants(["tl:num_comm=%d" % tl.num_comm]))
  assert list(again) == list(base)
  assert cli.parse_variants(["gluon:wg_partitions=1,block_m=128"]) == (
      ("gluon", {"wg_partitions": True, "block_m": 128}),)
  # warpgroup partitions exist for GEMM+RS only: an AG entry skips the variant, saying so (a
  # shape list of both ops with one --variant ran each AG entry into a ValueError)
  ag = fixture.Case("ag", 8192, 4096, 6144, world=8)
  plain = cli.fused_variants(ag, "NVIDIA H200", ["gluon"], 132)
  wg = cli.fused_variants(ag, "NVIDIA H200", ["gluon"], 132,
                          extra=cli.parse_variants(["gluon:wg_partitions=1"]))
  assert wg == plain
  assert "wg_partitions (a consumer partition per warpgroup) exists for GEMM+RS only" in (
      capsys.readouterr().err)
  for bad in ("tl", "tl:", "cuda:split_k=2", "tl:split_k", "tl:split_k=-1", "tl:bogus=1",
              "tl:pack_shards=2", "tl:pack_shards=01", "tl:engine=1"):
    with pytest.raises(ValueError, match="--variant"):
      cli.parse_variants([bad])


def test_stages_add_each_variant_in_deeper_pipelines_where_its_shared_memory_fits(capsys):
  """--stages N,...: every variant also with each pipeline depth, named <variant>-s<N>, where
  its kernel's shared memory (select.shared_memory) fits a CTA; skipped with the reason where
  not; the depths are parsed strictly."""
  from jax_autooverlap.tuning import select
  qkv = fixture.Case("ag", 128, 4096, 6144, world=8)  # Llama-3-8B Q/K/V, TP 8, M = 128
  base = {"tl": KernelConfig(num_comm=32),
          "tl-64x128-k2": KernelConfig(block_m=64, block_n=128, num_warps=4, split_k=2,
                                       num_comm=32),
          "tl-128x128-k8-p": KernelConfig(block_m=128, block_n=128, split_k=8,
                                          pack_shards=True, num_comm=32),
          "gluon-128x128": KernelConfig(engine="gluon", block_m=128, block_n=128, num_comm=64)}
  got = cli.with_stages(qkv, base, (4, 6))
  assert list(got)[:len(base)] == list(base) and all(got[n] == base[n] for n in base)
  for name, cfg in base.items():
    for depth in (4, 6):
      deeper = dataclasses.replace(cfg, num_stages=depth)
      fits = select.shared_memory(deeper, "ag", 2, 2) <= select.SMEM_LIMIT
      assert got.get(f"{name}-s{depth}") == (deeper if fits else None), (name, depth)
  # split: 6 stages of 64x128 (24 KB each) and no output tile; the unsplit 128x256 AG's
  # output tile (64 KB) beside 4 stages of 48 KB does not fit
  assert got["tl-64x128-k2-s6"] == dataclasses.replace(base["tl-64x128-k2"], num_stages=6)
  assert cli.variant_name(got["tl-64x128-k2-s6"]) == "tl-64x128-k2-s6"
  assert "tl-s4" not in got
  assert ("ag 128x4096x6144: tl in 4 stages skipped: tl ag kernel of 128x256x64 tiles in 4 "
          "stages needs 263168 bytes of shared memory, more than the 232448 a CTA can have"
          ) in capsys.readouterr().err
  assert cli.with_stages(qkv, base) == base
  assert cli.parse_stages("4,6") == (4, 6)
  for bad in ("", "4,", "1", "13", "four"):
    with pytest.raises(argparse.ArgumentTypeError, match="pipeline depths"):
      cli.parse_stages(bad)
  assert cli.parse_args(["ag", "--loopback", "--stages", "5"]).stages == (5,)
  assert cli.parse_args(["ag", "--loopback"]).stages == ()


def test_the_shared_memory_model_counts_what_each_kernel_allocates():
  """select.shared_memory: the operand stages; the output tile where the kernel stores through
  shared memory (both Gluon kernels; tl AG+GEMM unsplit; the AGs' 4-byte tiles of 256
  columns in halves); the Gluon AG
  mover's two 8 KB staging boxes; SMEM_SLACK.  (test_kernel_compile.py compares it with
  Triton's own count.)"""
  from jax_autooverlap.tuning import select
  stage = (128 * 64 + 64 * 256) * 2  # 48 KB of 128x256x64 bf16 tiles
  out, slack = 128 * 256 * 2, select.SMEM_SLACK
  tl, gluon = KernelConfig(), KernelConfig(engine="gluon")
  assert select.shared_memory(tl, "ag", 2, 2) == 3 * stage + out + slack
  assert select.shared_memory(dataclasses.replace(tl, split_k=2, split_tail=4), "ag", 2, 2) == (
      3 * stage + slack)
  assert select.shared_memory(tl, "rs", 2, 2) == 3 * stage + slack
  assert select.shared_memory(gluon, "ag", 2, 2) == 3 * stage + out + 16384 + slack
  assert select.shared_memory(gluon, "rs", 2, 4) == 3 * stage + 2 * out + slack
  # the shipped Gluon AG fits; in 4 stages it does not, and the tuner says so
  assert select.unsupported(1024, 4096, 4096, jnp.bfloat16, jnp.bfloat16, gluon, "ag") is None
  assert "needs 279552 bytes of shared memory" in select.unsupported(
      1024, 4096, 4096, jnp.bfloat16, jnp.bfloat16,
      dataclasses.replace(gluon, num_stages=4), "ag")
  # a 4-byte output tile of 256 columns: the tl AG stores it in halves (64 KB of buffer at
  # 128x256); the tl GEMM+RS sums its own tiles in halves, but its packed and split tiles'
  # registers do not hold one
  assert select.shared_memory(tl, "ag", 2, 4) == 3 * stage + out + slack
  assert select.unsupported(2048, 4096, 4096, jnp.bfloat16, np.float32, tl, "ag") is None
  assert select.unsupported(2048, 4096, 4096, jnp.bfloat16, np.float32, tl, "rs") is None
  assert "spills registers" in select.unsupported(
      2048, 4096, 4096, jnp.bfloat16, np.float32, dataclasses.replace(tl, split_k=2), "rs")
  # the Gluon AG too (gluon_engine.out_block_n); the Gluon GEMM+RS stages and sums the whole
  # tile, which does not fit at 128x256
  assert select.shared_memory(gluon, "ag", 2, 4) == 3 * stage + out + 16384 + slack
  assert select.unsupported(2048, 4096, 4096, jnp.bfloat16, np.float32, gluon, "ag") is None
  assert "needs 279552 bytes" in select.unsupported(2048, 4096, 4096, jnp.bfloat16, np.float32,
                                                    gluon, "rs")
  assert select.unsupported(2048, 4096, 4096, jnp.bfloat16, np.float32,
                            dataclasses.replace(gluon, block_n=128), "rs") is None


def test_a_grown_workspace_puts_parity_slot_1_half_way_through_the_buffers():
  """Case.spare: workspaces larger than the call needs (as after growth for a larger call);
  slot 1 starts half-way through the buffer area (runtime/workspace.py parity_bytes)."""
  case = fixture.Case("ag", 64, 128, 96, spare=4096 + 48)
  nbytes, piece = fixture.workspace_bytes(case), fixture.piece_bytes(case)
  half = workspace.parity_bytes(2, nbytes)
  assert nbytes == workspace.required_bytes(2, piece) + 4096 + 48
  assert half % 16 == 0 and half > 2 * piece
  assert fixture.piece_offset(case, 1, 0) == workspace.buffer_offset(2) + half
  assert fixture.piece_offset(case, 1, 1) + piece <= nbytes
  with pytest.raises(ValueError, match="spare=-1"):
    fixture.Case("ag", 64, 128, 96, spare=-1)


def test_warm_compiles_compiles_the_programs_concurrently_and_leaves_failures_to_their_calls(
    monkeypatch):
  """bench/common.warm_compiles: every program lowered (traced) in threads at once (three
  traces meet at a barrier one thread would never pass) and compiled, so that its call with
  fresh arguments of the same types compiles nothing; one that fails raises nothing here."""
  import os
  import threading
  monkeypatch.setattr(os, "cpu_count", lambda: 8)
  import jax
  import jax.numpy as jnp
  from jax_autooverlap.bench import common
  met, traced = threading.Barrier(3, timeout=10), []

  def make(i):
    def body(x):
      met.wait()
      traced.append(i)
      if i == 2:
        raise RuntimeError("Triton: out of resources")
      return x * i
    return jax.jit(body)
  x = jnp.ones(4)
  programs = [make(i) for i in range(3)]
  common.warm_compiles([(p, (x,)) for p in programs], threads=3)
  assert sorted(traced) == [0, 1, 2]
  compiles = []
  listen = lambda name, secs, **kw: compiles.append(name) if "backend_compile" in name else None
  fresh = jnp.arange(4.0) + 1  # another array of the same type, made before listening
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    outs = [programs[i](fresh) for i in (0, 1)]
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == [] and sorted(traced) == [0, 1, 2]  # neither traced nor compiled again
  np.testing.assert_array_equal(np.asarray(outs[1]), np.arange(4.0) + 1)


def test_warm_compiles_imports_the_kernels_before_its_threads():
  """Lowerings in threads must not be Triton's first import: its modules import each other in
  cycles, and a racing thread got a half-initialised `triton` (no attribute 'runtime') in a
  first call on the GPU.  A fresh interpreter whose 'lowerings' import the kernel modules."""
  import subprocess
  import sys
  code = """
import importlib, os, sys
os.cpu_count = lambda: 8  # as on the GPU machine: 8 threads at once
from jax_autooverlap._compat import import_jax_triton
from jax_autooverlap.bench import common
assert "triton" not in sys.modules
errors = []
class Lowering:
  def __init__(self, name): self.name = name
  def lower(self):
    try:
      importlib.import_module("jax_autooverlap.kernels." + self.name)
      import_jax_triton()  # as a fused program's lowering does
    except Exception as e:
      errors.append(repr(e))
names = ["ag_gemm", "gemm_rs", "split_k", "gluon_engine", "gluon_gemm_rs", "sync"] * 2
common.warm_compiles([(Lowering(n), ()) for n in names], threads=8)
print(errors)
assert not errors
"""
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("fastest", ["tl-128x128-k8-p-s6", "tl-64x256-k8-p-s5"])
def test_bench_case_times_ours_tl_alone_and_records_it(monkeypatch, fastest):
  """bench_case's orchestration, the GPU parts faked: every distinct tl variant also runs alone
  (its config unpacked, on a group of one with its own operands, checked, then timed in the
  same interleaved rounds), and ours_tl's alone run becomes the engine_alone_tl record; a
  wrong alone run (here 64x256 split 8's) is not timed, so no record says what it took."""
  import types
  from jax_autooverlap.runtime import cuda
  built = []

  class FakeLoopback:
    def __init__(self, case, device, seed=7):
      self.case = case

    def check(self, program):
      case, cfg = program
      wrong = case.world == 1 and (cfg.block_m, cfg.split_k) == (64, 8)
      return {"rel_err": 1.0 if wrong else 1e-3, "push_rel_err": 0.0, "bit_identical_repeat": True}

    def fused_args(self):
      return ()

    gemm_args = fused_args

  class Clocks:
    __enter__ = lambda self: self
    __exit__ = lambda self, *exc: None
    summary = lambda self: {}

  def fused_program(case, cfg, sms):
    built.append((case, cfg))
    return case, cfg

  def timed(contestants, rounds, calls):
    """`fastest` 1 us, the other variants 50 us, an alone run 10 us + 0.1 us per part"""
    def ms(name, program):
      if name.startswith("tl_alone"):
        return 0.010 + 1e-4 * program[1].split_k
      return 0.001 if name == fastest else 0.05
    return {name: (ms(name, fn), {}) for name, (fn, _, _) in contestants.items()}
  monkeypatch.setattr(cli, "Loopback", FakeLoopback)
  monkeypatch.setattr(cli, "fused_program", fused_program)
  monkeypatch.setattr(cli, "gemm_program", lambda case: "cublas")
  monkeypatch.setattr(cli.common, "warm_compiles", lambda programs: None)
  monkeypatch.setattr(cli.timing, "time_interleaved", timed)
  monkeypatch.setattr(cli.timing, "ClockSampler", Clocks)
  monkeypatch.setattr(cuda, "sm_count", lambda device_id: 132)
  case = fixture.Case("ag", 128, 4096, 6144, world=8)  # Llama-3-8B Q/K/V, TP 8, M = 128
  device = types.SimpleNamespace(device_kind="NVIDIA H200", local_hardware_id=0)
  records = {r["impl"]: r for r in cli.bench_case(case, device, ["tl"], rounds=1, calls=1)}
  variants = cli.fused_variants(case, "NVIDIA H200", ["tl"], 132)
  alone = [cfg for k, cfg in built if k.world == 1]
  assert sorted(map(str, alone)) == sorted({str(cli.alone_config(case, c))
                                            for c in variants.values()})  # each config once
  assert all(k == cli.alone_case(case) for k, _ in built if k.world == 1)
  assert records["ours_tl"]["kernel"] == dataclasses.asdict(variants[fastest])
  if fastest == "tl-64x256-k8-p-s5":  # its alone run was wrong: not timed, no record
    assert "engine_alone_tl" not in records
  else:
    record = records["engine_alone_tl"]
    assert record["kernel"] == {**dataclasses.asdict(variants[fastest]), "pack_shards": False}
    # its own alone run's time (split 8: 10.8 us), not another's
    assert (record["median_ms"], record["alone_world"], record["engine"]) == (0.0108, 1, "tl")
