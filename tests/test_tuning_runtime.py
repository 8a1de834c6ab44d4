"""Tuner verdicts, kernel-config validation and the runtime's host-side layout (no GPU needed)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_autooverlap as ao
from jax_autooverlap.runtime import workspace
from jax_autooverlap.tuning import select, store
from jax_autooverlap.tuning.config import KernelConfig
from fake_cuda import fake_gpu_mesh

H200 = "NVIDIA H200"


def test_measured_cache_drives_the_choice(monkeypatch):
  shipped = store.shipped_entries()
  assert shipped, "no measured tuning data shipped"
  # measured before kernel hashes were recorded: they do not count for these kernels ...
  assert all(store.staleness(e).startswith("measured with an earlier kernel source")
             for e in shipped.values())
  assert not set(shipped) & set(store.verdicts())
  # ... while the same entries measured with these kernels drive the choice
  monkeypatch.setattr(store, "verdicts", lambda: {k: store.stamped(e) for k, e in shipped.items()})
  for key, entry in shipped.items():
    op, kind, world, shape, dtype = key.split("|")
    m, k, n = map(int, shape.split("x"))
    w = int(world[1:])
    if op == "ag":  # per device: a[M/w, K] gathered, b[K, N/w]
      v = select.choose_ag(ao.OverlapConfig(), kind, w, m // w, k, n // w, dtype, dtype)
    else:  # per device: a[M, K/w], b[K/w, N]
      v = select.choose_rs(ao.OverlapConfig(), kind, w, m, k // w, n, dtype, dtype)
    if entry["impl"] == "triton":
      assert v.kernel == KernelConfig(**entry["kernel"]) and v.source == "measured"
      assert entry["ours_ms"] < entry["unfused_ms"]
    else:
      assert v.kernel is None and v.source == "measured" and v.reason.code == "tuner_unfused"


def test_small_shapes_fall_back_and_unsupported_shapes_say_why():
  v = select.choose_ag(ao.OverlapConfig(autotune=False), H200, 2, 128, 1024, 512, jnp.bfloat16,
                       jnp.bfloat16)
  assert v.kernel is None and v.source == "model" and v.reason.code == "tuner_unfused"
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 128, 1024, 512, jnp.bfloat16, jnp.bfloat16)
  assert v.kernel is None and v.source == "first_call" and v.predicted[0] >= v.predicted[1]
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 4096, 1000, 4096, jnp.bfloat16, jnp.bfloat16)
  assert v.kernel is None and v.reason.code == "unsupported_shape" and "K=1000" in v.reason
  v = select.choose_ag(ao.OverlapConfig(), H200, 2, 4096, 8192, 4096, jnp.int8, jnp.int32)
  assert v.kernel is None and v.reason.code == "unsupported_shape" and "int8" in v.reason
  big = KernelConfig(block_m=256, block_n=256, block_k=128, num_stages=4)
  v = select.choose_ag(ao.OverlapConfig(kernel=big), H200, 2, 4096, 8192, 4096, jnp.bfloat16,
                       jnp.bfloat16)
  assert v.kernel is None and v.reason.code == "unsupported_shape"


def test_kernel_config_validation():
  with pytest.raises(ValueError, match="block_n=96"):
    KernelConfig(block_n=96)
  with pytest.raises(ValueError, match="num_warps=2"):
    KernelConfig(num_warps=2)
  with pytest.raises(ValueError, match="chunks=0"):
    KernelConfig(chunks=0)
  with pytest.raises(TypeError, match="KernelConfig"):
    ao.OverlapConfig(kernel={"block_m": 64})
  with pytest.raises(ValueError, match="timeout_s"):
    ao.OverlapConfig(timeout_s=0)


def test_impl_triton_off_gpu_is_an_error():
  from jax_autooverlap.ops.planning import plan
  with pytest.raises(ValueError, match="needs the concrete mesh"):
    plan("ag_rows", ao.OverlapConfig(impl="triton"), 2, (1, 8, 64, 8), np.float32, np.float32)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_calls_parity_slot_never_overlaps_the_other_slot_of_any_call_on_the_workspace(world):
  """Calls of different sizes share a workspace (an fp8 all-gather's shards are half a bf16
  reduce-scatter's slots): a call on slot p must not touch slot 1 - p of ANY call, which the
  call before it may still be reading on a peer.  Slots packed by the call's own size
  overlapped (the fp8 training step's corruption, one H200, 2026-12-02)."""
  e4, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
  calls = [("ag_rows", 256, 256, 512, e4, bf16), ("rs_rows", 512, 256, 256, e4, bf16),
           ("ag_rows", 256, 256, 512, bf16, bf16), ("rs_rows", 24, 8, 40, bf16, bf16),
           ("ag_rows", 3, 5, 7, e4, bf16)]
  needs = [workspace.kernel_bytes(op, world, *dims, dt, out) for op, *dims, dt, out in calls]
  buf = workspace.buffer_offset(world)
  for nbytes in (max(needs), max(needs) + 4096, 3 * max(needs) + 17):  # as grown, any size
    half = workspace.parity_bytes(world, nbytes)
    assert half % 16 == 0
    for need in needs:
      used = (need - buf) // 2  # one slot's bytes (world pieces)
      assert used <= half  # slot 0 ends before slot 1 starts
      assert buf + half + used <= nbytes  # slot 1 inside the workspace


def test_launch_parity_bytes_from_the_workspace_size_and_refused_when_too_small():
  """The launchers' PARITY_BYTES: from the size of the workspaces the table points to (None:
  exactly what the launch needs); workspaces too small for the launch are an error naming it."""
  from jax_autooverlap.backends.launch import parity_bytes
  a = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  need = workspace.kernel_bytes("ag_rows", 4, 256, 512, 384, jnp.bfloat16, jnp.bfloat16)
  assert parity_bytes("ag_rows", 4, a, 384, jnp.bfloat16, None, "f") == 4 * 256 * 512 * 2
  assert parity_bytes("ag_rows", 4, a, 384, jnp.bfloat16, 1 << 24, "f") == \
      workspace.parity_bytes(4, 1 << 24)
  with pytest.raises(ValueError, match=f"launch_ag_gemm: workspaces of {need - 1} bytes per "
                                       rf"GPU; a\[256, 512\] with N = 384 in a group of 4 "
                                       f"needs {need}"):
    parity_bytes("ag_rows", 4, a, 384, jnp.bfloat16, need - 1, "launch_ag_gemm")


def test_workspace_layout_and_address_table():
  from types import SimpleNamespace
  from jax_autooverlap.backends.triton import _address_table
  assert workspace.buffer_offset(2) % 1024 == 0
  assert workspace.buffer_offset(8) >= workspace.FLAGS_OFFSET + workspace.flags_bytes(8)
  assert workspace.required_bytes(2, 1 << 20) == workspace.buffer_offset(2) + 4 * (1 << 20)
  assert workspace.parity_bytes(2, workspace.required_bytes(2, 1 << 20)) == 2 << 20
  devices = np.arange(8).reshape(2, 4)  # mesh ("a", "x"), gathering over "x"
  mesh = SimpleNamespace(axis_names=("a", "x"), devices=devices)
  addresses = [(i + 1) << 33 | 0x1234 for i in range(8)]
  table = _address_table(mesh, "x", 4, addresses)
  assert table.shape == (2, 10) and table.dtype == np.uint32
  for g in range(2):
    for r in range(4):
      addr = int(table[g, 2 * r]) | int(table[g, 2 * r + 1]) << 32
      assert addr == addresses[devices[g, r]]
    assert int(table[g, 8]) == int(table[g, 9]) == 0  # reserved: error record is in the header


pytestmark = pytest.mark.usefixtures("stand_in_cuda_driver")


_FAST = {"block_k": 64, "block_m": 128, "block_n": 256, "chunks": 8, "group_m": 8,
         "num_comm": 32, "num_stages": 3, "num_warps": 8}
_SYNTHETIC = {  # verdicts as the benchmark writes them
    f"ag|{H200}|w2|4096x8192x8192|bfloat16": {"impl": "triton", "kernel": _FAST},
    f"ag|{H200}|w2|512x8192x8192|bfloat16": {"impl": "unfused", "note": "fused kernel not faster"},
    f"rs|{H200}|w2|8192x4096x4096|bfloat16": {"impl": "unfused", "note": "fused kernel not faster"},
}


def test_gpu_plans_kernels_where_measured_and_keeps_unfused_elsewhere(monkeypatch):
  from jax_autooverlap.ops.planning import plan
  monkeypatch.setattr(store, "verdicts", lambda: _SYNTHETIC)
  mesh, cfg, bf16 = fake_gpu_mesh(), ao.OverlapConfig(), jnp.bfloat16
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 2048, 8192, 4096), bf16, bf16, mesh)
  assert impl == "triton" and gpu.kernel == KernelConfig(**_FAST) and "measured" in why
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 256, 8192, 4096), bf16, bf16, mesh)
  assert impl == "unfused" and why.code == "tuner_unfused" and "measured" in why  # 512x8192x8192
  impl, _, why = plan("rs_rows", cfg, 2, (1, 8192, 2048, 4096), bf16, bf16, mesh)
  assert impl == "unfused" and why.code == "tuner_unfused"                     # 8192x4096x4096
  impl, gpu, why = plan("ag_rows", cfg, 2, (1, 4096, 8192, 4096), bf16, bf16, mesh)
  assert impl == "unfused" and why.code == "first_call" and "model: fused" in why  # between
  off = ao.OverlapConfig(autotune=False)                               # measured: to be measured
  impl, gpu, why = plan("ag_rows", off, 2, (1, 4096, 8192, 4096), bf16, bf16, mesh)
  assert impl == "triton" and "model: fused" in why  # no measurement: the fit model's choice
  impl, _, why = plan("ag_k", cfg, 2, (1, 2048, 8192, 4096), bf16, bf16, mesh)
  assert impl == "unfused" and why.code == "no_kernel"
  impl, _, why = plan("ag_rows", cfg, 2, (4, 2048, 8192, 4096), bf16, bf16, mesh)
  assert impl == "unfused" and why.code == "batched"


def test_no_heuristic_pick_where_the_kernel_was_never_measured(monkeypatch):
  monkeypatch.setattr(store, "verdicts", lambda: _SYNTHETIC)
  big = (8192, 8192, 4096, jnp.bfloat16, jnp.bfloat16)
  off = ao.OverlapConfig(autotune=False)
  v = select.choose_ag(off, H200, 4, *big)
  assert v.kernel is None and v.reason.code == "never_measured"
  assert "jax_autooverlap.bench ag" in v.reason
  v = select.choose_ag(off, "NVIDIA H100 80GB HBM3", 2, *big)
  assert v.kernel is None and v.reason.code == "never_measured"
  assert select.choose_ag(off, H200, 2, *big).kernel is not None
  for kind, world in ((H200, 4), ("NVIDIA H100 80GB HBM3", 2), (H200, 2)):  # by default: measured
    v = select.choose_ag(ao.OverlapConfig(), kind, world, *big)
    assert v.kernel is None and v.reason.code == "first_call" and v.candidates
  v = select.choose_ag(ao.OverlapConfig(impl="triton"), H200, 4, *big)  # asked for: honoured
  assert v.kernel is not None and v.source == "explicit"


def test_user_cache_dir_verdicts_override_shipped_ones(monkeypatch, tmp_path):
  from jax_autooverlap.bench.__main__ import _merge_into_user_cache, _write_tuning_cache
  monkeypatch.setenv("JAX_AUTOOVERLAP_CACHE_DIR", str(tmp_path / "cache"))
  rec = lambda impl, ms, world: {
      "op": "ag", "m": 8192, "k": 8192, "n": 8192, "dtype": "bfloat16", "world_size": world,
      "impl": impl, "median_ms": ms, "gpu": "NVIDIA-H200", "date": "2026-11-30",
      **({"kernel": _FAST} if impl == "ours" else {})}
  run = tmp_path / "run" / "tuning-ag.json"
  run.parent.mkdir()
  _write_tuning_cache(run, [rec("unfused", 2.0, 4), rec("ours", 1.5, 4)], "bfloat16", "ag")
  _merge_into_user_cache(run, "ag")
  store.clear_cache()
  try:
    assert f"ag|{H200}|w4|8192x8192x8192|bfloat16" in store.verdicts()
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 8192, 2048, jnp.bfloat16, jnp.bfloat16)
    assert v.kernel == KernelConfig(**_FAST) and "measured" in v.reason
    # a later run where the kernel lost replaces the verdict
    _write_tuning_cache(run, [rec("unfused", 2.0, 4), rec("ours", 2.5, 4)], "bfloat16", "ag")
    _merge_into_user_cache(run, "ag")
    store.clear_cache()
    v = select.choose_ag(ao.OverlapConfig(), H200, 4, 2048, 8192, 2048, jnp.bfloat16, jnp.bfloat16)
    assert v.kernel is None and "measured: unfused faster" in v.reason
  finally:
    store.clear_cache()


def test_kernels_planned_whatever_the_command_buffer_flags(monkeypatch):
  """Kernel launches allocate nothing, so XLA may capture them in CUDA graphs: no flag matters."""
  from jax_autooverlap.ops.planning import plan
  mesh, cfg, bf16 = fake_gpu_mesh(), ao.OverlapConfig(impl="triton"), jnp.bfloat16
  for flags in ("", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL",
                "--xla_gpu_enable_command_buffer=+WHILE", "--xla_gpu_enable_command_buffer="):
    # conftest's flags kept: a CPU backend first made here still gets its 8 devices
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    assert plan("ag_rows", cfg, 2, (1, 2048, 8192, 4096), bf16, bf16, mesh)[0] == "triton", flags


def _kernel_calls_planned(monkeypatch):
  """Pretend the CPU mesh is a GPU mesh and record every GPU kernel the ops plan (unfused math)."""
  from conftest import stand_in_kernels
  from jax_autooverlap.runtime import context
  monkeypatch.setattr(context, "platform", lambda mesh: None if mesh is None else "gpu")
  return stand_in_kernels(monkeypatch)


def test_kernels_planned_inside_other_jits_loops_and_checkpoint(monkeypatch):
  from jax.sharding import PartitionSpec as P
  from conftest import cpu_mesh
  calls = _kernel_calls_planned(monkeypatch)
  mesh = cpu_mesh((2,), ("x",))
  cfg = ao.OverlapConfig(impl="triton")

  def block(x, w):
    h = jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w
    return jax.lax.psum_scatter(h @ w.T, "x", scatter_dimension=0, tiled=True)

  f = jax.shard_map(block, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  x, w = jnp.ones((256, 128)), jnp.ones((128, 128))
  want = jax.jit(f)(x, w)
  programs = {  # each with a fresh ao.jit, so that its trace is not reused from a cache
      "jax.jit(ao.jit(f))": lambda: jax.jit(ao.jit(f, overlap_config=cfg)),
      "ao.jit inside ao.jit": lambda: ao.jit(
          lambda x, w: ao.jit(f, overlap_config=cfg)(x, w) + 0),
      "scan body in jax.jit": lambda: jax.jit(lambda x, w: jax.lax.scan(
          lambda c, _: (ao.jit(f, overlap_config=cfg)(c, w), None), x, None, length=2)[0]),
      "checkpoint in jax.jit": lambda: jax.jit(jax.checkpoint(ao.jit(f, overlap_config=cfg))),
  }
  for where, make in programs.items():
    calls.clear()
    got = make()(x, w)
    assert [c[0] for c in calls] == ["ag", "rs"], (where, calls)
    if "scan" not in where:
      np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=where)

  def direct(x, w):  # fused ops called directly, inside a plain jax.jit
    return ao.matmul_rs(ao.ag_matmul(x, w, "x", config=cfg), w.T, "x", config=cfg)

  calls.clear()
  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(direct, in_specs=(P("x"), P()), out_specs=P("x")))(x, w)
  assert [c[0] for c in calls] == ["ag", "rs"]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_backward_dual_is_planned_on_the_forward_mesh():
  from jax_autooverlap.ops.planning import CoreParams, dual_params
  from jax_autooverlap.ops.ring import RingParams
  ring = RingParams(axis_name="x", axis_size=2, chunks=1, precision=None,
                    out_dtype=np.dtype(jnp.bfloat16))
  a = jnp.zeros((1, 2048, 8192), jnp.bfloat16)  # the dual ag_rows of a 4096x8192x8192 rs
  b = jnp.zeros((1, 8192, 4096), jnp.bfloat16)
  mesh = fake_gpu_mesh()
  # (without first-call measurement: the dual takes the model's kernel, fit on 2xH200)
  config = ao.OverlapConfig(impl="triton", autotune=False)
  forward = CoreParams(ring=ring, impl="triton", config=config, mesh=mesh)
  dual = dual_params("ag_rows", a, b, forward, jnp.bfloat16)
  assert dual.impl == "triton" and dual.gpu.mesh is mesh


def test_model_function_decorated_with_ao_jit_inside_a_users_jitted_train_step(monkeypatch):
  """The README pattern for users who cannot change their outer jit: a module-style model
  (parameters in a pytree, __call__ decorated with ao.jit) called from a jax.jit training step;
  forward and backward both plan the kernels, and the step equals the unfused one."""
  from jax.sharding import PartitionSpec as P
  from conftest import cpu_mesh
  calls = _kernel_calls_planned(monkeypatch)
  mesh = cpu_mesh((2,), ("x",))

  class TPMlp:  # what a Flax/Equinox module reduces to: static structure + a params pytree
    def __init__(self, mesh, fuse):
      self.mesh, self.fuse = mesh, fuse

    def _apply(self, params, x):
      def body(x, w_in, w_out):
        h = jax.nn.gelu(jax.lax.all_gather(x, "x", axis=0, tiled=True) @ w_in)
        return jax.lax.psum_scatter(h @ w_out, "x", scatter_dimension=0, tiled=True)
      return jax.shard_map(body, mesh=self.mesh, in_specs=(P("x"), P(None, "x"), P("x")),
                           out_specs=P("x"))(x, params["w_in"], params["w_out"])

    def __call__(self, params, x):
      if not self.fuse:
        return self._apply(params, x)
      return ao.jit(self._apply, overlap_config=ao.OverlapConfig(impl="triton"))(params, x)

  def make_step(model):
    @jax.jit
    def train_step(params, x):
      loss, grads = jax.value_and_grad(lambda p: jnp.sum(model(p, x) ** 2))(params)
      return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss
    return train_step

  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  params = {"w_in": jax.random.normal(k1, (64, 128)) / 8, "w_out": jax.random.normal(k2, (128, 64)) / 8}
  x = jax.random.normal(k3, (256, 64))
  want_params, want_loss = make_step(TPMlp(mesh, fuse=False))(params, x)
  fused_step = make_step(TPMlp(mesh, fuse=True))
  got_params, got_loss = fused_step(params, x)
  # forward AG+GEMM and GEMM+RS; backward the RS's dual (x is not differentiated: no dx)
  assert calls, "no kernel planned"
  report = ao.explain(fused_step, params, x)
  assert [(m.phase, m.kind) for m in report] == [
      ("fwd", "ag_matmul"), ("fwd", "matmul_rs"), ("bwd", "ag_matmul")], str(report)
  assert all(m.impl.startswith("triton kernel") and m.function == "_apply" for m in report), \
      str(report)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(got_params[k], want_params[k], rtol=1e-4, atol=1e-6)


class _Record:
  """An error record as runtime/cuda.py's ErrorRecord reads it."""

  def __init__(self, *ints):
    self.ints = list(ints) + [0] * (8 - len(ints))

  def read(self):
    return list(self.ints)

  def clear(self):
    self.ints = [0] * 8


def test_a_timeout_record_names_the_peer_or_the_split_tile():
  """kernels/sync.py's timeout record: a peer's chunk (chunk >= 0), or the other parts of a
  split tile on the GPU itself (kernels/split_k.py sum_own_rows: chunk -1 - tile)."""
  from jax_autooverlap.runtime import cuda
  from jax_autooverlap.runtime.errors import CollectiveTimeoutError, check_errors, register_op
  op = register_op("ag_matmul of x (16x4096 per rank) @ w")
  rec = _Record(cuda.ERR_TIMEOUT, op, 3, 5, 2, 0, 4)
  with pytest.raises(CollectiveTimeoutError,
                     match=r"ag_matmul of x \(16x4096 per rank\) @ w: rank 3 timed out waiting for "
                           r"chunk 2 from peer rank 5 \(arrival counter 0, expected 4\)"):
    check_errors(rec)
  assert rec.read()[0] == 0  # cleared
  with pytest.raises(CollectiveTimeoutError,
                     match=r"@ w: rank 3 timed out waiting for the other split-K parts of its "
                           r"split tile 6 \(counted 5, expected 8\)"):
    check_errors(_Record(cuda.ERR_TIMEOUT, op, 3, 3, -7, 5, 8))
