"""Warp-specialised GEMM engine in Gluon (sm_90): the building blocks of every Gluon kernel.

One persistent CTA per SM runs two partitions (`gl.warp_specialize`):
- the producer, one warp: claims output tiles from the kernel's per-call
  tile counter, publishes each tile number in a two-slot tile ring (shared
  memory + mbarriers), runs the kernel's hook for the tile (ag: wait for the
  rows' chunk), then TMA-loads the tile's A and B k-blocks into a STAGES-deep
  ring of shared-memory buffers, each guarded by a ready/empty mbarrier pair;
- the consumers, the kernel's default partition of consumer_warps(BLOCK_M)
  warps (a warpgroup per 64 rows of the tile: two for the 128-row tile, one
  for a 64-row tile; the kernel's num_warps): take the next tile number from the tile
  ring, run async `warpgroup_mma` over the k-blocks with one MMA group in
  flight (a stage is handed back to the producer once the MMA after it has
  been issued, i.e. once the MMA reading it has completed), then run the
  kernel's epilogue, which writes the tile through one shared-memory buffer
  with TMA stores whose wait is deferred to the next tile's epilogue
  (compute_and_store: the whole consumer side of the kernels whose epilogue
  only stores, the GEMM alone and AG+GEMM).

Invariants:
- Producer and consumers walk the same sequence of (tile, k-block) stages, so
  stage s = it % STAGES and its phase (it // STAGES) & 1 agree on both sides.
- mbarrier phases: a barrier completes phase 0 first; a fresh barrier counts
  as having completed the phase before it, so the producer's first wait on an
  empty stage (phase 1) passes at once.
- The epilogue buffer is rewritten only after `store_wait(0)` of the
  previous tile's TMA store (its shared-memory reads are done).
- Every shared-memory write by the generic proxy that the async proxy (TMA,
  wgmma) reads afterwards is followed by `fence_async_shared()`.

fp8 operands (e4m3/e5m2, any pairing): wgmma reads an fp8 B operand K-major only, so fp8
kernels take b as [N, K] (K contiguous); its [BLOCK_N, BLOCK_K] stages are fed to wgmma as a
transposed view (`b_kmajor`), and an fp8 wgmma is k32 (mma_layout).  Their epilogues multiply
the f32 accumulator by the launch's scale (kernels/sync.py's epilogue_scale).

Gluon renamed its TMA copies between triton 3.6 (async_copy_global_to_shared,
async_copy_shared_to_global) and 3.7+ (async_load, async_store); `tma_load`
and `tma_store` below are whichever this triton has.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from jax_autooverlap.kernels import gluon_trace as trace
from jax_autooverlap.kernels.gemm_rs import tile_of

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

NUM_WARPS = gl.constexpr(8)       # consumers of a 128-row tile: two warpgroups
PRODUCER_WARPS = gl.constexpr(1)
# The producer holds scalars (tile decode, 64-bit addresses, the bounded wait); setmaxnreg
# gives the rest of the register file to the consumers (224 per thread with 8 + 4 warps).
PRODUCER_REGS = gl.constexpr(56)
TILE_RING = gl.constexpr(2)       # tile numbers in flight between producer and consumers
SOURCE_AT = 4


@gluon.constexpr_function
def source_block(k_blocks):
  """The k-block behind whose MMA mma_tile loads its source: the 5th (by then the previous
  tile's TMA store has read the epilogue buffer), or the tile's last where it has fewer."""
  return min(SOURCE_AT, k_blocks - 1)


@gluon.constexpr_function
def consumer_warps(block_m):
  """Warps of a consumer partition computing block_m rows of each tile: a warpgroup (4 warps,
  16 rows each) per 64 rows, one m64 wgmma per warpgroup (KernelConfig: num_warps = block_m /
  16 for the Gluon engine)."""
  return block_m // 16


@gluon.constexpr_function
def mma_layout(block_n, num_warps, dtype):
  """Accumulator layout: warps stacked along M (16 rows each), so each warpgroup issues wgmma
  m64 x n{block_n} x k(256 / bits of the operand dtype: 16 for bf16/f16, 8 for tf32)."""
  return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                   instr_shape=[16, block_n, 256 // dtype.primitive_bitwidth])


@gluon.constexpr_function
def b_kmajor(dtype):
  """Is b K-major ([N, K], stages [BLOCK_N, BLOCK_K]): fp8 operands."""
  return dtype.is_fp8()


@gluon.constexpr_function
def b_block_n(block_shape, dtype):
  """BLOCK_N of a b tile (or stage ring) shape, whose last two dims are [BLOCK_K, BLOCK_N], or
  [BLOCK_N, BLOCK_K] where b is K-major."""
  return block_shape[-2] if dtype.is_fp8() else block_shape[-1]


@gluon.constexpr_function
def out_block_n(block_n, out_dtype):
  """Columns of the store-only kernels' epilogue buffer (compute_and_store): a 4-byte output
  tile of 256 columns or more is written in two column halves through a buffer of half its
  width (64 KB at 128x256, the bytes of a 16-bit tile), so it fits beside the operand stages
  (select.shared_memory counts the same)."""
  block_n = getattr(block_n, "value", block_n)
  out_dtype = getattr(out_dtype, "value", out_dtype)
  return block_n // 2 if out_dtype.primitive_bitwidth == 32 and block_n >= 256 else block_n


@gluon.constexpr_function
def shared_layout(block_shape, dtype):
  return gl.NVMMASharedLayout.get_default_for(block_shape, dtype)


@gluon.constexpr_function
def row_layout(num_warps):
  """A 1-element-per-thread layout for small int32 vectors in shared memory (the tile ring)."""
  return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.jit
def make_desc(base, shape, strides, block_shape: gl.constexpr):
  """Device-side TMA descriptor with the default NVMMA swizzle for its block."""
  return tma.make_tensor_descriptor(base, shape=shape, strides=strides, block_shape=block_shape,
                                    layout=shared_layout(block_shape, base.dtype.element_ty))


@gluon.jit
def alloc_pipeline(a_desc, b_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 1):
  """Shared-memory operand ring and its ready/empty mbarriers, plus the tile ring (CONSUMERS:
  partitions that each hand back every stage and take every tile number)."""
  a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
  b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
  ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
  empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
  for s in gl.static_range(STAGES):
    mbarrier.init(ready.index(s), count=1)
    mbarrier.init(empty.index(s), count=CONSUMERS)
  tiles, tile_ready, tile_free = alloc_ring(gl.int32, CONSUMERS)
  return a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free


@gluon.jit
def alloc_ring(dtype: gl.constexpr, TAKERS: gl.constexpr = 1):
  """A two-slot ring of scalars between partitions of a CTA (the tile ring; RS's releases for
  its signaller): slots in shared memory, a ready and a free mbarrier per slot (a slot is free
  again once each of TAKERS partitions has taken it)."""
  box = gl.allocate_shared_memory(dtype, [TILE_RING, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
  ready = gl.allocate_shared_memory(gl.int64, [TILE_RING, 1], mbarrier.MBarrierLayout())
  free = gl.allocate_shared_memory(gl.int64, [TILE_RING, 1], mbarrier.MBarrierLayout())
  for s in gl.static_range(TILE_RING):
    mbarrier.init(ready.index(s), count=1)
    mbarrier.init(free.index(s), count=TAKERS)
  return box, ready, free


@gluon.jit
def post(box, ready, free, n, value, WARPS: gl.constexpr):
  """Sender (a partition of WARPS warps): the n-th value into the ring.  The mbarrier arrive
  releases (CTA scope) what every sender thread did before the barrier to the taker."""
  slot = n % TILE_RING
  mbarrier.wait(free.index(slot), ((n // TILE_RING) & 1) ^ 1)
  box.index(slot).store(gl.full([1], value, box.dtype, row_layout(WARPS)))
  tl.debug_barrier()  # whichever lane stored, before the (single-thread) release by arrive
  mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def take(box, ready, free, n, WARPS: gl.constexpr):
  """Taker (a partition of WARPS warps): the n-th value posted, the same in every thread."""
  slot = n % TILE_RING
  mbarrier.wait(ready.index(slot), (n // TILE_RING) & 1)
  value = gl.max(box.index(slot).load(row_layout(WARPS)), axis=0)
  # every taker warp has read the slot before it is handed back
  tl.debug_barrier()
  mbarrier.arrive(free.index(slot), count=1)
  return value


@gluon.jit
def first_tile():
  """Producer: the first tile of a CTA is its program id (every CTA is resident and the grid
  is at most the tile count), so it starts without the per-call counter, whose address
  depends on the call's epoch; claim_tile hands out the rest."""
  return gl.program_id(0)


@gluon.jit
def claim_tile(tile_counter, NUM_CTAS: gl.constexpr):
  """Producer: the next tile, dynamically (a CTA that finishes early takes more): tiles
  [0, NUM_CTAS) went out statically, the per-call counter (zero at the call's start) counts
  the rest."""
  return claimed_tile(claim_start(tile_counter), NUM_CTAS)


@gluon.jit
def claim_start(tile_counter):
  """Producer (one warp): claim_tile in two halves, so that the atomic's round trip overlaps
  with what the producer does before it needs the tile (its current tile's loads).  Lane 0
  adds 1 to the counter; the old value is in lane 0 only until claimed_tile broadcasts it
  (gl.atomic_add would broadcast, and so wait for it, at once)."""
  return tl.inline_asm_elementwise(
      "{ .reg .pred p; .reg .b32 lane; mov.u32 lane, %laneid; setp.eq.u32 p, lane, 0; "
      "mov.u32 $0, 0; @p atom.global.gpu.relaxed.add.u32 $0, [$1], 1; }",
      "=r,l", [tile_counter], dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def claimed_tile(claim, NUM_CTAS: gl.constexpr):
  """Producer: the tile number of a claim_start, the same in every lane."""
  gl.static_assert(PRODUCER_WARPS == 1, "claim_start/claimed_tile assume a one-warp producer")
  return NUM_CTAS + tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r",
                                              [claim], dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def publish_tile(tiles, tile_ready, tile_free, j, t):
  """Producer: hand tile number t (the j-th this CTA claimed) to the consumers."""
  post(tiles, tile_ready, tile_free, j, t, PRODUCER_WARPS)


@gluon.jit
def next_tile(tiles, tile_ready, tile_free, j, WARPS: gl.constexpr):
  """Consumers (WARPS warps): the j-th tile number the producer published (>= the call's tile
  count: done)."""
  return take(tiles, tile_ready, tile_free, j, WARPS)


@gluon.jit
def load_tile(a_desc, row0, b_desc, col0, K, a_bufs, b_bufs, ready, empty, it):
  """Producer: TMA-load the k-blocks of one tile into the operand ring from stage counter it on."""
  STAGES: gl.constexpr = a_bufs.shape[0]
  BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
  nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
  for k in range(0, K, BLOCK_K):
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    tma_load(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
    if b_kmajor(b_desc.dtype):
      tma_load(b_desc, [col0, k], ready.index(s), b_bufs.index(s))
    else:
      tma_load(b_desc, [k, col0], ready.index(s), b_bufs.index(s))
    it += 1
  return it


@gluon.jit
def mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, source=None, load_source=False, ROW0: gl.constexpr = 0):
  """Consumers: acc[BLOCK_M, BLOCK_N] (fp32) of one tile from the operand ring; new stage counter.

  BLOCK_M rows of each A stage from row ROW0: the whole stage (the engine's 8-warp consumer
  partition), or one warpgroup's 64 rows (a partition per warpgroup: GEMM+RS with WG_PARTS = 2,
  kernels/gluon_gemm_rs.py; the empty barriers then count one arrival per partition).

  One wgmma group stays in flight: after issuing k-block i's MMA, waiting for
  at most one outstanding group means k-block i-1's MMA is done, so its stage
  goes back to the producer.  The last stage goes back after the final wait.
  The stage handed back is derived from the loop-carried `it` alone: Triton
  carries a name through a loop only if its value differs from the one it
  entered with, so a `prev = it` copy made at the top of the loop body is
  silently frozen at its entry value (every release then went to one stage,
  the others were never freed, and the producer hung).

  source = (desc, row, col, c_smem, bar): where load_source (the same in every
  thread), the epilogue's source tile desc[row:, col:] is TMA-loaded into the
  epilogue buffer c_smem (completion on bar) during the main loop, behind the
  MMA of k-block SOURCE_AT, instead of after it (K a constexpr then).
  """
  STAGES: gl.constexpr = a_bufs.shape[0]
  acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout(BLOCK_N, BLOCK_M // 16, a_bufs.dtype))
  for k in range(0, K, BLOCK_K):
    acc = mma_k_block(a_bufs, b_bufs, ready, acc, it, ROW0)
    if source is not None:
      KB: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
      if load_source and k == source_block(KB) * BLOCK_K:
        load_epilogue_source(source)
    # every warpgroup of the partition is past k-block it-1 before its stage is handed back
    tl.debug_barrier()
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
    it += 1
  acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
  tl.debug_barrier()
  # K > 0, so the loop ran and stage it-1 is the tile's last one
  mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
  return acc, it


@gluon.jit
def mma_k_block(a_bufs, b_bufs, ready, acc, it, ROW0: gl.constexpr = 0):
  """Consumers: wait for stage counter it's operands, issue its async wgmma into acc (the
  stage's A rows from ROW0, as many as acc has), and wait until at most that one group is in
  flight, i.e. the previous k-block's MMA is done and its stage may go back."""
  STAGES: gl.constexpr = a_bufs.shape[0]
  BLOCK_M: gl.constexpr = acc.shape[0]
  s = it % STAGES
  mbarrier.wait(ready.index(s), (it // STAGES) & 1)
  if BLOCK_M == a_bufs.shape[1]:
    a = a_bufs.index(s)
  else:
    a = a_bufs.index(s).slice(ROW0, BLOCK_M)
  if b_kmajor(b_bufs.dtype):
    b = b_bufs.index(s).permute((1, 0))
  else:
    b = b_bufs.index(s)
  acc = warpgroup_mma(a, b, acc, is_async=True)
  acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
  return acc


@gluon.jit
def free_epilogue_buffer():
  """Before a TMA load into the epilogue buffer: the last TMA store has read it, and every
  thread's earlier generic-proxy reads of it are ordered before the async-proxy write."""
  tma.store_wait(0)
  fence_async_shared()
  tl.debug_barrier()


@gluon.jit
def load_epilogue_source(source):
  """TMA-load source = (desc, row, col, c_smem, bars) into the epilogue buffer c_smem, in column
  blocks of desc's box width: block h (columns [h W, h W + W)) completes on bars.index(h)."""
  desc, row, col, c_smem, bars = source
  free_epilogue_buffer()
  for h in gl.static_range(c_smem.shape[1] // desc.block_type.shape[1]):
    load_epilogue_block(desc, row, col, h, c_smem, bars)


@gluon.jit
def load_epilogue_block(desc, row, col, h, c_smem, bars):
  """TMA-load column block h of desc[row:, col:] (desc's box) into its columns of c_smem, on
  bars.index(h).  The caller has freed those columns (free_epilogue_buffer, or a fence and a
  barrier after the last reads of them)."""
  W: gl.constexpr = desc.block_type.shape[1]
  mbarrier.expect(bars.index(h), desc.block_type.nbytes)
  tma_load(desc, [row, col + h * W], bars.index(h), epilogue_block(c_smem, h, W))


@gluon.jit
def epilogue_block(c_smem, h, W: gl.constexpr):
  """Columns [h W, h W + W) of the epilogue buffer (the whole buffer where W is its width)."""
  if W == c_smem.shape[1]:
    return c_smem
  else:
    return c_smem.slice(h * W, W, dim=1)


@gluon.jit
def add_partial(acc, part):
  """acc + part (f32), as an add the compiler keeps in place: a partial's adds then end before
  the barrier that frees its buffer, instead of being sunk (with the loaded values kept live
  across the following rounds) to where acc is next used (LLVM did so under triton 3.6: 264
  bytes of spills in bench/own_round.py's split modes)."""
  return gl.inline_asm_elementwise("add.f32 $0, $1, $2;", "=r,r,r", [acc, part.to(gl.float32)],
                                   dtype=gl.float32, is_pure=False, pack=1)


@gluon.constexpr_function
def _width_scaled(layout, num, den):
  """An accumulator layout (NVMMADistributedLayout) for num / den times its instr N."""
  return gl.NVMMADistributedLayout(version=layout.version, warps_per_cta=layout.warps_per_cta,
                                   instr_shape=[layout.instr_shape[0],
                                                layout.instr_shape[1] * num // den,
                                                layout.instr_shape[2]])


@gluon.jit
def _halves(acc):
  M: gl.constexpr = acc.shape[0]
  N: gl.constexpr = acc.shape[1]
  layout: gl.constexpr = _width_scaled(acc.type.layout, 1, 2)
  lo, hi = acc.reshape([M, 2, N // 2]).permute((0, 2, 1)).split()
  return gl.convert_layout(lo, layout), gl.convert_layout(hi, layout)


@gluon.jit
def split_columns(acc, PARTS: gl.constexpr):
  """acc[M, N] (mma_layout) as a tuple of PARTS (1, 2 or 4) column blocks [M, N / PARTS], each
  in mma_layout: a thread's registers are only renamed (it holds block h's columns of acc)."""
  if PARTS == 1:
    return (acc,)
  elif PARTS == 2:
    return _halves(acc)
  else:
    gl.static_assert(PARTS == 4, "PARTS: 1, 2 or 4")
    a, b = _halves(acc)
    a0, a1 = _halves(a)
    b0, b1 = _halves(b)
    return a0, a1, b0, b1


@gluon.jit
def join_columns(parts):
  """split_columns' inverse: the column blocks side by side, [M, N] in mma_layout."""
  PARTS: gl.constexpr = len(parts)
  if PARTS == 1:
    return parts[0]
  elif PARTS == 2:
    return _joined(parts[0], parts[1])
  else:
    return _joined(_joined(parts[0], parts[1]), _joined(parts[2], parts[3]))


@gluon.jit
def _joined(lo, hi):
  M: gl.constexpr = lo.shape[0]
  N: gl.constexpr = lo.shape[1] * 2
  both = gl.join(lo, hi).permute((0, 2, 1)).reshape([M, N])
  return gl.convert_layout(both, _width_scaled(lo.type.layout, 2, 1))


@gluon.jit
def stage_out(acc, c_smem):
  """Epilogue: write a finished tile (already in the output dtype) into the epilogue buffer.

  Waits first for the previous tile's TMA store to have read the buffer
  (deferred from that tile's epilogue), and fences before the TMA store
  that reads it next.
  """
  tma.store_wait(0)
  tl.debug_barrier()
  c_smem.store(acc)
  fence_async_shared()
  tl.debug_barrier()


@gluon.jit
def finish_partition():
  """Consumers at the end of the tile loop: no TMA store may still read shared memory."""
  tma.store_wait(0)


@gluon.jit
def compute_and_store(o_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                      rank, trace_ptr, K: gl.constexpr, WORLD: gl.constexpr, TM: gl.constexpr,
                      TN: gl.constexpr, GROUP_M: gl.constexpr, TRACE: gl.constexpr, scale=None):
  """The consumers of a kernel whose epilogue only stores (the GEMM alone, AG+GEMM): every tile
  the producer publishes (tile_of's order), computed and TMA-stored into o_desc, which is
  [rows, cols] where rank is None (the GEMM, WORLD = 1), else [src, rows, cols] (AG+GEMM: the
  tile of step s is source rank (rank - s) mod WORLD's; a ragged last tile row of a shard is
  clipped at its end).  c_smem: the epilogue buffer, out_block_n columns wide (a 4-byte tile
  of 256 columns goes out in two column halves).  trace_ptr: the timeline (gluon_trace.py)
  where TRACE.  scale (fp8): what the f32 accumulator is multiplied by before the output cast
  (None: nothing)."""
  BLOCK_M: gl.constexpr = a_bufs.shape[1]
  BLOCK_K: gl.constexpr = a_bufs.shape[2]
  BLOCK_N: gl.constexpr = b_block_n(b_bufs.shape, b_bufs.dtype)
  W: gl.constexpr = c_smem.shape[len(c_smem.shape) - 1]  # the epilogue buffer's columns
  WARPS: gl.constexpr = consumer_warps(BLOCK_M)
  trace.start(trace_ptr, TRACE)
  it = 0
  j = 0
  t = next_tile(tiles, tile_ready, tile_free, j, WARPS)
  while t < WORLD * TM * TN:
    trace.stamp(trace_ptr, j, t, trace.GOT_TILE, TRACE)
    acc, it = mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, BLOCK_M, BLOCK_N)
    trace.stamp(trace_ptr, j, t, trace.MAIN_DONE, TRACE)
    step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
    if scale is not None:
      acc = acc * scale
    # the tile in column parts of the epilogue buffer's width (out_block_n), each staged once
    # the previous part's store has read the buffer (stage_out)
    parts = split_columns(acc, BLOCK_N // W)
    for h in gl.static_range(BLOCK_N // W):
      if rank is None:
        stage_out(parts[h].to(o_desc.dtype), c_smem)
        tma_store(o_desc, [tm * BLOCK_M, tn * BLOCK_N + h * W], c_smem)
      else:
        stage_out(parts[h].to(o_desc.dtype), c_smem.reshape([BLOCK_M, W]))
        tma_store(o_desc, [(rank + WORLD - step) % WORLD, tm * BLOCK_M, tn * BLOCK_N + h * W],
                  c_smem)
    trace.stamp(trace_ptr, j, t, trace.EPILOGUE_DONE, TRACE)
    j += 1
    t = next_tile(tiles, tile_ready, tile_free, j, WARPS)
  finish_partition()
  trace.end(trace_ptr, TRACE)
