"""Kernel engines ("tl" | "gluon") from config to launch, on CPU: validation, the tuner's
measured pick, `explain`, and the launcher hand-over (no GPU needed)."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_autooverlap as ao
from jax_autooverlap.tuning import select, store
from jax_autooverlap.tuning.config import KernelConfig
from fake_cuda import fake_gpu_mesh

H200 = "NVIDIA H200"
bf16 = jnp.bfloat16


def test_engine_is_validated_with_what_the_gluon_kernels_need():
  assert KernelConfig().engine == "tl"
  assert KernelConfig(engine="gluon").engine == "gluon"
  with pytest.raises(ValueError, match="engine='cuda' is not one of"):
    KernelConfig(engine="cuda")
  with pytest.raises(ValueError, match="block_m=32 must be 64 or 128 for engine='gluon'"):
    KernelConfig(engine="gluon", block_m=32, num_warps=4)
  with pytest.raises(ValueError, match="num_warps=4 must be block_m / 16 for engine='gluon'"):
    KernelConfig(engine="gluon", num_warps=4)
  with pytest.raises(ValueError, match="num_warps=8 must be block_m / 16"):
    KernelConfig(engine="gluon", block_m=64)
  # 64-row tiles: one consumer warpgroup; no partition per warpgroup then
  assert KernelConfig(engine="gluon", block_m=64, num_warps=4).num_warps == 4
  with pytest.raises(ValueError, match="wg_partitions=True needs engine='gluon' and block_m=128"):
    KernelConfig(engine="gluon", block_m=64, num_warps=4, wg_partitions=True)
  # split-K is the tl engine's
  assert KernelConfig(split_k=4).split_k == 4
  with pytest.raises(ValueError, match="split_k=2 needs engine='tl'"):
    KernelConfig(engine="gluon", split_k=2)
  with pytest.raises(ValueError, match="split_k=0 must be a positive int"):
    KernelConfig(split_k=0)
  with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
    KernelConfig(engine="gluon", num_stages=1)
  with pytest.raises(ValueError, match="block_n=512"):
    KernelConfig(engine="gluon", block_n=512)
  KernelConfig(block_m=64, num_warps=4, num_stages=1)  # the tl engine takes these


def test_default_engine_follows_the_environment(monkeypatch):
  monkeypatch.delenv("JAX_AUTOOVERLAP_ENGINE", raising=False)
  assert select.default_kernel(bf16).engine == "tl"
  monkeypatch.setenv("JAX_AUTOOVERLAP_ENGINE", "gluon")
  assert select.default_kernel(bf16) == KernelConfig(engine="gluon")
  assert select.default_kernel(np.float32).engine == "tl"  # no 32-bit wgmma path in the engine
  monkeypatch.setenv("JAX_AUTOOVERLAP_ENGINE", "nope")
  with pytest.raises(ValueError, match="engine='nope'"):
    select.default_kernel(bf16)


def test_gluon_engine_needs_16_bit_operands():
  cfg = KernelConfig(engine="gluon", block_n=128, block_k=32)
  why = select.unsupported(4096, 8192, 4096, np.float32, np.float32, cfg)
  assert why is not None and "16-bit" in why and "float32" in why
  assert select.unsupported(4096, 8192, 4096, bf16, bf16, KernelConfig(engine="gluon")) is None



@pytest.mark.usefixtures("stand_in_cuda_driver")
def test_tuner_returns_the_measured_engine_and_explain_names_it(monkeypatch):
  from jax_autooverlap.ops.planning import plan
  fast = {"block_k": 64, "block_m": 128, "block_n": 256, "chunks": 4, "group_m": 8,
          "num_comm": 16, "num_stages": 3, "num_warps": 8}
  cache = {f"ag|{H200}|w2|4096x8192x8192|bfloat16": {"impl": "triton",
                                                      "kernel": {**fast, "engine": "gluon"}},
           f"rs|{H200}|w2|4096x8192x8192|bfloat16": {"impl": "triton", "kernel": fast}}
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(store, "verdicts", lambda: cache)
  mesh = fake_gpu_mesh()
  impl, gpu, why = plan("ag_rows", ao.OverlapConfig(), 2, (1, 2048, 8192, 4096), bf16, bf16,
                        mesh)
  assert impl == "triton" and gpu.kernel.engine == "gluon" and why.endswith("; gluon engine)")
  impl, gpu, why = plan("rs_rows", ao.OverlapConfig(), 2, (1, 4096, 4096, 8192), bf16, bf16,
                        mesh)
  assert impl == "triton" and gpu.kernel.engine == "tl" and why.endswith("; tl engine)")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_launchers_hand_gluon_configs_to_the_gluon_backend(monkeypatch, op):
  from jax_autooverlap.backends import gluon
  from jax_autooverlap.backends import triton as tb
  seen = []
  name = "launch_ag_gemm" if op == "ag" else "launch_gemm_rs"
  monkeypatch.setattr(gluon, name, lambda *a, **kw: seen.append((a, kw)) or "gluon-out")
  kw = dict(world=2, kernel=KernelConfig(engine="gluon"), out_dtype=bf16, timeout_s=1.0,
            num_sms=132, op_id=3, compute_capability=90)
  if op == "ag":
    kw["return_gathered"] = True
  args = ("a", "b", "table", "rank")
  assert getattr(tb, name)(*args, **kw) == "gluon-out"
  passed_on = {"poison": False, "workspace_bytes": None, "trace": False}
  assert seen == [(args, {**kw, **passed_on})]


def test_bench_sweeps_the_engines_asked_for(monkeypatch):
  """The two-GPU benchmark's sweep (its verdicts feed the tuner): both engines by default,
  those asked for with --engines."""
  import jax_autooverlap.bench.__main__ as bench
  swept = {}

  def fake_ag(m, k, n, dtype, iters, sweep, rivals=True):
    swept["ag"] = sweep
    raise SystemExit(0)
  monkeypatch.setattr(bench, "bench_ag_shape", fake_ag)
  monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(platform="gpu")] * 2)
  monkeypatch.setattr(bench.common, "gpu_name", lambda device=None: "NVIDIA-H200")
  monkeypatch.setattr(bench.common, "versions", lambda: {})
  with pytest.raises(SystemExit):
    bench.main(["ag", "--no-rivals", "--shapes", "4096x8192x8192", "--engines", "tl"])
  assert {c.engine for c in swept["ag"]} == {"tl"}
  with pytest.raises(SystemExit):
    bench.main(["ag", "--no-rivals", "--shapes", "4096x8192x8192"])
  engines = [c.engine for c in swept["ag"]]
  assert set(engines) == {"tl", "gluon"} and engines.count("gluon") == engines.count("tl")


def test_gluon_ag_push_units_are_column_slices_of_whole_boxes():
  """A Gluon AG push unit is a 128-row tile x push_slice(K) columns: 512 (enough units for
  every mover at the reference shapes), or the whole of a narrower shard, in 64-column boxes."""
  from jax_autooverlap.backends.gluon import push_slice
  assert [push_slice(k) for k in (8192, 4096, 1024, 512, 300, 64, 8)] == [512, 512, 512, 512, 320,
                                                                          64, 64]


def test_warpgroup_partitions_are_a_validated_gluon_only_flag():
  assert KernelConfig().wg_partitions is False
  assert KernelConfig(engine="gluon", wg_partitions=True).wg_partitions is True
  with pytest.raises(ValueError, match="wg_partitions=True needs engine='gluon'"):
    KernelConfig(wg_partitions=True)
  with pytest.raises(ValueError, match="wg_partitions=1 must be a bool"):
    KernelConfig(engine="gluon", wg_partitions=1)


def _jax_triton_calling(triton_call):
  """jax_triton with its triton_call replaced (its host TensorDescriptor, which the Gluon
  launchers build their operands' descriptors with, kept)."""
  from jax_autooverlap._compat import import_jax_triton
  return SimpleNamespace(triton_call=triton_call,
                         TensorDescriptor=import_jax_triton().TensorDescriptor)


def test_gluon_rs_launch_follows_the_configs_warpgroup_flag(monkeypatch):
  """backends/gluon.launch_gemm_rs builds the warpgroup-partition kernel (WG_PARTS = 2, its
  default partition one warpgroup) exactly when the config says so."""
  from jax_autooverlap.backends import gluon
  calls = []

  def triton_call(*args, **kw):
    calls.append(kw)
    return "out", "timeline", "scratch"
  monkeypatch.setattr(gluon, "import_jax_triton", lambda: _jax_triton_calling(triton_call))
  a = jax.ShapeDtypeStruct((1024, 512), bf16)
  b = jax.ShapeDtypeStruct((512, 768), bf16)
  kw = dict(world=2, out_dtype=bf16, timeout_s=1.0, num_sms=132, compute_capability=90)
  for wg in (True, False):
    cfg = KernelConfig(engine="gluon", wg_partitions=wg)
    assert gluon.launch_gemm_rs(a, b, "row", "rank", kernel=cfg, **kw) == "out"
  assert [(c["WG_PARTS"], c["num_warps"]) for c in calls] == [(2, 4), (1, 8)]


def test_engine_gemm_refuses_warpgroup_partitions():
  """Warpgroup partitions are GEMM+RS's (WG_PARTS = 2); the engine's GEMM alone has none."""
  from jax_autooverlap.backends import gluon
  a = jax.ShapeDtypeStruct((1024, 512), bf16)
  b = jax.ShapeDtypeStruct((512, 768), bf16)
  with pytest.raises(ValueError, match="wg_partitions=True"):
    gluon.launch_gemm(a, b, kernel=KernelConfig(engine="gluon", wg_partitions=True),
                      out_dtype=bf16, num_sms=132)


def test_no_environment_variable_reaches_a_kernel():
  """What a launched kernel computes follows from its arguments and config alone: neither the
  launchers nor the kernels read the environment."""
  import ast
  import pathlib
  import jax_autooverlap
  root = pathlib.Path(jax_autooverlap.__file__).parent
  for path in sorted((root / "backends").glob("*.py")) + sorted((root / "kernels").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
      assert name not in ("environ", "getenv", "putenv"), f"{path.name}:{node.lineno} reads {name}"


def test_gluon_push_descriptors_per_tile_only_where_a_cta_pushes_fewer_tiles_than_peers(
    monkeypatch):
  """backends/gluon.py: a push descriptor per peer and CTA (~0.7 us each, up front) unless a
  pushing CTA pushes fewer tiles (RS) or units (AG mover) than it has peers; never in a group
  of two (its kernels are the ones measured so far)."""
  from jax_autooverlap.backends import gluon
  calls = []

  def triton_call(*args, **kw):
    calls.append(kw)
    return tuple(range(len(kw["out_type"])))
  monkeypatch.setattr(gluon, "import_jax_triton", lambda: _jax_triton_calling(triton_call))
  kw = dict(out_dtype=bf16, timeout_s=1.0, num_sms=132, compute_capability=90)
  cfg = KernelConfig(engine="gluon")
  spec = lambda *s: jax.ShapeDtypeStruct(s, bf16)
  # RS, 16 output rows per owner at TP = 8, N = 4096: 7 x 16 remote tiles over 128 CTAs
  gluon.launch_gemm_rs(spec(128, 512), spec(512, 4096), "row", "rank", world=8, kernel=cfg, **kw)
  # the same GEMM at TP = 2: one peer
  gluon.launch_gemm_rs(spec(128, 512), spec(512, 4096), "row", "rank", world=2, kernel=cfg, **kw)
  # RS with 8192 rows at TP = 8: 7 x 16 x 16 remote tiles over 132 CTAs
  gluon.launch_gemm_rs(spec(8192, 512), spec(512, 4096), "row", "rank", world=8, kernel=cfg,
                       **kw)
  assert [c["PUSH_DESC_PER_TILE"] for c in calls] == [True, False, False]
  calls.clear()
  # AG, a 16-row shard, K = 8192 (16 column slices): 7 x 16 units over 64 movers, over 8
  for movers, world in ((64, 8), (8, 8), (64, 2)):
    gluon.launch_ag_gemm(spec(16, 8192), spec(8192, 1280), "row", "rank", world=world,
                         kernel=KernelConfig(engine="gluon", num_comm=movers),
                         return_gathered=False, **kw)
  assert [c["PUSH_DESC_PER_UNIT"] for c in calls] == [True, False, False]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("op", ["gemm", "ag", "rs"])
def test_gluon_launches_pass_host_made_descriptors_of_their_operands(monkeypatch, op, dtype):
  """The Gluon kernels take a's and b's TMA descriptors as launch parameters, encoded on the
  host by jax-triton, in boxes of the config's tiles (fp8: b K-major, [N, K]), and the AG's
  mover its shard as [1, rows, K] in 8 KB boxes: no CTA makes them before its first loads
  (~0.7 us each, docs/NOTES.md)."""
  from jax_autooverlap._compat import import_jax_triton
  from jax_autooverlap.backends import gluon
  from jax_autooverlap.kernels.gluon_engine import shared_layout
  jt = import_jax_triton()

  class Launched(Exception):
    pass

  def fake_call(*args, **kw):
    raise Launched(args)
  monkeypatch.setattr(jt, "triton_call", fake_call)
  dt = jnp.dtype(dtype)
  fp8 = dt.itemsize == 1
  cfg = KernelConfig(engine="gluon", block_k=128 if fp8 else 64)
  m, k, n = 1024, 512, 768
  a = jnp.zeros((m, k), dt)
  b = jnp.zeros((n, k) if fp8 else (k, n), dt)
  table, rank = jnp.zeros((6,), np.uint32), jnp.zeros((1,), np.int32)
  common = dict(kernel=cfg, out_dtype=bf16, num_sms=132, compute_capability=90)
  with pytest.raises(Launched) as launched:
    if op == "gemm":
      gluon.launch_gemm(a, b, **common)
    elif op == "ag":
      gluon.launch_ag_gemm(a, b, table, rank, world=2, return_gathered=False, timeout_s=1.0,
                           **common)
    else:
      gluon.launch_gemm_rs(a, b, table, rank, world=2, timeout_s=1.0, **common)
  args = launched.value.args[0]
  descs = [x for x in args if isinstance(x, jt.TensorDescriptor)]
  want = [(a, (m, k), (k, 1), (128, cfg.block_k))]
  if op == "ag":
    want.append((a, (1, m, k), (m * k, k, 1), (1, 64, 128 // dt.itemsize)))
  want.append((b, (n, k), (k, 1), (256, 128)) if fp8 else (b, (k, n), (n, 1), (64, 256)))
  assert [(d.base, d.shape, d.strides, d.block_shape) for d in descs] == want
  assert args[:len(descs)] == tuple(descs)  # the kernels' first parameters
  gl_dt = gluon._gl_dtype(dt)
  assert [d.layout for d in descs] == [shared_layout(list(d.block_shape), gl_dt) for d in descs]
