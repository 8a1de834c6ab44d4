"""Fused all-gather + GEMM on the warp-specialised Gluon engine (sm_90): the `gluon` engine of
kernels/ag_gemm.py, with the same workspace protocol and tile order.

    out[src*m + i, :] = a_src[i, :] @ b        for every rank src of the group

- CTAs [0, NUM_COMM) first push this GPU's shard into every peer's gather
  buffer, one BLOCK_M-row unit at a time (plain 16-byte loads/stores through
  peer pointers, all warps of the default partition), each unit bumping the
  peer's arrival counter of its chunk (release, system scope); with
  RETURN_GATHERED they then copy every shard, as it arrives, into `gathered`.
- Then every CTA runs the engine (kernels/gluon_engine.py).  Its producer
  warp claims output tiles from the per-call counter in the order local
  shard first, then rank-1, rank-2, ... (the order peers push to us); for a
  peer's tile it first waits (acquire, system scope, bounded by %globaltimer,
  error record on expiry: kernels/sync.py) for the arrival counter of the
  chunk holding the tile's rows, then fences the generic proxy against the
  async proxy (the rows are read by TMA), then TMA-loads the k-blocks.  The
  consumer warpgroups never wait on a peer.
- After the warp-specialised region the last CTA out zeroes this call's
  counters and advances the epoch (finish_call: runtime/workspace.py says why
  parity double-buffering is safe).
No CTA waits for another CTA of its own GPU, waits on peers are bounded.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels.gemm_rs import tile_of
from jax_autooverlap.kernels.gluon_sync import finish_call
from jax_autooverlap.kernels.sync import ERROR_SLOT_OFFSET, signal_add, table_address, wait_at_least


@gluon.jit
def copy_rows(src, dst, row0, ROWS: gl.constexpr, COLS: gl.constexpr, BLOCK_R: gl.constexpr,
              BLOCK_C: gl.constexpr, NUM_WARPS: gl.constexpr):
  """dst[row0:row0+BLOCK_R, :] = src[row0:row0+BLOCK_R, :] (rows < ROWS), row-major, COLS % BLOCK_C == 0;
  8 contiguous elements per thread (16-byte accesses for 16-bit dtypes)."""
  layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_C // 8), BLOCK_C // 8], [NUM_WARPS, 1], [1, 0])
  rows = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, layout))
  cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
  rmask = gl.expand_dims(rows < ROWS, 1)
  for c0 in range(0, COLS, BLOCK_C):
    offs = gl.expand_dims(rows * COLS, 1) + gl.expand_dims(c0 + cols, 0)
    gl.store(dst + offs, gl.load(src + offs, mask=rmask), mask=rmask)


@gluon.jit
def _producer(local_desc, bufs_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
              tile_free, tile_counter, my_flags, err_addr, rank, M_SHARD: gl.constexpr,
              K: gl.constexpr, WORLD: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr,
              GROUP_M: gl.constexpr, TILES_PER_CHUNK: gl.constexpr, MAX_CHUNKS: gl.constexpr,
              TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr):
  BLOCK_M: gl.constexpr = local_desc.block_type.shape[0]
  BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
  TOTAL: gl.constexpr = WORLD * TM * TN
  it = 0
  j = 0
  t = gl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  while t < TOTAL:
    eng.publish_tile(tiles, tile_ready, tile_free, j, t)
    j += 1
    step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
    src = (rank + WORLD - step) % WORLD
    if src == rank:
      it = eng.load_tile(local_desc, tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs, b_bufs, ready,
                         empty, it)
    else:
      c = tm // TILES_PER_CHUNK
      wait_at_least(my_flags + src * MAX_CHUNKS + c, gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK),
                    err_addr, OP_ID, rank, src, c, TIMEOUT_NS)
      it = eng.load_tile(bufs_desc, src * M_SHARD + tm * BLOCK_M, b_desc, tn * BLOCK_N, K, a_bufs,
                         b_bufs, ready, empty, it)
    t = gl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  eng.publish_tile(tiles, tile_ready, tile_free, j, TOTAL)  # no more tiles


@gluon.jit
def _consumer(o_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free, rank,
              K: gl.constexpr, BLOCK_K: gl.constexpr, WORLD: gl.constexpr, TM: gl.constexpr,
              TN: gl.constexpr, GROUP_M: gl.constexpr):
  BLOCK_M: gl.constexpr = o_desc.block_type.shape[1]
  BLOCK_N: gl.constexpr = o_desc.block_type.shape[2]
  it = 0
  j = 0
  t = eng.next_tile(tiles, tile_ready, tile_free, j)
  while t < WORLD * TM * TN:
    acc, it = eng.mma_tile(a_bufs, b_bufs, ready, empty, it, K, BLOCK_K, BLOCK_M, BLOCK_N)
    step, tm, tn = tile_of(t, WORLD, TM, TN, GROUP_M)
    eng.stage_out(acc.to(o_desc.dtype), c_smem.reshape([BLOCK_M, BLOCK_N]))
    # 3-D output [src, row, col]: a ragged last tile row of a shard is clipped at its end
    eng.tma_store(o_desc, [(rank + WORLD - step) % WORLD, tm * BLOCK_M, tn * BLOCK_N], c_smem)
    j += 1
    t = eng.next_tile(tiles, tile_ready, tile_free, j)
  eng.finish_partition()


@lean_launch
@gluon.jit
def gluon_ag_gemm_kernel(
    a_ptr, b_ptr, table_ptr, rank_ptr,  # inputs
    out_ptr, gathered_ptr, scratch_ptr,  # outputs (scratch: _compat.lean_launch)
    M_SHARD: gl.constexpr, K: gl.constexpr, N: gl.constexpr, WORLD: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    TILES_PER_CHUNK: gl.constexpr, NUM_COMM: gl.constexpr, NUM_CTAS: gl.constexpr,
    COPY_COLS: gl.constexpr, FLAGS_OFF: gl.constexpr, BUF_OFF: gl.constexpr,
    MAX_CHUNKS: gl.constexpr, FLAG_BLOCK: gl.constexpr, RETURN_GATHERED: gl.constexpr,
    TIMEOUT_NS: gl.constexpr, OP_ID: gl.constexpr, STAGES: gl.constexpr,
):
  dtype: gl.constexpr = a_ptr.dtype.element_ty
  pid = gl.program_id(0)
  rank = gl.load(rank_ptr)
  ws = table_address(table_ptr, rank)
  err_addr = ws + ERROR_SLOT_OFFSET  # holds this process's error-record address
  header = ws.to(gl.pointer_type(gl.int32))
  epoch = gl.load(header)
  parity = epoch % 2
  TM: gl.constexpr = (M_SHARD + BLOCK_M - 1) // BLOCK_M
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  NCHUNK: gl.constexpr = (TM + TILES_PER_CHUNK - 1) // TILES_PER_CHUNK
  SHARD: gl.constexpr = M_SHARD * K
  my_flags = (ws + FLAGS_OFF).to(gl.pointer_type(gl.int32)) + parity * WORLD * MAX_CHUNKS
  # 64-bit element offsets: world * shard elements can exceed 2**31.
  my_bufs = (ws + BUF_OFF).to(gl.pointer_type(dtype)) + parity.to(gl.int64) * WORLD * SHARD

  if pid < NUM_COMM:
    # Push: unit u = (chunk, peer step, row tile) in chunk-major order (as kernels/ag_gemm.py).
    UNITS: gl.constexpr = NCHUNK * (WORLD - 1) * TILES_PER_CHUNK
    for u in range(pid, UNITS, NUM_COMM):
      tm = (u // ((WORLD - 1) * TILES_PER_CHUNK)) * TILES_PER_CHUNK + u % TILES_PER_CHUNK
      if tm < TM:
        peer = (rank + 1 + (u // TILES_PER_CHUNK) % (WORLD - 1)) % WORLD
        peer_ws = table_address(table_ptr, peer)
        dst = (peer_ws + BUF_OFF).to(gl.pointer_type(dtype)) \
            + (parity * WORLD + rank).to(gl.int64) * SHARD
        copy_rows(a_ptr, gl.multiple_of(dst, 16), tm * BLOCK_M, M_SHARD, K, BLOCK_M, COPY_COLS,
                  eng.NUM_WARPS)
        peer_flag = (peer_ws + FLAGS_OFF).to(gl.pointer_type(gl.int32)) \
            + (parity * WORLD + rank) * MAX_CHUNKS + tm // TILES_PER_CHUNK
        signal_add(peer_flag, 1)
    if RETURN_GATHERED:
      for u in range(pid, WORLD * TM, NUM_COMM):
        src = (rank + WORLD - u // TM) % WORLD
        tm = u % TM
        dst = gl.multiple_of(gathered_ptr + src.to(gl.int64) * SHARD, 16)
        if src == rank:
          copy_rows(a_ptr, dst, tm * BLOCK_M, M_SHARD, K, BLOCK_M, COPY_COLS, eng.NUM_WARPS)
        else:
          c = tm // TILES_PER_CHUNK
          wait_at_least(my_flags + src * MAX_CHUNKS + c,
                        gl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK),
                        err_addr, OP_ID, rank, src, c, TIMEOUT_NS)
          copy_rows(gl.multiple_of(my_bufs + src.to(gl.int64) * SHARD, 16), dst, tm * BLOCK_M,
                    M_SHARD, K, BLOCK_M, COPY_COLS, eng.NUM_WARPS)

  # Descriptors are made once per CTA.  A ragged last tile row of a peer's shard
  # reads rows of the next shard: they only feed output rows the 3-D output
  # descriptor clips (rows >= M_SHARD of that source).
  b_desc = eng.make_desc(b_ptr, [K, N], [N, 1], [BLOCK_K, BLOCK_N])
  local_desc = eng.make_desc(a_ptr, [M_SHARD, K], [K, 1], [BLOCK_M, BLOCK_K])
  bufs_desc = eng.make_desc(my_bufs, [WORLD * M_SHARD, K], [K, 1], [BLOCK_M, BLOCK_K])
  o_desc = eng.make_desc(out_ptr, [WORLD, M_SHARD, N], [M_SHARD * N, N, 1], [1, BLOCK_M, BLOCK_N])
  a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free = eng.alloc_pipeline(local_desc, b_desc,
                                                                                  STAGES)
  c_smem = gl.allocate_shared_memory(o_desc.dtype, [1, BLOCK_M, BLOCK_N], o_desc.layout)
  tile_counter = header + 2 + parity
  gl.warp_specialize([
      (_consumer, (o_desc, c_smem, a_bufs, b_bufs, ready, empty, tiles, tile_ready, tile_free,
                   rank, K, BLOCK_K, WORLD, TM, TN, GROUP_M)),
      (_producer, (local_desc, bufs_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles, tile_ready,
                   tile_free, tile_counter, my_flags, err_addr, rank, M_SHARD, K, WORLD, TM, TN,
                   GROUP_M, TILES_PER_CHUNK, MAX_CHUNKS, TIMEOUT_NS, OP_ID)),
  ], [eng.PRODUCER_WARPS], [eng.PRODUCER_REGS])

  finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK,
              eng.NUM_WARPS)
