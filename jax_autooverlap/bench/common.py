"""What the benchmarks share: progress lines, what a record says ran (versions, GPU), and the
relative error every contestant is checked by."""
from __future__ import annotations

import platform
import sys
import time

import numpy as np


def logger(name: str):
  """log(msg): a `[name HH:MM:SS] msg` progress line on stderr (stdout keeps the tables)."""
  def log(msg):
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
  return log


def versions() -> dict:
  """Versions of what a measurement ran on (a record's `versions` field)."""
  import jax
  import jaxlib
  from jax_autooverlap._compat import import_jax_triton  # never import jax_triton unshimmed
  out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
  try:
    out["jax_triton"] = import_jax_triton().__version__
    out["triton"] = __import__("triton").__version__
  except Exception as e:  # noqa: BLE001 - recorded, not fatal
    out["jax_triton"] = f"unavailable ({type(e).__name__}: {e})"
  return out


def warm_compiles(programs, threads: int = 8) -> None:
  """Lower and compile every (jit function, args) of `programs`, up to `threads` at once.
  Lowering a fused kernel's program compiles the kernel with Triton, and compiling it runs
  XLA, both mostly outside the GIL; JAX keeps the executable for the calls that follow with
  arguments of the same types (a check's fresh inputs, the timing).  The shape list spent
  ~0.7 s per variant in its check, most of it this compile, one variant after the other
  (sixth round).  A program that fails is left for its call to report (the benchmarks log it
  there)."""
  from jax_autooverlap import backends
  from jax_autooverlap.tuning.autotune import in_threads

  def lower(item):
    fn, args = item
    try:
      fn.lower(*args).compile()
    except Exception:  # noqa: BLE001 - the program's own call raises it again, and logs it
      pass
  backends.load_kernels()  # first imports racing in threads see half-initialised modules
  in_threads(lower, programs, threads)


def gpu_name(device=None) -> str:
  """The device kind as records and file names spell it ("NVIDIA-H200"; "cpu" on CPU)."""
  import jax
  return (device or jax.devices()[0]).device_kind.replace(" ", "-")


def rel_err(got, want) -> float:
  """‖got − want‖ / ‖want‖ in float64; inf where `got` holds a NaN or an infinity (so that a
  check `rel_err(...) <= tol` fails on it)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
