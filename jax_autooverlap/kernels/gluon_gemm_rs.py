"""Fused GEMM + reduce-scatter on the warp-specialised Gluon engine (sm_90): the `gluon` engine
of kernels/gemm_rs.py, with the same workspace protocol and tile order.

    out[i, :] = sum over ranks r of (a_r @ b_r)[rank*m + i, :],  m = M / world

The engine's producer warp claims tiles from the per-call counter in owner
order rank+1, rank+2, ..., rank (remote owners first, this GPU's own rows
last; `tile_of`), and TMA-loads their k-blocks; it never waits on a peer.
The consumer warpgroups run the main loop and then, per tile:
- remote owner: the tile (output dtype) goes through the epilogue buffer and
  one TMA store into the owner's slot for this rank (a descriptor per peer,
  made once per CTA).  Its release is deferred to the next tile's epilogue,
  one main loop later: then every thread waits for its TMA stores to be
  written (not only read from shared memory), fences, and hands the owner's
  arrival counter of the chunk to the signaller warp (a third partition),
  which adds 1 to it (release, system scope; gluon_sync.hand_off_release
  says why that covers every issuing thread) while the consumers go on.
  Pending releases are handed off before any wait, and the signaller never
  waits on a peer, so two GPUs never wait on each other's held signals.
- own rows: wait (acquire, bounded) for the chunk from every peer, then sum
  this GPU's partial and the peers' partials (TMA-loaded into the epilogue
  buffer in SUM_PARTS column blocks, each on its own barrier: the next peer's
  block h is loaded once this peer's block h is read) in a fixed order: own
  partial first, then the peers in rank order.  The order is fixed per owner,
  so results are bit-identical run to run whatever the arrival order (it
  differs from the `tl` kernel's 0..world-1 order, which would keep a second
  fp32 tile live in registers).
  The first peer's partial usually comes early: the producer takes one look
  (acquire, system scope) at its arrival counter before publishing an own
  tile and, where it has arrived, prefetches it into L2 and tags the tile
  number (PREFETCH); the consumers then TMA-load that partial into the
  epilogue buffer behind an MMA of the tile's main loop (gluon_engine.mma_tile's
  source), off the tensor cores' critical path.
Every own tile is handed out after every remote tile on every GPU, so the
tiles it waits for are already claimed on the peers (deadlock-free, as the
`tl` kernel); no CTA waits for a CTA of its own GPU.

fp8 operands: b is [N, K] and each partial is multiplied by this GPU's scale before it is
pushed or summed (gluon_engine.py says how).
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels import gluon_trace as trace
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_sync import (all_see_at_least, call_state, finish_call,
                                                hand_off_release, signaller)
from jax_autooverlap.kernels.sync import (ERROR_SLOT_OFFSET, epilogue_scale, fence_proxy_async,
                                          table_address, wait_at_least)


# Tile numbers the producer publishes carry PREFETCH when the consumers should load the
# first peer's partial of that (own) tile during its main loop.
PREFETCH = gl.constexpr(1 << 30)
SIGNALLER_WARPS = gl.constexpr(1)
SIGNALLER_REGS = gl.constexpr(56)
WG_REGS = gl.constexpr(224)  # a consumer warpgroup's own partition (WG_PARTS = 2)
# Own tiles read the peers' partials in SUM_PARTS column blocks, each TMA-loaded on its own
# barrier, so the next peer's blocks are in flight while this peer's are added (one 64 KB
# box at a time, a round was its load plus its adds: bench/own_round.py, docs/NOTES.md).
# 4 blocks measured no better than 2 (more barrier waits and fences per round).
SUM_PARTS = gl.constexpr(2)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
              table_ptr, rank_ptr, out_ptr, M_OUT: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
              WORLD: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_CTAS: gl.constexpr, FLAGS_OFF: gl.constexpr, BUF_OFF: gl.constexpr,
              PARITY_BYTES: gl.constexpr,
              MAX_CHUNKS: gl.constexpr, TILES_PER_CHUNK: gl.constexpr, WG_PARTS: gl.constexpr):
  TOTAL: gl.constexpr = WORLD * TM * TN
  gl.static_assert(NUM_CTAS <= TOTAL, "a CTA without a tile")
  gl.static_assert(TOTAL < PREFETCH, "tile numbers overlap the prefetch tag")
  rank = gl.load(rank_ptr)
  # The first tile (static) is loaded before the rank -> table -> epoch chain is waited for;
  # the per-call counter's address depends on the epoch.
  t = eng.first_tile()
  eng.publish_tile(tiles, tile_ready, tile_free, 0, t)
  it = _load_rows(t, rank, a_desc, b_desc, a_bufs, b_bufs, ready, empty, gl.to_tensor(0), M_OUT, K,
                  WORLD, TM, TN, GROUP_M)
  _, ws, header, _, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD,
                                                  MAX_CHUNKS)
  tile_counter = header + 2 + parity
  my_slots = (ws + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(
      gl.pointer_type(out_ptr.dtype.element_ty))
  j = 1
  t = eng.claim_tile(tile_counter, NUM_CTAS)
  while t < TOTAL:
    look = _first_partial_arrived(t, rank, my_flags, my_slots, M_OUT, N, WORLD, TM, TN, GROUP_M,
                                  TILES_PER_CHUNK, MAX_CHUNKS, a_desc.block_type.shape[0],
                                  eng.b_block_n(b_desc.block_type.shape, b_desc.dtype), WG_PARTS)
    eng.publish_tile(tiles, tile_ready, tile_free, j, t + look * PREFETCH)
    j += 1
    # the next claim's atomic is in flight while this tile's loads are issued
    claim = eng.claim_start(tile_counter)
    it = _load_rows(t, rank, a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, M_OUT, K, WORLD, TM,
                    TN, GROUP_M)
    t = eng.claimed_tile(claim, NUM_CTAS)
  eng.publish_tile(tiles, tile_ready, tile_free, j, TOTAL)  # no more tiles


@gluon.jit
def _load_rows(t, rank, a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, M_OUT: gl.constexpr,
               K: gl.constexpr, WORLD: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr,
               GROUP_M: gl.constexpr):
  """Producer: TMA-load tile t's k-blocks (its owner's rows of a) into the operand ring."""
  BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = eng.b_block_n(b_desc.block_type.shape, b_desc.dtype)
  step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
  owner = (rank + 1 + step) % WORLD
  # A ragged last tile row of an owner reads rows of the next owner: they only feed output
  # rows >= M_OUT, which no descriptor stores.
  return eng.load_tile(a_desc, owner * M_OUT + tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs,
                       b_bufs, ready, empty, it)


@gluon.jit
def _first_partial_arrived(t, rank, my_flags, my_slots, M_OUT: gl.constexpr, N: gl.constexpr,
                           WORLD: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr,
                           GROUP_M: gl.constexpr, TILES_PER_CHUNK: gl.constexpr,
                           MAX_CHUNKS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           WG_PARTS: gl.constexpr):
  """Producer: 1 if t is an own tile whose partial from the first peer of the summation order
  has arrived (one look, acquire, system scope, never a wait: the producer must not block
  while the consumers hold a deferred release), else 0.  The look's latency overlaps with the
  consumers' previous tile; they then load that partial during the tile's main loop.  Where
  it has arrived, the partial is also prefetched into L2 now: the consumers' TMA load of it
  then reads L2, not DRAM, and does not hold the operand loads up behind it (measured: a
  64 KB load from DRAM in the main loop cost the tile ~2,000 cycles)."""
  step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
  c = tm // TILES_PER_CHUNK
  expected = gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * TN * WG_PARTS  # releases
  first = (rank == 0).to(gl.int32)
  look = 0
  if WORLD > 1 and (rank + 1 + step) % WORLD == rank:
    if all_see_at_least(my_flags + first * MAX_CHUNKS + c, expected, eng.PRODUCER_WARPS):
      look = 1
      prefetch_l2(my_slots + (first * M_OUT + tm * BLOCK_M).to(gl.int64) * N + tn * BLOCK_N,
                  M_OUT - tm * BLOCK_M, N - tn * BLOCK_N, N, BLOCK_M, BLOCK_N)
  return look


@gluon.jit
def prefetch_l2(base, rows, cols, stride: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
  """One warp: prefetch.global.L2 every 128-byte line of the tile base[:BLOCK_M, :BLOCK_N]
  (row stride `stride` elements) that lies within its first rows x cols elements."""
  LINE: gl.constexpr = 128 // (base.dtype.element_ty.primitive_bitwidth // 8)  # elements
  LINES: gl.constexpr = BLOCK_M * ((BLOCK_N + LINE - 1) // LINE)
  layout: gl.constexpr = gl.BlockedLayout([(LINES + 31) // 32], [32], [1], [0])
  i = gl.arange(0, LINES, layout=layout)
  r = i // ((BLOCK_N + LINE - 1) // LINE)
  col = (i % ((BLOCK_N + LINE - 1) // LINE)) * LINE
  inside = ((r < rows) & (col < cols)).to(gl.int32)
  gl.inline_asm_elementwise(
      "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
      "=r,l,r", [base + r.to(gl.int64) * stride + col, inside], dtype=gl.int32, is_pure=False,
      pack=1)


@gluon.jit
def _consumer(state, out_ptr, c_smem, part_bars, a_bufs, b_bufs, ready, empty, tiles,
              tile_ready, tile_free, sig_box, sig_ready, sig_free, table_ptr, rank_ptr, trace_ptr,
              K: gl.constexpr,
              BLOCK_K: gl.constexpr, M_OUT: gl.constexpr, N: gl.constexpr, WORLD: gl.constexpr,
              TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              TILES_PER_CHUNK: gl.constexpr, FLAGS_OFF: gl.constexpr, BUF_OFF: gl.constexpr,
              PARITY_BYTES: gl.constexpr,
              MAX_CHUNKS: gl.constexpr, NUM_CTAS: gl.constexpr, TIMEOUT_NS: gl.constexpr,
              OP_ID: gl.constexpr, TRACE: gl.constexpr, WG: gl.constexpr,
              WG_PARTS: gl.constexpr, PUSH_DESC_PER_TILE: gl.constexpr):
  """The consumers: one partition for whole tiles (WG_PARTS = 1; a warpgroup per 64 rows of
  the tile), or warpgroup WG's
  partition for rows [64 WG, 64 WG + 64) of every tile (WG_PARTS = 2: each warpgroup loads,
  adds and stores its half, and pushes and releases it; a peer's chunk counter then counts
  halves).  c_smem and part_bars are this partition's.  state: the call's (my_slots,
  my_flags, err_addr, rank, parity) from the kernel's top level (loads in flight: the default
  partition waits for them where it first uses them), or None: loaded here after the first
  main loop (a worker partition's arguments must be ready before any partition starts, which
  would hold the first tile up behind the rank -> table -> epoch chain)."""
  ROWS: gl.constexpr = c_smem.shape[0]  # rows of each tile this partition computes
  BLOCK_M: gl.constexpr = ROWS * WG_PARTS
  ROW0: gl.constexpr = WG * ROWS
  WARPS: gl.constexpr = eng.consumer_warps(ROWS)
  TRACE_HERE: gl.constexpr = TRACE if WG == 0 else False
  BLOCK_N: gl.constexpr = c_smem.shape[1]
  out_dtype: gl.constexpr = out_ptr.dtype.element_ty
  TOTAL: gl.constexpr = WORLD * TM * TN
  SLOT: gl.constexpr = M_OUT * N
  # The loop is rotated (epilogue of tile j, then prologue and main loop of tile j+1) so that
  # the first main loop runs before anything that depends on this call's epoch (rank ->
  # table -> epoch, loaded meanwhile).  Every CTA has a first tile (grid <= tiles).
  gl.static_assert(NUM_CTAS <= TOTAL, "a CTA without a tile")
  trace.start(trace_ptr, TRACE_HERE)
  # this partition's rows of the output (own tiles' stores), made while the producer's first
  # loads are in flight
  o_desc = eng.make_desc(out_ptr, [M_OUT, N], [N, 1], [ROWS, BLOCK_N])
  it = 0
  j = 0
  t = eng.take(tiles, tile_ready, tile_free, j, WARPS)  # the static first tile: never tagged
  trace.stamp(trace_ptr, j, t, trace.GOT_TILE, TRACE_HERE)
  acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, ROWS, BLOCK_N, ROW0=ROW0)
  trace.stamp(trace_ptr, j, t, trace.MAIN_DONE, TRACE_HERE)
  if state is None:
    rank, ws, _, _, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD,
                                                  MAX_CHUNKS)
    err_addr = ws + ERROR_SLOT_OFFSET
    my_slots = (ws + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(gl.pointer_type(out_dtype))
  else:
    my_slots, my_flags, err_addr, rank, parity = state
  if eng.b_kmajor(a_bufs.dtype):  # fp8: this GPU's scale of every partial
    scale = epilogue_scale(table_ptr, WORLD)
  # The peers' partials of this GPU's rows, and for the pushes to the owner of step i
  # (rank + 1 + i, i < WORLD - 1) a descriptor of its slot for this rank and its arrival
  # counters from this rank: the address table is read here, once per CTA, not in an
  # epilogue (a load there stalled every remote tile's epilogue by ~800 cycles); the
  # descriptors cost the CTA's first epilogue ~0.7 us each (docs/NOTES.md): one per peer,
  # or, where a CTA pushes fewer tiles than there are peers (PUSH_DESC_PER_TILE: small shapes
  # in large groups), one per pushed tile, made at the push.
  W: gl.constexpr = BLOCK_N // SUM_PARTS
  part_desc = eng.make_desc(my_slots, [WORLD * M_OUT, N], [N, 1], [ROWS, W])
  peer_descs = ()
  peer_slots = ()
  peer_flags = ()
  for i in gl.static_range(WORLD - 1):
    ws_r = table_address(table_ptr, (rank + 1 + i) % WORLD)
    slot = (ws_r + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(gl.pointer_type(out_dtype)) \
        + rank.to(gl.int64) * SLOT
    if PUSH_DESC_PER_TILE:
      peer_slots = peer_slots + (slot,)
    else:
      peer_descs = peer_descs + (eng.make_desc(slot, [M_OUT, N], [N, 1], [ROWS, BLOCK_N]),)
    peer_flags = peer_flags + ((ws_r + FLAGS_OFF).to(gl.pointer_type(gl.int32))
                               + (parity * WORLD + rank) * MAX_CHUNKS,)
  # the first peer of the fixed summation order (own partial, then peers in rank order)
  first = (rank == 0).to(gl.int32)
  loads = 0  # partial tiles TMA-loaded so far: phase of part_bar
  pending = 0  # 1: the tile pushed last is not yet signalled
  pending_flag = my_flags
  signals = 0  # releases handed to the signaller so far
  prefetched = 0  # the first tile's partial was not prefetched
  while t < TOTAL:  # (t untagged)
    if eng.b_kmajor(a_bufs.dtype):
      acc = acc * scale
    if pending != 0:
      hand_off_release(pending_flag, sig_box, sig_ready, sig_free, signals, WARPS)
      signals += 1
      pending = 0
    step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
    owner = (rank + 1 + step) % WORLD
    c = tm // TILES_PER_CHUNK
    if owner != rank:
      eng.stage_out(acc.to(out_dtype), c_smem)
      for i in gl.static_range(WORLD - 1):
        if i == step:  # owner (rank + 1 + step) % WORLD
          if PUSH_DESC_PER_TILE:
            # the descriptor's memory is rewritten only once the stores that used it are
            # written: hand_off_release's full wait, above, for the tile pushed before
            desc = eng.make_desc(peer_slots[i], [M_OUT, N], [N, 1], [ROWS, BLOCK_N])
          else:
            desc = peer_descs[i]
          eng.tma_store(desc, [tm * BLOCK_M + ROW0, tn * BLOCK_N], c_smem)
          pending_flag = peer_flags[i] + c
      pending = 1
    else:
      if WORLD > 1:  # (a group of 1 runs when asked for explicitly: no peers)
        expected = gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * TN * WG_PARTS
        row = tm * BLOCK_M + ROW0
        # The peers' partials in column blocks, each on its own barrier: a block of the next
        # peer is loaded as soon as every warp has read this peer's, so loads overlap adds.
        if prefetched == 0:  # else the first peer's blocks were loaded during the main loop
          wait_at_least(my_flags + first * MAX_CHUNKS + c, expected, err_addr, OP_ID, rank,
                        first, c, TIMEOUT_NS, WG_PARTS > 1)
          eng.load_epilogue_source((part_desc, first * M_OUT + row, tn * BLOCK_N, c_smem,
                                    part_bars))
        accs = eng.split_columns(acc, SUM_PARTS)
        # (a loop, not unrolled: unrolled over 7 peers, ptxas spilled ~200 bytes)
        for q in range(WORLD - 1):
          nxt = q + 1 + (rank <= q + 1).to(gl.int32)  # the peers in rank order: first is q = 0's
          summed = ()
          for h in gl.static_range(SUM_PARTS):
            mbarrier.wait(part_bars.index(h), loads & 1)
            block = eng.epilogue_block(c_smem, h, W).load(accs[h].type.layout)
            summed = summed + (eng.add_partial(accs[h], block),)
            fence_async_shared()  # every warp has read the block before the buffer is reused
            tl.debug_barrier()
            if q + 1 < WORLD - 1:
              if h == 0:
                wait_at_least(my_flags + nxt * MAX_CHUNKS + c, expected, err_addr, OP_ID, rank,
                              nxt, c, TIMEOUT_NS, WG_PARTS > 1)
              eng.load_epilogue_block(part_desc, nxt * M_OUT + row, tn * BLOCK_N, h, c_smem,
                                      part_bars)
          accs = summed
          loads += 1
        acc = eng.join_columns(accs)
      eng.stage_out(acc.to(out_dtype), c_smem)
      eng.tma_store(o_desc, [tm * BLOCK_M + ROW0, tn * BLOCK_N], c_smem)
    trace.stamp(trace_ptr, j, t, trace.EPILOGUE_DONE, TRACE_HERE)
    j += 1
    t = eng.take(tiles, tile_ready, tile_free, j, WARPS)
    prefetched = (t >= PREFETCH).to(gl.int32)
    t = t % PREFETCH
    if t < TOTAL:
      # a tagged (own) tile: the first peer's partial has arrived (the producer's acquire,
      # handed on through the tile ring's mbarrier); loaded behind an MMA of the main loop
      _, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
      if prefetched != 0:
        fence_proxy_async()
      trace.stamp(trace_ptr, j, t, trace.GOT_TILE, TRACE_HERE)
      acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, ROWS, BLOCK_N,
                             (part_desc, first * M_OUT + tm * BLOCK_M + ROW0, tn * BLOCK_N,
                              c_smem, part_bars), prefetched != 0, ROW0)
      trace.stamp(trace_ptr, j, t, trace.MAIN_DONE, TRACE_HERE)
  if pending != 0:
    hand_off_release(pending_flag, sig_box, sig_ready, sig_free, signals, WARPS)
    signals += 1
  eng.post(sig_box, sig_ready, sig_free, signals, 0, WARPS)  # the signaller's end
  eng.finish_partition()
  trace.end(trace_ptr, TRACE_HERE)


@gluon.jit
def _alloc_part_bars():
  """A consumer partition's barriers of the peers' partials' column blocks, one per block."""
  bars = gl.allocate_shared_memory(gl.int64, [SUM_PARTS, 1], mbarrier.MBarrierLayout())
  for h in gl.static_range(SUM_PARTS):
    mbarrier.init(bars.index(h), count=1)
  return bars


@lean_launch
@gluon.jit
def gluon_gemm_rs_kernel(
    a_desc, b_desc, table_ptr, rank_ptr,  # inputs: descriptors (host-made) of a[M, K] and b[K, N]
                                          # (fp8: [N, K]), this GPU's partial operands
    out_ptr, trace_ptr, scratch_ptr,    # outputs: [M / WORLD, N]; trace (gluon_trace.py); scratch
                                        # (_compat.lean_launch)
    M: gl.constexpr, K: gl.constexpr, N: gl.constexpr, WORLD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    TILES_PER_CHUNK: gl.constexpr, NUM_CTAS: gl.constexpr, FLAGS_OFF: gl.constexpr,
    BUF_OFF: gl.constexpr, PARITY_BYTES: gl.constexpr, MAX_CHUNKS: gl.constexpr,
    FLAG_BLOCK: gl.constexpr,
    TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr, STAGES: gl.constexpr, TRACE: gl.constexpr,
    WG_PARTS: gl.constexpr, PUSH_DESC_PER_TILE: gl.constexpr,
):
  """WG_PARTS: 1 (one consumer partition: two warpgroups for BLOCK_M = 128, one for 64) or 2
  (BLOCK_M = 128 only: a partition per warpgroup, KernelConfig.wg_partitions; launched with 4
  warps, its default partition being warpgroup 0).  PUSH_DESC_PER_TILE: a push descriptor
  per pushed tile instead of one per peer and CTA (backends/gluon.py chooses)."""
  trace.kernel_entry(trace_ptr, TRACE)
  out_dtype: gl.constexpr = out_ptr.dtype.element_ty
  # For the consumers (the default partition: first used after their first main loop) and
  # finish_call: loads in flight, not waited for before the partitions start.
  rank, ws, header, epoch, parity, my_flags = call_state(table_ptr, rank_ptr, FLAGS_OFF, WORLD,
                                                         MAX_CHUNKS)
  err_addr = ws + ERROR_SLOT_OFFSET  # holds this process's error-record address
  M_OUT: gl.constexpr = M // WORLD
  TM: gl.constexpr = (M_OUT + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  my_slots = (ws + BUF_OFF + parity.to(gl.int64) * PARITY_BYTES).to(gl.pointer_type(out_dtype))
  # The operands' descriptors are made on the host, so the first tile (static:
  # gluon_engine.first_tile) starts loading at once; each consumer partition makes its own
  # output descriptor, the others theirs (overlapping the first loads).
  ROWS: gl.constexpr = BLOCK_M // WG_PARTS  # rows of a tile per consumer partition
  c_layout: gl.constexpr = eng.shared_layout([ROWS, BLOCK_N], out_dtype)
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(a_desc, b_desc,
                                                                                  STAGES, WG_PARTS)
  if WG_PARTS == 1:
    c_smem = gl.allocate_shared_memory(out_dtype, [BLOCK_M, BLOCK_N], c_layout)
    part_bars = _alloc_part_bars()
    sig_box, sig_ready, sig_free = eng.alloc_ring(gl.int64)
    gl.warp_specialize([
        (_consumer, ((my_slots, my_flags, err_addr, rank, parity), out_ptr, c_smem, part_bars,
                     a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, sig_box,
                     sig_ready, sig_free, table_ptr, rank_ptr, trace_ptr, K, BLOCK_K, M_OUT, N,
                     WORLD, TM, TN, GROUP_M, TILES_PER_CHUNK, FLAGS_OFF, BUF_OFF, PARITY_BYTES,
                     MAX_CHUNKS, NUM_CTAS, TIMEOUT_NS, OP_ID, TRACE, 0, 1, PUSH_DESC_PER_TILE)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     table_ptr, rank_ptr, out_ptr, M_OUT, K, N, WORLD, TM, TN, GROUP_M, NUM_CTAS,
                     FLAGS_OFF, BUF_OFF, PARITY_BYTES, MAX_CHUNKS, TILES_PER_CHUNK, WG_PARTS)),
        (signaller, (((sig_box, sig_ready, sig_free),),)),
    ], [eng.PRODUCER_WARPS, SIGNALLER_WARPS], [eng.PRODUCER_REGS, SIGNALLER_REGS])
  else:
    gl.static_assert(WG_PARTS == 2, "WG_PARTS: 1 or 2")
    c_smem0 = gl.allocate_shared_memory(out_dtype, [ROWS, BLOCK_N], c_layout)
    c_smem1 = gl.allocate_shared_memory(out_dtype, [ROWS, BLOCK_N], c_layout)
    part_bars0 = _alloc_part_bars()
    part_bars1 = _alloc_part_bars()
    sig_box, sig_ready, sig_free = eng.alloc_ring(gl.int64)  # warpgroup 0's releases
    sig1_box, sig1_ready, sig1_free = eng.alloc_ring(gl.int64)  # warpgroup 1's
    gl.warp_specialize([
        (_consumer, (None, out_ptr, c_smem0, part_bars0, a_bufs, b_bufs, ready,
                     empty, tiles, tile_ready, tile_free, sig_box, sig_ready, sig_free, table_ptr,
                     rank_ptr, trace_ptr, K, BLOCK_K, M_OUT, N, WORLD, TM, TN, GROUP_M,
                     TILES_PER_CHUNK, FLAGS_OFF, BUF_OFF, PARITY_BYTES, MAX_CHUNKS, NUM_CTAS,
                     TIMEOUT_NS, OP_ID, TRACE, 0, 2, PUSH_DESC_PER_TILE)),
        (_consumer, (None, out_ptr, c_smem1, part_bars1, a_bufs, b_bufs, ready,
                     empty, tiles, tile_ready, tile_free, sig1_box, sig1_ready, sig1_free,
                     table_ptr, rank_ptr, trace_ptr, K, BLOCK_K, M_OUT, N, WORLD, TM, TN, GROUP_M,
                     TILES_PER_CHUNK, FLAGS_OFF, BUF_OFF, PARITY_BYTES, MAX_CHUNKS, NUM_CTAS,
                     TIMEOUT_NS, OP_ID, TRACE, 1, 2, PUSH_DESC_PER_TILE)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                     table_ptr, rank_ptr, out_ptr, M_OUT, K, N, WORLD, TM, TN, GROUP_M, NUM_CTAS,
                     FLAGS_OFF, BUF_OFF, PARITY_BYTES, MAX_CHUNKS, TILES_PER_CHUNK, WG_PARTS)),
        (signaller, (((sig_box, sig_ready, sig_free), (sig1_box, sig1_ready, sig1_free)),)),
    ], [eng.NUM_WARPS // 2, eng.PRODUCER_WARPS, SIGNALLER_WARPS],
       [WG_REGS, eng.PRODUCER_REGS, SIGNALLER_REGS])

  finish_call(header, my_flags, header + 2 + parity, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK,
              eng.consumer_warps(ROWS))
  trace.kernel_exit(trace_ptr, TRACE)
