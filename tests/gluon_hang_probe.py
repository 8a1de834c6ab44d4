"""Where does the Gluon engine's plain GEMM hang?  A ladder of variants, each in its own process.

Run on one sm_90 GPU (not collected by pytest; about 1-2 minutes):

    PYTHONPATH=$PWD python3 tests/gluon_hang_probe.py

(`--compile-only` instead lowers every variant for sm_90 without a GPU.)
Each variant runs in a fresh subprocess with a 20 s limit (a hung kernel
cannot be interrupted in-process) and prints one line:

    PASS   matches jnp.dot (relative Frobenius error <= 2e-2, bf16)
    WRONG  finished, but the result is off (error printed)
    HANG   killed after 20 s; `at` names the last step it reached
           (init / compile / run): run = the kernel never finished
    ERROR  the subprocess failed (last line of its output printed)
    SKIP   no sm_90 GPU, or the 135 s budget would be exceeded

Variants (m x k x n, grid = CTAs, nk = K / BLOCK_K k-blocks per tile,
tiles/CTA = output tiles each CTA computes):
- ws_handshake: a minimal warp-specialised Gluon kernel (one producer warp
  arrives on an mbarrier, the 8 default warps wait on it and write out):
  the launch width (.reqntid), setmaxnreg and mbarrier arrive in a worker
  partition, without the GEMM.
- fixed_*: the engine as committed (backends/gluon.launch_gemm).
- orig_*: the engine with mma_tile as it was when the GPU test hung: its
  `prev = it` copy is not carried through the k-loop by Triton's front end
  (a name is loop-carried only if its value changes in the body), so every
  stage release goes to the tile's first stage.  With nk = 1 the bug is
  dormant (expected PASS); with nk = 16 the producer waits forever for a
  stage that is never released (expected HANG).

Reading it: ws_handshake PASS + every fixed_* PASS + orig_k64 PASS +
orig_k1024 HANG confirms the diagnosis and the fix.  A fixed_* HANG with
ws_handshake PASS points at something else in the engine (the smallest
hanging variant narrows it: 1 tile/CTA vs several, STAGES=2); a
ws_handshake HANG/ERROR points at the warp-specialised launch itself.
"""
import os
import subprocess
import sys
import time

PER_VARIANT_S = 20
BUDGET_S = 135

# name: (kind, m, k, n, grid (None: one CTA per SM), num_stages)
VARIANTS = {
    "ws_handshake": ("handshake", 0, 0, 0, 1, 0),
    "fixed_256x256x256_grid2": ("fixed", 256, 256, 256, 2, 3),    # 1 tile/CTA, nk=4
    "fixed_256x256x256_grid1": ("fixed", 256, 256, 256, 1, 3),    # 2 tiles/CTA, nk=4
    "fixed_512x1024x768_grid1": ("fixed", 512, 1024, 768, 1, 3),  # 12 tiles/CTA, nk=16
    "fixed_512x1024x768_grid5": ("fixed", 512, 1024, 768, 5, 3),  # 2-3 tiles/CTA
    "fixed_512x1024x768_stages2_grid3": ("fixed", 512, 1024, 768, 3, 2),
    "fixed_1000x1024x1000_allsms": ("fixed", 1000, 1024, 1000, None, 3),  # ragged tiles
    # last: a killed hung kernel must not disturb the variants before it
    "orig_512x64x768_grid1_k64": ("orig", 512, 64, 768, 1, 3),    # nk=1: bug dormant
    "orig_512x1024x768_grid1_k1024": ("orig", 512, 1024, 768, 1, 3),  # nk=16: expected HANG
}


# ----------------------------------------------------------------------------- child side

def _kernels():
  """The probe's own Gluon functions (module level in a child only: the parent needs no triton)."""
  import triton.language as tl
  from triton.experimental import gluon
  from triton.experimental.gluon import language as gl
  from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma,
                                                                warpgroup_mma_wait)

  from jax_autooverlap.kernels import gluon_engine as eng
  g = globals()
  g.update(tl=tl, gl=gl, mbarrier=mbarrier, warpgroup_mma=warpgroup_mma,
           warpgroup_mma_wait=warpgroup_mma_wait, eng=eng)

  @gluon.jit
  def orig_mma_tile(a_bufs, b_bufs, ready, empty, it, K: gl.constexpr, BLOCK_K: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """mma_tile as it was when the GPU test hung (for the orig_* variants)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32,
                   eng.mma_layout(BLOCK_N, eng.NUM_WARPS, a_bufs.dtype))
    prev = it
    for k in range(0, K, BLOCK_K):
      s = it % STAGES
      mbarrier.wait(ready.index(s), (it // STAGES) & 1)
      acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
      acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_bufs.index(s), b_bufs.index(s)))
      tl.debug_barrier()
      mbarrier.arrive(empty.index(prev % STAGES), count=1, pred=it > prev)
      prev = it
      it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    tl.debug_barrier()
    mbarrier.arrive(empty.index(prev % STAGES), count=1, pred=it > prev)
    return acc, it

  @gluon.jit
  def hs_default(x_ptr, out_ptr, bar):
    mbarrier.wait(bar, 0)
    offs = gl.arange(0, 256, layout=gl.BlockedLayout([1], [32], [8], [0]))
    gl.store(out_ptr + offs, gl.load(x_ptr + offs) + 1)

  @gluon.jit
  def hs_worker(bar):
    mbarrier.arrive(bar, count=1)

  @gluon.jit
  def hs_kernel(x_ptr, out_ptr):
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(hs_default, (x_ptr, out_ptr, bar)), (hs_worker, (bar,))],
                       [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])

  g.update(orig_mma_tile=orig_mma_tile, hs_default=hs_default, hs_worker=hs_worker,
           hs_kernel=hs_kernel)


def _step(name):
  print(f"STEP {name}", flush=True)


def child(name, compile_only=False):
  """Run (or, compile_only, lower for sm_90 through jax.export without a GPU) one variant."""
  kind, m, k, n, grid, stages = VARIANTS[name]
  _step("init")
  import jax
  import jax.numpy as jnp
  import numpy as np
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not compile_only and (not gpus or str(getattr(gpus[0], "compute_capability", "")) != "9.0"):
    print("RESULT SKIP no sm_90 GPU", flush=True)
    return
  from jax_autooverlap._compat import import_jax_triton
  jt = import_jax_triton()
  _kernels()
  put = (lambda x: x) if compile_only else (lambda x: jax.device_put(x, gpus[0]))
  if kind == "handshake":
    f = jax.jit(lambda x: jt.triton_call(
        x, kernel=hs_kernel, name="ao_probe_handshake",  # noqa: F821 (_kernels)
        out_type=jax.ShapeDtypeStruct((256,), jnp.int32), grid=(1,), num_warps=8,
        compute_capability=90 if compile_only else None))
    args = (put(jnp.arange(256, dtype=jnp.int32)),)
    check = lambda got: (np.array_equal(got, np.arange(256) + 1), f"out[:4]={got[:4].tolist()}")
  else:
    from jax_autooverlap.backends.gluon import launch_gemm
    from jax_autooverlap.tuning.config import KernelConfig
    if kind == "orig":
      eng.mma_tile = orig_mma_tile  # noqa: F821 (_kernels); gluon_gemm's consumer reads it when compiled
    if grid is None:
      from jax_autooverlap.runtime import cuda
      num_sms = 132 if compile_only else cuda.sm_count(gpus[0].local_hardware_id)
    else:
      num_sms = grid
    cfg = KernelConfig(engine="gluon", num_stages=stages)
    k1, k2 = jax.random.split(jax.random.key(0))
    args = (put(jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)),
            put((jax.random.normal(k2, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)))
    f = jax.jit(lambda a, b: launch_gemm(a, b, kernel=cfg, out_dtype=jnp.bfloat16, num_sms=num_sms,
                                         compute_capability=90 if compile_only else None))
    want = np.asarray(jnp.dot(*args, preferred_element_type=jnp.float32), np.float64)

    def check(got):
      got = np.asarray(got, np.float64)
      err = float(np.linalg.norm(got - want) / np.linalg.norm(want)) if np.all(np.isfinite(got)) \
          else float("inf")
      return err <= 2e-2, f"rel_err={err:.2e}"
  _step("compile")
  if compile_only:
    jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call_ffi")])(*args)
    print("RESULT PASS compiled for sm_90 (not run)", flush=True)
    return
  fc = f.lower(*args).compile()
  _step("run")
  ok, detail = check(np.asarray(jax.block_until_ready(fc(*args))))
  print(f"RESULT {'PASS' if ok else 'WRONG'} {detail}", flush=True)


# ----------------------------------------------------------------------------- parent side

def run_variant(name, compile_only=False):
  """(verdict, detail, seconds) of one variant in its own process group."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  t0 = time.monotonic()
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                           "--compile-one" if compile_only else "--one", name], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=600 if compile_only else PER_VARIANT_S)
    timed_out = False
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)  # the process group this call started
    out, _ = proc.communicate()
    timed_out = True
  dt = time.monotonic() - t0
  lines = [l for l in (out or "").splitlines() if l.strip()]
  steps = [l.split(" ", 1)[1] for l in lines if l.startswith("STEP ")]
  results = [l.split(" ", 1)[1] for l in lines if l.startswith("RESULT ")]
  if timed_out:
    return "HANG", f"at {steps[-1] if steps else 'start'} (killed after {PER_VARIANT_S} s)", dt
  if results:
    verdict, _, detail = results[-1].partition(" ")
    return verdict, detail, dt
  tail = lines[-1] if lines else "(no output)"
  return "ERROR", f"rc={proc.returncode} at {steps[-1] if steps else 'start'}: {tail[:300]}", dt


def main(compile_only=False):
  t_start = time.monotonic()
  summary = []
  for name in VARIANTS:
    if not compile_only and time.monotonic() - t_start + PER_VARIANT_S > BUDGET_S:
      verdict, detail, dt = "SKIP", f"time budget ({BUDGET_S} s) would be exceeded", 0.0
    else:
      verdict, detail, dt = run_variant(name, compile_only)
    summary.append((name, verdict))
    print(f"{verdict:5s} {name:36s} {dt:5.1f}s  {detail}", flush=True)
    if verdict == "SKIP" and detail.startswith("no sm_90"):
      break
  counts = {v: sum(1 for _, x in summary if x == v) for v in ("PASS", "WRONG", "HANG", "ERROR", "SKIP")}
  print("SUMMARY " + " ".join(f"{v}={c}" for v, c in counts.items() if c)
        + f" total={time.monotonic() - t_start:.0f}s", flush=True)
  print("SUMMARY " + " ".join(f"{n}={v}" for n, v in summary), flush=True)


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] in ("--one", "--compile-one"):
    child(sys.argv[2], compile_only=sys.argv[1] == "--compile-one")
  else:
    main(compile_only="--compile-only" in sys.argv)
