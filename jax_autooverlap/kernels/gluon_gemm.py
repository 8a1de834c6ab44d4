"""Plain persistent GEMM on the Gluon engine: c[M, N] = a[M, K] @ b[K, N].

The fused kernels' compute path without communication: the engine's
reference point against cuBLAS (loopback and GPU tests) and its compile
check.  Static persistent schedule (tile t on CTA t % NUM_CTAS), GROUP_M
tile rows at a time over all tile columns (L2 reuse of b).  fp8 operands: b is [N, K]
(gluon_engine.py), the product is not scaled.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels import gluon_trace as trace
from jax_autooverlap.kernels.gemm_rs import tile_of


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              K: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_CTAS: gl.constexpr):
  BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = eng.b_block_n(b_desc.block_type.shape, b_desc.dtype)
  it = 0
  j = 0
  for t in range(gl.program_id(0), TM * TN, NUM_CTAS):
    eng.publish_tile(tiles, tile_ready, tile_free, j, t)
    j += 1
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    it = eng.load_tile(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs, b_bufs, ready, empty, it)
  eng.publish_tile(tiles, tile_ready, tile_free, j, TM * TN)  # no more tiles


@gluon.jit
def _consumers(c_ptr, M: gl.constexpr, N: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, c_smem, a_bufs, b_bufs, ready, empty,
               tiles, tile_ready, tile_free, trace_ptr, K: gl.constexpr, TM: gl.constexpr,
               TN: gl.constexpr, GROUP_M: gl.constexpr, TRACE: gl.constexpr):
  """The consumers make the output's descriptor themselves: it is first used at their first
  epilogue, and made here it does not hold up the producer's first loads."""
  OUT_N: gl.constexpr = c_smem.shape[1]  # the epilogue buffer's columns (eng.out_block_n)
  c_desc = eng.make_desc(c_ptr, [M, N], [N, 1], [BLOCK_M, OUT_N])
  eng.compute_and_store(c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                        tile_free, None, trace_ptr, K, 1, TM, TN, GROUP_M, TRACE)


@lean_launch
@gluon.jit
def gluon_gemm_kernel(a_desc, b_desc, c_ptr, trace_ptr, scratch_ptr,
                      M: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      NUM_CTAS: gl.constexpr, TRACE: gl.constexpr):
  """a_desc, b_desc: host-made descriptors of a [M, K] and b [K, N] (fp8: [N, K])."""
  trace.kernel_entry(trace_ptr, TRACE)
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(a_desc, b_desc, STAGES)
  OUT_N: gl.constexpr = eng.out_block_n(BLOCK_N, c_ptr.dtype.element_ty)
  c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, OUT_N],
                                     eng.shared_layout([BLOCK_M, OUT_N], c_ptr.dtype.element_ty))
  TM: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  gl.warp_specialize([
      (_consumers, (c_ptr, M, N, BLOCK_M, BLOCK_N, c_smem, a_bufs, b_bufs, ready, empty, tiles,
                    tile_ready, tile_free, trace_ptr, K, TM, TN, GROUP_M, TRACE)),
      (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                   K, TM, TN, GROUP_M, NUM_CTAS)),
  ], [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])
  trace.kernel_exit(trace_ptr, TRACE)
