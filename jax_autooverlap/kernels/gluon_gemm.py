"""Plain persistent GEMM on the Gluon engine: c[M, N] = a[M, K] @ b[K, N].

The fused kernels' compute path without communication: the engine's
reference point against cuBLAS (loopback and GPU tests) and its compile
check.  Static persistent schedule (tile t on CTA t % NUM_CTAS), GROUP_M
tile rows at a time over all tile columns (L2 reuse of b).  STREAM_K: the
last partial wave's work split evenly over the CTAs (kernels/gluon_stream_k.py;
a prototype, not yet measured on a GPU); its partial sums pass through
`part` in the output dtype, so split tiles round once more than others.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels import gluon_trace as trace
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_stream_k import whole_tiles
from jax_autooverlap.kernels.gluon_sync import full_write_wait
from jax_autooverlap.kernels.sync import fence_proxy_async, globaltimer, ld_acquire_sys, trap

SK_TIMEOUT_NS = gl.constexpr(2_000_000_000)  # an owner's wait for its tile's tail (same GPU)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              K: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_CTAS: gl.constexpr, STREAM_K: gl.constexpr = False):
  BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
  it = 0
  j = 0
  for t in range(gl.program_id(0), whole_tiles(TM * TN, NUM_CTAS, STREAM_K), NUM_CTAS):
    eng.publish_tile(tiles, tile_ready, tile_free, j, t)
    j += 1
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    it = eng.load_tile(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs, b_bufs, ready, empty, it)
  eng.publish_tile(tiles, tile_ready, tile_free, j, TM * TN)  # no more whole tiles
  if STREAM_K:  # then this CTA's pieces of the tail (kernels/gluon_stream_k.py)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    KB: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    g, end = _sk_share(TM * TN, KB, NUM_CTAS)
    while g < end:
      j += 1
      t, k0, k1 = _sk_piece(g, end, TM * TN, KB, NUM_CTAS)
      eng.publish_tile(tiles, tile_ready, tile_free, j, t)
      _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
      it = eng.load_tile(a_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, k1 * BLOCK_K, a_bufs, b_bufs,
                         ready, empty, it, k0 * BLOCK_K)
      g += k1 - k0


@gluon.jit
def _consumer(c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              trace_ptr, K: gl.constexpr, BLOCK_K: gl.constexpr, TM: gl.constexpr,
              TN: gl.constexpr, GROUP_M: gl.constexpr, TRACE: gl.constexpr, stream_k=None,
              NUM_CTAS: gl.constexpr = 0):
  """stream_k = (part_desc, part_bar, flags_ptr): after the whole tiles, this CTA's pieces of
  the tail (_tail_pieces)."""
  BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
  trace.start(trace_ptr, TRACE)
  it = 0
  j = 0
  t = eng.next_tile(tiles, tile_ready, tile_free, j)
  while t < TM * TN:
    trace.stamp(trace_ptr, j, t, trace.GOT_TILE, TRACE)
    acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, BLOCK_M, BLOCK_N)
    trace.stamp(trace_ptr, j, t, trace.MAIN_DONE, TRACE)
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    eng.stage_out(acc.to(c_desc.dtype), c_smem)
    eng.tma_store(c_desc, [tm * BLOCK_M, tn * BLOCK_N], c_smem)
    trace.stamp(trace_ptr, j, t, trace.EPILOGUE_DONE, TRACE)
    j += 1
    t = eng.next_tile(tiles, tile_ready, tile_free, j)
  if stream_k is not None:
    _tail_pieces(c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, it,
                 j + 1, stream_k, K, BLOCK_K, TM, TN, GROUP_M, NUM_CTAS)
  eng.finish_partition()
  trace.end(trace_ptr, TRACE)


@gluon.jit
def _sk_share(T: gl.constexpr, KB: gl.constexpr, NUM_CTAS: gl.constexpr):
  """This CTA's [g, end) of the tail's k-blocks (gluon_stream_k.pieces says the same)."""
  WORK: gl.constexpr = (T - whole_tiles(T, NUM_CTAS, True)) * KB
  pid = gl.program_id(0)
  return pid * WORK // NUM_CTAS, (pid + 1) * WORK // NUM_CTAS


@gluon.jit
def _sk_piece(g, end, T: gl.constexpr, KB: gl.constexpr, NUM_CTAS: gl.constexpr):
  """(tile, first k-block, end k-block) of the piece starting at tail k-block g of [g, end)."""
  k0 = g % KB
  return whole_tiles(T, NUM_CTAS, True) + g // KB, k0, gl.minimum(KB, k0 + end - g)


@gluon.jit
def _tail_pieces(c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, it, j,
                 stream_k, K: gl.constexpr, BLOCK_K: gl.constexpr, TM: gl.constexpr,
                 TN: gl.constexpr, GROUP_M: gl.constexpr, NUM_CTAS: gl.constexpr):
  """Consumers, stream-K: this CTA's pieces of the tail, from the j-th published tile on.  A
  tile's tail piece (this CTA's first piece, k0 > 0) goes to part[pid] and is released on
  flags[pid]; its head piece (this CTA's last, k0 = 0, k1 < KB) waits for flags[pid + 1],
  adds part[pid + 1] and runs the tile's epilogue."""
  part_desc, part_bar, flags_ptr = stream_k
  BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
  KB: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
  pid = gl.program_id(0)
  g, end = _sk_share(TM * TN, KB, NUM_CTAS)
  while g < end:
    t, k0, k1 = _sk_piece(g, end, TM * TN, KB, NUM_CTAS)
    eng.next_tile(tiles, tile_ready, tile_free, j)  # == t
    j += 1
    acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, k1 * BLOCK_K, BLOCK_K, BLOCK_M,
                           BLOCK_N, k_first=k0 * BLOCK_K)
    if k0 > 0:  # the tail of a tile whose head the previous CTA runs: hand it over
      eng.stage_out(acc.to(c_desc.dtype), c_smem)
      eng.tma_store(part_desc, [pid * BLOCK_M, 0], c_smem)
      full_write_wait()
      tl.debug_barrier()
      gl.atomic_add(flags_ptr + pid, 1, sem="release", scope="gpu")
    else:
      if k1 < KB:  # the head of a tile whose tail the next CTA ran first: add it
        _wait_flag(flags_ptr + pid + 1, SK_TIMEOUT_NS)
        eng.load_epilogue_source((part_desc, (pid + 1) * BLOCK_M, 0, c_smem, part_bar))
        mbarrier.wait(part_bar, 0)  # at most one head piece per CTA: phase 0
        acc += c_smem.load(acc.type.layout).to(gl.float32)
        tl.debug_barrier()  # every warp has read the partial before stage_out rewrites it
      _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
      eng.stage_out(acc.to(c_desc.dtype), c_smem)
      eng.tma_store(c_desc, [tm * BLOCK_M, tn * BLOCK_N], c_smem)
    g += k1 - k0


@gluon.jit
def _wait_flag(ptr, TIMEOUT_NS: gl.constexpr):
  """Every thread: spin (acquire) until *ptr >= 1, bounded (trap: the call fails, no hang);
  then order the generic-proxy acquire before the TMA load of what it guards."""
  seen = ld_acquire_sys(ptr)
  if seen < 1:
    start = globaltimer()
    while seen < 1:
      seen = ld_acquire_sys(ptr)
      if globaltimer() - start > TIMEOUT_NS:
        trap()
  fence_proxy_async()
  tl.debug_barrier()


@lean_launch
@gluon.jit
def gluon_gemm_kernel(a_ptr, b_ptr, c_ptr, part_ptr, flags_ptr, trace_ptr, scratch_ptr,
                      M: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      NUM_CTAS: gl.constexpr, TRACE: gl.constexpr, STREAM_K: gl.constexpr):
  a_desc = eng.make_desc(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
  b_desc = eng.make_desc(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
  c_desc = eng.make_desc(c_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(a_desc, b_desc, STAGES)
  c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
  TM: gl.constexpr = (M + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  if STREAM_K:
    # part: [NUM_CTAS * BLOCK_M, BLOCK_N] partial tiles, one per CTA; flags: [NUM_CTAS], zeroed
    part_desc = eng.make_desc(part_ptr, [NUM_CTAS * BLOCK_M, BLOCK_N], [BLOCK_N, 1],
                              [BLOCK_M, BLOCK_N])
    part_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(part_bar, count=1)
    gl.warp_specialize([
        (_consumer, (c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     trace_ptr, K, BLOCK_K, TM, TN, GROUP_M, TRACE,
                     (part_desc, part_bar, flags_ptr), NUM_CTAS)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     K, TM, TN, GROUP_M, NUM_CTAS, STREAM_K)),
    ], [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])
  else:
    gl.warp_specialize([
        (_consumer, (c_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     trace_ptr, K, BLOCK_K, TM, TN, GROUP_M, TRACE)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     K, TM, TN, GROUP_M, NUM_CTAS)),
    ], [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])
