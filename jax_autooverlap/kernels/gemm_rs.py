"""Fused GEMM + reduce-scatter: one persistent Triton kernel per GPU.

    out[i, :] = sum over ranks r of (a_r @ b_r)[rank*m + i, :],  m = M / world

Every GPU computes the partial product of its own operands.  Output tiles
are handed out by a per-call atomic counter in owner order rank+1, rank+2,
..., rank (remote owners first, this GPU's own rows last).  A tile owned by a
peer is stored (plain 16-byte stores through the peer pointer) into the
owner's slot for this rank, and the owner's arrival counter of that chunk (a
group of tile rows) is bumped with release semantics at system scope.  A
tile owned by this GPU waits (acquire, bounded) for the chunk from every
peer, reads the partials with TMA and sums them in a fixed order (its own
partial first, then the peers' in rank order, as the Gluon kernel), so results
are bit-identical run to run whatever the arrival order.  No CTA waits for a
CTA of its own GPU.  With SPLIT_K > 1 the counter hands out parts of tiles
(kernels/split_k.py; of the tiles from SPLIT_FROM on): the part that finishes a tile's sum last pushes it or,
for own rows, sums it with the peers'.

The release of a pushed tile is deferred until the CTA has run the main
loop of its next tile: a system-scope release waits until every earlier
store of the CTA has reached the peer, which right after the stores is a
full NVLink round trip with the tensor cores idle; one main loop later the
stores have drained and the release is cheap.  Pending releases are always
issued before any wait, so two GPUs can never wait on each other's held
signals.

With PACK > 1 (KernelConfig.pack_shards: owners of M / WORLD = BLOCK_M / PACK rows) a row
tile is PACK owners' rows, so B is read once per PACK owners.  Tiles go out in one order on
every GPU (row tile by row tile); a finished tile pushes each peer owner's rows (one store,
a destination per row) and signals it at once on the counter of its column tile; the tile
holding this GPU's own rows then waits for every peer's push of that column tile and sums
the partials into them in rank order.  Every tile pushes before it waits and every GPU hands
tiles out in the same order, so the lowest tile any GPU waits for has been pushed everywhere
(deadlock-free without the own-rows-last order).  The split counters start at the third
of the own row's counters, as in kernels/ag_gemm.py.  With SPREAD > 0 rows per part
(split_k.py Spread) every part of a split tile finishes its own rows: it pushes those of
peer owners and signals them, or sums the own ones; an owner whose rows span several parts
is signalled once per part (OWNER_SIGNALS), which its wait expects.  The last part of a
tile no longer sums, pushes and signals all of it alone, one step after the other on one SM
(~16 us of a 22.6 us call at Llama-3-8B down, TP 8, M = 128: docs/NOTES.md).

fp8 operands (e4m3/e5m2, any pairing): b comes K-major as [N, K] (wgmma reads
fp8 B K-major only); each partial is multiplied by this GPU's scale
(sync.epilogue_scale) in f32 before it is pushed or summed.
"""
import triton
import triton.language as tl

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import split_k, tl_trace
from jax_autooverlap.kernels.sync import (ERROR_SLOT_OFFSET, epilogue_scale, finish_call,
                                          signal_add, signal_add_all, table_address,
                                          wait_all_at_least, wait_at_least)


@triton.jit
def tile_of(t, WORLD: tl.constexpr, TM: tl.constexpr, TN: tl.constexpr, GROUP_M: tl.constexpr):
  """Tile t of the per-call order -> (j, tm, tn), owner = (rank + 1 + j) % WORLD.

  j = 0..WORLD-2 are the peers (remote tiles, never waiting), j = WORLD-1 is
  this GPU's own rows, last: every own tile is handed out after every remote
  tile, on every GPU, so the tiles it waits for are already handed out on the
  peers and finish (deadlock-free).  Within an owner, GROUP_M tile rows x all
  columns at a time (L2 reuse).
  """
  PER_OWNER: tl.constexpr = TM * TN
  GROUP: tl.constexpr = GROUP_M * TN
  l = t % PER_OWNER
  first_m = (l // GROUP) * GROUP_M
  group_rows = tl.minimum(TM - first_m, GROUP_M)
  return t // PER_OWNER, first_m + (l % GROUP) % group_rows, (l % GROUP) // group_rows


@lean_launch
@triton.jit
def gemm_rs_kernel(
    a_desc, b_desc, table_ptr, rank_ptr,  # inputs: host-made descriptors of a[M, K] and b[K, N]
                                          # (fp8: [N, K]), this GPU's partial operands
    out_ptr, partials_ptr, trace_ptr, scratch_ptr,  # outputs: [M / WORLD, N]; split_k.py's
                                                    # partials; tl_trace.py's timeline;
                                                    # scratch (_compat.lean_launch)
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr, NUM_CTAS: tl.constexpr, FLAGS_OFF: tl.constexpr,
    BUF_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    FLAG_BLOCK: tl.constexpr,
    TIMEOUT_NS: tl.constexpr, OP_ID: tl.constexpr, SPLIT_K: tl.constexpr,
    SPLIT_FROM: tl.constexpr, PACK: tl.constexpr, TRACE: tl.constexpr = False,
    SPREAD: tl.constexpr = 0,
):
  tl_trace.start(trace_ptr, TRACE)
  out_dtype = out_ptr.dtype.element_ty
  FP8: tl.constexpr = a_desc.dtype.is_fp8()
  rank = tl.load(rank_ptr)
  ws = table_address(table_ptr, rank)
  err_slot = ws + ERROR_SLOT_OFFSET
  header = ws.to(tl.pointer_type(tl.int32))
  epoch = tl.load(header)
  parity = epoch % 2
  M_OUT: tl.constexpr = M // WORLD
  TM: tl.constexpr = (M_OUT + BLOCK_M - 1) // BLOCK_M
  TN: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  SLOT: tl.constexpr = M_OUT * N
  PER_OWNER: tl.constexpr = TM * TN
  my_flags = (ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) + parity * WORLD * MAX_CHUNKS
  # 64-bit offsets: a parity slot can exceed 2**31 bytes.
  my_slots = (ws + BUF_OFF + parity.to(tl.int64) * PARITY_BYTES).to(tl.pointer_type(out_dtype))
  tile_counter = header + 2 + parity
  # One descriptor per operand for the whole call (a's and b's made on the host:
  # backends/launch.operand_descs).  A ragged last tile row of an owner reads rows of the
  # next owner (of a, or of the next partial slot): they only feed output rows >= M_OUT,
  # which are never stored.
  if FP8:  # b is [N, K]
    scale = epilogue_scale(table_ptr, WORLD)
  else:
    scale = 1.0  # unused
  # A 4-byte output's own tiles are summed and stored in column halves (OUT_HALVES): a whole
  # float32 partial loaded beside the float32 accumulator does not fit the registers at
  # 128x256 (ptxas spilled 84 bytes).
  OUT_HALVES: tl.constexpr = out_dtype.primitive_bitwidth == 32 and BLOCK_N >= 256
  OUT_COLS: tl.constexpr = BLOCK_N // 2 if OUT_HALVES else BLOCK_N
  part_desc = tl.make_tensor_descriptor(my_slots, shape=[WORLD * M_OUT, N], strides=[N, 1],
                                        block_shape=[BLOCK_M, OUT_COLS])
  o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M_OUT, N], strides=[N, 1],
                                     block_shape=[BLOCK_M, OUT_COLS])

  pending = tl.full([], 0, tl.int32)  # 1: the tile pushed last is not yet signalled
  pending_flag = my_flags
  counters = my_flags + rank * MAX_CHUNKS + (2 if PACK > 1 else 0)  # split-K's
  PT: tl.constexpr = (WORLD + PACK - 1) // PACK  # row tiles with PACK > 1
  ROWS: tl.constexpr = SPREAD + (SPREAD == 0) * BLOCK_M  # rows a finishing unit finishes
  OWNER_SIGNALS: tl.constexpr = (M_OUT + ROWS - 1) // ROWS  # per source and column tile
  TILES: tl.constexpr = PT * TN if PACK > 1 else WORLD * PER_OWNER
  u = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  WORK: tl.constexpr = SPLIT_FROM + (TILES - SPLIT_FROM) * SPLIT_K
  nth = 0  # this CTA's units so far (the trace's row)
  if PACK > 1:
    while u < WORK:
      t, part = split_k.unit_tile(u, SPLIT_FROM, SPLIT_K)  # the tile, part of its k-blocks
      pt = t // TN
      tn = t % TN
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.GOT_TILE, TRACE)
      if SPREAD > 0:  # this part's SPREAD rows of the tile's sum (split_k.py Spread)
        acc = split_k.spread_part(a_desc, b_desc, pt * BLOCK_M, tn * BLOCK_N, t, part, scale,
                                  partials_ptr, counters, err_slot, OP_ID, rank, K, BLOCK_M,
                                  BLOCK_N, BLOCK_K, SPLIT_K, FP8, TIMEOUT_NS, SPREAD, trace_ptr,
                                  nth, TRACE)
        first = part * SPREAD
        finish = True
      else:
        acc, finish = split_k.tile_part(a_desc, b_desc, pt * BLOCK_M, tn * BLOCK_N, t, part,
                                        scale, partials_ptr, counters, SPLIT_FROM, K, BLOCK_M,
                                        BLOCK_N, BLOCK_K, SPLIT_K, FP8, trace_ptr, nth, TRACE)
        first = 0
      if finish:  # else another part of this tile finishes it
        rows = first + tl.arange(0, ROWS)  # of the tile; past BLOCK_M (Spread's last parts) none
        in_tile = rows < BLOCK_M
        cols = tn * BLOCK_N + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_N), BLOCK_N),
                                                BLOCK_N)
        owner = pt * PACK + rows // M_OUT  # of each row of the tile
        r_out = rows % M_OUT
        # the peers' rows, each to its owner's slot for this rank
        dest = (table_address(table_ptr, tl.minimum(owner, WORLD - 1)) + BUF_OFF
                + parity.to(tl.int64) * PARITY_BYTES).to(tl.pointer_type(out_dtype)) \
            + rank.to(tl.int64) * SLOT + r_out * N
        remote = (owner != rank) & (owner < WORLD) & in_tile
        tl.store(dest[:, None] + cols[None, :], acc.to(out_dtype),
                 mask=remote[:, None] & (cols[None, :] < N))
        # the owners of these rows, signalled together (each owner's rows of a column tile come
        # in OWNER_SIGNALS parts: one, or with Spread rows fewer than an owner's, M_OUT / ROWS)
        j = tl.arange(0, PACK)
        o = pt * PACK + j
        mine = (j * M_OUT < tl.minimum(first + ROWS, BLOCK_M)) & ((j + 1) * M_OUT > first)
        signal_add_all((table_address(table_ptr, tl.minimum(o, WORLD - 1)) + FLAGS_OFF).to(
            tl.pointer_type(tl.int32)) + (parity * WORLD + rank) * MAX_CHUNKS + tn, 1,
            (o < WORLD) & (o != rank) & mine)
        tl_trace.stamp(trace_ptr, nth, u, tl_trace.PUSHED, TRACE)
        own = (owner == rank) & in_tile
        if tl.max(own.to(tl.int32), axis=0) > 0:  # this GPU's own rows: the peers' partials
          peers = tl.arange(0, FLAG_BLOCK // MAX_CHUNKS)  # every peer's push at once
          wait_all_at_least(my_flags + tl.minimum(peers, WORLD - 1) * MAX_CHUNKS + tn,
                            OWNER_SIGNALS, (peers < WORLD) & (peers != rank), err_slot, OP_ID,
                            rank, peers, tn, TIMEOUT_NS)
          for r in tl.static_range(WORLD):  # in rank order
            if r != rank:
              src = my_slots + r * SLOT + r_out * N
              acc += tl.load(src[:, None] + cols[None, :], cache_modifier=".cg",
                             mask=own[:, None] & (cols[None, :] < N), other=0.0).to(tl.float32)
          tl.store(out_ptr + (r_out * N)[:, None] + cols[None, :], acc.to(out_dtype),
                   mask=own[:, None] & (cols[None, :] < N))
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.EPILOGUE_DONE, TRACE)
      nth += 1
      u = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  else:
    while u < WORK:
      t, part = split_k.unit_tile(u, SPLIT_FROM, SPLIT_K)  # the tile, part of its k-blocks
      j, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
      owner = (rank + 1 + j) % WORLD
      row0 = owner * M_OUT + tm * BLOCK_M
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.GOT_TILE, TRACE)
      acc, finish = split_k.tile_part(a_desc, b_desc, row0, tn * BLOCK_N, t, part, scale,
                                      partials_ptr, counters, SPLIT_FROM, K,
                                      BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FP8, trace_ptr, nth,
                                      TRACE)
      if pending != 0:
        signal_add(pending_flag, 1)
        pending = tl.full([], 0, tl.int32)
      c = tm // TILES_PER_CHUNK
      if finish:  # else another part of this tile finishes it
        if owner != rank:
          rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
          cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
          offs = (rows[:, None] * N
                  + tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)[None, :])
          mask = (rows[:, None] < M_OUT) & (cols[None, :] < N)
          peer_ws = table_address(table_ptr, owner)
          slot = (peer_ws + BUF_OFF + parity.to(tl.int64) * PARITY_BYTES).to(
              tl.pointer_type(out_dtype)) + rank.to(tl.int64) * SLOT
          tl.store(tl.multiple_of(slot, 16) + offs, acc.to(out_dtype), mask=mask)
          pending_flag = (peer_ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) \
              + (parity * WORLD + rank) * MAX_CHUNKS + c
          pending = tl.full([], 1, tl.int32)
        else:
          expected = tl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * TN
          # summed into acc in place (a second f32 tile beside it spilled: 264 bytes per thread)
          if OUT_HALVES:  # the left halves as each peer's arrives, then the right ones
            left, right = acc.reshape([BLOCK_M, 2, OUT_COLS]).permute(0, 2, 1).split()
            for r in tl.static_range(WORLD):
              if r != rank:
                wait_at_least(my_flags + r * MAX_CHUNKS + c, expected, err_slot, OP_ID, rank, r,
                              c, TIMEOUT_NS)
                left += part_desc.load([r * M_OUT + tm * BLOCK_M, tn * BLOCK_N])
            o_desc.store([tm * BLOCK_M, tn * BLOCK_N], left)
            for r in tl.static_range(WORLD):
              if r != rank:
                right += part_desc.load([r * M_OUT + tm * BLOCK_M, tn * BLOCK_N + OUT_COLS])
            o_desc.store([tm * BLOCK_M, tn * BLOCK_N + OUT_COLS], right)
          else:
            for r in tl.static_range(WORLD):
              if r != rank:
                wait_at_least(my_flags + r * MAX_CHUNKS + c, expected, err_slot, OP_ID, rank, r,
                              c, TIMEOUT_NS)
                acc += part_desc.load([r * M_OUT + tm * BLOCK_M, tn * BLOCK_N]).to(tl.float32)
            o_desc.store([tm * BLOCK_M, tn * BLOCK_N], acc.to(out_dtype))
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.EPILOGUE_DONE, TRACE)
      nth += 1
      u = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  if pending != 0:
    signal_add(pending_flag, 1)
  tl_trace.end(trace_ptr, TRACE)

  finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK)
