"""Experiment: the engine's plain GEMM with its two consumer warpgroups as two partitions
(bench/NOTES.md, "Two warpgroup partitions"); the fused kernels do not use it yet.

The engine's consumers (gluon_engine.mma_tile) are one 8-warp partition: the two warpgroups
(64 rows of the 128-row tile each) meet at a barrier after every k-block and so run their
epilogues at the same time, with the tensor cores idle (~1.1 kcycles per tile, measured).
Here each warpgroup is its own partition over the same operand ring and tile ring: each hands
back every stage and takes every tile number (those barriers count two arrivals), and has its
own 64-row epilogue buffer and TMA store, so neither waits for the other except through the
stages they share.  The operand traffic is the engine's (one 128 x 256 tile per CTA, each B
k-block read by both warpgroups).  Measured on one H200 (bench/NOTES.md): 0.1-0.9 % faster
than the engine, most at K = 2048 and on the 31-wave shape; starting warpgroup 1 0, 1 or 2
k-blocks behind warpgroup 0 changed nothing measurable (the shared stages keep them in step).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_gemm import _producer

WG_WARPS = gl.constexpr(4)
WG_REGS = gl.constexpr(224)


@gluon.jit
def _warpgroup(WG: gl.constexpr, c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
               tile_free, K: gl.constexpr, BLOCK_K: gl.constexpr, TM: gl.constexpr,
               TN: gl.constexpr, GROUP_M: gl.constexpr):
  """Warpgroup WG: rows [64 WG, 64 WG + 64) of every tile, from the shared operand ring."""
  ROWS: gl.constexpr = c_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
  it = 0
  j = 0
  t = eng.take(tiles, tile_ready, tile_free, j, WG_WARPS)
  while t < TM * TN:
    acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, ROWS, BLOCK_N,
                           ROW0=WG * ROWS)
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    eng.stage_out(acc.to(c_desc.dtype), c_smem)
    eng.tma_store(c_desc, [tm * 2 * ROWS + WG * ROWS, tn * BLOCK_N], c_smem)
    j += 1
    t = eng.take(tiles, tile_ready, tile_free, j, WG_WARPS)
  eng.finish_partition()


@lean_launch
@gluon.jit
def gluon_gemm_wg_kernel(a_ptr, b_ptr, c_ptr, scratch_ptr,
                         M: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CTAS: gl.constexpr):
  gl.static_assert(BLOCK_M == 2 * 16 * WG_WARPS, "two warpgroups of 64 rows")
  a_desc = eng.make_desc(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
  b_desc = eng.make_desc(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
  c_desc = eng.make_desc(c_ptr, [M, N], [N, 1], [BLOCK_M // 2, BLOCK_N])
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(
      a_desc, b_desc, STAGES, 2)
  c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], c_desc.layout)
  TM: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  gl.warp_specialize([
      (_warpgroup, (0, c_desc, c_smem.index(0), a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                    tile_free, K, BLOCK_K, TM, TN, GROUP_M)),
      (_warpgroup, (1, c_desc, c_smem.index(1), a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                    tile_free, K, BLOCK_K, TM, TN, GROUP_M)),
      (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                   K, TM, TN, GROUP_M, NUM_CTAS)),
  ], [WG_WARPS, eng.PRODUCER_WARPS], [WG_REGS, eng.PRODUCER_REGS])
