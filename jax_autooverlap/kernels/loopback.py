"""Loopback helper: make a fused kernel's waits on its peers succeed at once (one-GPU timing).

In loopback mode (bench/loopback/) a fused kernel runs as rank 0 of a group
of WORLD whose WORLD - 1 "peer" workspaces are buffers on the same GPU.  The
peers' data is written into rank 0's workspace once, when it is built; the
arrival counters, which the kernel zeroes at the end of every call, are set
again before every call by this kernel.  The counters of both parity slots
are set to a value above any expected count, for every source rank but 0,
so every wait of the next call passes on its first poll.

The kernel also copies the address table through to its output: the fused
kernel takes that output as its table, so XLA cannot run it before this one.
"""
import triton
import triton.language as tl

ARMED = tl.constexpr(1 << 30)  # above every expected count (chunk tiles x columns)


@triton.jit
def loopback_arm_kernel(table_ptr, table_out_ptr, TABLE_LEN: tl.constexpr, WORLD: tl.constexpr,
                        FLAGS_OFF: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
  offs = tl.arange(0, BLOCK)
  tl.store(table_out_ptr + offs, tl.load(table_ptr + offs, mask=offs < TABLE_LEN),
           mask=offs < TABLE_LEN)
  lo = tl.load(table_ptr).to(tl.int64) & 0xFFFFFFFF
  hi = tl.load(table_ptr + 1).to(tl.int64)
  flags = (((hi << 32) | lo) + FLAGS_OFF).to(tl.pointer_type(tl.int32))
  # counters int32[2 parity][WORLD src][MAX_CHUNKS]; src 0 is this rank itself.
  src = (offs // MAX_CHUNKS) % WORLD
  n = 2 * WORLD * MAX_CHUNKS
  tl.store(flags + offs, tl.full([BLOCK], ARMED, tl.int32), mask=(offs < n) & (src != 0))
