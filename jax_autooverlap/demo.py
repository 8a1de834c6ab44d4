"""Demo: a tensor-parallel transformer MLP block, with jax.jit and with ao.jit.

    python -m jax_autooverlap.demo

Runs on whatever devices exist (8 virtual CPU devices when there is no GPU),
prints what the rewrite fused, checks both programs agree and times them
(back-to-back calls, as in a training loop, and single synchronous calls).
Exits non-zero if the outputs disagree.  On CPU the virtual devices share one
processor: the run checks correctness, and its timings cannot show overlap.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only affects the CPU platform: 8 virtual devices when there is no GPU.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_autooverlap as ao  # noqa: E402


def mlp_block(x, w_in, w_out):
  """Sequence-parallel input -> column-parallel matmul -> GELU -> row-parallel matmul."""
  x_full = lax.all_gather(x, "tp", axis=0, tiled=True)       # [tokens, hidden]
  h = jax.nn.gelu(x_full @ w_in)                             # [tokens, ffn / tp]
  return lax.psum_scatter(h @ w_out, "tp", scatter_dimension=0, tiled=True)


def _times_ms(fn, *args, reps: int) -> tuple[float, float]:
  """(per-call time of `reps` back-to-back calls, median latency of one synchronous call)."""
  jax.block_until_ready(fn(*args))  # compile + warm up
  t0 = time.perf_counter()
  jax.block_until_ready([fn(*args) for _ in range(reps)])
  per_call = (time.perf_counter() - t0) * 1e3 / reps
  latency = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    latency.append((time.perf_counter() - t0) * 1e3)
  return per_call, float(np.median(latency))


CPU_NOTE = ("Running on virtual CPU devices: this checks that ao.jit computes what jax.jit "
            "computes. The devices share one processor, so the timings cannot show overlap "
            "gains (or losses); run on NVIDIA GPUs to measure them.")


def _parse(argv):
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.demo",
      description="Run a tensor-parallel MLP block (all_gather -> matmul -> GELU -> matmul -> "
                  "psum_scatter) under jax.jit and ao.jit on all local devices: print what "
                  "ao.explain fused, check that both agree, and time them. Without a GPU it uses "
                  "8 virtual CPU devices, which check correctness but cannot show overlap gains.")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  _parse(argv)
  devices = jax.devices()
  n = len(devices)
  platform = devices[0].platform
  on_gpu = platform == "gpu"
  tokens, hidden, ffn = (8192, 4096, 16384) if on_gpu else (1024, 256, 1024)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  print(f"jax_autooverlap demo: {n} x {devices[0].device_kind} ({platform}), "
        f"tokens={tokens} hidden={hidden} ffn={ffn} {jnp.dtype(dtype).name}")
  if platform == "cpu":
    print(CPU_NOTE)

  mesh = jax.make_mesh((n,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  block = jax.shard_map(mlp_block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")),
                        out_specs=P("tp"))
  keys = jax.random.split(jax.random.key(0), 3)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  x = put(jax.random.normal(keys[0], (tokens, hidden), dtype), P("tp"))
  w_in = put(jax.random.normal(keys[1], (hidden, ffn), dtype) / hidden**0.5, P(None, "tp"))
  w_out = put(jax.random.normal(keys[2], (ffn, hidden), dtype) / ffn**0.5, P("tp"))

  print(ao.explain(block, x, w_in, w_out))
  plain, fused = jax.jit(block), ao.jit(block)
  want = np.asarray(plain(x, w_in, w_out), np.float32)
  got = np.asarray(fused(x, w_in, w_out), np.float32)
  err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  reps = 50 if on_gpu else 10
  (b_plain, l_plain), (b_fused, l_fused) = (_times_ms(f, x, w_in, w_out, reps=reps)
                                             for f in (plain, fused))
  print(f"relative error ao.jit vs jax.jit: {err:.2e} (tolerance {tol:.0e})")
  print(f"back-to-back, per call  jax.jit: {b_plain:8.3f} ms   ao.jit: {b_fused:8.3f} ms   ({reps} calls)")
  print(f"one call, median        jax.jit: {l_plain:8.3f} ms   ao.jit: {l_fused:8.3f} ms   ({reps} calls)")
  if platform == "cpu":
    print("(CPU timings: the reference ring on virtual devices sharing one processor; "
          "they say nothing about overlap on GPUs)")
  if not err <= tol:
    print("FAIL: ao.jit and jax.jit disagree", file=sys.stderr)
    return 1
  print("OK: outputs agree")
  return 0


if __name__ == "__main__":
  sys.exit(main())
