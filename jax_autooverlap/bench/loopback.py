"""Loopback benchmark: a fused kernel's compute path on ONE GPU, against cuBLAS doing the same work.

    python -m jax_autooverlap.bench ag|rs --loopback [--shapes 4096x8192x8192,...] [--out DIR]

The fused kernel runs as rank 0 of a group of two (world 2) whose peer is a
second workspace buffer on the same GPU:
  ag  the peer's shard is already in rank 0's gather buffer and its arrival
      counters are set (kernels/loopback.py), so remote tiles never wait;
      rank 0's pushes land in the second buffer;
  rs  the peer's partial tiles of rank 0's rows are already in rank 0's
      slots, counters set; rank 0's pushes of the peer's tiles land in the
      second buffer.
So the tile order, the waits (their first poll), the epilogue and the push
(at same-GPU bandwidth, not NVLink) are timed, without a second GPU.

Shapes are global M x K x N of the two-GPU op (as in `python -m
jax_autooverlap.bench`); the local work of one GPU is
  ag  [M, K] @ [K, N/2]   (its shard is M/2 of the M rows)
  rs  [M, K/2] @ [K/2, N] (it owns M/2 output rows)
Contestants, run interleaved (rounds of back-to-back calls of each in turn):
  gemm_alone  the local GEMM through XLA (cuBLAS)
  ours        the fused kernel with the engine the tuner would pick: the
              fastest correct engine of this run (field `engine`; GEMM+RS on the
              Gluon engine with and without a consumer partition per warpgroup,
              as autotuning times it: field `kernel`)
  ours_tl     the fused kernel with the plain `tl` engine
  engine_alone  the Gluon engine's plain GEMM (kernels/gluon_gemm.py) on the same
              local work, same tiles: what the fused kernel costs over its engine
              (in the table; its records go to *-engine-alone.json with mode "engine",
              so the *-loopback.json records are gemm_alone, ours and ours_tl)
Times are device times of the contestant's kernels (jax.profiler, CUPTI),
without the loopback set-up kernel: per round the mean per call, then the
median over rounds (`round_ms` keeps every round: the spread, e.g. under the
power cap; `kernels` the kernel names counted).  Without device events (no
CUPTI) wall-clock batches are used instead (field `timing`).  Every fused contestant is first checked
against the unfused computation (jnp on the same GPU): its output, and what
it pushed into the peer's buffer; a wrong one is reported and not timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

WORLD = 2
DEFAULT_SHAPES = ["4096x8192x8192", "16384x8192x8192", "16384x8192x28672", "8192x4096x4096"]
MAX_REL_ERR = 2e-2
ARM_KERNEL = "loopback_arm_kernel"


def _log(msg):
  print(f"[loopback {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Case:
  """One loopback measurement: global shape of the two-GPU op, and rank 0's local operands."""
  op: str  # "ag" | "rs"
  m: int
  k: int
  n: int
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.op not in ("ag", "rs"):
      raise ValueError(f"op={self.op!r} must be 'ag' or 'rs'")
    split = {"ag": ("m", "n"), "rs": ("m", "k")}[self.op]
    for name in split:
      if getattr(self, name) % WORLD:
        raise ValueError(f"{self.op} {self.m}x{self.k}x{self.n}: {name}={getattr(self, name)} "
                         f"must be divisible by the group size {WORLD}")

  @property
  def a_shape(self):  # rank 0's left operand
    return (self.m // WORLD, self.k) if self.op == "ag" else (self.m, self.k // WORLD)

  @property
  def b_shape(self):
    return (self.k, self.n // WORLD) if self.op == "ag" else (self.k // WORLD, self.n)

  @property
  def local_gemm(self):  # (M, K, N) of the GEMM one GPU computes
    return (self.m, self.k, self.n // WORLD) if self.op == "ag" else (self.m, self.k // WORLD, self.n)

  @property
  def piece_shape(self):
    """What a peer places in rank 0's workspace, per source rank: a shard of `a` (ag), or a
    partial of rank 0's output rows (rs); also what rank 0 pushes into the peer's buffer."""
    return self.a_shape if self.op == "ag" else (self.m // WORLD, self.n)

  @property
  def out_shape(self):
    return (self.m, self.n // WORLD) if self.op == "ag" else (self.m // WORLD, self.n)

  @property
  def label(self):
    return f"{self.m}x{self.k}x{self.n}"


def piece_offset(case: Case, parity: int, src: int) -> int:
  """Byte offset of source rank `src`'s piece in parity slot `parity` of a workspace."""
  from jax_autooverlap.runtime import workspace
  nbytes = int(np.prod(case.piece_shape)) * np.dtype(_np_dtype(case.dtype)).itemsize
  return workspace.buffer_offset(WORLD) + (parity * WORLD + src) * nbytes


def workspace_bytes(case: Case) -> int:
  from jax_autooverlap.runtime import workspace
  nbytes = int(np.prod(case.piece_shape)) * np.dtype(_np_dtype(case.dtype)).itemsize
  return workspace.required_bytes(WORLD, nbytes)


def rank0_workspace(case: Case, peer_piece: np.ndarray, err_address: int = 0) -> np.ndarray:
  """Host image of rank 0's workspace: zero counters (epoch 0), the error record's address in
  the header (runtime/workspace.py), the peer's piece in both parity slots (the kernel
  alternates between them from call to call)."""
  from jax_autooverlap.runtime import workspace
  host = np.zeros(workspace_bytes(case), np.uint8)
  slot = workspace.ERROR_SLOT_OFFSET
  host[slot:slot + 8] = np.array([err_address], np.uint64).view(np.uint8)
  raw = np.ascontiguousarray(peer_piece).view(np.uint8).reshape(-1)
  for parity in (0, 1):
    off = piece_offset(case, parity, 1)
    host[off:off + raw.size] = raw
  return host


def address_table(ws_addresses) -> np.ndarray:
  """uint32 (lo, hi) of each rank's workspace, then a zero pair (backends/triton.py's layout:
  the error record's address is in each workspace's header)."""
  table = np.zeros(2 * (len(ws_addresses) + 1), np.uint32)
  for i, a in enumerate(ws_addresses):
    table[2 * i], table[2 * i + 1] = a & 0xFFFFFFFF, a >> 32
  return table


def _np_dtype(name):
  import jax.numpy as jnp
  return np.dtype(jnp.dtype(name))


# --- device-side pieces (GPU only) -------------------------------------------------------------

def _arm(table, compute_capability=None):
  """The loopback set-up kernel before each fused call (kernels/loopback.py)."""
  import jax
  from jax_autooverlap._compat import import_jax_triton
  from jax_autooverlap.kernels.loopback import loopback_arm_kernel
  from jax_autooverlap.runtime import workspace
  jt = import_jax_triton()
  n = max(table.shape[0], 2 * WORLD * workspace.MAX_CHUNKS)
  return jt.triton_call(
      table, kernel=loopback_arm_kernel, name="ao_loopback_arm",
      out_type=jax.ShapeDtypeStruct(table.shape, table.dtype), grid=(1,), num_warps=4,
      compute_capability=compute_capability,
      TABLE_LEN=table.shape[0], WORLD=WORLD, FLAGS_OFF=workspace.FLAGS_OFFSET,
      MAX_CHUNKS=workspace.MAX_CHUNKS, BLOCK=1 << (n - 1).bit_length())


def fused_program(case: Case, kernel, num_sms: int, timeout_s: float = 10.0,
                  compute_capability: int | None = None, return_gathered: bool = False,
                  trace: bool = False):
  """jit(a, b, table, rank) -> rank 0's output (ag with return_gathered: (output, gathered
  shards)): set-up kernel, then the fused kernel (compute_capability: compile-only checks on a
  machine without a GPU).  trace (Gluon engine): (output, the kernel's per-tile timeline)."""
  cc = dict(compute_capability=compute_capability)
  import functools
  import jax
  if trace:  # the Gluon launchers themselves: only they record a timeline
    from jax_autooverlap.backends import gluon as backend
  else:
    from jax_autooverlap.backends import triton as backend
  if kernel is not None and kernel.wg_partitions and case.op != "rs":
    raise ValueError("fused_program: wg_partitions is built for GEMM+RS only")
  extra = dict(trace=True) if trace else {}
  launch_ag_gemm = functools.partial(backend.launch_ag_gemm, **extra)
  launch_gemm_rs = functools.partial(backend.launch_gemm_rs, **extra)
  dtype = _np_dtype(case.dtype)

  def run(a, b, table, rank):
    table = _arm(table, **cc)  # data dependence: the set-up kernel runs first
    if case.op == "ag":
      return launch_ag_gemm(a, b, table, rank, world=WORLD, kernel=kernel, out_dtype=dtype,
                            return_gathered=return_gathered, timeout_s=timeout_s, num_sms=num_sms,
                            **cc)
    return launch_gemm_rs(a, b, table, rank, world=WORLD, kernel=kernel, out_dtype=dtype,
                          timeout_s=timeout_s, num_sms=num_sms, **cc)
  return jax.jit(run)


def engine_program(kernel, num_sms: int, compute_capability: int | None = None,
                   trace: bool = False):
  """jit(a, b) -> a @ b on the Gluon engine alone (no communication), same tiles and stages
  (trace: (a @ b, the per-tile timeline))."""
  import jax
  from jax_autooverlap.backends.gluon import launch_gemm

  def run(a, b):
    return launch_gemm(a, b, kernel=kernel, out_dtype=a.dtype, num_sms=num_sms,
                       compute_capability=compute_capability, trace=trace)
  return jax.jit(run)


def gemm_program():
  import jax
  return jax.jit(lambda a, b: a @ b)


def _read(ws, offset: int, shape, dtype):
  """shape/dtype view of a workspace's bytes at `offset`, read on the device (XLA reads the
  buffer's memory as it is now: the kernels write it behind XLA's back)."""
  import jax
  from jax import lax
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize

  @jax.jit
  def read(w):
    raw = lax.slice(w, (offset,), (offset + nbytes,)).reshape(tuple(shape) + (dtype.itemsize,))
    return lax.bitcast_convert_type(raw, dtype) if dtype.itemsize > 1 else raw.reshape(shape)
  return np.asarray(read(ws))


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def references(case: Case, a, b, peer):
  """(output, what rank 0 pushes to the peer) of the unfused computation, f32 accumulation."""
  import jax
  import jax.numpy as jnp
  f32 = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
  if case.op == "ag":
    out = jax.jit(lambda a, b, p: f32(jnp.concatenate([a, p]), b))(a, b, peer)
    return np.asarray(out), np.asarray(a)
  half = case.m // WORLD
  partial = jax.jit(f32)(a, b)
  out = partial[:half] + peer.astype(jnp.float32)
  return np.asarray(out), np.asarray(partial[half:])


class Loopback:
  """Rank 0 and its same-GPU peer for one case: operands, workspaces, address table."""

  def __init__(self, case: Case, device, seed: int = 7):
    import jax
    import jax.numpy as jnp
    from jax_autooverlap.runtime.workspace import REGISTRY
    self.case, self.device = case, device
    dtype = _np_dtype(case.dtype)
    ka, kb, kp = jax.random.split(jax.random.key(seed), 3)
    put = lambda x: jax.device_put(x, device)
    self.a = put(jax.random.normal(ka, case.a_shape, np.float32).astype(dtype))
    self.b = put((jax.random.normal(kb, case.b_shape, np.float32)
                  / np.sqrt(case.b_shape[0])).astype(dtype))
    peer = jax.random.normal(kp, case.piece_shape, np.float32)
    if case.op == "rs":  # a partial product has the scale of one GPU's share of K
      peer = peer * np.sqrt(0.5)
    self.peer = put(peer.astype(dtype))
    self.err_address = REGISTRY.error_record().device_address
    self.rank = put(jnp.zeros((1,), jnp.int32))
    self.ws0 = put(rank0_workspace(case, np.asarray(self.peer), self.err_address))
    self.ws1 = self._zeros_ws()
    self.table = self._table(self.ws1)
    self.checks = 0   # calls of check (each scales a by its own power of two)

  def _table(self, ws1):
    import jax
    addrs = (self.ws0.unsafe_buffer_pointer(), ws1.unsafe_buffer_pointer())
    return jax.device_put(address_table(addrs), self.device)

  def epoch(self) -> int:
    return int(_read(self.ws0, 0, (1,), np.int32)[0])

  def check(self, program) -> dict:
    """Run once with a fresh peer buffer; compare the output and the push with the references,
    then once more on the shared buffers (the result must not change).  Each check scales a by
    its own power of two (2, 4, ...: RS's own partial stays the larger term): XLA may hand a
    contestant the freed output buffer of the one checked before, which must then not hold the
    right answer already."""
    import jax
    from jax_autooverlap.runtime.errors import check_errors
    case = self.case
    self.checks += 1
    scale = 2.0 ** self.checks   # exact in any float format
    a = jax.jit(lambda x: x * scale)(self.a)
    want_out, want_push = references(case, a, self.b, self.peer)
    ws1 = self._zeros_ws()
    parity = self.epoch() % 2
    got = np.asarray(program(a, self.b, self._table(ws1), self.rank))
    check_errors()
    pushed = _read(ws1, piece_offset(case, parity, 0), case.piece_shape, _np_dtype(case.dtype))
    again = np.asarray(program(a, self.b, self.table, self.rank))
    return {"rel_err": _rel_err(got, want_out), "push_rel_err": _rel_err(pushed, want_push),
            "bit_identical_repeat": bool(np.array_equal(again, got))}

  def _zeros_ws(self):
    import jax
    import jax.numpy as jnp
    return jax.device_put(jnp.zeros((workspace_bytes(self.case),), jnp.uint8), self.device)

  def fused_args(self):
    return (self.a, self.b, self.table, self.rank)

  def gemm_args(self):
    import jax
    import jax.numpy as jnp
    if self.case.op == "ag":  # the gathered rows, this GPU's shard first (as the kernel computes)
      return (jax.jit(jnp.concatenate)([self.a, self.peer]), self.b)
    return (self.a, self.b)


# --- timing -------------------------------------------------------------------------------------

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


def counted(events, kernel_names, exclude=(ARM_KERNEL, "Memset")):
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


class _ClockSampler:
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


# --- the benchmark ------------------------------------------------------------------------------

def kernel_configs(case: Case, device_kind: str, engines) -> dict:
  """{engine: KernelConfig}: the tuner's config for the two-GPU op of this shape (its cached
  verdict, else the default), with each engine."""
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import OverlapConfig
  dtype = _np_dtype(case.dtype)
  if case.op == "ag":
    v = select.choose_ag(OverlapConfig(), device_kind, WORLD, case.m // WORLD, case.k,
                         case.n // WORLD, dtype, dtype)
  else:
    v = select.choose_rs(OverlapConfig(), device_kind, WORLD, case.m, case.k // WORLD, case.n,
                         dtype, dtype)
  base = v.kernel or select.default_kernel(dtype)
  out = {}
  for engine in engines:
    try:
      cfg = dataclasses.replace(base, engine=engine)
    except ValueError as e:  # the tuner's tiles do not fit this engine
      _log(f"{case.op} {case.label}: engine {engine} skipped: {e}")
      continue
    # rows per GPU (ag: its shard; rs: its output rows), then the local GEMM's K and N
    why = select.unsupported(case.m // WORLD, case.local_gemm[1], case.local_gemm[2], dtype, dtype,
                             cfg)
    if why is None:
      out[engine] = cfg
    else:
      _log(f"{case.op} {case.label}: engine {engine} skipped: {why}")
  return out


def kernel_names(engine: str, op: str) -> tuple[str, ...]:
  """Substrings of the fused kernel's name in the profiler (the @jit function's name)."""
  if engine == "tl":
    return ("ag_gemm_kernel",) if op == "ag" else ("gemm_rs_kernel",)
  return (f"gluon_{op}_gemm_kernel",) if op == "ag" else ("gluon_gemm_rs_kernel",)


def bench_case(case: Case, device, engines, rounds: int, calls: int) -> list[dict]:
  """Records of one case: gemm_alone, ours_tl, engine_alone and ours (the fastest of the fused
  variants autotuning times: each engine, and for GEMM+RS the Gluon engine with a consumer
  partition per warpgroup too)."""
  from jax_autooverlap.runtime import cuda
  lb = Loopback(case, device)
  num_sms = cuda.sm_count(device.local_hardware_id)
  configs = kernel_configs(case, device.device_kind, engines)
  contestants, checks = {"gemm_alone": (gemm_program(), lb.gemm_args(), None)}, {}
  if "gluon" in configs:
    contestants["engine_alone"] = (engine_program(configs["gluon"], num_sms), lb.gemm_args(),
                                   ("gluon_gemm_kernel",))
  variants = dict(configs)
  if case.op == "rs" and "gluon" in configs:
    variants["gluon_wg"] = dataclasses.replace(configs["gluon"], wg_partitions=True)
  for engine, cfg in variants.items():
    program = fused_program(case, cfg, num_sms)
    try:
      checks[engine] = lb.check(program)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
      _log(f"{case.op} {case.label} engine {engine} failed: {type(e).__name__}: {str(e)[:400]}")
      continue
    ok = (checks[engine]["rel_err"] <= MAX_REL_ERR and checks[engine]["push_rel_err"] <= MAX_REL_ERR
          and checks[engine]["bit_identical_repeat"])
    _log(f"{case.op} {case.label} engine {engine}: {checks[engine]} -> "
         f"{'ok' if ok else 'WRONG, not timed'}")
    if ok:
      contestants[engine] = (program, lb.fused_args(),
                             kernel_names("gluon" if engine == "gluon_wg" else engine, case.op))
  with _ClockSampler() as clocks:
    timed = time_interleaved(contestants, rounds, calls)
  variants_timed = [e for e in variants if e in timed]
  records = [("gemm_alone", timed["gemm_alone"], {})]
  if "tl" in timed:
    records.append(("ours_tl", timed["tl"], {"engine": "tl", **checks["tl"]}))
  if "engine_alone" in timed:
    records.append(("engine_alone", timed["engine_alone"], {"engine": "gluon"}))
  if variants_timed:
    best = min(variants_timed, key=lambda e: timed[e][0])
    records.append(("ours", timed[best], {"engine": variants[best].engine, **checks[best],
                                          "kernel": dataclasses.asdict(variants[best])}))
  for e in variants:
    if e != "tl" and e in timed:
      _log(f"{case.op} {case.label} engine {e}: {timed[e][0]:.4f} ms")
  return [{"impl": impl, "median_ms": round(ms, 4), **extra, **info, **clocks.summary()}
          for impl, (ms, info), extra in records]


def trace_case(case: Case, device, calls: int = 3) -> tuple[dict, dict]:
  """({contestant: summary}, {contestant: raw trace}) of the Gluon engine alone and the fused
  Gluon kernel on this case (the config bench_case times): the timeline of the last of `calls`
  calls (bench/timeline.py)."""
  import jax
  from jax_autooverlap.bench import timeline
  from jax_autooverlap.runtime import cuda
  lb = Loopback(case, device)
  num_sms = cuda.sm_count(device.local_hardware_id)
  cfg = kernel_configs(case, device.device_kind, ["gluon"]).get("gluon")
  if cfg is None:
    return {}, {}
  rows = case.m // WORLD  # ag: a shard; rs: an owner's output rows
  cols = case.n // WORLD if case.op == "ag" else case.n
  per_source = -(-rows // cfg.block_m) * -(-cols // cfg.block_n)
  if case.op == "ag":
    kind = lambda t: "local" if t < per_source else "peer"
  else:
    kind = lambda t: "own" if t >= (WORLD - 1) * per_source else "remote"
  runs = {"engine_alone": (engine_program(cfg, num_sms, trace=True), lb.gemm_args(), None),
          "ours": (fused_program(case, cfg, num_sms, trace=True), lb.fused_args(), kind)}
  summaries, raw = {}, {}
  for name, (fn, args, k) in runs.items():
    for _ in range(calls):
      _, trace = jax.block_until_ready(fn(*args))
    raw[name] = np.asarray(trace)
    summaries[name] = timeline.summarize(raw[name], k)
    _log(f"{case.op} {case.label} {name} timeline: {summaries[name]}")
  return summaries, raw


def format_table(op: str, records: list[dict]) -> str:
  by_shape: dict = {}
  for r in records:
    by_shape.setdefault((r["m"], r["k"], r["n"]), {})[r["impl"]] = r
  title = "AllGather+GEMM" if op == "ag" else "GEMM+ReduceScatter"
  lines = [f"{title} loopback (one GPU, world {WORLD}), ms, device time per call (median)",
           "  ".join(f"{h:>16}" for h in ("shape MxKxN", "local GEMM", "gemm_alone", "ours",
                                           "engine", "ours_tl", "engine_alone", "ours/gemm",
                                           "tl/gemm", "engine/gemm", "sm MHz min"))]
  nan = {"median_ms": float("nan")}
  for (m, k, n), impls in by_shape.items():
    g, o, t, e = (impls.get(i, nan)["median_ms"]
                  for i in ("gemm_alone", "ours", "ours_tl", "engine_alone"))
    local = "x".join(map(str, impls["gemm_alone"]["local_gemm"]))
    clock = impls["gemm_alone"].get("sm_clock_mhz_min", float("nan"))
    shape = f"{m}x{k}x{n}"
    ours = impls.get("ours", {})
    engine = ours.get("engine", "-") + ("+wg" if ours.get("kernel", {}).get("wg_partitions") else "")
    lines.append("  ".join([f"{shape:>16}",
                            f"{local:>16}", f"{g:>16.4f}", f"{o:>16.4f}",
                            f"{engine:>16}", f"{t:>16.4f}",
                            f"{e:>16.4f}", f"{o / g:>16.3f}", f"{t / g:>16.3f}", f"{e / g:>16.3f}",
                            f"{clock:>16.0f}"]))
  return "\n".join(lines)


def parse_args(argv):
  ap = argparse.ArgumentParser(prog="python -m jax_autooverlap.bench OP --loopback")
  ap.add_argument("op", choices=["ag", "rs"])
  ap.add_argument("--loopback", action="store_true", required=True)
  ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="global MxKxN, comma-separated")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--engines", default="tl,gluon",
                  help="fused-kernel engines to time, comma-separated: tl, gluon")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per round")
  ap.add_argument("--tag", default="", help="suffix of the output file names")
  ap.add_argument("--trace", action="store_true",
                  help="also record one call's per-tile timeline of the Gluon engine alone and the "
                       "fused Gluon kernel (kernels/gluon_trace.py): summary JSON + raw .npz")
  ap.add_argument("--out", default="bench/results")
  return ap.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  cases = [Case(args.op, *map(int, s.split("x")), dtype=args.dtype) for s in args.shapes.split(",")]
  import jax
  from jax_autooverlap.bench.__main__ import _versions
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  if not gpus:
    print("bench --loopback: needs an NVIDIA GPU", file=sys.stderr)
    return 2
  engines = [e for e in args.engines.split(",") if e]
  if "gluon" in engines and str(getattr(gpus[0], "compute_capability", "")) != "9.0":
    _log(f"engine gluon skipped: it is for sm_90, this GPU is {gpus[0].device_kind}")
    engines.remove("gluon")
  gpu, versions = gpus[0].device_kind.replace(" ", "-"), _versions()
  date = datetime.date.today().isoformat()
  records, timelines, raw_traces = [], [], {}
  for case in cases:
    _log(f"{case.op} {case.label}: local GEMM {'x'.join(map(str, case.local_gemm))}")
    for r in bench_case(case, gpus[0], engines, args.rounds, args.calls):
      records.append({"op": case.op, "m": case.m, "k": case.k, "n": case.n, "dtype": case.dtype,
                      "world_size": WORLD, "mode": "loopback", "local_gemm": list(case.local_gemm),
                      **r, "gpu": gpu, "versions": versions, "date": date})
    if args.trace and "gluon" in engines:
      summaries, raw = trace_case(case, gpus[0])
      for impl, summary in summaries.items():
        timelines.append({"op": case.op, "m": case.m, "k": case.k, "n": case.n, "impl": impl,
                          **summary, "gpu": gpu, "versions": versions, "date": date})
      raw_traces.update({f"{case.label}/{impl}": t for impl, t in raw.items()})
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = f"{gpu}-x1-{date}-{args.op}"
  path = out_dir / f"{stem}-loopback{args.tag}.json"
  if timelines:
    (out_dir / f"{stem}-timeline{args.tag}.json").write_text(json.dumps(timelines, indent=1))
    np.savez_compressed(out_dir / f"{stem}-timeline{args.tag}.npz", **raw_traces)
  engine = [{**r, "mode": "engine"} for r in records if r["impl"] == "engine_alone"]
  if engine:
    (out_dir / f"{stem}-engine-alone{args.tag}.json").write_text(json.dumps(engine, indent=1))
  path.write_text(json.dumps([r for r in records if r["impl"] != "engine_alone"], indent=1))
  table = format_table(args.op, records)
  path.with_suffix(".txt").write_text(table + "\n")
  print(table)
  print(f"wrote {path}")
  return 0
