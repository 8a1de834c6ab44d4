"""Experiment: the engine's plain GEMM with its epilogue spread over the next tile's main loop.

Why: the cooperative engine is 1.0-4.5 % slower than cuBLAS on the eight local shapes, and
the time goes to writing the output: on one H200 the engine with its tiles staged into shared
memory but not TMA-stored ran 1.0-5 % faster, at or below cuBLAS (bench/NOTES.md, seventh
session, diagnostics of a first version of this kernel).  Spreading the TMA stores over the
next tile's first k-blocks (SPREAD parts, STORE_LSU False) gained nothing there.  STORE_LSU
writes each staged part with ordinary coalesced 16-byte stores from the consumer threads
(shared memory -> registers -> global, no TMA) instead: whether the TMA store's cost is the
TMA unit's (which also issues the operand loads) or the writes' (L2, DRAM).

Schedule (consumers; the producer is gluon_gemm's): tile j's result stays in registers in the
output dtype (64 registers beside the next accumulator) while tile j + 1's main loop starts;
while k-block p's wgmma runs, column part p of tile j is staged into shared-memory buffer p
and stored.  The last tile's parts go out after the loop.

Invariants (besides gluon_engine's stage/phase walk, unchanged):
- Buffer p is rewritten one tile after it was last read.  TMA stores: before writing part p,
  at most p bulk stores may be pending (this tile's parts 0..p-1; groups complete in order),
  so the previous tile's store of buffer p has read it.  LSU stores: the buffer is read back
  by the same threads between two partition barriers, a tile before it is rewritten.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma_wait)

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_gemm import _producer


@gluon.jit
def _column_halves(x):
  """The [M, N] tile x (accumulator layout) as its two [M, N / 2] column halves: the wgmma
  layout keeps column c of a thread's rows in its register c / 8, so each half is a subset of
  the thread's registers (no data moves)."""
  M: gl.constexpr = x.shape[0]
  N: gl.constexpr = x.shape[1]
  return x.reshape([M, 2, N // 2]).permute([0, 2, 1]).split()


@gluon.constexpr_function
def _row_major(cols, num_warps):
  """Coalesced layout of a [rows, cols] part: 8 consecutive 16-bit elements (16 bytes) per
  thread, a warp covering whole rows."""
  lanes = cols // 8
  return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.jit
def _write_part(x, c_desc, c_ptr, row, col, c_parts, P: gl.constexpr, PARTS: gl.constexpr,
                M: gl.constexpr, N: gl.constexpr, STORE_LSU: gl.constexpr):
  """Stage column part P of the finished tile x (output dtype) into buffer P and store it at
  [row, col + P * width]: by TMA, or (STORE_LSU) read back coalesced and stored by the threads."""
  if PARTS == 1:
    parts = (x,)
  elif PARTS == 2:
    lo, hi = _column_halves(x)
    parts = (lo, hi)
  else:
    gl.static_assert(PARTS == 4, "spread epilogue: 1, 2 or 4 parts")
    lo, hi = _column_halves(x)
    l0, l1 = _column_halves(lo)
    h0, h1 = _column_halves(hi)
    parts = (l0, l1, h0, h1)
  W: gl.constexpr = c_desc.block_type.shape[1]
  if not STORE_LSU:
    tma.store_wait(P)
  tl.debug_barrier()
  c_parts.index(P).store(parts[P])
  if STORE_LSU:
    tl.debug_barrier()
    layout: gl.constexpr = _row_major(W, eng.NUM_WARPS)
    vals = c_parts.index(P).load(layout)
    rows = gl.expand_dims(row + gl.arange(0, c_desc.block_type.shape[0],
                                          layout=gl.SliceLayout(1, layout)), 1)
    cols = gl.expand_dims(col + P * W + gl.arange(0, W, layout=gl.SliceLayout(0, layout)), 0)
    gl.store(c_ptr + rows * N + cols, vals, mask=(rows < M) & (cols < N))
  else:
    fence_async_shared()
    tl.debug_barrier()
    eng.tma_store(c_desc, [row, col + P * W], c_parts.index(P))


@gluon.jit
def _consumer(c_desc, c_ptr, c_parts, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              M: gl.constexpr, K: gl.constexpr, N: gl.constexpr, BLOCK_K: gl.constexpr,
              TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr, PARTS: gl.constexpr,
              STORE_LSU: gl.constexpr):
  BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = c_desc.block_type.shape[1] * PARTS
  STAGES: gl.constexpr = a_bufs.shape[0]
  gl.static_assert((K + BLOCK_K - 1) // BLOCK_K >= PARTS, "spread epilogue: fewer k-blocks than parts")
  layout: gl.constexpr = eng.mma_layout(BLOCK_N, BLOCK_M // 16, a_bufs.dtype)
  prev = gl.zeros([BLOCK_M, BLOCK_N], c_desc.dtype, layout)
  row = 0
  col = 0
  it = 0
  j = 0
  t = eng.next_tile(tiles, tile_ready, tile_free, j)
  while t < TM * TN:
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    for p in gl.static_range(PARTS):   # the first PARTS k-blocks, each beside a part of tile j - 1
      acc = eng.mma_k_block(a_bufs, b_bufs, ready, acc, it)
      if j > 0:
        _write_part(prev, c_desc, c_ptr, row, col, c_parts, p, PARTS, M, N, STORE_LSU)
      tl.debug_barrier()   # every warpgroup is past k-block it - 1 before its stage goes back
      if p > 0:
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
      it += 1
    for k in range(PARTS * BLOCK_K, K, BLOCK_K):
      acc = eng.mma_k_block(a_bufs, b_bufs, ready, acc, it)
      tl.debug_barrier()
      mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
      it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    tl.debug_barrier()
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    prev = acc.to(c_desc.dtype)
    row = tm * BLOCK_M
    col = tn * BLOCK_N
    j += 1
    t = eng.next_tile(tiles, tile_ready, tile_free, j)
  if j > 0:
    for p in gl.static_range(PARTS):
      _write_part(prev, c_desc, c_ptr, row, col, c_parts, p, PARTS, M, N, STORE_LSU)
  eng.finish_partition()


@lean_launch
@gluon.jit
def gluon_gemm_spread_kernel(a_ptr, b_ptr, c_ptr, scratch_ptr,
                             M: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             NUM_CTAS: gl.constexpr, PARTS: gl.constexpr,
                             STORE_LSU: gl.constexpr):
  """c = a @ b as gluon_gemm_kernel, the epilogue in PARTS (1, 2, 4) column parts spread over
  the next tile's first k-blocks, stored by TMA or (STORE_LSU) by the consumer threads."""
  a_desc = eng.make_desc(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
  b_desc = eng.make_desc(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
  c_desc = eng.make_desc(c_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N // PARTS])
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(a_desc, b_desc, STAGES)
  c_parts = gl.allocate_shared_memory(c_desc.dtype, [PARTS, BLOCK_M, BLOCK_N // PARTS], c_desc.layout)
  TM: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  gl.warp_specialize([
      (_consumer, (c_desc, c_ptr, c_parts, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                   tile_free, M, K, N, BLOCK_K, TM, TN, GROUP_M, PARTS, STORE_LSU)),
      (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                   K, TM, TN, GROUP_M, NUM_CTAS)),
  ], [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])
