"""Fused GEMM + reduce-scatter: one persistent Triton kernel per GPU.

    out[i, :] = sum over ranks r of (a_r @ b_r)[rank*m + i, :],  m = M / world

Every GPU computes the partial product of its own operands.  Output tiles
are handed out by a per-call atomic counter in owner order rank+1, rank+2,
..., rank (remote owners first, this GPU's own rows last).  A tile owned by a
peer is stored (plain stores through the peer pointer) into the owner's slot
for this rank, and the owner's arrival counter of that chunk (a group of tile
rows) is bumped with release semantics at system scope.  A tile owned by
this GPU waits (acquire, bounded) for the chunk from every peer and sums the
partials in fixed rank order 0..world-1, so results are bit-identical run to
run whatever the arrival order.  No CTA waits for a CTA of its own GPU.
"""
import triton
import triton.language as tl

from jax_autooverlap.kernels.sync import finish_call, signal_add, table_address, wait_at_least


@triton.jit
def gemm_rs_kernel(
    a_ptr, b_ptr, table_ptr, rank_ptr,  # inputs: a[M, K], b[K, N] (this GPU's partial operands)
    out_ptr,                            # output: [M / WORLD, N]
    M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TILES_PER_CHUNK: tl.constexpr, NUM_CTAS: tl.constexpr, FLAGS_OFF: tl.constexpr,
    BUF_OFF: tl.constexpr, MAX_CHUNKS: tl.constexpr, FLAG_BLOCK: tl.constexpr,
    TIMEOUT_NS: tl.constexpr, OP_ID: tl.constexpr,
):
  out_dtype = out_ptr.dtype.element_ty
  rank = tl.load(rank_ptr)
  ws = table_address(table_ptr, rank)
  err_addr = table_address(table_ptr, WORLD)
  header = ws.to(tl.pointer_type(tl.int32))
  epoch = tl.load(header)
  parity = epoch % 2
  M_OUT: tl.constexpr = M // WORLD
  TM: tl.constexpr = (M_OUT + BLOCK_M - 1) // BLOCK_M
  TN: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  SLOT: tl.constexpr = M_OUT * N
  PER_OWNER: tl.constexpr = TM * TN
  GROUP: tl.constexpr = GROUP_M * TN
  my_flags = (ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) + parity * WORLD * MAX_CHUNKS
  # 64-bit element offsets: world * slot elements can exceed 2**31.
  my_slots = (ws + BUF_OFF).to(tl.pointer_type(out_dtype)) + parity.to(tl.int64) * WORLD * SLOT
  tile_counter = header + 2 + parity
  b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1],
                                     block_shape=[BLOCK_K, BLOCK_N])
  o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M_OUT, N], strides=[N, 1],
                                     block_shape=[BLOCK_M, BLOCK_N])

  t = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")
  while t < WORLD * PER_OWNER:
    owner = (rank + 1 + t // PER_OWNER) % WORLD
    l = t % PER_OWNER
    first_m = (l // GROUP) * GROUP_M
    group_rows = tl.minimum(TM - first_m, GROUP_M)
    tm = first_m + (l % GROUP) % group_rows
    tn = (l % GROUP) // group_rows
    a_desc = tl.make_tensor_descriptor(a_ptr + owner.to(tl.int64) * (M_OUT * K),
                                       shape=[M_OUT, K], strides=[K, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
      acc = tl.dot(a_desc.load([tm * BLOCK_M, k]), b_desc.load([k, tn * BLOCK_N]), acc)
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = rows[:, None] * N + tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)[None, :]
    mask = (rows[:, None] < M_OUT) & (cols[None, :] < N)
    c = tm // TILES_PER_CHUNK
    if owner != rank:
      peer_ws = table_address(table_ptr, owner)
      slot = (peer_ws + BUF_OFF).to(tl.pointer_type(out_dtype)) \
          + (parity * WORLD + rank).to(tl.int64) * SLOT
      tl.store(tl.multiple_of(slot, 16) + offs, acc.to(out_dtype), mask=mask)
      peer_flag = (peer_ws + FLAGS_OFF).to(tl.pointer_type(tl.int32)) \
          + (parity * WORLD + rank) * MAX_CHUNKS + c
      signal_add(peer_flag, 1)
    else:
      expected = tl.minimum(TILES_PER_CHUNK, TM - c * TILES_PER_CHUNK) * TN
      total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
      for r in tl.static_range(WORLD):  # fixed rank order: deterministic sums
        if r == rank:
          total += acc
        else:
          wait_at_least(my_flags + r * MAX_CHUNKS + c, expected, err_addr, OP_ID, rank, r, c,
                        TIMEOUT_NS)
          part = tl.load(tl.multiple_of(my_slots + r * SLOT, 16) + offs, mask=mask, other=0.0)
          total += part.to(tl.float32)
      o_desc.store([tm * BLOCK_M, tn * BLOCK_N], total.to(out_dtype))
    t = tl.atomic_add(tile_counter, 1, sem="relaxed", scope="gpu")

  finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS, WORLD * MAX_CHUNKS, FLAG_BLOCK)
