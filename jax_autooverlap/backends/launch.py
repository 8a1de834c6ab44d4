"""Launch geometry both engines' launchers share (backends/triton.py, backends/gluon.py): the
grids of the fused kernels, the compile-time constants every fused kernel takes, the
layout of fp8 operands, and the operands' TMA descriptors made on the host."""
from __future__ import annotations

import math

import numpy as np
from jax import lax

from jax_autooverlap import fp8

from jax_autooverlap.runtime import workspace
from jax_autooverlap.tuning.config import KernelConfig
from jax_autooverlap.tuning.model import tiles_per_chunk
from jax_autooverlap.tuning.select import fused_tiles, packed_unsupported, split_k_unsupported


def parity_bytes(op: str, world: int, a, n: int, out_dtype, workspace_bytes: int | None,
                 what: str) -> int:
  """The distance between a workspace's parity slots (runtime/workspace.py) for a launch of
  `op` with a[m, K] and N = n on workspaces of workspace_bytes (None: exactly what this launch
  needs, as the loopback fixture allocates).  Raises ValueError (naming the launcher `what`)
  where they are too small for it."""
  m, k = a.shape
  need = workspace.kernel_bytes(op, world, m, k, n, a.dtype, out_dtype)
  size = need if workspace_bytes is None else workspace_bytes
  if size < need:
    raise ValueError(f"{what}: workspaces of {size} bytes per GPU; a[{m}, {k}] with N = {n} "
                     f"in a group of {world} needs {need}")
  return workspace.parity_bytes(world, size)


def kernel_constants(kernel: KernelConfig, world: int, tile_rows: int, num_ctas: int,
                     timeout_s: float, op_id: int, parity: int) -> dict:
  """The compile-time constants every fused kernel takes (both ops, both engines): its tiles and
  the workspace protocol (runtime/workspace.py's layout, `parity` = parity_bytes, the bounded
  waits' limit)."""
  return dict(WORLD=world, BLOCK_M=kernel.block_m, BLOCK_N=kernel.block_n, BLOCK_K=kernel.block_k,
              GROUP_M=kernel.group_m, TILES_PER_CHUNK=tiles_per_chunk(tile_rows, kernel.chunks),
              NUM_CTAS=num_ctas, FLAGS_OFF=workspace.FLAGS_OFFSET,
              BUF_OFF=workspace.buffer_offset(world), PARITY_BYTES=parity,
              MAX_CHUNKS=workspace.MAX_CHUNKS,
              FLAG_BLOCK=1 << (world * workspace.MAX_CHUNKS - 1).bit_length(),
              TIMEOUT_NS=int(timeout_s * 1e9), OP_ID=op_id)


COPY_ELEMS = 128 * 128  # a tl mover's copy block: 64 elements per thread at 8 warps


def copy_block(m_shard: int, k: int, block_m: int, world: int = 2, num_comm: int = 1,
               packed: bool = False) -> dict:
  """The tl AG movers' copies (kernels/ag_gemm.py _copy_rows).  COPY_ROWS, COPY_COLS: the
  block, rows covering a row tile's part of the shard (its rows rounded up to a power of two,
  16 to block_m), columns filling COPY_ELEMS that divide K (a multiple of 64).  Each block is
  one load and one store in turn, latency-bound: a 16-row shard in 128-row blocks was 64
  blocks of 4 useful KB at K = 8192, now 8 of 32 KB.  PUSH_PARTS: the column parts of a push
  unit (a row tile to a peer), so that where the units are fewer than the num_comm movers a
  shard still goes out through several of them (a divisor of the blocks per unit, at most
  num_comm / units).  OWN_PARTS (packed): the own shard's copy into its slot, every tile's
  first wait, one block per part, claimed by every CTA (1 where not packed)."""
  rows = min(block_m, max(16, 1 << (m_shard - 1).bit_length()))
  cols = COPY_ELEMS // rows
  while k % cols:
    cols //= 2
  blocks = k // cols
  units = max(1, (world - 1) * math.ceil(m_shard / block_m))  # a group of 1 pushes nothing
  push = max(d for d in range(1, blocks + 1)
             if blocks % d == 0 and d <= max(1, math.ceil(num_comm / units)))
  return dict(COPY_ROWS=rows, COPY_COLS=cols, PUSH_PARTS=push,
              OWN_PARTS=blocks if packed else 1)


def trace_out_type(num_ctas: int, trace: bool):
  """The trace operand of a launch (kernels/gluon_trace.py, tl_trace.py: one layout):
  [num_ctas, 1 + SLOTS, FIELDS] int64 where the launch records it (zeroed before: rows of tiles
  a CTA did not run stay 0), else a 4-element placeholder the kernel never touches."""
  import jax
  from jax_autooverlap.kernels import gluon_trace
  shape = (num_ctas, 1 + gluon_trace.SLOTS.value, gluon_trace.FIELDS.value) if trace else (4,)
  return jax.ShapeDtypeStruct(shape, np.int64)


def split_from(kernel: KernelConfig, tiles: int) -> int:
  """The first split tile of a launch of `tiles` output tiles (kernels/split_k.py SPLIT_FROM):
  `tiles` without split-K, 0 where every tile is split, else tiles - split_tail."""
  if kernel.split_k == 1:
    return tiles
  return max(tiles - kernel.split_tail, 0) if kernel.split_tail else 0


def spread_rows(kernel: KernelConfig, tiles: int, num_ctas: int) -> int:
  """The rows of a split tile each part sums in an AG+GEMM launch, or a packed GEMM+RS one, of
  num_ctas CTAs (kernels/split_k.py Spread: block_m / split_k up to a power of 2) where every
  tile is split
  (SPLIT_FROM 0) and a tile's parts can all run at once (split_k <= num_ctas: the parts wait
  for each other); else 0 (the part that completes a tile sums all of it)."""
  if kernel.split_k == 1 or split_from(kernel, tiles) != 0 or num_ctas < kernel.split_k:
    return 0
  return 1 << (math.ceil(kernel.block_m / kernel.split_k) - 1).bit_length()


def work_units(kernel: KernelConfig, tiles: int) -> int:
  """The work units of a launch of `tiles` output tiles: a whole tile or a part of a split one."""
  first = split_from(kernel, tiles)
  return first + (tiles - first) * kernel.split_k


def partials_type(kernel: KernelConfig, tiles: int, k: int, what: str):
  """The split-K partial tiles (kernels/split_k.py) of a launch of `tiles` output tiles with
  K = k: fp32 [split tiles * split_k * block_m * block_n], or a 4-element placeholder without
  split-K.  Raises ValueError (naming the launcher `what`) where split-K cannot run."""
  import jax
  import numpy as np
  why = split_k_unsupported(kernel, tiles, k)
  if why:
    raise ValueError(f"{what}: {why}")
  if kernel.split_k == 1:
    return jax.ShapeDtypeStruct((4,), np.float32)
  split = tiles - split_from(kernel, tiles)
  return jax.ShapeDtypeStruct((split * kernel.split_k * kernel.block_m * kernel.block_n,),
                              np.float32)


def ag_grid(m: int, n: int, world: int, kernel: KernelConfig, num_sms: int):
  """(row tiles of a shard, column tiles, mover CTAs, CTAs, output tiles) of an AG+GEMM launch
  (both engines; pack_shards: a shard is one row tile's part, the tiles cover the gathered rows).

  tl: the movers are CTAs of their own, which compute only after pushing (split-K: a work unit
  per part of a tile); gluon: the mover is a warp of a computing CTA
  (kernels/gluon_ag_gemm.py), in the first num_comm CTAs."""
  tm, tn = math.ceil(m / kernel.block_m), math.ceil(n / kernel.block_n)
  tiles = fused_tiles(world, m, n, kernel)
  if kernel.engine == "gluon":
    num_ctas = min(num_sms, tiles)
    return tm, tn, max(1, min(kernel.num_comm, num_ctas)), num_ctas, tiles
  num_comm = max(1, min(kernel.num_comm, num_sms // 2))
  return tm, tn, num_comm, min(num_sms, num_comm + work_units(kernel, tiles)), tiles


def pack(kernel: KernelConfig, op: str, rows: int, n: int) -> int:
  """Shards (op "ag") or owners ("rs") of `rows` rows per row tile of a launch with N = n
  (kernels/ag_gemm.py, gemm_rs.py PACK); ValueError, naming the launcher, where the config's
  packing cannot run it (select.packed_unsupported)."""
  if not kernel.pack_shards:
    return 1
  why = packed_unsupported(kernel, rows, n, op)
  if why:
    raise ValueError(f"launch_{'ag_gemm' if op == 'ag' else 'gemm_rs'}: {why}")
  return kernel.block_m // rows


def rs_grid(m: int, n: int, world: int, kernel: KernelConfig, num_sms: int):
  """(rows out, row tiles of an owner, column tiles, CTAs, output tiles) of a GEMM+RS launch
  (both engines; split-K: a work unit per part of a tile; pack_shards: the tiles cover every
  owner's rows, several owners per row tile)."""
  m_out = m // world
  tm, tn = math.ceil(m_out / kernel.block_m), math.ceil(n / kernel.block_n)
  tiles = fused_tiles(world, m_out, n, kernel)
  return m_out, tm, tn, min(num_sms, work_units(kernel, tiles)), tiles


def b_cols(a, b) -> int:
  """N of a launch's b: fp8 kernels take b K-major as [N, K] (wgmma reads fp8 B K-major only),
  the others [K, N]."""
  return b.shape[0] if fp8.is_fp8(a.dtype) else b.shape[1]


def with_scale(table_row, scale, world: int):
  """An fp8 launch's table row with the f32 bits of its epilogue scale in the first word of the
  last pair (kernels/sync.py's epilogue_scale reads it; the word is otherwise unused)."""
  bits = lax.bitcast_convert_type(lax.convert_element_type(scale, np.float32), np.uint32)
  return table_row.at[2 * world].set(bits.reshape(()))


def operand_descs(a, b, kernel: KernelConfig, layout=None):
  """TMA descriptors of a launch's operands, made on the host (jax-triton's TensorDescriptor:
  jaxlib encodes each with its buffer's address into the launch's parameters), so that no CTA
  makes them before its first loads (~0.7 us each on the device, docs/NOTES.md): a [M, K] in
  [block_m, block_k] boxes, b [K, N] in [block_k, block_n] boxes (fp8: b is [N, K], b_cols,
  boxes [block_n, block_k]).  layout(block_shape, dtype): the shared-memory layout a Gluon
  kernel declares for a descriptor (None: Triton chooses, for `tl` kernels)."""
  from jax_autooverlap._compat import import_jax_triton
  jt = import_jax_triton()

  def desc(x, shape, strides, block):
    return jt.TensorDescriptor(x, shape, strides, block,
                               layout=None if layout is None else layout(block, x.dtype))
  (m, k), bm, bn, bk = a.shape, kernel.block_m, kernel.block_n, kernel.block_k
  n = b_cols(a, b)
  b_desc = (desc(b, (n, k), (k, 1), (bn, bk)) if fp8.is_fp8(a.dtype)
            else desc(b, (k, n), (n, 1), (bk, bn)))
  return desc(a, (m, k), (k, 1), (bm, bk)), b_desc
