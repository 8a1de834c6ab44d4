"""Processes sharing one GPU run the fused kernels over a mesh of their devices (needs a GPU).

    python tests/gpu_two_process.py [--world 2|4|8[,...]] [--parallel] [--log FILE]
        [--budget-s S] [--timeout-s S]
        [--scenario kernels|missing_peer|nested_step|first_call|fp8_step|fp8_qdq]
        [--engine tl|gluon [--wg-partitions]] [--packed] [--split-k S] [--fp8]

starts each scenario as `--world` processes (default 2; several sizes, one after
the other: --world 8,4,2, or all at once with --parallel; CUDA_VISIBLE_DEVICES=0 in each,
XLA_PYTHON_CLIENT_PREALLOCATE=false, jax.distributed on 127.0.0.1), one device
per process, and prints a PASS/FAIL table (the first_call scenario also a table
of its two runs), its verdict last; exit status 0 iff every check passed.
--budget-s bounds the whole run: what would start after it is a FAIL row "not
run", and the tables still print.  --timeout-s replaces each run's own limit (TIMEOUT_S,
longer for larger groups): for large AO_STEP_DIMS.

AO_STEP_DIMS="D,F,S,L" (model dim, MLP hidden dim, tokens, layers; default 256,512,512,2)
sizes the training steps of nested_step, first_call and fp8_step; S and F must be
multiples of the process count.  E.g. a Llama-3-8B layer's TP+SP step,
AO_STEP_DIMS=4096,14336,4096,1 (or S=8192): the first_call table's "first step s" is the
first call's cost (trace, measure each shape, compile, run).  Each process also runs the
step unsharded in f32 on its CPU for the reference (minutes at those sizes; not in that
time).
tests/test_gpu_multiprocess.py runs it under `pytest -m gpu`.

NCCL refuses several ranks on one GPU, so the programs hold no XLA collectives:
inputs are built per process (make_array_from_process_local_data) from the
same seeded host arrays, and every result is compared with a numpy reference
of this process's shard.  The processes' kernels rendezvous through
time-sliced contexts: timings mean nothing here.  --engine picks the kernels'
engine (KernelConfig.engine; default: the tuner's choice); --wg-partitions with the
gluon engine runs GEMM+RS with a consumer partition per warpgroup
(KernelConfig.wg_partitions).  --packed: the tl kernels with the shards packed into 128x128
row tiles (KernelConfig.pack_shards; with AO_STEP_DIMS whose S / processes divides 128 into
two or more, e.g. 256,512,128,2 for nested_step: every rank of the group runs the packed
kernels, the rank-0 loopback cannot show the other ranks' tiles).  --split-k S: the tl kernels
with every tile's k-blocks in S parts (KernelConfig.split_k; AG+GEMM's parts then sum their
rows of a tile together: kernels/split_k.py Spread; e.g. AO_STEP_DIMS=4096,2048,128,2 with
--packed --split-k 4, whose K per rank has 4 k-blocks or more at 8 processes).  --fp8: the
first_call scenario measures the fp8_step's program (fp8 matmuls' first call) instead of the
bf16 step.

Scenarios:
  kernels       explain says "triton kernel ..., N processes"; AG+GEMM and GEMM+RS
                equal the host reference; repeated calls of each are bit-identical;
                a lax.scan body holding each op; each op inside a user's jax.jit (an
                ao.jit function called there, and the op called directly).
  missing_peer  every process traces the program, only process 0 runs it: its
                bounded waits expire, the call fails and check_errors() raises
                CollectiveTimeoutError naming a peer (no hang).
  nested_step   the user's pattern: a TP+SP model (2 SwiGLU layers under lax.scan +
                jax.checkpoint) decorated with ao.jit, called from the user's own
                jax.jit training step (VJP with a sharded cotangent, SGD): every
                collective of forward and backward on the kernel (a plain one would fail
                with NCCL's "Duplicate GPU"), explain's rows, output, input gradient and
                updated weights against the same step run unsharded on the CPU; calls 2
                and 3 bit-identical to call 1.
  first_call    the same step with the DEFAULT config (no impl="triton"), twice, in new
                processes sharing one fresh tuning cache: the first run's explain says
                every row is measured on the first call, the call measures each shape
                (the unfused program fails here: NCCL refuses the processes, so the
                fastest kernel config that passed its checks is chosen), every process
                takes the same verdicts, the cache holds them, every row then runs the
                kernel, results equal the CPU reference; the second run measures
                nothing and runs the same kernels.
  fp8_step      the nested_step layers in fp8 (impl="triton": every match on the kernel):
                each matmul written as Flax's fp8 dot (our own custom_vjp op: per-tensor
                scales as inputs, i.e. delayed scaling; operands `v / s -> clip -> e4m3`,
                one dot_general of the fp8 values, the scales on its result; the backward
                quantizes the cotangent to e5m2), the form whose forward AND backward the
                rewrite fuses (the quantize-dequantize form, `astype(bf16) * s` before the
                dot, fuses the forward only).  explain's 5 rows all fused: fwd AG+GEMM and
                GEMM+RS and remat AG+GEMM in e4m3 x e4m3, bwd AG+GEMM and GEMM+RS in
                e5m2 x e4m3; no plain collective; output, gradients and updated weights
                against the same step unsharded in f32 on the CPU from the same fp8 values,
                within the fp8 tolerance (jax_autooverlap/fp8.py: gemm_tolerance plus the
                formats' quantization_error); calls 2 and 3 bit-identical to call 1.
  fp8_qdq       the same layers forward only (a prefill), every matmul's operands in the
                quantize-dequantize form (`v / s -> clip -> e4m3 -> bf16 * s`, scales as
                inputs), under the user's jax.jit: explain's 2 rows fused in e4m3 x e4m3 (the
                gathered activations quantized before the gather), no plain collective, the
                output against the same forward unsharded in f32 on the CPU within the fp8
                tolerance, calls 2 and 3 bit-identical.  (The form's backward has 16-bit
                matmuls beside unfused collectives: NCCL would refuse them here.)
                tests/test_multiprocess.py runs nested_step, first_call, fp8_step and fp8_qdq
                on 2 CPU processes (the ops' pure-JAX reference).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
M, K, N = 1024, 1024, 1024
TOL = 2e-2  # bf16 outputs
# Checks each process must report (a crash must not pass as "nothing failed"), by process
# (0, others).
EXPECTED_CHECKS = {"kernels": (12, 12), "missing_peer": (2, 0), "nested_step": (6, 6),
                   "first_call": (7, 7), "first_call_again": (7, 7), "fp8_step": (6, 6),
                   "fp8_qdq": (5, 5)}
TIMEOUT_S = {"kernels": 400, "missing_peer": 180, "nested_step": 300, "first_call": 420,
             "first_call_again": 240, "fp8_step": 300, "fp8_qdq": 240}
SCENARIOS = ("kernels", "missing_peer", "nested_step", "first_call", "fp8_step", "fp8_qdq")


# --- worker ------------------------------------------------------------------

def _worker(scenario: str, me: int, n: int, port: str):
  sys.path.insert(0, REPO)
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", n, me, initialization_timeout=120)
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_autooverlap as ao
  from gpu_config import forced_kernel_config  # beside this script; not conftest (gpu_config.py)
  from jax_autooverlap.runtime import CollectiveTimeoutError, check_errors
  from jax_autooverlap.runtime import rendezvous

  kv = rendezvous.client()

  def check(name, ok, detail=""):
    print("CHECK " + json.dumps({"scenario": scenario, "process": me, "check": name,
                                 "ok": bool(ok), "detail": str(detail)[:900]}), flush=True)

  gpus = jax.devices()
  if len(gpus) != n or any(d.platform != "gpu" for d in gpus):
    check(f"{n} GPU devices, one per process", False, f"devices {gpus}")
    return
  mesh = jax.make_mesh((n,), ("x",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,))
  if scenario.startswith("first_call"):
    info = _first_call_step(mesh, check, kv, again=scenario == "first_call_again", on_gpu=True)
    print("INFO " + json.dumps(info), flush=True)
    kv.wait_at_barrier("ao-test/done", 300_000)
    return
  rng = np.random.default_rng(1234)  # the same host arrays in every process
  bf16 = lambda a: np.asarray(a, np.float32).astype(jnp.bfloat16)
  X = bf16(rng.standard_normal((M, K)))
  W = bf16(rng.standard_normal((K, N)) / np.sqrt(K))
  H = bf16(rng.standard_normal((M, K)))
  W2 = bf16(rng.standard_normal((K, N)) / np.sqrt(K))
  rows, cols = slice(me * M // n, (me + 1) * M // n), slice(me * N // n, (me + 1) * N // n)
  kcols = slice(me * K // n, (me + 1) * K // n)

  def global_array(local, spec, shape):
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local, shape)

  x = global_array(X[rows], P("x"), (M, K))
  w = global_array(W[:, cols], P(None, "x"), (K, N))
  h = global_array(H[:, kcols], P(None, "x"), (M, K))
  w2 = global_array(W2[kcols], P("x", None), (K, N))
  f32 = lambda a: np.asarray(a, np.float64)
  want_ag = f32(X) @ f32(W[:, cols])  # this process's columns of all_gather(x) @ w
  want_rs = (f32(H) @ f32(W2))[rows]  # this process's rows of psum_scatter(h @ w2)

  timeout = 2.0 if scenario == "missing_peer" else 60.0
  cfg = ao.OverlapConfig(impl="triton", timeout_s=timeout, kernel=forced_kernel_config())
  ag = lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w
  rs = lambda h, w: lax.psum_scatter(h @ w, "x", scatter_dimension=0, tiled=True)
  f_ag = ao.jit(jax.shard_map(ag, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                              out_specs=P(None, "x")), overlap_config=cfg)
  f_rs = ao.jit(jax.shard_map(rs, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                              out_specs=P("x")), overlap_config=cfg)
  local = lambda a: a.addressable_data(0)

  def rel(got, want):
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))

  if scenario == "nested_step":
    _nested_step(mesh, cfg, check, kv, "kernel")
    kv.wait_at_barrier("ao-test/done", 300_000)
    return

  if scenario == "fp8_step":
    _fp8_step(mesh, cfg, check, kv, "kernel")
    kv.wait_at_barrier("ao-test/done", 300_000)
    return

  if scenario == "fp8_qdq":
    _fp8_qdq(mesh, cfg, check, kv, "kernel")
    kv.wait_at_barrier("ao-test/done", 300_000)
    return

  if scenario == "missing_peer":
    f_ag.lower(x, w).compile()  # both processes set up and compile; only process 0 runs it
    kv.wait_at_barrier("ao-test/compiled", 300_000)
    if me == 0:
      try:
        jax.block_until_ready(f_ag(x, w))
        check("the call fails", False, "returned normally")
      except Exception as e:  # noqa: BLE001
        check("the call fails", True, f"{type(e).__name__}: {str(e)[:150]}")
      try:
        check_errors()
        check("check_errors raises CollectiveTimeoutError", False, "no error recorded")
      except CollectiveTimeoutError as e:
        check("check_errors raises CollectiveTimeoutError",
              "ag_matmul over axis 'x'" in str(e) and "from peer rank" in str(e), e)
    kv.wait_at_barrier("ao-test/done", 300_000)
    # Process 0's CUDA context is lost: skip the teardown (XLA may abort on it), in both
    # processes so that neither waits for the other at jax.distributed's shutdown.
    sys.stdout.flush()
    os._exit(0)

  for name, f, args in (("ag", f_ag, (x, w)), ("rs", f_rs, (h, w2))):
    impl = f.explain(*args).matches[0].impl
    check(f"{name}: explain", impl.startswith("triton kernel") and f"{n} processes" in impl, impl)
  f_ag.lower(x, w).compile(), f_rs.lower(h, w2).compile()
  kv.wait_at_barrier("ao-test/compiled", 300_000)  # no first call waits on a compiling peer

  repeats = 2000 // n  # the contexts are time-sliced: fewer calls in larger groups
  for name, f, args, want in (("ag", f_ag, (x, w), want_ag), ("rs", f_rs, (h, w2), want_rs)):
    first = local(f(*args))
    err = rel(first, want)
    check(f"{name}: equals the host reference", err < TOL, f"relative error {err:.2e}")
    t0 = time.perf_counter()
    worst = jnp.zeros((), jnp.float32)
    for _ in range(repeats):  # local (this device's) comparisons only: no collectives
      worst = jnp.maximum(worst, jnp.max(jnp.abs(local(f(*args)) - first).astype(jnp.float32)))
    worst = float(worst)
    check(f"{name}: {repeats:,} repeated calls bit-identical", worst == 0.0,
          f"max |diff| {worst} ({time.perf_counter() - t0:.1f} s)")

  steps = 20

  def scanned(mm, init_shape):
    def body(a, b):
      def step(acc, i):
        return acc + mm(a * (1 + i.astype(a.dtype) / 64), b).astype(jnp.float32), None
      init = lax.pcast(jnp.zeros(init_shape, jnp.float32), "x", to="varying")
      return lax.scan(step, init, jnp.arange(steps))[0]
    return body

  scale = lambda A, i: f32(bf16(f32(A) * (1 + i / 64)))
  s_ag = ao.jit(jax.shard_map(scanned(ag, (M, N // n)), mesh=mesh,
                              in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")),
                overlap_config=cfg)
  s_rs = ao.jit(jax.shard_map(scanned(rs, (M // n, N)), mesh=mesh,
                              in_specs=(P(None, "x"), P("x", None)), out_specs=P("x")),
                overlap_config=cfg)
  want_s_ag = sum(scale(X, i) @ f32(W[:, cols]) for i in range(steps))
  want_s_rs = sum((scale(H, i) @ f32(W2))[rows] for i in range(steps))
  for name, f, args, want in (("ag", s_ag, (x, w), want_s_ag), ("rs", s_rs, (h, w2), want_s_rs)):
    impl = f.explain(*args).matches[0].impl
    f.lower(*args).compile()
    kv.wait_at_barrier(f"ao-test/scan-{name}", 300_000)
    errs = [rel(local(f(*args)), want) for _ in range(3)]
    check(f"{name}: lax.scan body ({steps} steps, 3 runs)",
          impl.startswith("triton kernel") and max(errs) < TOL,
          f"{impl[:40]}...; relative errors {[f'{e:.1e}' for e in errs]}")

  # Inside a user's jax.jit: an ao.jit function called there, and the ops called directly.
  ag_op = lambda x, w: ao.ag_matmul(x, w, "x", config=cfg)
  rs_op = lambda h, w: ao.matmul_rs(h, w, "x", config=cfg)
  nested = {
      "ag": (jax.jit(lambda x, w: f_ag(x, w) * 1), jax.jit(jax.shard_map(
          ag_op, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))),
             (x, w), want_ag),
      "rs": (jax.jit(lambda h, w: f_rs(h, w) * 1), jax.jit(jax.shard_map(
          rs_op, mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x"))),
             (h, w2), want_rs),
  }
  with jax.set_mesh(mesh):
    for name, (in_jit, direct, args, want) in nested.items():
      for where, f in (("jax.jit(ao.jit(f))", in_jit), ("op called in jax.jit", direct)):
        hlo = f.lower(*args).compile().as_text()
        kv.wait_at_barrier(f"ao-test/nested-{name}-{where}", 300_000)
        errs = [rel(local(f(*args)), want) for _ in range(3)]
        check(f"{name}: {where}", "triton_kernel_call" in hlo and max(errs) < TOL,
              f"kernel in program: {'triton_kernel_call' in hlo}; relative errors "
              f"{[f'{e:.1e}' for e in errs]}")
  kv.wait_at_barrier("ao-test/done", 300_000)


def _step_dims(n: int) -> tuple[int, int, int, int]:
  """(D, F, S, L) of the training steps: model dim, MLP hidden dim, tokens, layers; AO_STEP_DIMS
  ("D,F,S,L") overrides the default.  S and F are split over the n processes (sequence and
  tensor parallel), so both must be multiples of n."""
  spec = os.environ.get("AO_STEP_DIMS", "").strip()
  if not spec:
    return 256, 512, 512, 2
  parts = spec.split(",")
  try:
    dims = tuple(int(p) for p in parts)
  except ValueError:
    dims = ()
  if len(parts) != 4 or len(dims) != 4 or min(dims) < 1:
    raise ValueError(f"AO_STEP_DIMS={spec!r}: want four positive ints D,F,S,L (model dim, MLP "
                     "hidden dim, tokens, layers), e.g. 4096,14336,4096,1")
  D, F, S, L = dims
  if S % n or F % n:
    raise ValueError(f"AO_STEP_DIMS={spec!r}: S={S} and F={F} must be multiples of the "
                     f"process count {n}")
  return dims


def _placer(mesh):
  """place(host array, spec, dtype=bf16): a global array over `mesh`, every process giving the
  blocks of its own devices from the same host array."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  def place(a, spec, dtype=jnp.bfloat16):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                        lambda i: jnp.asarray(a[i], dtype))
  return place


def _step_case(mesh, cfg):
  """The nested_step program: (step, (params, x, ct), the host arrays, the reference outputs:
  the same step run unsharded in f32 on this process's CPU)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jax_autooverlap as ao
  D, F, S, L = _step_dims(mesh.shape["x"])
  rng = np.random.default_rng(99)
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  host = {k: as_bf16(rng.standard_normal(shape) / np.sqrt(shape[1]))
          for k, shape in (("w1", (L, D, F)), ("w3", (L, D, F)), ("w2", (L, F, D)))}
  X, CT = (as_bf16(rng.standard_normal((S, D))) for _ in range(2))
  specs = {"w1": P(None, None, "x"), "w3": P(None, None, "x"), "w2": P(None, "x", None)}

  place = _placer(mesh)
  def layer(x, p, gather, scatter):
    g = gather(x)
    h = jax.nn.silu(g @ p["w1"]) * (g @ p["w3"])
    return x + scatter(h @ p["w2"])

  def stack(params, x, gather, scatter):
    one = lambda x, p: (jax.checkpoint(lambda x, p: layer(x, p, gather, scatter))(x, p), None)
    return lax.scan(one, x, params)[0]

  def train_step(model):
    def step(params, x, ct):
      out, vjp = jax.vjp(model, params, x)
      grads, dx = vjp(ct)
      return out, dx, grads, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return step

  body = lambda params, x: stack(params, x, lambda v: lax.all_gather(v, "x", axis=0, tiled=True),
                                 lambda v: lax.psum_scatter(v, "x", scatter_dimension=0,
                                                            tiled=True))
  model = ao.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("x")), out_specs=P("x")),
                 overlap_config=cfg)
  step = jax.jit(train_step(model))
  params = {k: place(v, specs[k]) for k, v in host.items()}
  args = (params, place(X, P("x")), place(CT, P("x")))
  with jax.default_device(jax.local_devices(backend="cpu")[0]):  # unsharded, f32, this CPU
    ref = jax.jit(train_step(lambda p, x: stack(p, x, lambda v: v, lambda v: v)))(
        {k: jnp.asarray(v) for k, v in host.items()}, jnp.asarray(X), jnp.asarray(CT))
  return step, args, host, jax.tree.map(np.asarray, ref)


def _fp8_step_case(mesh, cfg):
  """The fp8_step program: (step, (params, scales, x, ct), the host arrays, the reference
  outputs: the same step run unsharded in f32 on this process's CPU, from the same fp8 values).

  The SwiGLU layers of _step_case with every matmul an fp8 one, written as Flax's fp8 dot
  writes it (our own op, `fp8_dot`): the operands quantized to e4m3 with per-tensor scales
  that are inputs (delayed scaling: `v / s -> clip -> astype(e4m3)`), one dot_general of the
  fp8 values into bf16, the scales applied to its result; its VJP quantizes the cotangent to
  e5m2 and multiplies the fp8 values the same way.  That form fuses forward AND backward:
  the gathered fp8 value may feed several dots (remat's recomputed matmul and the weight
  gradient's), where the quantize-dequantize form (`astype(e4m3).astype(bf16) * s` before
  the dot) fuses the forward only (its backward has 16-bit matmuls, and a dequantized gathered
  value read by two dots stays unfused).  w1 and w3 are one weight w13 (L, D, 2, F), sharded on
  F: one matmul reads the gathered activations, so the backward holds one matmul before its
  reduce-scatter (a sum of two fp8 matmuls with their own scales is not one GEMM).
  The host inputs are fp8 values times power-of-2 scales: quantizing them is exact on both
  sides; the intermediates (h, the cotangents) are quantized in both from values that differ
  by the GPU's bf16 roundings."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jax_autooverlap as ao
  E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  D, F, S, L = _step_dims(mesh.shape["x"])
  on_grid = _on_e4m3_grid(np.random.default_rng(98))
  (W13, s13), (W2, s2) = on_grid((L, D, 2, F), D ** -0.5), on_grid((L, F, D), F ** -0.5)
  (X, sx), (CT, _) = on_grid((S, D), 1.0), on_grid((S, D), 1.0)
  host = {"w13": W13, "w2": W2}
  # Per layer, per-tensor f32 scales (delayed scaling: inputs, not computed from the values):
  # x, w13, w2 as generated; h = silu(y1) * y3 of O(1) values, |h| < 448 / 16 = 28; the
  # cotangents in e5m2 (range 2**-16 .. 57344) at scale 1.
  scale_host = {k: np.full((L,), v, np.float32) for k, v in (
      ("x", sx), ("w13", s13), ("h", 1 / 16), ("w2", s2), ("g13", 1.0), ("g2", 1.0))}
  specs = {"w13": P(None, None, None, "x"), "w2": P(None, "x", None)}
  sspecs = {k: P() for k in scale_host}

  def quantize(v, s, dtype):
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(v / s.astype(v.dtype), -top, top).astype(dtype)

  def scaled_dot(qa, qb, scale, dn, out):
    return lax.dot_general(qa, qb, dn, preferred_element_type=out) * scale.astype(out)

  mm, mm_t, mm_k = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))

  @jax.custom_vjp
  def fp8_dot(a, b, sa, sb, sg):  # a (M, K) @ b (K, N) in e4m3 x e4m3, the result in a's dtype
    return scaled_dot(quantize(a, sa, E4), quantize(b, sb, E4), sa * sb, mm, a.dtype)

  def fp8_dot_fwd(a, b, sa, sb, sg):
    qa, qb = quantize(a, sa, E4), quantize(b, sb, E4)
    return scaled_dot(qa, qb, sa * sb, mm, a.dtype), (qa, qb, sa, sb, sg)

  def fp8_dot_bwd(res, ct):  # the cotangent in e5m2; the scales get no gradient
    qa, qb, sa, sb, sg = res
    qg = quantize(ct, sg, E5)
    da = scaled_dot(qg, qb, sg * sb, mm_t, ct.dtype)  # ct @ b^T
    db = scaled_dot(qa, qg, sa * sg, mm_k, ct.dtype)  # a^T @ ct
    return da, db, jnp.zeros_like(sa), jnp.zeros_like(sb), jnp.zeros_like(sg)

  fp8_dot.defvjp(fp8_dot_fwd, fp8_dot_bwd)

  def layer(x, p, s, gather, scatter):
    g = gather(x)
    w13 = p["w13"].reshape(p["w13"].shape[0], -1)  # [w1 | w3] of this shard's F columns
    y = fp8_dot(g, w13, s["x"], s["w13"], s["g13"]).reshape(g.shape[0], 2, -1)
    h = jax.nn.silu(y[:, 0]) * y[:, 1]
    return x + scatter(fp8_dot(h, p["w2"], s["h"], s["w2"], s["g2"]))

  def stack(params, scales, x, gather, scatter):
    one = lambda x, ps: (jax.checkpoint(lambda x, p, s: layer(x, p, s, gather, scatter))(x, *ps),
                         None)
    return lax.scan(one, x, (params, scales))[0]

  def train_step(model):
    def step(params, scales, x, ct):
      out, vjp = jax.vjp(lambda p, x: model(p, scales, x), params, x)
      grads, dx = vjp(ct)
      return out, dx, grads, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return step

  body = lambda params, scales, x: stack(
      params, scales, x, lambda v: lax.all_gather(v, "x", axis=0, tiled=True),
      lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))
  model = ao.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, sspecs, P("x")),
                               out_specs=P("x")), overlap_config=cfg)
  step = jax.jit(train_step(model))

  place = _placer(mesh)
  args = ({k: place(v, specs[k]) for k, v in host.items()},
          {k: place(v, P(), jnp.float32) for k, v in scale_host.items()},
          place(X, P("x")), place(CT, P("x")))
  with jax.default_device(jax.local_devices(backend="cpu")[0]):  # unsharded, f32, this CPU
    ref = jax.jit(train_step(lambda p, s, x: stack(p, s, x, lambda v: v, lambda v: v)))(
        {k: jnp.asarray(v) for k, v in host.items()},
        {k: jnp.asarray(v) for k, v in scale_host.items()}, jnp.asarray(X), jnp.asarray(CT))
  return step, args, host, jax.tree.map(np.asarray, ref)


def _on_e4m3_grid(rng):
  """on_grid(shape, std) -> (host values, scale): N(0, std) rounded to e4m3 values times a
  power-of-2 per-tensor scale, so that quantizing them with that scale is exact."""
  import jax.numpy as jnp
  import numpy as np

  def on_grid(shape, std):
    s = float(2.0 ** np.round(np.log2(std / 16)))  # |q| about 16 * N(0, 1): e4m3 ends at 448
    q = np.asarray(jnp.asarray(rng.standard_normal(shape) * std / s,
                               jnp.float32).astype(jnp.float8_e4m3fn))
    return q.astype(np.float32) * s, s
  return on_grid


def _fp8_qdq_case(mesh, cfg):
  """The fp8_qdq program: (forward, (params, scales, x), the reference output: the same
  forward unsharded in f32 on this process's CPU, from the same fp8 values).

  The SwiGLU layers of _step_case, forward only (a prefill), every matmul's operands in the
  quantize-dequantize form of Flax's fp8 ops (`qdq`: `v / s -> clip -> astype(e4m3) ->
  astype(bf16) * s`, the scales inputs: delayed scaling), which XLA's GEMM rewriter turns into
  one fp8 GEMM: the gathered activations are quantized after the all_gather (the rewrite
  quantizes the shard and gathers fp8), the reduce-scatter's matmul reads h quantized.  Its
  backward would hold 16-bit matmuls next to unfused collectives (the form fuses the forward
  only), which NCCL refuses between processes sharing a GPU: forward only."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jax_autooverlap as ao
  E4 = jnp.float8_e4m3fn
  D, F, S, L = _step_dims(mesh.shape["x"])
  on_grid = _on_e4m3_grid(np.random.default_rng(99))
  (W13, s13), (W2, s2), (X, sx) = (on_grid((L, D, 2, F), D ** -0.5),
                                   on_grid((L, F, D), F ** -0.5), on_grid((S, D), 1.0))
  host = {"w13": W13, "w2": W2}
  scale_host = {k: np.full((L,), v, np.float32) for k, v in (
      ("x", sx), ("w13", s13), ("h", 1 / 16), ("w2", s2))}
  specs = {"w13": P(None, None, None, "x"), "w2": P(None, "x", None)}

  def qdq(v, s):
    top = jnp.finfo(E4).max.astype(v.dtype)
    q = jnp.clip(v / s.astype(v.dtype), -top, top).astype(E4)
    return q.astype(v.dtype) * s.astype(v.dtype)

  def layer(x, p, s, gather, scatter):
    g = gather(x)
    w13 = p["w13"].reshape(p["w13"].shape[0], -1)
    y = (qdq(g, s["x"]) @ qdq(w13, s["w13"])).reshape(g.shape[0], 2, -1)
    h = jax.nn.silu(y[:, 0]) * y[:, 1]
    return x + scatter(qdq(h, s["h"]) @ qdq(p["w2"], s["w2"]))

  def stack(params, scales, x, gather, scatter):
    return lax.scan(lambda x, ps: (layer(x, *ps, gather, scatter), None), x,
                    (params, scales))[0]

  body = lambda params, scales, x: stack(
      params, scales, x, lambda v: lax.all_gather(v, "x", axis=0, tiled=True),
      lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True))
  model = ao.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, {k: P() for k in scale_host},
                                                          P("x")), out_specs=P("x")),
                 overlap_config=cfg)
  forward = jax.jit(lambda params, scales, x: model(params, scales, x))

  place = _placer(mesh)
  args = ({k: place(v, specs[k]) for k, v in host.items()},
          {k: place(v, P(), jnp.float32) for k, v in scale_host.items()}, place(X, P("x")))
  with jax.default_device(jax.local_devices(backend="cpu")[0]):  # unsharded, f32, this CPU
    ref = jax.jit(lambda p, s, x: stack(p, s, x, lambda v: v, lambda v: v))(
        {k: jnp.asarray(v) for k, v in host.items()},
        {k: jnp.asarray(v) for k, v in scale_host.items()}, jnp.asarray(X))
  return forward, args, np.asarray(ref)


def _check_fp8_rows_fused(check, name, program, args, mode) -> list[tuple]:
  """Checks that explain's every row of `program` is fused on the kernel (mode "kernel") or the
  reference ring (mode "reference"); returns the rows' (phase, kind, status, dtype)."""
  import jax_autooverlap as ao
  report = ao.explain(program, *args)
  runs = "triton kernel" if mode == "kernel" else "reference ring"
  check(f"{name}: every row fused", report.matches and all(
      m.status == "fused" and m.impl and m.impl.startswith(runs) for m in report),
      "; ".join(f"{m.phase} {m.kind} {m.status} {m.dtype} {m.impl or m.reason}" for m in report))
  return [(m.phase, m.kind, m.status, m.dtype) for m in report]


def _fp8_qdq(mesh, cfg, check, kv, mode):
  """The fp8_qdq scenario (see the module docstring); mode "kernel" (GPUs) or "reference"
  (CPU processes: the reference ring); kv None: one process."""
  import jax
  import numpy as np
  forward, args, ref = _fp8_qdq_case(mesh, cfg)
  rows = _check_fp8_rows_fused(check, "fp8_qdq", forward, args, mode)
  want = [("fwd", k, "fused", "e4m3xe4m3->bfloat16") for k in ("ag_matmul", "matmul_rs")]
  check("fp8_qdq: 2 rows, AG+GEMM and GEMM+RS in e4m3 x e4m3", sorted(rows) == want, rows)
  plain = _plain_collectives(forward, args)
  check("fp8_qdq: no plain collective in the program", not plain, plain)
  if kv is not None:
    kv.wait_at_barrier("ao-test/fp8-qdq-compiled", 300_000)
  got = jax.block_until_ready(forward(*args))
  shard = got.addressable_shards[0]
  err = float(np.linalg.norm(np.asarray(shard.data, np.float64) - ref[shard.index])
              / np.linalg.norm(ref[shard.index]))
  tol = _fp8_tolerances(mesh)[0]  # as the fp8_step's output (see _fp8_step)
  check("fp8_qdq: output equals the CPU reference", err < tol, f"{err:.1e} (tol {tol:.2f})")
  _check_repeat(check, "fp8_qdq", forward, args, got)


def _fp8_step(mesh, cfg, check, kv, mode):
  """The fp8_step scenario (see the module docstring); mode "kernel" (GPUs) or "reference"
  (CPU processes: the reference ring); kv None: one process."""
  import jax
  step, args, host, ref = _fp8_step_case(mesh, cfg)
  rows = _check_fp8_rows_fused(check, "fp8", step, args, mode)
  # forward and remat: e4m3 x e4m3; backward: the e5m2 cotangent times an e4m3 operand
  want = sorted([("fwd", "ag_matmul"), ("fwd", "matmul_rs"), ("remat", "ag_matmul")]) + [
      ("bwd", "ag_matmul"), ("bwd", "matmul_rs")]
  want = [(p, k, "fused", ("e5m2xe4m3" if p == "bwd" else "e4m3xe4m3") + "->bfloat16")
          for p, k in want]
  check("fp8: 5 rows: forward, recomputed forward (e4m3 x e4m3), backward (e5m2 x e4m3)",
        sorted(rows) == sorted(want), rows)
  plain = _plain_collectives(step, args)
  check("fp8: no plain collective in the program", not plain, plain)
  if kv is not None:
    kv.wait_at_barrier("ao-test/fp8-step-compiled", 300_000)
  got = jax.block_until_ready(step(*args))
  # Tolerances (jax_autooverlap/fp8.py).  Each fused GEMM is within gemm_tolerance of the f32
  # product of its fp8 operands (K up to 2F; n partials summed in bf16).  The reference runs the
  # same quantizations in f32; the inputs are exact fp8 values on both sides, but h and the
  # cotangents are quantized from values that differ by the GEMMs' errors and the bf16
  # roundings of the sharded step.  An element that lands on the other side of a rounding
  # boundary moves by one step of its fp8 format, but only the few elements within that small
  # difference of a boundary do: the normwise error they add stays below the formats' own
  # error per product (quantization_error), which bounds it here: e4m3 x e4m3 for the output
  # and input gradient, e5m2 x e4m3 (the cotangent's format) for the weight gradients and the
  # updates (whose steps are larger than the weights).  On 2 CPU processes at the default
  # sizes: out 3e-2, dx 7e-2, dw 8e-2 (fp8 roundings flipped by bf16's), against 0.14 / 0.20.
  _check_step_results(check, got, host, ref, "fp8", tol=_fp8_tolerances(mesh))
  _check_repeat(check, "fp8", step, args, got)


def _fp8_tolerances(mesh) -> tuple[float, float]:
  """(output and input gradient, weight gradients and updates) of the fp8 step against its
  reference (see _fp8_step)."""
  import jax.numpy as jnp
  from jax_autooverlap import fp8
  F, n = _step_dims(mesh.shape["x"])[1], mesh.shape["x"]
  gemm = fp8.gemm_tolerance(2 * F, jnp.bfloat16, partials=n)
  return (gemm + fp8.quantization_error(jnp.float8_e4m3fn, jnp.float8_e4m3fn),
          gemm + fp8.quantization_error(jnp.float8_e5m2, jnp.float8_e4m3fn))


def _check_step_results(check, got, host, ref, name="nested", tol=(TOL, TOL)) -> float:
  """Output, input gradient, every weight gradient and update against the reference (this
  process's first block of each); the largest relative error.  tol: (output and input
  gradient, weight gradients and updates)."""
  import numpy as np
  out, dx, grads, new = got

  def rel(got, want):
    shard = got.addressable_shards[0]
    g = np.asarray(shard.data, np.float64)
    w = np.asarray(want, np.float64)[shard.index]
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))

  errs = {"out": rel(out, ref[0]), "dx": rel(dx, ref[1]),
          **{f"d{k}": rel(grads[k], ref[2][k]) for k in host}}
  bounds = {k: tol[0] if k in ("out", "dx") else tol[1] for k in errs}
  check(f"{name}: output and every gradient equal the CPU reference",
        all(errs[k] < bounds[k] for k in errs),
        {k: f"{e:.1e}" for k, e in errs.items()} | ({"tol": tol} if tol != (TOL, TOL) else {}))
  updates = {k: rel(new[k], ref[3][k]) for k in host}
  check(f"{name}: updated weights equal the CPU reference", max(updates.values()) < tol[1],
        {k: f"{e:.1e}" for k, e in updates.items()})
  return max(*errs.values(), *updates.values())


def _plain_collectives(step, args) -> list[str]:
  hlo = step.lower(*args).compile().as_text()
  return [op for op in ("all-gather", "reduce-scatter", "all-reduce")
          if f" {op}(" in hlo or f" {op}-start(" in hlo]


def _nested_step(mesh, cfg, check, kv, mode):
  """The nested_step scenario (see the module docstring); mode "kernel" (GPUs: every row on the
  kernel) or "reference" (CPU processes: the reference ring); kv None: one process."""
  import jax
  import jax_autooverlap as ao
  step, args, host, ref = _step_case(mesh, cfg)
  report = ao.explain(step, *args)
  runs = "triton kernel" if mode == "kernel" else "reference ring"
  check("nested: every row fused",
        report.matches and all(m.impl and m.impl.startswith(runs) for m in report),
        "; ".join(f"{m.phase} {m.kind} {m.status} {m.impl or m.reason}" for m in report))
  phases = sorted(m.phase for m in report)
  check("nested: forward, recomputed forward and backward rows",
        phases == ["bwd", "bwd", "fwd", "fwd", "remat"], phases)
  plain = _plain_collectives(step, args)
  check("nested: no plain collective in the program", not plain, plain)
  if kv is not None:
    kv.wait_at_barrier("ao-test/nested-step-compiled", 300_000)
  got = jax.block_until_ready(step(*args))
  _check_step_results(check, got, host, ref)
  _check_repeat(check, "nested", step, args, got)


def _check_repeat(check, name, step, args, got):
  """Calls 2 and 3 of the same step on the same inputs give call 1's results bit for bit.
  The kernels alternate their buffers' parity slots from call to call: with an odd number of
  fused calls per step (one layer) call 2 runs every op on the other slot, call 3 on call 1's;
  and calls 2 and 3 follow other calls than call 1 did.  The detail names each leaf that
  differs: how many elements, the first one."""
  import jax
  import numpy as np
  local = lambda a: np.asarray(a.addressable_shards[0].data, np.float32)
  leaves = jax.tree_util.tree_flatten_with_path(got)[0]

  def differ(again):
    out = []
    for (path, a), b in zip(leaves, jax.tree.leaves(again)):
      x, y = local(a), local(b)
      bad = ~((x == y) | (np.isnan(x) & np.isnan(y)))
      if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        out.append(f"{jax.tree_util.keystr(path)}{list(x.shape)}: {int(bad.sum())} differ, "
                   f"first at {first}, max {float(np.nanmax(np.abs(x - y))):.3g}")
    return out or ["same"]

  calls = [differ(jax.block_until_ready(step(*args))) for _ in range(2)]
  check(f"{name}: calls 2 and 3 bit-identical to call 1", calls == [["same"], ["same"]],
        f"call 2: {'; '.join(calls[0])} | call 3: {'; '.join(calls[1])}")


def _first_call_step(mesh, check, kv, again: bool, on_gpu: bool):
  """The first_call scenario (module docstring) in this process, with the DEFAULT config:
  `again` is the second run (same cache, new processes); on_gpu: the unfused program cannot
  run here, so every row must end on the kernel (on CPU processes the kernels' stand-ins and
  the unfused program both run: either may win).  AO_TEST_FP8=1 (--fp8): the fp8_step's
  program and tolerances instead of the bf16 step's.  Returns what the table shows."""
  import jax
  import jax_autooverlap as ao
  from jax_autooverlap.ops import measure
  from jax_autooverlap.tuning import store
  t0 = time.perf_counter()
  n = mesh.shape["x"]
  in_fp8 = os.environ.get("AO_TEST_FP8") == "1"
  step, args, host, ref = (_fp8_step_case if in_fp8 else _step_case)(mesh, ao.OverlapConfig())
  before = ao.explain(step, *args)
  rows = lambda r: "; ".join(f"{m.phase} {m.kind} {m.status} {m.impl or m.reason}" for m in r)
  if again:
    check("first_call: explain before the call: every row decided from the cache",
          before.matches and not before.pending, rows(before))
  else:
    check("first_call: explain before the call: every row measured on the first call",
          before.matches and before.pending == before.matches
          and all(m.code == "first_call" for m in before), rows(before))
  measured, t_step = measure.measurements(), time.perf_counter()
  got = jax.block_until_ready(step(*args))  # the first call: trace, measure, compile, run
  measured, t_step = measure.measurements() - measured, time.perf_counter() - t_step
  check("first_call: shapes measured" if not again else "first_call: nothing measured again",
        measured == 0 if again else measured > 0, f"{measured} measurement(s)")
  after = ao.explain(step, *args)
  if on_gpu:  # (a plain collective left in the step would have failed it: NCCL "Duplicate GPU")
    check("first_call: every row on the kernel after the call", after.matches and all(
        m.impl.startswith("triton kernel (autotuned") for m in after), rows(after))
  else:
    check("first_call: every row decided after the call", after.matches and all(
        m.impl.startswith(("triton kernel (autotuned", "unfused program on gpu (autotuned"))
        for m in after), rows(after))
  err = (_check_step_results(check, got, host, ref, "fp8", tol=_fp8_tolerances(mesh)) if in_fp8
         else _check_step_results(check, got, host, ref))
  mine = {k: v for k, v in store.verdicts().items()
          if v.get("source") == "first_call" and f"|w{n}|" in k}
  kv.key_value_set(f"ao-test/verdicts/{'again' if again else 'first'}/{jax.process_index()}",
                   json.dumps(mine, sort_keys=True))
  kv.wait_at_barrier(f"ao-test/verdicts-{again}", 300_000)
  theirs = [json.loads(kv.blocking_key_value_get(
      f"ao-test/verdicts/{'again' if again else 'first'}/{p}", 60_000)) for p in range(n)]
  check("first_call: every process has the same verdicts",
        mine and all(t == mine for t in theirs), f"{len(mine)} verdict(s)")
  on_disk = {}
  for path in store.user_cache_dir().glob("tuning-*.json"):
    on_disk.update(json.loads(path.read_text()))
  check("first_call: the cache holds them", all(on_disk.get(k) == v for k, v in mine.items()),
        f"{sum(k in on_disk for k in mine)} of {len(mine)} in {store.user_cache_dir()}")
  fused = sum(v["impl"] == "triton" for v in mine.values())
  return {"process": jax.process_index(), "world": n, "run": 2 if again else 1,
          "dims": ",".join(map(str, _step_dims(n))) + (" fp8" if in_fp8 else ""),
          "verdicts": len(mine), "fused": fused, "measured": measured, "max_rel_err": err,
          "first_step_s": round(t_step, 1), "seconds": round(time.perf_counter() - t0, 1)}


# --- launcher ------------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Run:
  """One scenario's `world` processes, started at once; `finish()` waits for them (bounded) and
  returns (checks, combined output tail, INFO records).  Outputs go to files, so that no
  process blocks on a full pipe while another is waited for."""

  def __init__(self, scenario: str, world: int, env_extra=None, budget_s: float = float("inf"),
               timeout_s: float | None = None):
    self.scenario, self.world = scenario, world
    self.timeout_s = min(timeout_s or TIMEOUT_S[scenario] * (1 + world / 4), budget_s)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("AO_TEST_GPU", "0"),
               XLA_PYTHON_CLIENT_PREALLOCATE="false", **(env_extra or {}))
    env.pop("XLA_FLAGS", None)  # no virtual CPU devices from a test session
    env.pop("JAX_PLATFORMS", None)
    port = str(_free_port())
    self.logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", scenario,
                                    str(i), str(world), port], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, text=True)
                  for i, log in enumerate(self.logs)]
    self.deadline = time.monotonic() + self.timeout_s

  def finish(self) -> tuple[list[dict], str, list]:
    outs = []
    for i, (p, log) in enumerate(zip(self.procs, self.logs)):
      note = ""
      try:
        p.wait(timeout=max(1.0, self.deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        note = f"\n[process {i} killed after {self.timeout_s:g} s]"
      log.seek(0)
      outs.append((i, p.returncode, log.read() + note))
      log.close()
    checks, tail, info = [], [], []
    name = f"{self.scenario} x{self.world}"
    for i, rc, out in outs:
      mine = [{**json.loads(l[len("CHECK "):]), "scenario": name} for l in out.splitlines()
              if l.startswith("CHECK ")]
      info += [json.loads(l[len("INFO "):]) for l in out.splitlines() if l.startswith("INFO ")]
      want = EXPECTED_CHECKS[self.scenario][min(i, 1)]
      checks += mine
      checks.append({"scenario": name, "process": i, "check": f"reported {want} checks",
                     "ok": len(mine) == want, "detail": f"{len(mine)} reported"})
      checks.append({"scenario": name, "process": i, "check": "process exits cleanly",
                     "ok": rc == 0, "detail": f"exit status {rc}"})
      tail.append(f"--- {name}, process {i} (exit {rc}) ---\n" + "\n".join(
          l for l in out.splitlines()[-40:] if not l.startswith("CHECK ")))
    return checks, "\n".join(tail), info


def _first_call_table(info: list[dict], checks: list[dict]) -> list[str]:
  """One row per group size and run: what process 0 saw, and the checks of every process."""
  failed = lambda name: sum(not c["ok"] for c in checks if c["scenario"] == name)
  lines = [f"{'world':>5} {'run':>3} {'D,F,S,L':>16} {'measured':>8} {'verdicts':>8} "
           f"{'fused':>5} {'max rel err':>11} {'first step s':>12} {'run s':>6}  checks "
           "(all processes)"]
  for r in sorted(info, key=lambda r: (r["world"], r["run"])):
    if r["process"] == 0:
      name = f"{'first_call' if r['run'] == 1 else 'first_call_again'} x{r['world']}"
      bad = failed(name)
      lines.append(f"{r['world']:>5} {r['run']:>3} {r['dims']:>16} {r['measured']:>8} "
                   f"{r['verdicts']:>8} "
                   f"{r['fused']:>5} {r['max_rel_err']:>11.1e} {r['first_step_s']:>12.1f} "
                   f"{r['seconds']:>6.1f}  {f'{bad} FAILED' if bad else 'PASS'}")
  return lines


def main(argv) -> int:
  if argv[:1] == ["worker"]:
    _worker(argv[1], int(argv[2]), int(argv[3]), argv[4])
    return 0
  log = argv[argv.index("--log") + 1] if "--log" in argv else None
  scenarios = ([argv[argv.index("--scenario") + 1]] if "--scenario" in argv else list(SCENARIOS))
  worlds = [int(w) for w in argv[argv.index("--world") + 1].split(",")] if "--world" in argv \
      else [2]
  if "--fp8" in argv:  # first_call: the fp8 step (the workers inherit the environment)
    os.environ["AO_TEST_FP8"] = "1"
  if "--engine" in argv:  # the workers read it (they inherit the environment)
    os.environ["AO_TEST_ENGINE"] = argv[argv.index("--engine") + 1]
  if "--packed" in argv:  # the tl kernels with packed shards (the workers read it)
    os.environ["AO_TEST_PACKED"] = "1"
  if "--split-k" in argv:  # the tl kernels with split-K (the workers read it)
    os.environ["AO_TEST_SPLIT_K"] = argv[argv.index("--split-k") + 1]
  if "--wg-partitions" in argv:  # GEMM+RS with a consumer partition per warpgroup (gluon)
    if os.environ.get("AO_TEST_ENGINE") != "gluon":
      print("--wg-partitions needs --engine gluon", file=sys.stderr)
      return 2
    os.environ["AO_TEST_WG_PARTITIONS"] = "1"
  budget = float(argv[argv.index("--budget-s") + 1]) if "--budget-s" in argv else float("inf")
  timeout = float(argv[argv.index("--timeout-s") + 1]) if "--timeout-s" in argv else None
  try:  # a bad AO_STEP_DIMS is an error here, not a crash in every process
    [_step_dims(w) for w in worlds]
  except ValueError as e:
    print(e, file=sys.stderr)
    return 2
  deadline = time.monotonic() + budget
  # phases: each scenario's runs in order (first_call: twice, new processes, one fresh cache per
  # group size); --parallel starts a phase's runs of every group size at once
  phases = []
  for scenario in scenarios:
    runs = ("first_call", "first_call_again") if scenario == "first_call" else (scenario,)
    phases += [[(run, world) for world in worlds] for run in runs]
  caches = {w: {"JAX_AUTOOVERLAP_CACHE_DIR": tempfile.mkdtemp(prefix=f"ao-first-call-x{w}-")}
            for w in worlds}
  batches = phases if "--parallel" in argv else [[r] for phase in phases for r in phase]
  checks, tails, info = [], [], []
  not_run = lambda run, world, why: {"scenario": f"{run} x{world}", "process": "-", "ok": False,
                                     "check": "not run", "detail": why}
  first_not_run = set()  # group sizes whose first_call run did not start: no second run
  for b, batch in enumerate(batches):
    left = deadline - time.monotonic() - 60 * (len(batches) - 1 - b)  # 60 s for each one after
    if left < 30:
      checks += [not_run(run, world, f"--budget-s {budget:g} spent") for run, world in batch]
      first_not_run |= {world for run, world in batch if run == "first_call"}
      continue
    again = [(run, world) for run, world in batch
             if run == "first_call_again" and world in first_not_run]
    checks += [not_run(run, world, "its first run did not run") for run, world in again]
    started = [Run(run, world, caches[world] if run.startswith("first_call") else {}, left,
                   timeout)
               for run, world in batch if (run, world) not in again]
    for run in started:
      c, t, i = run.finish()
      checks, info = checks + c, info + i
      tails.append(t)
  lines = [f"{'scenario':<22} {'process':<8} {'result':<7} check / detail", "-" * 100]
  for c in checks:
    lines.append(f"{c['scenario']:<22} {c['process']!s:<8} {'PASS' if c['ok'] else 'FAIL':<7} "
                 f"{c['check']}" + (f"  [{c['detail']}]" if c["detail"] else ""))
  passed = bool(checks) and all(c["ok"] for c in checks)
  if info:
    lines += ["", "first-call measurement, default config (process 0's view; run 2: new "
              "processes, same cache):"] + _first_call_table(info, checks)
  lines.append("ALL PASS" if passed else "SOME CHECKS FAILED")
  report = "\n".join(lines)
  if not passed:
    print("\n".join(tails))
  print(report)
  if log:
    with open(log, "w") as f:
      f.write(report + "\n\n" + "\n".join(tails) + "\n")
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
