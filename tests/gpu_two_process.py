"""Two processes sharing one GPU run the fused kernels over a 2-device mesh (needs a GPU).

    python tests/gpu_two_process.py [--log FILE] [--scenario kernels|missing_peer]
                                    [--engine tl|gluon [--wg-partitions]]

starts each scenario as a pair of processes (CUDA_VISIBLE_DEVICES=0 in both,
XLA_PYTHON_CLIENT_PREALLOCATE=false, jax.distributed on 127.0.0.1), one
device per process, and prints a PASS/FAIL table; exit status 0 iff every
check passed.  tests/test_gpu_multiprocess.py runs it under `pytest -m gpu`.

NCCL refuses two ranks on one GPU, so the programs hold no XLA collectives:
inputs are built per process (make_array_from_process_local_data) from the
same seeded host arrays, and every result is compared with a numpy reference
of this process's shard.  The two processes' kernels rendezvous through
time-sliced contexts: timings mean nothing here.  --engine picks the kernels'
engine (KernelConfig.engine; default: the tuner's choice); --wg-partitions with the
gluon engine runs GEMM+RS with a consumer partition per warpgroup
(KernelConfig.wg_partitions).

Scenarios:
  kernels       explain says "triton kernel ..., 2 processes"; AG+GEMM and GEMM+RS
                equal the host reference; 1,000 repeated calls of each are
                bit-identical; a lax.scan body holding each op; each op inside a
                user's jax.jit (an ao.jit function called there, and the op
                called directly).
  missing_peer  both processes trace the program, only process 0 runs it: its
                bounded waits expire, the call fails and check_errors() raises
                CollectiveTimeoutError naming the peer (no hang).
  nested_step   the user's pattern: a TP+SP model (2 SwiGLU layers under lax.scan +
                jax.checkpoint) decorated with ao.jit, called from the user's own
                jax.jit training step (VJP with a sharded cotangent, SGD): every
                collective of forward and backward on the kernel (a plain one would fail
                with NCCL's "Duplicate GPU"), explain's rows, output, input gradient and
                updated weights against the same step run unsharded on the CPU.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
M, K, N = 1024, 1024, 1024
TOL = 2e-2  # bf16 outputs
# Checks each process must report (a crash must not pass as "nothing failed").
EXPECTED_CHECKS = {"kernels": (12, 12), "missing_peer": (2, 0), "nested_step": (5, 5)}
TIMEOUT_S = {"kernels": 400, "missing_peer": 180, "nested_step": 300}


# --- worker ------------------------------------------------------------------

def _worker(scenario: str, me: int, port: str):
  sys.path.insert(0, REPO)
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", 2, me, initialization_timeout=120)
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
                                 "ok": bool(ok), "detail": str(detail)[:300]}), flush=True)

  gpus = jax.devices()
  if len(gpus) != 2 or any(d.platform != "gpu" for d in gpus):
    check("two GPU devices, one per process", False, f"devices {gpus}")
    return
  mesh = jax.make_mesh((2,), ("x",), devices=gpus, axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(1234)  # the same host arrays in both processes
  bf16 = lambda a: np.asarray(a, np.float32).astype(jnp.bfloat16)
  X = bf16(rng.standard_normal((M, K)))
  W = bf16(rng.standard_normal((K, N)) / np.sqrt(K))
  H = bf16(rng.standard_normal((M, K)))
  W2 = bf16(rng.standard_normal((K, N)) / np.sqrt(K))
  rows, cols = slice(me * M // 2, (me + 1) * M // 2), slice(me * N // 2, (me + 1) * N // 2)
  kcols = slice(me * K // 2, (me + 1) * K // 2)

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
    _nested_step(mesh, cfg, check, kv)
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
              "ag_matmul over axis 'x'" in str(e) and "from peer rank 1" in str(e), e)
    kv.wait_at_barrier("ao-test/done", 300_000)
    # Process 0's CUDA context is lost: skip the teardown (XLA may abort on it), in both
    # processes so that neither waits for the other at jax.distributed's shutdown.
    sys.stdout.flush()
    os._exit(0)

  for name, f, args in (("ag", f_ag, (x, w)), ("rs", f_rs, (h, w2))):
    impl = f.explain(*args).matches[0].impl
    check(f"{name}: explain", impl.startswith("triton kernel") and "2 processes" in impl, impl)
  f_ag.lower(x, w).compile(), f_rs.lower(h, w2).compile()
  kv.wait_at_barrier("ao-test/compiled", 300_000)  # no first call waits on a compiling peer

  for name, f, args, want in (("ag", f_ag, (x, w), want_ag), ("rs", f_rs, (h, w2), want_rs)):
    first = local(f(*args))
    err = rel(first, want)
    check(f"{name}: equals the host reference", err < TOL, f"relative error {err:.2e}")
    t0 = time.perf_counter()
    worst = jnp.zeros((), jnp.float32)
    for _ in range(1000):  # local (this device's) comparisons only: no collectives
      worst = jnp.maximum(worst, jnp.max(jnp.abs(local(f(*args)) - first).astype(jnp.float32)))
    worst = float(worst)
    check(f"{name}: 1,000 repeated calls bit-identical", worst == 0.0,
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
  s_ag = ao.jit(jax.shard_map(scanned(ag, (M, N // 2)), mesh=mesh,
                              in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")),
                overlap_config=cfg)
  s_rs = ao.jit(jax.shard_map(scanned(rs, (M // 2, N)), mesh=mesh,
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


def _nested_step(mesh, cfg, check, kv):
  """The nested_step scenario (see the module docstring); kv None: one process."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_autooverlap as ao
  D, F, S, L = 256, 512, 512, 2
  rng = np.random.default_rng(99)
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  host = {k: as_bf16(rng.standard_normal(shape) / np.sqrt(shape[1]))
          for k, shape in (("w1", (L, D, F)), ("w3", (L, D, F)), ("w2", (L, F, D)))}
  X, CT = (as_bf16(rng.standard_normal((S, D))) for _ in range(2))
  specs = {"w1": P(None, None, "x"), "w3": P(None, None, "x"), "w2": P(None, "x", None)}

  def place(a, spec):  # every process gives the blocks of its devices
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                        lambda i: jnp.asarray(a[i], jnp.bfloat16))

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
  x, ct = place(X, P("x")), place(CT, P("x"))

  report = ao.explain(step, params, x, ct)
  runs = "triton kernel" if cfg.impl == "triton" else "reference ring"
  check("nested: every row fused",
        report.matches and all(m.impl and m.impl.startswith(runs) for m in report),
        "; ".join(f"{m.phase} {m.kind} {m.status} {m.impl or m.reason}" for m in report))
  phases = sorted(m.phase for m in report)
  check("nested: forward, recomputed forward and backward rows",
        phases == ["bwd", "bwd", "fwd", "fwd", "remat"], phases)
  hlo = step.lower(params, x, ct).compile().as_text()
  plain = [op for op in ("all-gather", "reduce-scatter", "all-reduce")
           if f" {op}(" in hlo or f" {op}-start(" in hlo]
  check("nested: no plain collective in the program", not plain, plain)
  if kv is not None:
    kv.wait_at_barrier("ao-test/nested-step-compiled", 300_000)
  out, dx, grads, new = jax.block_until_ready(step(params, x, ct))

  with jax.default_device(jax.local_devices(backend="cpu")[0]):  # unsharded, f32, this CPU
    ref = jax.jit(train_step(lambda p, x: stack(p, x, lambda v: v, lambda v: v)))(
        {k: jnp.asarray(v) for k, v in host.items()}, jnp.asarray(X), jnp.asarray(CT))
  ref = jax.tree.map(np.asarray, ref)

  def rel(got, want):  # this process's first block of `got` against the same block of `want`
    shard = got.addressable_shards[0]
    g = np.asarray(shard.data, np.float64)
    w = np.asarray(want, np.float64)[shard.index]
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))

  errs = {"out": rel(out, ref[0]), "dx": rel(dx, ref[1]),
          **{f"d{k}": rel(grads[k], ref[2][k]) for k in host}}
  check("nested: output and every gradient equal the CPU reference", max(errs.values()) < TOL,
        {k: f"{e:.1e}" for k, e in errs.items()})
  errs = {k: rel(new[k], ref[3][k]) for k in host}
  check("nested: updated weights equal the CPU reference", max(errs.values()) < TOL,
        {k: f"{e:.1e}" for k, e in errs.items()})


# --- launcher ------------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_scenario(scenario: str) -> tuple[list[dict], str]:
  """Run one scenario's two processes; (checks, combined output tail)."""
  timeout_s = TIMEOUT_S[scenario]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("AO_TEST_GPU", "0"),
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env.pop("XLA_FLAGS", None)  # no virtual CPU devices from a test session
  env.pop("JAX_PLATFORMS", None)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", scenario,
                             str(i), port], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  deadline = time.monotonic() + timeout_s
  outs = []
  for i, p in enumerate(procs):
    try:
      out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      out, _ = p.communicate()
      out += f"\n[process {i} killed after {timeout_s:g} s]"
    outs.append((i, p.returncode, out))
  checks, tail = [], []
  for i, rc, out in outs:
    mine = [json.loads(l[len("CHECK "):]) for l in out.splitlines() if l.startswith("CHECK ")]
    want = EXPECTED_CHECKS[scenario][i]
    checks += mine
    checks.append({"scenario": scenario, "process": i, "check": f"reported {want} checks",
                   "ok": len(mine) == want, "detail": f"{len(mine)} reported"})
    checks.append({"scenario": scenario, "process": i, "check": "process exits cleanly",
                   "ok": rc == 0, "detail": f"exit status {rc}"})
    tail.append(f"--- {scenario}, process {i} (exit {rc}) ---\n" + "\n".join(
        l for l in out.splitlines()[-40:] if not l.startswith("CHECK ")))
  return checks, "\n".join(tail)


def main(argv) -> int:
  if argv[:1] == ["worker"]:
    _worker(argv[1], int(argv[2]), argv[3])
    return 0
  log = argv[argv.index("--log") + 1] if "--log" in argv else None
  scenarios = [argv[argv.index("--scenario") + 1]] if "--scenario" in argv else list(TIMEOUT_S)
  if "--engine" in argv:  # the workers read it (they inherit the environment)
    os.environ["AO_TEST_ENGINE"] = argv[argv.index("--engine") + 1]
  if "--wg-partitions" in argv:  # GEMM+RS with a consumer partition per warpgroup (gluon)
    if os.environ.get("AO_TEST_ENGINE") != "gluon":
      print("--wg-partitions needs --engine gluon", file=sys.stderr)
      return 2
    os.environ["AO_TEST_WG_PARTITIONS"] = "1"
  checks, tails = [], []
  for scenario in scenarios:
    c, t = run_scenario(scenario)
    checks += c
    tails.append(t)
  lines = [f"{'scenario':<13} {'process':<8} {'result':<7} check / detail", "-" * 100]
  for c in checks:
    lines.append(f"{c['scenario']:<13} {c['process']:<8} {'PASS' if c['ok'] else 'FAIL':<7} "
                 f"{c['check']}" + (f"  [{c['detail']}]" if c["detail"] else ""))
  passed = bool(checks) and all(c["ok"] for c in checks)
  lines.append("ALL PASS" if passed else "SOME CHECKS FAILED")
  report = "\n".join(lines)
  print(report)
  if not passed:
    print("\n".join(tails))
  if log:
    with open(log, "w") as f:
      f.write(report + "\n\n" + "\n".join(tails) + "\n")
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
