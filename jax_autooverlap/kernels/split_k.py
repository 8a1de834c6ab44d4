"""The `tl` fused kernels' work on one output tile (tile_part: the main loop dot_k, the fp8
scale) and their split-K (KernelConfig.split_k = S > 1): where a shape has fewer output tiles
than SMs, each tile's k-blocks are cut into S parts, each part a work unit of its
own (units t*S .. t*S + S - 1 of tile t, handed out by the kernel's tile counter), so S times
as many CTAs work on the GEMM.  With KernelConfig.split_tail = R > 0 only the last R tiles
are split (tiles t < SPLIT_FROM = tiles - R are whole units u = t, then each split tile's S
parts): a short second wave of R tiles, on R SMs while the others idle, runs on R * S CTAs.

Every part stores its fp32 partial tile in the launch's `partials` output (slot [tile, part]),
then counts itself on the tile's split counter (acq_rel, GPU scope).  The part that counts
last sums the S partial tiles in part order 0 .. S-1 (a fixed order: bit-identical results
whichever part comes last) and finishes the tile as the unsplit kernel does (store, push or
own-rows sum); the others go on to their next unit.  Partial slots and counters are indexed
by the split tile's number t - SPLIT_FROM.  No CTA waits for another CTA of its GPU (but
with Spread).

Spread (SPREAD > 0 rows per part, AG+GEMM and packed GEMM+RS: backends/launch.py
spread_rows): the last
part's sum reads S partial tiles through one SM, S one-after-another rounds of L2 latency
(7.8 us of a 22.7 us call at 70B Q/K/V, TP 8, M = 128, 64x256 split 8: tenth round).  With
SPREAD every part, once its partial is stored and counted, waits (bounded:
sync.wait_at_least, the record naming the split tile) until all S have been, then sums its
own SPREAD rows (BLOCK_M / S up to a power of 2) of the S partials (sum_own_rows), in part
order (the same adds as combine: bit-identical), and finishes them (AG: stores them; packed
GEMM+RS: pushes the peers' rows, sums the own ones with the peers' partials).
This wait on other CTAs of the GPU cannot deadlock on CTA scheduling: units are claimed in
order, so every part below a claimed one is claimed by a running CTA, which stores its
partial before it waits; a tile's missing parts are the next units, which the next CTA to
finish its unit claims (S <= the grid: backends/launch.py spread_rows).  Not in Triton's
interpreter, which runs CTAs one after another (tests/interpret_kernels.py: no SPREAD).

The split counters are this call's arrival counters of the GPU's own rank (runtime/workspace.py
holds int32[2 parity][world][MAX_CHUNKS]; no peer ever writes a rank's own row): zero when
the call starts, zeroed again with the others by the call's last CTA (kernels/sync.py
finish_call).  Hence at most MAX_CHUNKS split tiles per call, two fewer
with packed shards, whose own shard's parts the first two count (kernels/ag_gemm.py;
tuning/select.py split_k_unsupported; the launchers refuse more).

Memory ordering: each thread's partial stores, then a CTA barrier, then one thread's acq_rel
add (release is cumulative over what the barrier ordered before it); the last part's add
acquires every earlier part's release, and a CTA barrier orders its other threads' loads
after it; those loads bypass L1 (`.cg`), which is not coherent between SMs.
"""
import triton
import triton.language as tl

from jax_autooverlap.kernels import tl_trace
from jax_autooverlap.kernels.sync import wait_at_least


@triton.jit
def dot_k(acc, a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
  """acc + a[row0 tile, k_lo:k_hi] @ b[k_lo:k_hi, col0 tile]: the main loop of the `tl` fused
  kernels, split or not.  fp8: b is K-major ([N, K]; wgmma reads fp8 B K-major only)."""
  for k in range(k_lo, k_hi, BLOCK_K):
    if FP8:
      acc = tl.dot(a_desc.load([row0, k]), b_desc.load([col0, k]).T, acc)
    else:
      acc = tl.dot(a_desc.load([row0, k]), b_desc.load([k, col0]), acc)
  return acc


@triton.jit
def k_range(part, K: tl.constexpr, BLOCK_K: tl.constexpr, parts):
  """[lo, hi) of part `part` of `parts`' k (elements): the k-blocks split as evenly as whole
  blocks go, none empty (parts <= the k-block count: tuning/select.py split_k_unsupported)."""
  KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
  return (part * KB // parts) * BLOCK_K, ((part + 1) * KB // parts) * BLOCK_K


@triton.jit
def unit_tile(u, SPLIT_FROM, SPLIT_K: tl.constexpr):
  """(tile, part) of work unit u: tiles before SPLIT_FROM are one unit each (part 0), the
  later ones SPLIT_K units each."""
  if SPLIT_K == 1:
    return u, 0
  s = tl.maximum(u - SPLIT_FROM, 0)
  return tl.where(u < SPLIT_FROM, u, SPLIT_FROM + s // SPLIT_K), tl.where(u < SPLIT_FROM, 0,
                                                                          s % SPLIT_K)


@triton.jit
def combine(acc, slot, part, partials_ptr, counters, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SPLIT_K: tl.constexpr):
  """(the tile's sum over its parts, True) for the part that counts last; (acc, False) for the
  others.  slot: the split tile's number; partials_ptr: fp32 [split tiles, SPLIT_K, BLOCK_M,
  BLOCK_N]; counters: int32 per split tile.  The sum goes into acc in place (a second fp32
  tile beside it spills at 128x256: ptxas -v)."""
  rows = tl.arange(0, BLOCK_M)
  cols = tl.arange(0, BLOCK_N)
  offs = rows[:, None] * BLOCK_N + cols[None, :]
  base = partials_ptr + slot.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
  tl.store(base + part * (BLOCK_M * BLOCK_N) + offs, acc)
  tl.debug_barrier()
  last = tl.atomic_add(counters + slot, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
  if last:
    tl.debug_barrier()
    acc = tl.load(base + offs, cache_modifier=".cg")
    for r in tl.static_range(1, SPLIT_K):  # part order: deterministic sums
      acc += tl.load(base + r * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
  return acc, last


@triton.jit
def tile_part(a_desc, b_desc, row0, col0, t, part, scale, partials_ptr, counters, SPLIT_FROM,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr,
              trace_ptr=0, j=0, TRACE: tl.constexpr = False):
  """Part `part` of output tile t (all of its k where t < SPLIT_FROM or without split-K) at
  [row0, col0], fp8: times `scale` (each part scaled, so the sum of the parts is the scaled
  sum).  (the tile's sum, True) where this part completes the tile, (acc, False) where another
  part will (combine; counters: the split counters, this rank's own row of the arrival
  counters).  TRACE: the main loop's end stamped as the CTA's j-th unit (kernels/tl_trace.py)."""
  acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
  if SPLIT_K == 1:
    acc = dot_k(acc, a_desc, b_desc, row0, col0, 0, K, BLOCK_K, FP8)
    tl_trace.stamp(trace_ptr, j, t, tl_trace.MAIN_DONE, TRACE)
    if FP8:
      acc = acc * scale
    return acc, True
  split = t >= SPLIT_FROM
  # a whole tile is its only part of one: k-blocks [0, KB) (a ragged last block reads zeros)
  k_lo, k_hi = k_range(tl.where(split, part, 0), K, BLOCK_K, tl.where(split, SPLIT_K, 1))
  acc = dot_k(acc, a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_K, FP8)
  tl_trace.stamp(trace_ptr, j, t, tl_trace.MAIN_DONE, TRACE)
  if FP8:
    acc = acc * scale
  last = t < SPLIT_FROM
  if split:
    acc, last = combine(acc, t - SPLIT_FROM, part, partials_ptr, counters, BLOCK_M, BLOCK_N,
                        SPLIT_K)
  return acc, last


@triton.jit
def sum_own_rows(acc, slot, part, partials_ptr, counters, err_slot, op_id, rank,
                TIMEOUT_NS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, R: tl.constexpr, trace_ptr=0, j=0,
                TRACE: tl.constexpr = False):
  """Rows [part * R, part * R + R) of the split tile `slot`'s sum over its parts (the module's
  Spread; R: a power of 2 >= BLOCK_M / SPLIT_K, so the last parts may have fewer rows or none;
  rows past BLOCK_M are zeros): store this part's partial, count it, wait for the other parts'
  counts where this part has rows (a timeout records chunk -1 - slot of the own rank), then
  sum the rows of every partial in part order.  TRACE: when the wait had passed, stamped as
  the CTA's j-th unit (tl_trace.PARTS_IN)."""
  cols = tl.arange(0, BLOCK_N)
  rows = tl.arange(0, BLOCK_M)
  base = partials_ptr + slot.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
  tl.store(base + part * (BLOCK_M * BLOCK_N) + rows[:, None] * BLOCK_N + cols[None, :], acc)
  tl.debug_barrier()
  tl.atomic_add(counters + slot, 1, sem="acq_rel", scope="gpu")
  mine = part * R + tl.arange(0, R)
  if part * R < BLOCK_M:
    wait_at_least(counters + slot, SPLIT_K, err_slot, op_id, rank, rank, -1 - slot, TIMEOUT_NS)
  tl_trace.stamp(trace_ptr, j, slot, tl_trace.PARTS_IN, TRACE)
  offs = mine[:, None] * BLOCK_N + cols[None, :]
  mask = mine[:, None] < BLOCK_M
  total = tl.load(base + offs, mask=mask, other=0.0, cache_modifier=".cg")
  for r in tl.static_range(1, SPLIT_K):  # part order: the same sums as combine
    total += tl.load(base + r * (BLOCK_M * BLOCK_N) + offs, mask=mask, other=0.0,
                     cache_modifier=".cg")
  return total


@triton.jit
def spread_part(a_desc, b_desc, row0, col0, t, part, scale, partials_ptr, counters, err_slot,
                op_id, rank, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr,
                TIMEOUT_NS: tl.constexpr, R: tl.constexpr, trace_ptr=0, j=0,
                TRACE: tl.constexpr = False):
  """tile_part with Spread (every tile split: SPLIT_FROM == 0): rows [part * R, part * R + R)
  of tile t's sum (sum_own_rows), for the caller to store those of them below BLOCK_M.
  TRACE: the main loop's end and the other parts' arrival stamped as the CTA's j-th unit."""
  k_lo, k_hi = k_range(part, K, BLOCK_K, SPLIT_K)
  acc = dot_k(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a_desc, b_desc, row0, col0, k_lo,
              k_hi, BLOCK_K, FP8)
  tl_trace.stamp(trace_ptr, j, t, tl_trace.MAIN_DONE, TRACE)
  if FP8:
    acc = acc * scale
  return sum_own_rows(acc, t, part, partials_ptr, counters, err_slot, op_id, rank, TIMEOUT_NS,
                     BLOCK_M, BLOCK_N, SPLIT_K, R, trace_ptr, j, TRACE)
