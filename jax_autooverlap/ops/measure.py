"""First-call measurement of a fused call on its own devices (tuning/autotune.py's protocol).

`first_call` times, for a canonical call the tuner planned "first_call", the
unfused program and each kernel candidate: the op alone (its core's own
implementations, on 2-D operands) in shard_map over the call's mesh, every
device of the mesh running it, as the kernels need.

Inputs: random normal values that every process generates the same way, block
by block on the device that holds the block (no collective, no host copy of the
operands), two sets used alternately.  Each program's result is checked against
the reference: this device's block of the product computed by XLA's dot on the
device alone, in float32, from the same blocks.  That is the unfused program's
math without its collective, so the check also runs where the unfused program
cannot (several processes sharing one GPU, which NCCL refuses).

The processes of the mesh agree through runtime/rendezvous.py: a Session named
by the call's cache key, the mesh's devices and how many times this process
measured them (every process counts alike: they trace the same program).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_autooverlap import backends, fp8
from jax_autooverlap.ops import registry
from jax_autooverlap.runtime import cuda, rendezvous
from jax_autooverlap.tuning import autotune, select
from jax_autooverlap.tuning.config import KernelConfig

INPUT_SETS = 2
# Relative (Frobenius) error a result may have against the float32 reference, by dtype: the
# output's rounding and a different summation order, with room (bf16 keeps 8 mantissa bits).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3}
_MEASURED = collections.Counter()  # (cache key, devices) -> measurements started here


def measurements() -> int:
  """First-call measurements this process has started (tests check a cached run starts none)."""
  return sum(_MEASURED.values())


def tolerance(dtype, out_dtype, k: int | None = None, partials: int = 1) -> float:
  """How far a candidate's result may be from the f32 reference: per 16-bit or f32 dtype, or
  for fp8 operands the formats' bound at contraction k (jax_autooverlap/fp8.py gemm_tolerance;
  the operands are exact fp8 values on both sides)."""
  if fp8.is_fp8(dtype):
    return fp8.gemm_tolerance(k, out_dtype, partials=partials)
  return max(TOLERANCE[np.dtype(d).name] for d in (dtype, out_dtype))


class _Case:
  """The operands of one call (two input sets) and this process's reference blocks."""

  def __init__(self, op, mesh, axis_name, sizes, dtype, out_dtype, b_dtype=None):
    rows, k, cols = sizes
    self.n = n = mesh.shape[axis_name]
    self.mesh, self.axis, self.op = mesh, axis_name, op
    # each operand in its own format (an fp8 backward: e5m2 cotangents times e4m3 weights)
    self.dtypes = (np.dtype(dtype), np.dtype(b_dtype if b_dtype is not None else dtype))
    # rs sums n partial products, each rounded to out_dtype: contraction n * k
    self.tol = (tolerance(dtype, out_dtype, k) if op == "ag_rows"
                else tolerance(dtype, out_dtype, n * k, partials=n))
    if op == "ag_rows":  # all_gather(a, rows) @ b: a [n*rows, k] by rows, b [k, n*cols] by cols
      self.shapes = ((n * rows, k), (k, n * cols))
      self.specs = (P(axis_name), P(None, axis_name))
      self.blocks = ((rows, k), (k, cols))
      self.out_spec, self.out_shape = P(None, axis_name), (n * rows, n * cols)
    else:  # psum_scatter(a @ b, rows): a [rows, n*k] by columns, b [n*k, cols] by rows
      self.shapes = ((rows, n * k), (n * k, cols))
      self.specs = (P(None, axis_name), P(axis_name))
      self.blocks = ((rows, k), (k, cols))
      self.out_spec, self.out_shape = P(axis_name), (rows, cols)
    names = "".join(d.name for d in self.dtypes)
    self.seed = int(hashlib.sha256(f"{op}{sizes}{names}".encode()).hexdigest()[:7], 16)
    self._args, self._refs = {}, {}

  def position(self, device) -> int:
    """The device's index along the call's axis."""
    where = np.argwhere(np.asarray(self.mesh.devices) == device)[0]
    return int(where[list(self.mesh.axis_names).index(self.axis)])

  def block(self, which: int, s: int, j: int, device):
    """Block j of operand `which` (0: a, 1: b) of input set s, made on `device`."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), 4 * s + which), j)
    with jax.default_device(device):
      return _normal(key, self.blocks[which], self.dtypes[which])

  def args(self, s: int):
    """Input set s as global arrays over the mesh."""
    if s not in self._args:
      out = []
      for which, (shape, spec) in enumerate(zip(self.shapes, self.specs)):
        sharding = NamedSharding(self.mesh, spec)
        local = [self.block(which, s, self.position(d), d) for d in sharding.addressable_devices]
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, local))
      self._args[s] = tuple(out)
    return self._args[s]

  def reference(self, s: int, device):
    """This device's block of the output of input set s: XLA's dot on the device alone, f32
    (computed once, shared by every program's check)."""
    if (s, device) in self._refs:
      return self._refs[(s, device)]
    j = self.position(device)
    whole = lambda which, axis: jnp.concatenate(
        [self.block(which, s, i, device) for i in range(self.n)], axis=axis)
    with jax.default_device(device):
      if self.op == "ag_rows":
        ref = _dot(whole(0, 0), self.block(1, s, j, device))
      else:
        rows = self.out_shape[0] // self.n
        ref = _dot(whole(0, 1)[j * rows:(j + 1) * rows], whole(1, 0))
    self._refs[(s, device)] = ref
    return ref


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@jax.jit
def _dot(a, b):
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _rel_error(got, want):
  return jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)


@dataclasses.dataclass
class _Program:
  """One timed program (autotune.Program): the op alone through implementation `cp.impl`."""
  label: str
  case: _Case
  core_name: str
  cp: object
  fn: Callable | None = None
  not_run: str | None = None  # why this program cannot run here: it fails at once, saying so

  def compile(self):
    if self.not_run:
      raise RuntimeError(f"not run: {self.not_run}")
    core, case = registry.core(self.core_name), self.case

    def body(x, w):
      res = core.impls[self.cp.impl].run(x[None], w[None], self.cp, False)
      return (res[0] if core.gathers else res)[0]

    fn = jax.jit(jax.shard_map(body, mesh=case.mesh, in_specs=case.specs,
                               out_specs=case.out_spec))
    self.fn = fn.lower(*case.args(0)).compile()

  def check(self):
    for s in range(INPUT_SETS):
      out = jax.block_until_ready(self.fn(*self.case.args(s)))
      for shard in out.addressable_shards:
        err = float(_rel_error(shard.data, self.case.reference(s, shard.device)))
        if not err <= self.case.tol:  # NaN fails too
          raise ValueError(f"result off the reference on {shard.device}: relative error "
                           f"{err:.2e} > {self.case.tol:g}")

  def time(self, iters: int) -> float:
    t0 = time.perf_counter()
    outs = [self.fn(*self.case.args(i % INPUT_SETS)) for i in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) * 1e3 / iters


class _Agreement:
  """autotune.Agreement over the mesh's processes (runtime/rendezvous.py)."""

  def __init__(self, tag: str, processes, what: str):
    self.session = rendezvous.Session(tag, processes, what)
    self.first = self.session.me == min(self.session.processes)

  def exchange(self, step, payload):
    return self.session.exchange(step, payload)

  def conclude(self, ok, reason):
    decision = self.session.decide(ok, reason)
    return decision.ok, decision.reason


def shared_gpus(mesh, agreement) -> str | None:
  """Why the unfused program cannot run on `mesh`, if processes of it share a GPU (each seeing
  it as its device: a test set-up), else None.  NCCL refuses such a group, after tens of
  seconds of connection retries at 8 processes; told up front, the measurement skips that.
  GPUs are told apart by UUID (CUDA_VISIBLE_DEVICES numbers them per process)."""
  mine = [d for d in np.asarray(mesh.devices).flat if d.process_index == jax.process_index()]
  if not mine or mine[0].platform != "gpu":
    return None
  uuids = agreement.exchange("gpus", [cuda.device_uuid(d.local_hardware_id) for d in mine])
  seen = collections.Counter(u for per_process in uuids.values() for u in per_process)
  shared = sum(c > 1 for c in seen.values())
  if not shared:
    return None
  return (f"{shared} GPU(s) of the mesh are shared by several processes, "
          "which NCCL refuses")


def describe_call(op: str, world: int, sizes, dtype, b_dtype=None, out_dtype=None) -> str:
  """ "ag 8192x4096x4096 bf16 on 8 GPUs": the global M x K x N as the benchmarks name shapes
  (two formats, "float8_e5m2 x float8_e4m3fn", where the operands' differ; "bf16 -> f32" where
  the product is not the default, as the verdict's key says)."""
  rows, k, cols = sizes
  m, kk, n = (world * rows, k, world * cols) if op == "ag_rows" else (rows, world * k, cols)
  short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
  names = [np.dtype(d).name for d in (dtype, b_dtype) if d is not None]
  names = " x ".join(short.get(x, x) for x in dict.fromkeys(names))
  if select.wide_product(dtype, out_dtype):
    out = np.dtype(out_dtype).name
    names += f" -> {short.get(out, out)}"
  return f"{op[:2]} {m}x{kk}x{n} {names} on {world} GPUs"


def first_call(op: str, verdict: select.Verdict, mesh, axis_name, sizes, dtype, out_dtype,
               params: Callable[[KernelConfig | None], object], b_dtype=None) -> select.Verdict:
  """Measure verdict.candidates against the unfused program on `mesh` (every process of it
  agreeing) and return the verdict; params(kernel) is the CoreParams of the op on a 2-D call
  (kernel None: the unfused program).  b_dtype: the second operand's format where it differs
  from `dtype` (two fp8 formats): the operands are made in their own formats, so the kernel
  timed and checked is the one that then runs (the verdict's key names `dtype`)."""
  devices = np.asarray(mesh.devices)
  ids = ",".join(str(d.id) for d in devices.flat)
  count = _MEASURED[(verdict.key, ids)]
  _MEASURED[(verdict.key, ids)] += 1
  processes = sorted({d.process_index for d in devices.flat})
  tag = "first-call/{}/{}/{}".format(re.sub(r"[^\w.|x-]", "_", verdict.key),
                                     hashlib.sha256(ids.encode()).hexdigest()[:12], count)
  what = describe_call(op, mesh.shape[axis_name], sizes, dtype, b_dtype, out_dtype)
  agreement = _Agreement(tag, processes, f"first-call measurement of {what}")

  def programs():  # compiled in several threads (autotune.compile_all): no import may race there
    backends.load_kernels()
    case = _Case(op, mesh, axis_name, sizes, dtype, out_dtype, b_dtype)
    kernels = (None, *verdict.candidates)
    labels = (autotune.UNFUSED, *map(str, range(len(verdict.candidates))))
    out = [_Program(label, case, op, params(kernel)) for label, kernel in zip(labels, kernels)]
    out[0].not_run = shared_gpus(mesh, agreement)
    return out

  return autotune.tune(op[:2], verdict, programs, agreement, what, len(processes))

