"""The cross-GPU protocol of kernels/sync.py, for Gluon kernels.

Gluon kernels call the scalar primitives of kernels/sync.py directly (they
are plain @triton.jit scalar code); what needs tensors, which in Gluon carry
an explicit layout, or TMA-store completion, is here.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from jax_autooverlap.kernels import gluon_engine as eng
from jax_autooverlap.kernels.sync import signal_add, table_address


@gluon.jit
def full_write_wait():
  """Wait until every TMA store this thread issued has been written to global memory (not only
  read out of shared memory), then order those async-proxy writes before this thread's later
  generic-proxy operations.  Every thread runs it, so it covers whichever threads issued.
  (triton 3.6's tma.store_wait only has the shared-memory-read variant.)"""
  tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
                            "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def call_state(table_ptr, rank_ptr, FLAGS_OFF: gl.constexpr, WORLD: gl.constexpr,
               MAX_CHUNKS: gl.constexpr):
  """(rank, workspace address, header, epoch, parity, this parity's arrival counters) of this
  call: a chain of dependent loads (rank -> address table -> epoch).  Each partition of a
  warp-specialised kernel loads it where it first needs it: values handed from the kernel's
  top level into a worker partition must be ready before any partition starts, which would
  put the whole chain before the first tile."""
  rank = gl.load(rank_ptr)
  ws = table_address(table_ptr, rank)
  header = ws.to(gl.pointer_type(gl.int32))
  epoch = gl.load(header)
  parity = epoch % 2
  my_flags = (ws + FLAGS_OFF).to(gl.pointer_type(gl.int32)) + parity * WORLD * MAX_CHUNKS
  return rank, ws, header, epoch, parity, my_flags


@gluon.jit
def all_see_at_least(ptr, expected, NUM_WARPS: gl.constexpr):
  """One look, no wait: whether *ptr >= expected (acquire, system scope), the same answer in
  every thread of the partition.  Each thread loads with acquire; the answer is their minimum,
  so where it is true every thread has acquired a value >= expected (a per-thread scalar load
  could disagree between threads while the counter moves, and split the partition at its next
  barrier)."""
  layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
  ptrs = ptr + gl.zeros([32 * NUM_WARPS], gl.int32, layout)
  seen = gl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptrs],
                                   dtype=gl.int32, is_pure=False, pack=1)
  return gl.min(seen, axis=0) >= expected


@gluon.jit
def signal_after_tma_stores(flag):
  """Publish the TMA stores issued so far, then add 1 to a (peer's) counter (release, system scope).

  The engine's TMA stores are issued by one elected thread in each of several
  warps (one message per 64-column box).  Every thread waits for its own
  bulk groups to be written (full_write_wait: a no-op where it issued none),
  then the CTA barrier in signal_add orders all of those completions before
  the single thread that performs the release; release is cumulative, so the
  peer that acquires the counter sees every byte of the tile.
  """
  full_write_wait()
  signal_add(flag, 1)


@gluon.jit
def hand_off_release(flag, box, ready, free, n, NUM_WARPS: gl.constexpr):
  """signal_after_tma_stores with the release itself done by another warp (the signaller),
  which takes `flag` from a ring (gluon_engine.alloc_ring(gl.int64)): every thread waits for
  its TMA stores to be written and fences the async proxy (full_write_wait), then `post`'s
  barrier and mbarrier arrive
  order those completions before the taker's release (system scope, cumulative), so the
  peer that acquires the counter sees every byte.  The senders do not wait for the
  system-scope release (~1 µs per pushed tile when the consumers did it: docs/NOTES.md)."""
  full_write_wait()
  tl.debug_barrier()
  eng.post(box, ready, free, n, flag.to(gl.int64, bitcast=False), NUM_WARPS)


@gluon.jit
def signaller(rings):
  """One-warp partition: add 1 (release, system scope) to every counter posted in the rings
  (hand_off_release; rings: (box, ready, free) per posting partition), until a 0 arrives.
  With several rings (a consumer partition per warpgroup) every poster posts one release per
  pushed tile, in the same tile order, then a 0, so the rings are taken in turn; no deadlock:
  a poster that runs ahead and finds its ring full holds no operand stage, so the others
  reach their own posts."""
  n = 0
  flag = eng.take(rings[0][0], rings[0][1], rings[0][2], n, 1)
  while flag != 0:
    signal_add(flag.to(gl.pointer_type(gl.int32)), 1)
    for i in gl.static_range(1, len(rings)):
      other = eng.take(rings[i][0], rings[i][1], rings[i][2], n, 1)
      signal_add(other.to(gl.pointer_type(gl.int32)), 1)
    n += 1
    flag = eng.take(rings[0][0], rings[0][1], rings[0][2], n, 1)
  for i in gl.static_range(1, len(rings)):
    eng.take(rings[i][0], rings[i][1], rings[i][2], n, 1)  # their 0s


@gluon.jit
def finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS: gl.constexpr,
                NUM_FLAGS: gl.constexpr, FLAG_BLOCK: gl.constexpr, NUM_WARPS: gl.constexpr):
  """kernels/sync.py's finish_call: the last CTA out zeroes this call's counters and advances
  the epoch (every CTA of this call has finished reading them; peers write this parity slot
  again only after this GPU has run its next call)."""
  tl.debug_barrier()
  done = gl.atomic_add(header + 1, 1, sem="acq_rel", scope="gpu")
  if done == NUM_CTAS - 1:
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    offs = gl.arange(0, FLAG_BLOCK, layout=layout)
    gl.store(my_flags + offs, gl.zeros([FLAG_BLOCK], gl.int32, layout), mask=offs < NUM_FLAGS)
    gl.store(tile_counter, 0)
    gl.store(header + 1, 0)
    gl.store(header, epoch + 1)
