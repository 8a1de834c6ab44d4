"""Fused all-gather + GEMM: one persistent Triton kernel per GPU.

    out[src*m + i, :] = a_src[i, :] @ b        for every rank src of the group

Roles (grid <= number of SMs, one CTA per program):
- CTAs [0, NUM_COMM) push this GPU's shard, one unit at a time: a BLOCK_M-row tile's
  rows, in PUSH_PARTS column parts (backends/launch.py copy_block: a small shard is split so
  that it goes to a peer through several CTAs at once), into every peer's gather buffer
  (plain loads/stores through peer pointers), chunk by chunk; each unit bumps the peer's
  arrival counter of its chunk (release, system scope): a chunk has arrived at
  (its tiles) * PUSH_PARTS.  With RETURN_GATHERED they then also copy every
  shard, as it arrives, into the `gathered` output.
- All CTAs (the movers once done) take output tiles from a per-call atomic
  counter: local shard first (no waiting), then the shards of rank-1,
  rank-2, ... (the order in which peers push to us), each tile waiting
  (acquire, bounded) only for the chunk holding its rows.  The GEMM main
  loop reads A and B through TMA tensor descriptors.
- With SPLIT_K > 1 the counter hands out parts of tiles (kernels/split_k.py; of
  the tiles from SPLIT_FROM on): the part that finishes a tile's sum last stores it or, with
  SPREAD rows per part (backends/launch.py spread_rows), every part sums and stores its
  SPREAD rows of the tile once all parts have stored their partials (split_k.py's Spread).
- With PACK > 1 (KernelConfig.pack_shards: shards of M_SHARD = BLOCK_M / PACK rows) a row
  tile is PACK sources' shards, read from the gather buffer, whose every slot is then in use:
  this GPU's own shard is copied into its own slot in OWN_PARTS column parts, which every
  CTA, before its first tile, claims from a counter (the own row's second arrival counter)
  and copies until none is left, each counted on the own first arrival counter (the split
  counters start after these two).  A tile waits for each of its sources, its own included:
  the one wait of a CTA on other CTAs of its GPU, on parts that running CTAs have claimed (a
  copy waits for nothing), so it cannot deadlock on CTA scheduling either; CTAs run one
  after another (Triton's interpreter), the first claims every part.  B is read once per
  PACK sources.
- The last CTA to finish zeroes this call's counters and advances the epoch
  (see runtime/workspace.py for why parity double-buffering is safe).
Without PACK no CTA waits for another CTA of its own GPU, so the kernel cannot
deadlock on CTA scheduling; waits on peers are bounded (kernels/sync.py).

fp8 operands (e4m3/e5m2, any pairing): the shard moves as fp8 bytes, b comes
K-major as [N, K] (wgmma reads fp8 B K-major only) and the f32 product is
multiplied by the launch's scale (sync.epilogue_scale) before the output cast.
"""
import triton
import triton.language as tl

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import split_k, tl_trace
from jax_autooverlap.kernels.sync import (ERROR_SLOT_OFFSET, epilogue_scale, finish_call,
                                          signal_add, table_address, wait_all_at_least,
                                          wait_at_least)


@triton.jit
def _copy_rows(src, dst, row0, ROWS: tl.constexpr, COLS: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, part=0, PARTS: tl.constexpr = 1):
  """dst[row0:row0+BLOCK_R, cols] = src[row0:row0+BLOCK_R, cols] (rows < ROWS) for the
  columns of part `part` of PARTS equal ones, row-major, COLS % (PARTS * BLOCK_C) == 0.  One
  load, then its store, per block: latency-bound, so blocks are as large as the registers
  allow (backends/launch.py copy_block: BLOCK_R covers a tile's rows of the shard, no more)."""
  rows = row0 + tl.arange(0, BLOCK_R)
  rmask = rows[:, None] < ROWS
  PART_COLS: tl.constexpr = COLS // PARTS
  for c0 in range(part * PART_COLS, (part + 1) * PART_COLS, BLOCK_C):
    cols = c0 + tl.arange(0, BLOCK_C)
    offs = rows[:, None] * COLS + tl.max_contiguous(tl.multiple_of(cols, BLOCK_C), BLOCK_C)[None, :]
    tl.store(dst + offs, tl.load(src + offs, mask=rmask), mask=rmask)


@triton.jit
def _store_rows(dst, vals, tile_row0, first, col0, ROWS: tl.constexpr, COLS: tl.constexpr,
                BLOCK_M: tl.constexpr):
  """dst[tile_row0 + first + i, col0 + j] = vals[i, j] of a row-major [ROWS, COLS], for rows
  first + i of the tile below BLOCK_M and in bounds: a spread split tile's share of rows
  (kernels/split_k.py)."""
  R: tl.constexpr = vals.shape[0]
  BN: tl.constexpr = vals.shape[1]
  in_tile = first + tl.arange(0, R)
  rows = tile_row0 + in_tile
  cols = col0 + tl.arange(0, BN)
  offs = rows.to(tl.int64)[:, None] * COLS + cols[None, :]
  tl.store(dst + offs, vals.to(dst.dtype.element_ty),
           mask=((in_tile < BLOCK_M) & (rows < ROWS))[:, None] & (cols[None, :] < COLS))


@lean_launch
@triton.jit
def ag_gemm_kernel(
    a_ptr, a_desc, b_desc, table_ptr, rank_ptr,  # inputs: a (the movers' copies read it) and
                                                 # the host-made descriptors of a and b
    out_ptr, gathered_ptr, partials_ptr, trace_ptr, scratch_ptr,  # outputs (partials: split_k.py;
                                                                  # trace: tl_trace.py; scratch:
                                                                  # see _compat.lean_launch)
    M_SHARD: tl.constexpr, K: tl.constexpr, N: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr, NUM_COMM: tl.constexpr, NUM_CTAS: tl.constexpr,
    COPY_ROWS: tl.constexpr, COPY_COLS: tl.constexpr, PUSH_PARTS: tl.constexpr,
    OWN_PARTS: tl.constexpr, FLAGS_OFF: tl.constexpr,
    BUF_OFF: tl.constexpr, PARITY_BYTES: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    FLAG_BLOCK: tl.constexpr, RETURN_GATHERED: tl.constexpr, TIMEOUT_NS: tl.constexpr,
    OP_ID: tl.constexpr,
    SPLIT_K: tl.constexpr, SPLIT_FROM: tl.constexpr, PACK: tl.constexpr,
    TRACE: tl.constexpr = False, SPREAD: tl.constexpr = 0,
):
  dtype = a_ptr.dtype.element_ty
  FP8: tl.constexpr = dtype.is_fp8()
  pid = tl.program_id(0)
  tl_trace.start(trace_ptr, TRACE)
  rank = tl.load(rank_ptr)
  ws = table_address(table_ptr, rank)
  err_slot = ws + ERROR_SLOT_OFFSET
  header = ws.to(tl.pointer_type(tl.int32))
  epoch = tl.load(header)
  parity = epoch % 2
  TM: tl.constexpr = (M_SHARD + BLOCK_M - 1) // BLOCK_M
  TN: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  NCHUNK: tl.constexpr = (TM + TILES_PER_CHUNK - 1) // TILES_PER_CHUNK
  SHARD: tl.constexpr = M_SHARD * K
  my_flags = (ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) + parity * WORLD * MAX_CHUNKS
  # 64-bit offsets: a parity slot can exceed 2**31 bytes.
  my_bufs = (ws + BUF_OFF + parity.to(tl.int64) * PARITY_BYTES).to(tl.pointer_type(dtype))

  if pid < NUM_COMM:
    # Push: unit u = (chunk, peer step, row tile, column part) in chunk-major order.
    UNITS: tl.constexpr = NCHUNK * (WORLD - 1) * TILES_PER_CHUNK * PUSH_PARTS
    for u in range(pid, UNITS, NUM_COMM):
      v = u // PUSH_PARTS
      tm = (v // ((WORLD - 1) * TILES_PER_CHUNK)) * TILES_PER_CHUNK + v % TILES_PER_CHUNK
      if tm < TM:
        peer = (rank + 1 + (v // TILES_PER_CHUNK) % (WORLD - 1)) % WORLD
        peer_ws = table_address(table_ptr, peer)
        dst = (peer_ws + BUF_OFF + parity.to(tl.int64) * PARITY_BYTES).to(
            tl.pointer_type(dtype)) + rank.to(tl.int64) * SHARD
        _copy_rows(a_ptr, tl.multiple_of(dst, 16), tm * BLOCK_M, M_SHARD, K, COPY_ROWS, COPY_COLS,
                   u % PUSH_PARTS, PUSH_PARTS)
        peer_flag = (peer_ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) \
            + (parity * WORLD + rank) * MAX_CHUNKS + tm // TILES_PER_CHUNK
        signal_add(peer_flag, 1)
    if RETURN_GATHERED:
      for u in range(pid, WORLD * TM, NUM_COMM):
        src = (rank + WORLD - u // TM) % WORLD
        tm = u % TM
        dst = tl.multiple_of(gathered_ptr + src.to(tl.int64) * SHARD, 16)
        if src == rank:
          _copy_rows(a_ptr, dst, tm * BLOCK_M, M_SHARD, K, COPY_ROWS, COPY_COLS)
        else:
          c = tm // TILES_PER_CHUNK
          wait_at_least(my_flags + src * MAX_CHUNKS + c,
                        tl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * PUSH_PARTS,
                        err_slot, OP_ID, rank, src, c, TIMEOUT_NS)
          _copy_rows(tl.multiple_of(my_bufs + src.to(tl.int64) * SHARD, 16), dst, tm * BLOCK_M, M_SHARD, K,
                     COPY_ROWS, COPY_COLS)

  # PACK > 1: before its first tile, every CTA (a mover after its pushes, which the peers wait
  # for) claims parts of the own shard (TM == 1) and copies them, until none is left.
  own_flag = my_flags + rank * MAX_CHUNKS
  if PACK > 1:
    p = tl.atomic_add(own_flag + 1, 1, sem="relaxed", scope="gpu")
    while p < OWN_PARTS:
      _copy_rows(a_ptr, tl.multiple_of(my_bufs + rank.to(tl.int64) * SHARD, 16), 0, M_SHARD, K,
                 COPY_ROWS, COPY_COLS, p, OWN_PARTS)
      signal_add(own_flag, 1)
      p = tl.atomic_add(own_flag + 1, 1, sem="relaxed", scope="gpu")

  # Output tiles are handed out by a per-call counter, in the order local
  # shard first, then rank-1, rank-2, ...: compute CTAs start at once, movers
  # join when their pushes are done.  Each tile waits only for its chunk.
  # The operands' descriptors are made on the host (backends/launch.operand_descs), the
  # others once per CTA (made per tile, their device-side creation cost up to 10 %, on
  # 8192x4096x4096; ~0.7 us each once per CTA).  A ragged last tile row of a peer's
  # shard reads rows of the next shard: they only feed output rows the 3-D
  # output descriptor clips (rows >= M_SHARD of that source).
  tile_counter = header + 2 + parity
  if FP8:  # b is [N, K]
    scale = epilogue_scale(table_ptr, WORLD)
  else:
    scale = 1.0  # unused
  local_desc = a_desc
  bufs_desc = tl.make_tensor_descriptor(my_bufs, shape=[WORLD * M_SHARD, K], strides=[K, 1],
                                        block_shape=[BLOCK_M, BLOCK_K])
  # A 4-byte output tile is stored in column halves (OUT_HALVES): its TMA-store buffer is
  # then 64 KB at 128x256, so 128x256 tiles fit a float32 product beside 3 operand stages.
  OUT_HALVES: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth == 32 and BLOCK_N >= 256
  OUT_COLS: tl.constexpr = BLOCK_N // 2 if OUT_HALVES else BLOCK_N
  o_desc = tl.make_tensor_descriptor(out_ptr, shape=[WORLD, M_SHARD, N],
                                     strides=[M_SHARD * N, N, 1],
                                     block_shape=[1, BLOCK_M, OUT_COLS])
  if PACK > 1:  # the gathered rows in row tiles of PACK sources: out is [WORLD * M_SHARD, N]
    packed_desc = tl.make_tensor_descriptor(out_ptr, shape=[WORLD * M_SHARD, N], strides=[N, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
  PT: tl.constexpr = (WORLD + PACK - 1) // PACK  # row tiles with PACK > 1
  PER_SRC: tl.constexpr = TM * TN
  GROUP: tl.constexpr = GROUP_M * TN
  TILES: tl.constexpr = PT * TN if PACK > 1 else WORLD * PER_SRC
  # the split counters: this rank's own row of arrival counters, after the own shard's (PACK)
  counters = own_flag + (2 if PACK > 1 else 0)
  u = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  WORK: tl.constexpr = SPLIT_FROM + (TILES - SPLIT_FROM) * SPLIT_K
  nth = 0  # this CTA's units so far (the trace's row)
  while u < WORK:
    t, part = split_k.unit_tile(u, SPLIT_FROM, SPLIT_K)  # the tile, part of its k-blocks
    if PACK > 1:  # the own sources' row tile first, then rank-1's, ...
      pt = (rank // PACK + PT - t // TN) % PT
      tn = t % TN
      srcs = pt * PACK + tl.arange(0, PACK)  # every source of the row tile at once
      wait_all_at_least(my_flags + tl.minimum(srcs, WORLD - 1) * MAX_CHUNKS,
                        tl.where(srcs == rank, OWN_PARTS, PUSH_PARTS), srcs < WORLD,
                        err_slot, OP_ID, rank, srcs, 0, TIMEOUT_NS)
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.GOT_TILE, TRACE)
      if SPREAD > 0:
        rows = split_k.spread_part(bufs_desc, b_desc, pt * BLOCK_M, tn * BLOCK_N, t, part, scale,
                                   partials_ptr, counters, err_slot, OP_ID, rank, K, BLOCK_M,
                                   BLOCK_N, BLOCK_K, SPLIT_K, FP8, TIMEOUT_NS, SPREAD, trace_ptr,
                                   nth, TRACE)
        _store_rows(out_ptr, rows, pt * BLOCK_M, part * SPREAD, tn * BLOCK_N,
                    WORLD * M_SHARD, N, BLOCK_M)
      else:
        acc, last = split_k.tile_part(bufs_desc, b_desc, pt * BLOCK_M, tn * BLOCK_N, t, part,
                                      scale, partials_ptr, counters, SPLIT_FROM, K, BLOCK_M,
                                      BLOCK_N, BLOCK_K, SPLIT_K, FP8, trace_ptr, nth, TRACE)
        if last:  # else another part of this tile stores it
          packed_desc.store([pt * BLOCK_M, tn * BLOCK_N], acc.to(out_ptr.dtype.element_ty))
    else:
      src = (rank + WORLD - t // PER_SRC) % WORLD
      l = t % PER_SRC
      first_m = (l // GROUP) * GROUP_M
      group_rows = tl.minimum(TM - first_m, GROUP_M)
      tm = first_m + (l % GROUP) % group_rows
      tn = (l % GROUP) // group_rows
      a_desc = local_desc
      row0 = tm * BLOCK_M
      if src != rank:
        c = tm // TILES_PER_CHUNK
        wait_at_least(my_flags + src * MAX_CHUNKS + c,
                      tl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * PUSH_PARTS,
                      err_slot, OP_ID, rank, src, c, TIMEOUT_NS)
        a_desc = bufs_desc
        row0 += src * M_SHARD
      tl_trace.stamp(trace_ptr, nth, u, tl_trace.GOT_TILE, TRACE)
      if SPREAD > 0:
        rows = split_k.spread_part(a_desc, b_desc, row0, tn * BLOCK_N, t, part, scale,
                                   partials_ptr, counters, err_slot, OP_ID, rank, K, BLOCK_M,
                                   BLOCK_N, BLOCK_K, SPLIT_K, FP8, TIMEOUT_NS, SPREAD, trace_ptr,
                                   nth, TRACE)
        _store_rows(out_ptr + src.to(tl.int64) * (M_SHARD * N), rows, tm * BLOCK_M,
                    part * SPREAD, tn * BLOCK_N, M_SHARD, N, BLOCK_M)
      else:
        acc, last = split_k.tile_part(a_desc, b_desc, row0, tn * BLOCK_N, t, part, scale,
                                      partials_ptr, counters, SPLIT_FROM, K, BLOCK_M, BLOCK_N,
                                      BLOCK_K, SPLIT_K, FP8, trace_ptr, nth, TRACE)
        if last:  # else another part of this tile stores it
          tile = acc.to(out_ptr.dtype.element_ty)
          if OUT_HALVES:
            left, right = tile.reshape([BLOCK_M, 2, OUT_COLS]).permute(0, 2, 1).split()
            o_desc.store([src, tm * BLOCK_M, tn * BLOCK_N], left.reshape([1, BLOCK_M, OUT_COLS]))
            o_desc.store([src, tm * BLOCK_M, tn * BLOCK_N + OUT_COLS],
                         right.reshape([1, BLOCK_M, OUT_COLS]))
          else:
            o_desc.store([src, tm * BLOCK_M, tn * BLOCK_N], tile.reshape([1, BLOCK_M, BLOCK_N]))
    tl_trace.stamp(trace_ptr, nth, u, tl_trace.EPILOGUE_DONE, TRACE)
    nth += 1
    u = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")

  tl_trace.end(trace_ptr, TRACE)
  finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK)
