"""The `tl` fused kernels' work on one output tile (tile_part: the main loop dot_k, the fp8
scale) and their split-K (KernelConfig.split_k = S > 1): where a shape has fewer output tiles
than SMs, each tile's k-blocks are cut into S parts, each part a work unit of its
own (units t*S .. t*S + S - 1 of tile t, handed out by the kernel's tile counter), so S times
as many CTAs work on the GEMM.

Every part stores its fp32 partial tile in the launch's `partials` output (slot [tile, part]),
then counts itself on the tile's split counter (acq_rel, GPU scope).  The part that counts
last sums the S partial tiles in part order 0 .. S-1 (a fixed order: bit-identical results
whichever part comes last) and finishes the tile as the unsplit kernel does (store, push or
own-rows sum); the others go on to their next unit.  No CTA waits for another CTA of its GPU.

The split counters are this call's arrival counters of the GPU's own rank (runtime/workspace.py
holds int32[2 parity][world][MAX_CHUNKS]; no peer ever writes a rank's own row, no kernel
waits on it): zero when the call starts, zeroed again with the others by the call's last CTA
(kernels/sync.py finish_call).  Hence at most MAX_CHUNKS split tiles per call
(tuning/select.py split_k_unsupported; the launchers refuse more).

Memory ordering: each thread's partial stores, then a CTA barrier, then one thread's acq_rel
add (release is cumulative over what the barrier ordered before it); the last part's add
acquires every earlier part's release, and a CTA barrier orders its other threads' loads
after it; those loads bypass L1 (`.cg`), which is not coherent between SMs.
"""
import triton
import triton.language as tl


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
def k_range(part, K: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
  """[lo, hi) of part `part`'s k (elements): the k-blocks split as evenly as whole blocks go,
  none empty (SPLIT_K <= the k-block count: tuning/select.py split_k_unsupported)."""
  KB: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
  return (part * KB // SPLIT_K) * BLOCK_K, ((part + 1) * KB // SPLIT_K) * BLOCK_K


@triton.jit
def combine(acc, tile, part, partials_ptr, counters, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SPLIT_K: tl.constexpr):
  """(the tile's sum over its parts, True) for the part that counts last; (acc, False) for the
  others.  partials_ptr: fp32 [tiles, SPLIT_K, BLOCK_M, BLOCK_N]; counters: int32 per tile."""
  rows = tl.arange(0, BLOCK_M)
  cols = tl.arange(0, BLOCK_N)
  offs = rows[:, None] * BLOCK_N + cols[None, :]
  base = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
  tl.store(base + part * (BLOCK_M * BLOCK_N) + offs, acc)
  tl.debug_barrier()
  last = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
  total = acc
  if last:
    tl.debug_barrier()
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(SPLIT_K):  # part order: deterministic sums
      total += tl.load(base + r * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
  return total, last


@triton.jit
def tile_part(a_desc, b_desc, row0, col0, t, part, scale, partials_ptr, counters,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8: tl.constexpr):
  """Part `part` of output tile t (all of its k without split-K) at [row0, col0], fp8: times
  `scale` (each part scaled, so the sum of the parts is the scaled sum).  (the tile's sum,
  True) where this part completes the tile, (acc, False) where another part will (combine;
  counters: the split counters, this rank's own row of the arrival counters)."""
  acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
  if SPLIT_K == 1:
    k_lo, k_hi = 0, K
  else:
    k_lo, k_hi = k_range(part, K, BLOCK_K, SPLIT_K)
  acc = dot_k(acc, a_desc, b_desc, row0, col0, k_lo, k_hi, BLOCK_K, FP8)
  if FP8:
    acc = acc * scale
  last = True
  if SPLIT_K > 1:
    acc, last = combine(acc, t, part, partials_ptr, counters, BLOCK_M, BLOCK_N, SPLIT_K)
  return acc, last
