"""The loopback fixture: rank 0 of a group of `world` GPUs and its world - 1 peers, all on one
GPU.  The peers' data and arrival counters are already in place in rank 0's workspace (what
the other GPUs would have pushed), and a workspace per peer (one device buffer, the peers'
workspaces back to back) absorbs rank 0's pushes.  A group of one (world 1) has no peers: the
fused kernel's GEMM and its own per-call costs alone (cli.alone_case).

fp8 cases (dtype float8_e4m3fn / float8_e5m2): the operands are fp8, b is stored K-major
([N, K]: what the fp8 kernels and cuBLASLt's fp8 GEMM read), the output and RS partials are
bf16, and the table carries the epilogue scale (backends/launch.py's with_scale)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jax_autooverlap.bench.common import rel_err

WORLD = 2  # the default group size
PEER_ALIGN = 4096  # each peer workspace's start in the peers' buffer (TMA needs 16 bytes)


@dataclasses.dataclass(frozen=True)
class Case:
  """One loopback measurement: global shape of the `world`-GPU op, and rank 0's local operands."""
  op: str  # "ag" | "rs"
  m: int
  k: int
  n: int
  dtype: str = "bfloat16"
  world: int = WORLD
  b_dtype: str = ""  # b's, where it differs (fp8: e.g. an e5m2 gradient times e4m3 weights)
  # Bytes the workspaces have beyond what this call needs, as after growth for a larger call:
  # parity slot 1 then starts later than right after slot 0 (runtime/workspace.py).
  spare: int = 0
  out: str = ""  # the product's dtype where it is not out_dtype's default (e.g. "float32")

  def __post_init__(self):
    if self.op not in ("ag", "rs"):
      raise ValueError(f"op={self.op!r} must be 'ag' or 'rs'")
    if not isinstance(self.world, int) or self.world < 1:
      raise ValueError(f"world={self.world!r} must be an int >= 1")
    if not isinstance(self.spare, int) or self.spare < 0:
      raise ValueError(f"spare={self.spare!r} must be an int >= 0")
    if self.out and np_dtype(self.out).itemsize < np_dtype(self.dtype).itemsize:
      raise ValueError(f"out={self.out!r} is narrower than the operands' {self.dtype}")
    split = {"ag": ("m", "n"), "rs": ("m", "k")}[self.op]
    for name in split:
      if getattr(self, name) % self.world:
        raise ValueError(f"{self.op} {self.m}x{self.k}x{self.n}: {name}={getattr(self, name)} "
                         f"must be divisible by the group size {self.world}")

  @property
  def a_shape(self):  # rank 0's left operand
    w = self.world
    return (self.m // w, self.k) if self.op == "ag" else (self.m, self.k // w)

  @property
  def fp8(self) -> bool:
    from jax_autooverlap import fp8
    return fp8.is_fp8(np_dtype(self.dtype))

  @property
  def out_dtype(self) -> str:
    """The product's dtype: `out` if given, else the operands', bf16 for fp8 operands."""
    return self.out or ("bfloat16" if self.fp8 else self.dtype)

  @property
  def b_shape(self):
    w = self.world
    k, n = (self.k, self.n // w) if self.op == "ag" else (self.k // w, self.n)
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
    w = self.world
    return (self.m, self.k, self.n // w) if self.op == "ag" else (self.m, self.k // w, self.n)

  @property
  def piece_shape(self):
    """What a peer places in rank 0's workspace, per source rank: a shard of `a` (ag), or a
    partial of rank 0's output rows (rs); also what rank 0 pushes into each peer's buffer."""
    return self.a_shape if self.op == "ag" else (self.m // self.world, self.n)

  @property
  def out_shape(self):
    w = self.world
    return (self.m, self.n // w) if self.op == "ag" else (self.m // w, self.n)

  @property
  def label(self):
    return f"{self.m}x{self.k}x{self.n}" + (f"->{self.out}" if self.out else "")


def piece_bytes(case: Case) -> int:
  return int(np.prod(case.piece_shape)) * np.dtype(np_dtype(case.piece_dtype)).itemsize


def piece_offset(case: Case, parity: int, src: int) -> int:
  """Byte offset of source rank `src`'s piece in parity slot `parity` of a workspace."""
  from jax_autooverlap.runtime import workspace
  return (workspace.buffer_offset(case.world)
          + parity * workspace.parity_bytes(case.world, workspace_bytes(case))
          + src * piece_bytes(case))


def workspace_bytes(case: Case) -> int:
  from jax_autooverlap.runtime import workspace
  return workspace.required_bytes(case.world, piece_bytes(case)) + case.spare


def peer_stride(case: Case) -> int:
  """Bytes from one peer's workspace to the next in the peers' buffer."""
  return -(-workspace_bytes(case) // PEER_ALIGN) * PEER_ALIGN


def rank0_workspace(case: Case, peer_pieces, err_address: int = 0) -> np.ndarray:
  """Host image of rank 0's workspace: zero counters (epoch 0), the error record's address in
  the header (runtime/workspace.py), peer src's piece (peer_pieces[src - 1], src = 1 ..
  world - 1) in its slot of both parities (the kernel alternates between them from call to
  call)."""
  from jax_autooverlap.runtime import workspace
  if len(peer_pieces) != case.world - 1:
    raise ValueError(f"rank0_workspace: {len(peer_pieces)} peer pieces for a group of "
                     f"{case.world}")
  host = np.zeros(workspace_bytes(case), np.uint8)
  slot = workspace.ERROR_SLOT_OFFSET
  host[slot:slot + 8] = np.array([err_address], np.uint64).view(np.uint8)
  for src, piece in enumerate(peer_pieces, start=1):
    raw = np.ascontiguousarray(piece).view(np.uint8).reshape(-1)
    for parity in (0, 1):
      off = piece_offset(case, parity, src)
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


def group_addresses(case: Case, ws0_address: int, peers_address: int) -> list[int]:
  """Workspace address of each rank: rank 0's own, then the peers' in their shared buffer."""
  return [ws0_address] + [peers_address + i * peer_stride(case) for i in range(case.world - 1)]


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


def references(case: Case, a, b, peers):
  """(output, [what rank 0 pushes to peer r, r = 1 .. world - 1]) of the unfused computation,
  f32 accumulation (fp8: the f32 product of the exact values); peers: the pieces of sources
  1 .. world - 1.  The operands are made in programs of their own, the product is a plain dot:
  XLA autotunes a dot with a convert or concatenate fused into it, 30-100 s a shape in fp8."""
  import jax
  import jax.numpy as jnp
  wide = (lambda x: x.astype(jnp.float32)) if case.fp8 else (lambda x: x)
  b = jax.jit(lambda b: wide(b).T if case.fp8 else b)(b)  # fp8 b is [N, K]
  dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32) * case.scale)
  if case.op == "ag":
    gathered = jax.jit(lambda *x: jnp.concatenate([wide(v) for v in x]))(a, *peers)
    return np.asarray(dot(gathered, b)), [np.asarray(a.astype(jnp.float32))] * (case.world - 1)
  rows = case.m // case.world
  partial = dot(jax.jit(wide)(a), b)
  out = partial[:rows]
  for p in peers:  # rank order, as the kernels sum
    out = out + p.astype(jnp.float32)
  pushes = [np.asarray(partial[r * rows:(r + 1) * rows]) for r in range(1, case.world)]
  return np.asarray(out), pushes


class Loopback:
  """Rank 0 and its same-GPU peers for one case: operands, workspaces, address table."""

  def __init__(self, case: Case, device, seed: int = 7):
    import jax
    import jax.numpy as jnp
    from jax_autooverlap.runtime.workspace import REGISTRY
    self.case, self.device = case, device
    dtype = np_dtype(case.dtype)
    ka, kb, *kp = jax.random.split(jax.random.key(seed), 1 + case.world)
    put = lambda x: jax.device_put(x, device)
    self.a = put(jax.random.normal(ka, case.a_shape, np.float32).astype(dtype))
    b = jax.random.normal(kb, case.b_shape, np.float32)
    self.b = put((b if case.fp8 else b / np.sqrt(case.b_shape[0])).astype(
        np_dtype(case.b_dtype or case.dtype)))
    # a partial product of rs has the scale of one GPU's share of K
    scale = 1.0 if case.op == "ag" else np.sqrt(1.0 / case.world)
    piece = np_dtype(case.piece_dtype)
    self.peers = [put((jax.random.normal(key, case.piece_shape, np.float32) * scale).astype(piece))
                  for key in kp]
    self.err_address = REGISTRY.error_record().device_address
    self.rank = put(jnp.zeros((1,), jnp.int32))
    self.ws0 = put(rank0_workspace(case, [np.asarray(p) for p in self.peers], self.err_address))
    self.peer_ws = self._zeros_peers()
    self.table = self._table(self.peer_ws)
    self.checks = 0   # calls of check (each scales a by its own power of two)

  def _table(self, peer_ws):
    import jax
    addrs = group_addresses(self.case, self.ws0.unsafe_buffer_pointer(),
                            peer_ws.unsafe_buffer_pointer())
    scale = self.case.scale if self.case.fp8 else None
    return jax.device_put(address_table(addrs, scale), self.device)

  def epoch(self) -> int:
    return int(read_workspace(self.ws0, 0, (1,), np.int32)[0])

  def check(self, program) -> dict:
    """Run once with fresh peer buffers; compare the output and the pushes into every peer with
    the references, then once more on the shared buffers (the result must not change).  Each
    check scales a by its own power of two (2, 4, ...: RS's own partial stays the larger term):
    XLA may hand a contestant the freed output buffer of the one checked before, which must
    then not hold the right answer already."""
    import jax
    from jax_autooverlap.runtime.errors import check_errors
    case = self.case
    self.checks += 1
    # exact in any float format; fp8 cycles through 2..16 (e4m3 ends at 448)
    scale = 2.0 ** (1 + (self.checks - 1) % 4 if case.fp8 else self.checks)
    a = jax.jit(lambda x: x * scale)(self.a)
    want_out, want_pushes = references(case, a, self.b, self.peers)
    peer_ws = self._zeros_peers()
    parity = self.epoch() % 2
    got = np.asarray(program(a, self.b, self._table(peer_ws), self.rank))
    check_errors()
    push_errs = []
    for r, want in enumerate(want_pushes, start=1):
      off = (r - 1) * peer_stride(case) + piece_offset(case, parity, 0)
      pushed = read_workspace(peer_ws, off, case.piece_shape, np_dtype(case.piece_dtype))
      push_errs.append(rel_err(pushed, want))
    again = np.asarray(program(a, self.b, self.table, self.rank))
    return {"rel_err": rel_err(got, want_out),
            "push_rel_err": max(push_errs, default=0.0),  # (a group of one pushes nothing)
            "bit_identical_repeat": bool(np.array_equal(again, got))}

  def _zeros_peers(self):
    """The peers' workspaces, zeroed, back to back in one buffer."""
    import jax
    import jax.numpy as jnp
    # a group of one: an unread page, so that the buffer has an address
    nbytes = max((self.case.world - 1) * peer_stride(self.case), PEER_ALIGN)
    return jax.device_put(jnp.zeros((nbytes,), jnp.uint8), self.device)

  def fused_args(self):
    return (self.a, self.b, self.table, self.rank)

  def gathered(self):
    """ag: the gathered rows, rank 0's shard first (as the kernel computes them)."""
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda *x: jnp.concatenate(x))(self.a, *self.peers)

  def gemm_args(self):
    if self.case.op == "ag":
      return (self.gathered(), self.b)
    return (self.a, self.b)
