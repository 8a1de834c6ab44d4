"""Experiment (triton >= 3.7 only): the engine's GEMM in 2-CTA clusters, B multicast, with
ping-pong consumers (bench/NOTES.md, "Clusters and multicast").

Why: the engine's consumers (two warpgroups sharing one 128 x 256 tile) run their epilogues
together with the tensor cores idle (~1.1 kcycles per tile, measured).  Ping-pong consumers
(each warpgroup a whole tile, taking turns) hide that epilogue behind the other warpgroup's
main loop, but with a tile per warpgroup each k-block's operands serve half the FLOPs, and
without multicast they starved on operand feed (1.01-1.16 x cuBLAS, third session).  Here
the two CTAs of a cluster compute the two halves (rows) of one [2 BM, BN] cluster tile, so
they share every B k-block: the cluster's lead CTA TMA-loads it once and multicasts it into
both CTAs' shared memory, which brings the L2 -> SM traffic per FLOP back to the cooperative
128 x 256 tile's.

Measured on one H200 (bench/NOTES.md, sixth session): correct, but 1.09-1.12 x cuBLAS with
128 x 128 tiles and 5 stages and 1.8 x with 64 x 256 and 4 stages, against the cooperative
engine's 1.01-1.04 x; why is not established.  Not used by the fused kernels.

Gluon's multi-CTA model: one program per cluster (program_id is the cluster's), tensors and
shared memory sharded across the CTAs by their layouts' cga_layout.  A is [2 BM, BK] split
along M (each CTA loads and holds its BM rows); B is [BK, BN] broadcast (each CTA holds all of
it; a multicast load is issued by the lead CTA); C and the accumulators are split along M.

Per CTA: one producer warp and two consumer warpgroups.  The CTA's tiles (static persistent
schedule: cluster tile pid, pid + clusters, ...) alternate between the warpgroups, j-th tile
to warpgroup j % 2; the producer fills one STAGES-deep ring with the k-blocks of the tiles in
order, so the warpgroups' main loops follow each other through the ring and each one's
epilogue runs while the other computes.

Invariants:
- Stage s = it % STAGES, phase (it // STAGES) & 1; tile j's k-blocks are it = j KB ...
  j KB + KB - 1 on both sides (KB = k-blocks per tile), so no tile ring is needed.
- A stage is written by both CTAs' TMA (A: each its own; B: the lead's multicast into both),
  so it is free again only when both CTAs' consumers have handed it back: `empty` (per CTA,
  guards A) and `empty2` (one barrier for the pair in the lead CTA, counting both CTAs'
  releases; only the lead waits on it, and only the lead issues B).
- `ready` is per CTA and expects the CTA's A rows plus the whole B block; the lead's
  multicast completes bytes on both CTAs' `ready` at the same offset.  A multicast may land
  before the receiving CTA's own expect for that phase (the transaction count goes negative,
  which PTX allows); it cannot land a phase early, because the lead issues round r + 1 of a
  stage only after both CTAs' consumers released round r, i.e. after they saw it complete.
- A warpgroup starts tile j's main loop only after the other one's main loop of tile j - 1 has
  passed all its stages (`turn`, one barrier per warpgroup).  Besides making the warpgroups
  take turns on the tensor cores, this keeps every ready/empty wait at most one phase ahead of
  the stage's last completed one: a warpgroup skips the other's tile, which may span several
  rounds of the ring, and an mbarrier parity wait two phases ahead passes on a stale phase
  (seen: wrong results and a hang on the GPU without it).
- The pair barrier's releases stay within one phase of the lead's waits only because the
  non-lead needs the lead's multicast for every round: a build in which each CTA loaded B
  itself (pair barrier kept) let the non-lead run two phases ahead and hung (seen on the GPU).
  The schedule without multicast is num_ctas=1 (no pair barrier at all).
- Cross-CTA barriers are initialised before warp_specialize (the compiler adds the cluster
  barrier that orders the inits before any use).
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (cluster, fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma_wait)

from jax_autooverlap._compat import lean_launch
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels.gemm_rs import tile_of

WG_WARPS = gl.constexpr(4)
PRODUCER_WARPS = gl.constexpr(1)
WG_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)


@gluon.constexpr_function
def _cga(ctas, split):
  """cga_layout over `ctas` (1 or 2) CTAs: split = one half of dimension 0 each, else every CTA
  holds the whole block (broadcast); none for one CTA."""
  if ctas == 1:
    return []
  return [[1, 0]] if split else [[0, 0]]


@gluon.constexpr_function
def _smem_layout(shape, dtype, ctas, split):
  return gl.NVMMASharedLayout.get_default_for(shape, dtype, cga_layout=_cga(ctas, split))


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, empty2, K: gl.constexpr,
              TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              CLUSTERS: gl.constexpr):
  CM: gl.constexpr = a_desc.block_type.shape[0]
  BK: gl.constexpr = a_desc.block_type.shape[1]
  BN: gl.constexpr = b_desc.block_type.shape[1]
  STAGES: gl.constexpr = a_bufs.shape[0]
  PAIR: gl.constexpr = gl.num_ctas() > 1
  nbytes: gl.constexpr = a_desc.nbytes_per_cta + b_desc.nbytes_per_cta
  it = 0
  for t in range(gl.program_id(0), TM * TN, CLUSTERS):
    _, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    for k in range(0, K, BK):
      s = it % STAGES
      phase = ((it // STAGES) & 1) ^ 1
      mbarrier.wait(empty.index(s), phase)
      if PAIR:
        mbarrier.wait(empty2.index(s), phase)   # the lead CTA only: both CTAs released stage s
      mbarrier.expect(ready.index(s), nbytes)
      tma.async_load(a_desc, [tm * CM, k], ready.index(s), a_bufs.index(s))
      tma.async_load(b_desc, [k, tn * BN], ready.index(s), b_bufs.index(s), multicast=gl.num_ctas() > 1)
      it += 1


@gluon.jit
def _consumer(WG: gl.constexpr, c_desc, c_smem, a_bufs, b_bufs, ready, empty, empty2, turn,
              K: gl.constexpr, TM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr,
              CLUSTERS: gl.constexpr):
  """Warpgroup WG: tiles j = WG, WG + 2, ... of this cluster's sequence, whole."""
  CM: gl.constexpr = c_desc.block_type.shape[0]
  BN: gl.constexpr = c_desc.block_type.shape[1]
  BK: gl.constexpr = a_bufs.shape[2]
  STAGES: gl.constexpr = a_bufs.shape[0]
  KB: gl.constexpr = (K + BK - 1) // BK
  PAIR: gl.constexpr = gl.num_ctas() > 1
  acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
      version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, BN, 16],
      cga_layout=_cga(gl.num_ctas(), True))
  j = WG
  for t in range(gl.program_id(0) + WG * CLUSTERS, TM * TN, 2 * CLUSTERS):
    _o, tm, tn = tile_of(t, 1, TM, TN, GROUP_M)
    if j > 0:   # the other warpgroup's main loop of tile j - 1 has passed all its stages
      mbarrier.wait(turn.index(WG), ((j - 1) // 2) & 1)
    it = j * KB
    acc = gl.zeros([CM, BN], gl.float32, acc_layout)
    for k in range(0, K, BK):
      acc = eng.mma_k_block(a_bufs, b_bufs, ready, acc, it)
      tl.debug_barrier()   # every warp of the warpgroup is past k-block it - 1
      prev = (it + STAGES - 1) % STAGES
      mbarrier.arrive(empty.index(prev), pred=k > 0)
      if PAIR:
        mbarrier.arrive(empty2.index(prev), pred=k > 0)
      it += 1
    mbarrier.arrive(turn.index(1 - WG))   # tile j + 1 may start its main loop
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    tl.debug_barrier()
    last = (it + STAGES - 1) % STAGES
    mbarrier.arrive(empty.index(last))
    if PAIR:
      mbarrier.arrive(empty2.index(last))
    tma.store_wait(0)       # this warpgroup's previous tile has left its buffer
    tl.debug_barrier()
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tl.debug_barrier()
    tma.async_store(c_desc, [tm * CM, tn * BN], c_smem)
    j += 2
  tma.store_wait(0)


@lean_launch
@gluon.jit
def gluon_gemm_mc_kernel(a_ptr, b_ptr, c_ptr, scratch_ptr,
                         M: gl.constexpr, K: gl.constexpr, N: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, CLUSTERS: gl.constexpr,
                         SETUP_FENCE: gl.constexpr = False):
  """c = a @ b; BLOCK_M rows per CTA and warpgroup tile (the cluster tile is num_ctas
  BLOCK_M).  Launched with num_ctas=2 (clusters) or 1 (the same ping-pong schedule, each CTA
  on its own: the baseline that separates the clusters' effect)."""
  CTAS: gl.constexpr = gl.num_ctas()
  gl.static_assert(CTAS == 1 or CTAS == 2, "launch with num_ctas=1 or 2")
  CM: gl.constexpr = CTAS * BLOCK_M
  dtype: gl.constexpr = a_ptr.dtype.element_ty
  a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[CM, BLOCK_K],
                                      layout=_smem_layout([CM, BLOCK_K], dtype, CTAS, True))
  b_desc = tma.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N],
                                      layout=_smem_layout([BLOCK_K, BLOCK_N], dtype, CTAS, False))
  c_desc = tma.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[CM, BLOCK_N],
                                      layout=_smem_layout([CM, BLOCK_N], c_ptr.dtype.element_ty, CTAS, True))
  a_bufs = gl.allocate_shared_memory(dtype, [STAGES, CM, BLOCK_K], a_desc.layout)
  b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
  c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, CM, BLOCK_N], c_desc.layout)
  ready = mbarrier.allocate_mbarrier(batch=STAGES)
  empty = mbarrier.allocate_mbarrier(batch=STAGES)
  if CTAS > 1:
    empty2 = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
  else:
    empty2 = empty    # never used: no pair
  turn = mbarrier.allocate_mbarrier(batch=2)
  for s in gl.static_range(STAGES):
    mbarrier.init(ready.index(s), count=1)
    mbarrier.init(empty.index(s), count=1)
    if CTAS > 1:
      mbarrier.init(empty2.index(s), count=1)   # x 2: one release from each CTA
  for w in gl.static_range(2):
    mbarrier.init(turn.index(w), count=1)
  TM: gl.constexpr = (M + CM - 1) // CM
  TN: gl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
  # Orders everything above (descriptors staged in shared memory, barrier inits) before any
  # multicast into the peer: without it the compiler guards each multicast with a rendezvous
  # of the two producers, every k-block (seen in the 64 x 256 build: 2.9 -> 1.8 x cuBLAS).
  if SETUP_FENCE:   # no proxy fence in the loops (an experiment: 0-2 % here, bench/NOTES.md)
    eng.setup_fence(CTAS > 1)
  if CTAS > 1:
    cluster.barrier()
  gl.warp_specialize([
      (_consumer, (0, c_desc, c_smem.index(0), a_bufs, b_bufs, ready, empty, empty2, turn, K, TM, TN,
                   GROUP_M, CLUSTERS)),
      (_consumer, (1, c_desc, c_smem.index(1), a_bufs, b_bufs, ready, empty, empty2, turn, K, TM, TN,
                   GROUP_M, CLUSTERS)),
      (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, empty2, K, TM, TN, GROUP_M,
                   CLUSTERS)),
  ], [WG_WARPS, PRODUCER_WARPS], [WG_REGS, PRODUCER_REGS])
