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


@triton.jit
def globaltimer():
  return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
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
def wait_at_least(ptr, expected, err_ptr, op_id, rank, src, chunk, timeout_ns: tl.constexpr):
  """Spin until *ptr >= expected; on timeout record (op, rank, src, chunk) and trap."""
  seen = ld_acquire_sys(ptr)
  if seen < expected:
    start = globaltimer()
    while seen < expected:
      seen = ld_acquire_sys(ptr)
      if globaltimer() - start > timeout_ns:
        rec = err_ptr.to(tl.pointer_type(tl.int32))
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
  fence_proxy_async()
  tl.debug_barrier()
