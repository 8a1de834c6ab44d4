"""The loopback fixture: rank 0 of a group of two and its peer, both on one GPU, with the peer's
data and arrival counters already in place in rank 0's workspace (what a second GPU would have
pushed) and a second workspace absorbing rank 0's pushes.

fp8 cases (dtype float8_e4m3fn / float8_e5m2): the operands are fp8, b is stored K-major
([N, K]: what the fp8 kernels and cuBLASLt's fp8 GEMM read), the output and RS partials are
bf16, and the table carries the epilogue scale (backends/launch.py's with_scale)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_autooverlap.bench.common import rel_err

WORLD = 2


@dataclasses.dataclass(frozen=True)
class Case:
  """One loopback measurement: global shape of the two-GPU op, and rank 0's local operands."""
  op: str  # "ag" | "rs"
  m: int
  k: int
  n: int
  dtype: str = "bfloat16"
  b_dtype: str = ""  # b's, where it differs (fp8: e.g. an e5m2 gradient times e4m3 weights)

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
  def fp8(self) -> bool:
    from jax_autooverlap import fp8
    return fp8.is_fp8(np_dtype(self.dtype))

  @property
  def out_dtype(self) -> str:
    """The product's dtype: the operands', bf16 for fp8 operands."""
    return "bfloat16" if self.fp8 else self.dtype

  @property
  def b_shape(self):
    k, n = (self.k, self.n // WORLD) if self.op == "ag" else (self.k // WORLD, self.n)
    return (n, k) if self.fp8 else (k, n)

  @property
  def piece_dtype(self) -> str:
    """What a peer places in rank 0's workspace: a shard of a (ag), a partial output (rs)."""
    return self.dtype if self.op == "ag" else self.out_dtype

  @property
  def scale(self) -> float:
    """The epilogue scale of an fp8 case: 1/sqrt(local K) as a power of two (fp8 operands are
    not pre-scaled by it, as bf16 ones are, which would leave them subnormal)."""
    return 2.0 ** -round(np.log2(self.local_gemm[1]) / 2) if self.fp8 else 1.0

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
  nbytes = int(np.prod(case.piece_shape)) * np.dtype(np_dtype(case.piece_dtype)).itemsize
  return workspace.buffer_offset(WORLD) + (parity * WORLD + src) * nbytes


def workspace_bytes(case: Case) -> int:
  from jax_autooverlap.runtime import workspace
  nbytes = int(np.prod(case.piece_shape)) * np.dtype(np_dtype(case.piece_dtype)).itemsize
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


def address_table(ws_addresses, scale: float | None = None) -> np.ndarray:
  """uint32 (lo, hi) of each rank's workspace, then a zero pair (backends/triton.py's layout:
  the error record's address is in each workspace's header), its first word the f32 bits of
  the epilogue scale of fp8 kernels (backends/launch.py's with_scale)."""
  table = np.zeros(2 * (len(ws_addresses) + 1), np.uint32)
  for i, a in enumerate(ws_addresses):
    table[2 * i], table[2 * i + 1] = a & 0xFFFFFFFF, a >> 32
  if scale is not None:
    table[2 * len(ws_addresses)] = np.array([scale], np.float32).view(np.uint32)[0]
  return table


def np_dtype(name):
  import jax.numpy as jnp
  return np.dtype(jnp.dtype(name))


def read_workspace(ws, offset: int, shape, dtype):
  """shape/dtype view of a workspace's bytes at `offset`, read on the device (XLA reads the
  buffer's memory as it is now: the kernels write it behind XLA's back)."""
  import jax
  from jax import lax
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize

  @jax.jit
  def read(w):
    raw = lax.slice(w, (offset,), (offset + nbytes,)).reshape(tuple(shape) + (dtype.itemsize,))
    if dtype.itemsize == 1:
      return lax.bitcast_convert_type(raw.reshape(shape), dtype)
    return lax.bitcast_convert_type(raw, dtype)
  return np.asarray(read(ws))


def references(case: Case, a, b, peer):
  """(output, what rank 0 pushes to the peer) of the unfused computation, f32 accumulation."""
  import jax
  import jax.numpy as jnp
  def f32(x, y):  # fp8: the f32 product of the exact (dequantized) values, scaled
    if case.fp8:
      x, y = x.astype(jnp.float32), y.astype(jnp.float32).T
    return jnp.dot(x, y, preferred_element_type=jnp.float32) * case.scale
  if case.op == "ag":
    out = jax.jit(lambda a, b, p: f32(jnp.concatenate([a, p]), b))(a, b, peer)
    return np.asarray(out), np.asarray(a.astype(jnp.float32))
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
    dtype = np_dtype(case.dtype)
    ka, kb, kp = jax.random.split(jax.random.key(seed), 3)
    put = lambda x: jax.device_put(x, device)
    self.a = put(jax.random.normal(ka, case.a_shape, np.float32).astype(dtype))
    b = jax.random.normal(kb, case.b_shape, np.float32)
    self.b = put((b if case.fp8 else b / np.sqrt(case.b_shape[0])).astype(
        np_dtype(case.b_dtype or case.dtype)))
    peer = jax.random.normal(kp, case.piece_shape, np.float32)
    if case.op == "rs":  # a partial product has the scale of one GPU's share of K
      peer = peer * np.sqrt(0.5)
    self.peer = put(peer.astype(np_dtype(case.piece_dtype)))
    self.err_address = REGISTRY.error_record().device_address
    self.rank = put(jnp.zeros((1,), jnp.int32))
    self.ws0 = put(rank0_workspace(case, np.asarray(self.peer), self.err_address))
    self.ws1 = self._zeros_ws()
    self.table = self._table(self.ws1)
    self.checks = 0   # calls of check (each scales a by its own power of two)

  def _table(self, ws1):
    import jax
    addrs = (self.ws0.unsafe_buffer_pointer(), ws1.unsafe_buffer_pointer())
    scale = self.case.scale if self.case.fp8 else None
    return jax.device_put(address_table(addrs, scale), self.device)

  def epoch(self) -> int:
    return int(read_workspace(self.ws0, 0, (1,), np.int32)[0])

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
    pushed = read_workspace(ws1, piece_offset(case, parity, 0), case.piece_shape,
                            np_dtype(case.piece_dtype))
    again = np.asarray(program(a, self.b, self.table, self.rank))
    return {"rel_err": rel_err(got, want_out), "push_rel_err": rel_err(pushed, want_push),
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
