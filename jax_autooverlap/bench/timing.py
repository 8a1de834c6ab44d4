"""Device time of benchmark contestants on one GPU: each contestant's kernels as the profiler
(CUPTI) records them, in rounds that interleave the contestants, with the SM clock and power
that nvidia-smi samples meanwhile (the power cap moves both contestants alike only when they
share the rounds)."""
from __future__ import annotations

import glob
import pathlib
import statistics
import subprocess
import tempfile
import threading
import time

# Kernels never counted as a contestant's work: the loopback's set-up kernel (its own work,
# before each fused call) and memsets (XLA clears cuBLAS's workspace before a GEMM).
NOT_WORK = ("loopback_arm_kernel", "Memset")


def kernel_lines(lines):
  """The lines of a device plane that hold the kernels themselves: the per-stream lines, else
  every line but XLA's derived ones ("XLA Ops", "XLA Modules", ... repeat the same work)."""
  streams = [line for line in lines if line.name.startswith("Stream")]
  return streams or [line for line in lines if not line.name.startswith("XLA")
                     and line.name not in ("Launch Stats", "Steps", "Framework Name Scope")]


def device_kernel_events(trace_dir) -> list[tuple[str, float]]:
  """(kernel name, duration ms) of every GPU kernel in a jax.profiler trace directory, in
  start order."""
  from jax.profiler import ProfileData
  events = []
  for path in glob.glob(str(pathlib.Path(trace_dir) / "**" / "*.xplane.pb"), recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if plane.name.startswith("/device:GPU"):
        for line in kernel_lines(list(plane.lines)):
          events += [(e.start_ns, e.name, e.duration_ns / 1e6) for e in line.events]
  return [(name, ms) for _, name, ms in sorted(events)]


def counted(events, kernel_names, exclude=NOT_WORK):
  """The events of one contestant: names containing any of `kernel_names` (None: every kernel
  but the loopback set-up kernel and memsets (XLA clears cuBLAS's workspace before the GEMM:
  not GEMM work); the GEMM alone may be several kernels)."""
  return [(name, ms) for name, ms in events if not any(x in name for x in exclude)
          and (kernel_names is None or any(x in name for x in kernel_names))]


def per_call_ms(events, kernel_names, calls: int) -> float | None:
  """Device time per call of one contestant over a round of `calls` calls; None where the
  profiler recorded no kernel at all.  Kernels recorded, none of them the contestant's: a
  ValueError naming them (a name filter that misses would otherwise time the wall clock)."""
  total = sum(ms for _, ms in counted(events, kernel_names))
  if total > 0:
    return total / calls
  seen = sorted({name for name, _ in counted(events, None)})
  if seen:
    raise ValueError(f"none of the profiled kernels {seen[:8]} matches {list(kernel_names)}")
  return None


class ClockSampler:
  """SM clock and power of GPU 0 sampled by nvidia-smi while a shape is timed (power cap)."""

  def __init__(self, period_s=0.25):
    self.samples, self._stop, self.period_s = [], threading.Event(), period_s
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      try:
        out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=5).stdout.strip().split(",")
        self.samples.append((float(out[0]), float(out[1])))
      except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return
      self._stop.wait(self.period_s)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join(timeout=10)

  def summary(self) -> dict:
    if not self.samples:
      return {}
    clocks, power = [c for c, _ in self.samples], [p for _, p in self.samples]
    return {"sm_clock_mhz_min": min(clocks), "sm_clock_mhz_median": statistics.median(clocks),
            "power_w_max": max(power)}


def time_interleaved(contestants: dict, rounds: int, calls: int) -> dict:
  """{impl: (median ms, {"round_ms": [...], "timing": ..., "kernels": [...]})}.  contestants: impl ->
  (fn, args, kernel names or None).  Every round runs `calls` back-to-back calls of each
  contestant in turn under the profiler; wall-clock batches where it records no GPU kernel."""
  import jax
  for fn, args, _ in contestants.values():  # compile and warm up
    jax.block_until_ready(fn(*args))
  rounds_ms = {impl: [] for impl in contestants}
  timing = {impl: "cupti" for impl in contestants}
  kernels = {impl: [] for impl in contestants}
  for _ in range(rounds):
    for impl, (fn, args, names) in contestants.items():
      with tempfile.TemporaryDirectory(prefix="ao-loopback-") as d:
        with jax.profiler.trace(d):
          jax.block_until_ready([fn(*args) for _ in range(calls)])
        events = device_kernel_events(d)
      ms = per_call_ms(events, names, calls)
      kernels[impl] = sorted({name for name, _ in counted(events, names)})
      if ms is None:  # no device events: wall clock of a batch, outside the profiler
        timing[impl] = "wall_clock"
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        ms = (time.perf_counter() - t0) * 1e3 / calls
      rounds_ms[impl].append(ms)
  return {impl: (statistics.median(v), {"round_ms": [round(x, 4) for x in v],
                                        "timing": timing[impl], "kernels": kernels[impl]})
          for impl, v in rounds_ms.items()}
