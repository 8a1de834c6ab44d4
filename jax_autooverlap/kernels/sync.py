"""Cross-GPU synchronisation primitives for Triton kernels (system scope, bounded).

Ordering protocol between a producer CTA on one GPU and consumer CTAs on
another:
  producer: plain stores of the data -> CTA barrier -> atomic add with
            release semantics at system scope on the consumer's counter;
  consumer: spin on an acquire load at system scope until the counter
            reaches the expected value -> async-proxy fence (the data is then
            read by TMA, which goes through the async proxy) -> CTA barrier.
Every spin is bounded by %globaltimer; on expiry the kernel writes an error
record to pinned host memory and traps, so a missing peer becomes an error
instead of a hang.  (%globaltimer is only compared on one GPU.)
"""
import triton
import triton.language as tl

ERR_TIMEOUT = tl.constexpr(1)  # must match runtime.cuda.ERR_TIMEOUT
# Where a GPU's workspace header holds the address of its process's error record (it
# differs per process, so it cannot be in the address table); must match runtime.workspace.
ERROR_SLOT_OFFSET = tl.constexpr(128)


@triton.jit
def globaltimer():
  return _special_register_u64("%globaltimer")


@triton.jit
def clock64():
  """The SM's cycle counter (kernels/gluon_trace.py)."""
  return _special_register_u64("%clock64")


@triton.jit
def _special_register_u64(NAME: tl.constexpr):
  return tl.inline_asm_elementwise("mov.u64 $0, " + NAME + ";", "=l", [], dtype=tl.int64,
                                   is_pure=False, pack=1)


@triton.jit
def ld_acquire_sys(ptr):
  return tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr],
                                   dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async():
  tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                            is_pure=False, pack=1)


@triton.jit
def fence_sys():
  tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                            is_pure=False, pack=1)


@triton.jit
def trap():
  tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                            pack=1)


@triton.jit
def signal_add(ptr, value):
  """Publish everything this CTA stored so far, then add `value` to a (peer's) counter."""
  tl.debug_barrier()
  tl.atomic_add(ptr, value, sem="release", scope="sys")


@triton.jit
def signal_add_all(ptrs, value, mask):
  """signal_add to a block of counters at once (ptrs; where mask is false nothing is added):
  one CTA barrier, then the releases from as many threads together, in one instruction.  One
  after the other (a barrier and a release per counter), the seven owners of a packed GEMM+RS
  tile at TP 8 cost 3.4-5.1 us more per call (docs/NOTES.md, seventeenth round)."""
  tl.debug_barrier()
  tl.atomic_add(ptrs, value, mask=mask, sem="release", scope="sys")


@triton.jit
def wait_at_least(ptr, expected, err_slot, op_id, rank, src, chunk, timeout_ns: tl.constexpr,
                  OUT_OF_LINE: tl.constexpr = False):
  """Spin until *ptr >= expected; on timeout record (op, rank, src, chunk) in the error
  record whose address is stored at err_slot, and trap.  OUT_OF_LINE: the first acquire load
  inline (the usual case: the counter is already there), the polling loop in a function of its
  own, whose registers are its own (inline beside a live accumulator in a one-warpgroup
  partition, the loop made ptxas spill it: docs/NOTES.md)."""
  seen = ld_acquire_sys(ptr)
  if seen < expected:
    if OUT_OF_LINE:
      _poll_out_of_line(ptr, expected, seen, err_slot, op_id, rank, src, chunk, timeout_ns)
    else:
      _poll(ptr, expected, seen, err_slot, op_id, rank, src, chunk, timeout_ns)
  fence_proxy_async()
  tl.debug_barrier()


@triton.jit
def _poll(ptr, expected, seen, err_slot, op_id, rank, src, chunk, timeout_ns: tl.constexpr):
  """wait_at_least's bounded polling loop and error record."""
  start = globaltimer()
  while seen < expected:
    seen = ld_acquire_sys(ptr)
    if globaltimer() - start > timeout_ns:
      _timed_out(err_slot, op_id, rank, src, chunk, seen, expected)


@triton.jit
def _timed_out(err_slot, op_id, rank, src, chunk, seen, expected):
  """Write the timeout record whose address is stored at err_slot, then trap."""
  rec = tl.load(err_slot.to(tl.pointer_type(tl.int64))).to(tl.pointer_type(tl.int32))
  tl.store(rec + 1, op_id)
  tl.store(rec + 2, rank)
  tl.store(rec + 3, src)
  tl.store(rec + 4, chunk)
  tl.store(rec + 5, seen)
  tl.store(rec + 6, expected)
  # Plain store + full system fence (atomics to host memory over PCIe may be
  # unsupported), so the record is in host memory before the trap kills us.
  tl.store(rec, ERR_TIMEOUT)
  fence_sys()
  trap()


@triton.jit
def wait_all_at_least(ptrs, expected, mask, err_slot, op_id, rank, srcs, chunk,
                      timeout_ns: tl.constexpr):
  """wait_at_least for a block of counters (ptrs, expected, srcs: blocks of one shape; where
  mask is false, ptrs must still be valid and nothing is waited for): the acquire loads go out
  together, one load latency for all of them rather than one each.  Then a CTA barrier (every
  thread after every acquire) and each thread's async-proxy fence.  On timeout the record names
  the lowest src still short."""
  seen = ld_acquire_sys(ptrs)
  short = mask & (seen < expected)
  if tl.max(short.to(tl.int32), axis=0) > 0:
    start = globaltimer()
    while tl.max(short.to(tl.int32), axis=0) > 0:
      seen = ld_acquire_sys(ptrs)
      short = mask & (seen < expected)
      if globaltimer() - start > timeout_ns:
        src = tl.min(tl.where(short, srcs, 1 << 30), axis=0)
        first = short & (srcs == src)
        _timed_out(err_slot, op_id, rank, src, chunk, tl.max(tl.where(first, seen, -1), axis=0),
                   tl.max(tl.where(first, expected, -1), axis=0))
  tl.debug_barrier()
  fence_proxy_async()


@triton.jit(noinline=True)
def _poll_out_of_line(ptr, expected, seen, err_slot, op_id, rank, src, chunk,
                      timeout_ns: tl.constexpr):
  _poll(ptr, expected, seen, err_slot, op_id, rank, src, chunk, timeout_ns)


@triton.jit
def table_address(table_ptr, i):
  """The i-th 64-bit address of a table stored as uint32 (lo, hi) pairs."""
  lo = tl.load(table_ptr + 2 * i).to(tl.int64) & 0xFFFFFFFF
  hi = tl.load(table_ptr + 2 * i + 1).to(tl.int64)
  return (hi << 32) | lo


@triton.jit
def epilogue_scale(table_ptr, WORLD: tl.constexpr):
  """fp8 kernels: the f32 scale their epilogue multiplies the product by (the operands'
  per-tensor scales), whose bits the launch puts in the first word of the address table's
  last pair (backends/triton.py's with_scale)."""
  return tl.load(table_ptr + 2 * WORLD).to(tl.float32, bitcast=True)


@triton.jit
def finish_call(header, my_flags, tile_counter, epoch, NUM_CTAS: tl.constexpr,
                NUM_FLAGS: tl.constexpr, FLAG_BLOCK: tl.constexpr):
  """The last CTA out zeroes this call's counters and advances the epoch.

  Safe because every CTA of this call has finished reading them, and peers
  write this parity slot again only after this GPU has run its next call.
  """
  tl.debug_barrier()
  done = tl.atomic_add(header + 1, 1, sem="acq_rel", scope="gpu")
  if done == NUM_CTAS - 1:
    offs = tl.arange(0, FLAG_BLOCK)
    tl.store(my_flags + offs, tl.zeros([FLAG_BLOCK], tl.int32), mask=offs < NUM_FLAGS)
    tl.store(tile_counter, 0)
    tl.store(header + 1, 0)
    tl.store(header, epoch + 1)
