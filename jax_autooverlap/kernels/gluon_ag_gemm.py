"""Fused all-gather + GEMM on the warp-specialised Gluon engine (sm_90): the `gluon` engine of
kernels/ag_gemm.py, with the same workspace protocol and tile order.

    out[src*m + i, :] = a_src[i, :] @ b        for every rank src of the group

Every CTA runs three partitions (`gl.warp_specialize`):
- the consumers and the producer of the engine (kernels/gluon_engine.py; the
  consumers are its compute_and_store, into the 3-D output [src, rows, cols]).
  The producer warp claims output tiles from the per-call counter in the
  order local shard first, then rank-1, rank-2, ... (the order peers push to
  us); for a peer's tile it first waits (acquire, system scope, bounded by
  %globaltimer, error record on expiry: kernels/sync.py) for the arrival
  counter of the chunk holding the tile's rows, then fences the generic proxy
  against the async proxy (the rows are read by TMA), then TMA-loads the
  k-blocks.  The consumer warpgroups never wait on a peer.
- the mover, one warp, in CTAs [0, NUM_COMM) (idle elsewhere): pushes this
  GPU's shard into every peer's gather buffer, one BLOCK_M-row unit at a time
  in chunk-major order, with TMA box copies through two shared-memory staging
  buffers (copy_boxes); after a unit it waits until its TMA stores are
  written (not only read from shared memory), fences, and adds 1 to the
  peer's arrival counter of the unit's chunk (release, system scope).  With
  RETURN_GATHERED it then copies every shard, as it arrives, into `gathered`.
  The push costs no consumer time: the TMA unit moves the bytes, the mover
  warp only issues and waits for them, and it never waits for the consumers
  or the producer (its staging buffers and barriers are its own).
After the warp-specialised region the last CTA out zeroes this call's
counters and advances the epoch (finish_call: runtime/workspace.py says why
parity double-buffering is safe).  No CTA waits for another CTA of its own
GPU, waits on peers are bounded.

fp8 operands: the mover pushes fp8 bytes, b is [N, K] and the consumers scale the product
(gluon_engine.py says how).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels import gluon_trace as trace
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_sync import call_state, finish_call, signal_after_tma_stores
from jax_autooverlap.kernels.sync import (ERROR_SLOT_OFFSET, epilogue_scale, table_address,
                                          wait_at_least)

MOVER_WARPS = gl.constexpr(1)
MOVER_REGS = gl.constexpr(56)
BOX = gl.constexpr(64)  # staging box rows; its columns: box_cols (8 KB a box), two boxes


@gluon.constexpr_function
def box_cols(dtype):
  """Columns of a mover's staging box: 128 bytes a row, so a box is 8 KB in every dtype (64
  columns of a 16-bit dtype, 128 of fp8).  Each mover keeps two boxes in flight, so the push
  rate per mover grows with the box: 64-column fp8 boxes (4 KB) pushed at half bf16's rate per
  mover, and the fp8 GEMM is twice as fast (the push outlasted it: docs/NOTES.md)."""
  return 1024 // dtype.primitive_bitwidth


@gluon.jit
def copy_boxes(src_desc, src_i, dst_desc, dst_i, row0, ROWS: gl.constexpr, k0, k1, bufs, bars, n):
  """Mover: dst[dst_i, row0:row0+ROWS, k0:k1] = src[src_i, row0:row0+ROWS, k0:k1] (3-D descriptors
  [shards, rows, K] with [1, BOX, box_cols] boxes: rows past a shard's end are zero-filled on load
  and clipped on store), box after box through the two staging buffers.  n counts the boxes
  this mover has copied: buffer n % 2, phase (n // 2) & 1.  Before a buffer is loaded again
  the TMA store that last read it has finished reading (store_wait(1): only the newest store
  may still be reading, and it reads the other buffer)."""
  BOX_R: gl.constexpr = bufs.shape[2]
  BOX_C: gl.constexpr = bufs.shape[3]
  for r in gl.static_range(0, ROWS, BOX_R):
    for k in range(k0, k1, BOX_C):
      b = n % 2
      eng.tma.store_wait(1)
      mbarrier.expect(bars.index(b), src_desc.block_type.nbytes)
      eng.tma_load(src_desc, [src_i, row0 + r, k], bars.index(b), bufs.index(b))
      mbarrier.wait(bars.index(b), (n // 2) & 1)
      fence_async_shared()
      eng.tma_store(dst_desc, [dst_i, row0 + r, k], bufs.index(b))
      n += 1
  return n


@gluon.jit
def _mover(local_desc3, gathered_ptr, mv_bufs, mv_bars, table_ptr, rank_ptr, BUF_OFF: gl.constexpr,
           PARITY_BYTES: gl.constexpr, M_SHARD: gl.constexpr, K: gl.constexpr, WORLD: gl.constexpr,
           TM: gl.constexpr, BLOCK_M: gl.constexpr, TILES_PER_CHUNK: gl.constexpr, KS: gl.constexpr,
           NUM_COMM: gl.constexpr, FLAGS_OFF: gl.constexpr, MAX_CHUNKS: gl.constexpr,
           RETURN_GATHERED: gl.constexpr, TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr,
           PUSH_DESC_PER_UNIT: gl.constexpr):
  pid = gl.program_id(0)
  NCHUNK: gl.constexpr = (TM + TILES_PER_CHUNK - 1) // TILES_PER_CHUNK
  SHARD: gl.constexpr = M_SHARD * K
  KSPLIT: gl.constexpr = (K + KS - 1) // KS
  n = 0
  if pid < NUM_COMM:
    rank, ws, _, _, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD, MAX_CHUNKS)
    err_addr = ws + ERROR_SLOT_OFFSET
    dtype: gl.constexpr = local_desc3.dtype
    my_bufs = (ws + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(gl.pointer_type(dtype))
    # Gather buffers of this call's parity as [src, row, col] of the peer of step i (rank + 1
    # + i, i < WORLD - 1; this rank's shard goes to index rank there), and that peer's arrival
    # counters from this rank: the address table is read once per CTA, and a descriptor
    # (~0.7 us of the mover's start, docs/NOTES.md) is made per peer, not per rank; or, where
    # a mover pushes fewer units than there are peers (PUSH_DESC_PER_UNIT: small shards in
    # large groups), one per unit, made at the unit.
    peer_descs = ()
    peer_bufs = ()
    peer_flags = ()
    for i in gl.static_range(WORLD - 1):
      ws_p = table_address(table_ptr, (rank + 1 + i) % WORLD)
      bufs = (ws_p + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(gl.pointer_type(dtype))
      if PUSH_DESC_PER_UNIT:
        peer_bufs = peer_bufs + (bufs,)
      else:
        peer_descs = peer_descs + (eng.make_desc(bufs, [WORLD, M_SHARD, K], [SHARD, K, 1],
                                                 [1, BOX, box_cols(dtype)]),)
      peer_flags = peer_flags + ((ws_p + FLAGS_OFF).to(gl.pointer_type(gl.int32))
                                 + (parity * WORLD + rank) * MAX_CHUNKS,)
    # Push: unit u = (chunk, peer step, row tile, column slice of KS) in chunk-major order
    # (as kernels/ag_gemm.py, whose units are whole row tiles): a mover keeps only two boxes
    # in flight, so the push rate grows with the movers at work, and slices give every
    # mover a share of even a few row tiles.
    UNITS: gl.constexpr = NCHUNK * (WORLD - 1) * TILES_PER_CHUNK * KSPLIT
    for u in range(pid, UNITS, NUM_COMM):
      ks = u % KSPLIT
      v = u // KSPLIT
      tm = (v // ((WORLD - 1) * TILES_PER_CHUNK)) * TILES_PER_CHUNK + v % TILES_PER_CHUNK
      if tm < TM:
        step = (v // TILES_PER_CHUNK) % (WORLD - 1)  # to the peer rank + 1 + step
        for i in gl.static_range(WORLD - 1):
          if i == step:
            if PUSH_DESC_PER_UNIT:
              # rewritten only once the stores that used it are written: the previous unit's
              # signal_after_tma_stores waited for them
              desc = eng.make_desc(peer_bufs[i], [WORLD, M_SHARD, K], [SHARD, K, 1],
                                   [1, BOX, box_cols(dtype)])
            else:
              desc = peer_descs[i]
            n = copy_boxes(local_desc3, 0, desc, rank, tm * BLOCK_M, BLOCK_M, ks * KS,
                           gl.minimum(K, (ks + 1) * KS), mv_bufs, mv_bars, n)
            signal_after_tma_stores(peer_flags[i] + tm // TILES_PER_CHUNK)
    if RETURN_GATHERED:
      gath_desc = eng.make_desc(gathered_ptr, [WORLD, M_SHARD, K], [SHARD, K, 1],
                                [1, BOX, box_cols(dtype)])
      # this GPU's gather buffers of this call's parity as [src, row, col]
      bufs_desc3 = eng.make_desc(my_bufs, [WORLD, M_SHARD, K], [SHARD, K, 1],
                                 [1, BOX, box_cols(dtype)])
      for u in range(pid, WORLD * TM, NUM_COMM):
        src = (rank + WORLD - u // TM) % WORLD
        tm = u % TM
        if src == rank:
          n = copy_boxes(local_desc3, 0, gath_desc, src, tm * BLOCK_M, BLOCK_M, 0, K, mv_bufs,
                         mv_bars, n)
        else:
          c = tm // TILES_PER_CHUNK
          wait_at_least(my_flags + src * MAX_CHUNKS + c,
                        gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * KSPLIT,
                        err_addr, OP_ID, rank, src, c, TIMEOUT_NS)
          n = copy_boxes(bufs_desc3, src, gath_desc, src, tm * BLOCK_M, BLOCK_M, 0, K, mv_bufs,
                         mv_bars, n)
  eng.tma.store_wait(0)  # no TMA store still reads the staging buffers when the CTA ends


@gluon.jit
def _producer(local_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              table_ptr, rank_ptr, M_SHARD: gl.constexpr, K: gl.constexpr, WORLD: gl.constexpr,
              TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              TILES_PER_CHUNK: gl.constexpr, KS: gl.constexpr, FLAGS_OFF: gl.constexpr,
              BUF_OFF: gl.constexpr, PARITY_BYTES: gl.constexpr, MAX_CHUNKS: gl.constexpr,
              NUM_CTAS: gl.constexpr, TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr):
  BLOCK_M: gl.constexpr = local_desc.block_type.shape[0]
  BLOCK_K: gl.constexpr = local_desc.block_type.shape[1]
  BLOCK_N: gl.constexpr = eng.b_block_n(b_desc.block_type.shape, b_desc.dtype)
  TOTAL: gl.constexpr = WORLD * TM * TN
  gl.static_assert(NUM_CTAS <= TOTAL, "a CTA without a tile")
  # The first tile (static) is loaded before the rank -> table -> epoch chain is waited for
  # when it is local (step 0: the first TM x TN tiles); the peers' buffers, the flags and
  # the per-call counter depend on the epoch.
  t = eng.first_tile()
  eng.publish_tile(tiles, tile_ready, tile_free, 0, t)
  step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
  it = gl.to_tensor(0)  # the operand ring's stage counter
  if step == 0:
    it = eng.load_tile(local_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs, b_bufs, ready,
                       empty, it)
  rank, ws, header, _, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD,
                                                     MAX_CHUNKS)
  err_addr = ws + ERROR_SLOT_OFFSET
  tile_counter = header + 2 + parity
  my_bufs = (ws + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(
      gl.pointer_type(local_desc.dtype))
  # Peers' rows, as one [WORLD * M_SHARD, K] matrix of this call's parity slot.  A ragged last
  # tile row of a peer's shard reads rows of the next shard: they only feed output rows the
  # 3-D output descriptor clips (rows >= M_SHARD of that source).
  bufs_desc = eng.make_desc(my_bufs, [WORLD * M_SHARD, K], [K, 1], [BLOCK_M, BLOCK_K])
  if step != 0:
    it = _load_peer_rows(step, tm, tn, rank, bufs_desc, b_desc, a_bufs, b_bufs, ready, empty, it,
                         my_flags, err_addr, M_SHARD, K, KS, WORLD, TM, TILES_PER_CHUNK,
                         MAX_CHUNKS, TIMEOUT_NS, OP_ID)
  j = 1
  t = eng.claim_tile(tile_counter, NUM_CTAS)
  while t < TOTAL:
    eng.publish_tile(tiles, tile_ready, tile_free, j, t)
    j += 1
    # the next claim's atomic is in flight while this tile's loads are issued
    claim = eng.claim_start(tile_counter)
    step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
    if step == 0:  # this GPU's shard
      it = eng.load_tile(local_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs, b_bufs, ready,
                         empty, it)
    else:
      it = _load_peer_rows(step, tm, tn, rank, bufs_desc, b_desc, a_bufs, b_bufs, ready, empty,
                           it, my_flags, err_addr, M_SHARD, K, KS, WORLD, TM, TILES_PER_CHUNK,
                           MAX_CHUNKS, TIMEOUT_NS, OP_ID)
    t = eng.claimed_tile(claim, NUM_CTAS)
  eng.publish_tile(tiles, tile_ready, tile_free, j, TOTAL)  # no more tiles


@gluon.jit
def _load_peer_rows(step, tm, tn, rank, bufs_desc, b_desc, a_bufs, b_bufs, ready, empty, it,
                    my_flags, err_addr, M_SHARD: gl.constexpr, K: gl.constexpr, KS: gl.constexpr,
                    WORLD: gl.constexpr, TM: gl.constexpr, TILES_PER_CHUNK: gl.constexpr,
                    MAX_CHUNKS: gl.constexpr, TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr):
  """Producer: wait for the chunk of source rank - step holding row tile tm (bounded: every
  column slice of each of its row tiles), then TMA-load the tile's k-blocks from the gather
  buffer."""
  BLOCK_M: gl.constexpr = bufs_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = eng.b_block_n(b_desc.block_type.shape, b_desc.dtype)
  src = (rank + WORLD - step) % WORLD
  c = tm // TILES_PER_CHUNK
  wait_at_least(my_flags + src * MAX_CHUNKS + c,
                gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * ((K + KS - 1) // KS),
                err_addr, OP_ID, rank, src, c, TIMEOUT_NS)
  return eng.load_tile(bufs_desc, src * M_SHARD + tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs,
                       b_bufs, ready, empty, it)


@gluon.jit
def _consumers(out_ptr, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, rank,
               trace_ptr, M_SHARD, K: gl.constexpr, N, WORLD: gl.constexpr, TM: gl.constexpr,
               TN: gl.constexpr, GROUP_M: gl.constexpr, TRACE: gl.constexpr, scale=None):
  """The engine's consumers, into the output as [src, rows, cols], whose descriptor they make
  (first used at their first epilogue; made here, it does not hold up the producer)."""
  # (M_SHARD and N arrive as values, not constexprs: the descriptor takes c_smem's layout)
  BLOCK_M: gl.constexpr = c_smem.shape[1]
  OUT_N: gl.constexpr = c_smem.shape[2]  # the epilogue buffer's columns (eng.out_block_n)
  o_desc = eng.tma.make_tensor_descriptor(out_ptr, shape=[WORLD, M_SHARD, N],
                                          strides=[M_SHARD * N, N, 1],
                                          block_shape=[1, BLOCK_M, OUT_N], layout=c_smem.layout)
  eng.compute_and_store(o_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                        tile_free, rank, trace_ptr, K, WORLD, TM, TN, GROUP_M, TRACE, scale)


@lean_launch
@gluon.jit
def gluon_ag_gemm_kernel(
    a_desc, a3_desc, b_desc, table_ptr, rank_ptr,  # inputs (a's and b's descriptors: host-made)
    out_ptr, gathered_ptr, trace_ptr, scratch_ptr,  # outputs (trace: gluon_trace.py; scratch:
                                                    # _compat.lean_launch)
    M_SHARD: gl.constexpr, K: gl.constexpr, N: gl.constexpr, WORLD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    TILES_PER_CHUNK: gl.constexpr, KS: gl.constexpr, NUM_COMM: gl.constexpr,
    NUM_CTAS: gl.constexpr, FLAGS_OFF: gl.constexpr, BUF_OFF: gl.constexpr,
    PARITY_BYTES: gl.constexpr,
    MAX_CHUNKS: gl.constexpr, FLAG_BLOCK: gl.constexpr, RETURN_GATHERED: gl.constexpr,
    TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr, STAGES: gl.constexpr, TRACE: gl.constexpr,
    PUSH_DESC_PER_UNIT: gl.constexpr,
):
  trace.kernel_entry(trace_ptr, TRACE)
  dtype: gl.constexpr = a_desc.dtype
  # Only the consumers (the default partition, which needs the rank at its first epilogue)
  # and finish_call use these here: loads in flight, not waited for before the partitions.
  rank, ws, header, epoch, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD,
                                                         MAX_CHUNKS)
  TM: gl.constexpr = (M_SHARD + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  # a's descriptors (a_desc for the GEMM, a3_desc: the shard as [1, rows, K] in the mover's
  # boxes) and b's are made on the host, so the first tile (local, static:
  # gluon_engine.first_tile) starts loading at once; each partition makes the descriptors
  # only it uses (the output's, the gather buffers', the peers'), overlapping the others.
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(a_desc, b_desc,
                                                                                  STAGES)
  out_dtype: gl.constexpr = out_ptr.dtype.element_ty
  OUT_N: gl.constexpr = eng.out_block_n(BLOCK_N, out_dtype)
  c_smem = gl.allocate_shared_memory(out_dtype, [1, BLOCK_M, OUT_N],
                                     eng.shared_layout([1, BLOCK_M, OUT_N], out_dtype))
  mv_bufs = gl.allocate_shared_memory(dtype, [2, 1, BOX, box_cols(dtype)], a3_desc.layout)
  mv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
  for i in gl.static_range(2):
    mbarrier.init(mv_bars.index(i), count=1)
  consumers = (out_ptr, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, rank,
               trace_ptr, M_SHARD, K, N, WORLD, TM, TN, GROUP_M, TRACE)
  if eng.b_kmajor(dtype):  # fp8: the epilogue's scale, like rank, the consumers' (in flight)
    consumers = consumers + (epilogue_scale(table_ptr, WORLD),)
  gl.warp_specialize([
      (_consumers, consumers),
      (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                   table_ptr, rank_ptr, M_SHARD, K, WORLD, TM, TN, GROUP_M, TILES_PER_CHUNK, KS,
                   FLAGS_OFF, BUF_OFF, PARITY_BYTES, MAX_CHUNKS, NUM_CTAS, TIMEOUT_NS, OP_ID)),
      (_mover, (a3_desc, gathered_ptr, mv_bufs, mv_bars, table_ptr, rank_ptr, BUF_OFF,
                PARITY_BYTES, M_SHARD, K, WORLD, TM, BLOCK_M, TILES_PER_CHUNK, KS,
                NUM_COMM, FLAGS_OFF, MAX_CHUNKS, RETURN_GATHERED, TIMEOUT_NS, OP_ID,
                PUSH_DESC_PER_UNIT)),
  ], [eng.PRODUCER_WARPS, MOVER_WARPS], [eng.PRODUCER_REGS, MOVER_REGS])

  finish_call(header, my_flags, header + 2 + parity, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK,
              eng.consumer_warps(BLOCK_M))
  trace.kernel_exit(trace_ptr, TRACE)
