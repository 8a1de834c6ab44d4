"""The `tl` fused kernels run by Triton's interpreter on the CPU, as rank 0 of a loopback group.

    TRITON_INTERPRET=1 python tests/interpret_kernels.py OP WORLD SPLIT_K BLOCK_M BLOCK_N \
        [M K N [SPARE [SPLIT_TAIL [PACK_SHARDS [RANK [NUM_COMM [OUT]]]]]]]

(tests/test_kernel_interpret.py starts it: the interpreter is chosen when a kernel module is
imported, so it needs a process of its own.)  The loopback fixture's host images
(bench/loopback/fixture.py: rank 0's workspace with every peer's piece in both parity slots,
the peers' workspaces back to back, the address table) in host memory, the set-up kernel that
arms rank 0's counters, then the fused kernel (float16: NumPy has no bfloat16), twice (both
parity slots); its output and its push into each peer's workspace are compared with the
unfused result.  SPARE: bytes the workspaces have beyond what the call needs (a grown
workspace: parity slot 1 further away).  SPLIT_TAIL: split only the last tiles
(KernelConfig.split_tail).  PACK_SHARDS 1: the shards (AG) or owners' rows (GEMM+RS) packed
into the row tiles (KernelConfig.pack_shards).  RANK: the kernel runs as that rank of the
group (default 0; the peers' pieces and counters made here, not by the benchmark's
fixture).  NUM_COMM: the AG's movers (default 2; more split a small shard's pushes into
column parts, launch.copy_block).  OUT: the product's dtype (default float16, the
operands'; float32 as preferred_element_type=float32 gives it).  The interpreter runs the
CTAs one after another, so this checks what the kernel computes and where it writes (tile
order, split-K's parts and sums, the counters left zero), not the memory ordering between
CTAs or GPUs.  The interpreter has no inline assembly: the system-scope acquire load is a
plain load here, the proxy fence and the clock nothing.
Prints one line: OK, or what differed.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

# The operands are host memory already: the executor copies nothing.
interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (list(args), dict(kwargs))
interpreter.GridExecutor._restore_args_dev = lambda self, *args: None

from jax_autooverlap.kernels import sync  # noqa: E402


@triton.jit
def _plain_acquire(ptr):
  return tl.load(ptr)


@triton.jit
def _no_fence():
  pass


@triton.jit
def _zero_clock():
  return 0


sync.ld_acquire_sys = _plain_acquire
sync.fence_proxy_async = _no_fence
sync.globaltimer = _zero_clock


class _Dtype:
  """A dtype as Triton reads it from a tensor (its str).  One object per name: Triton caches
  what it made of a dtype by the object's identity."""
  _all: dict = {}

  def __new__(cls, name):
    if name not in cls._all:
      cls._all[name] = super().__new__(cls)
      cls._all[name].name = name
      cls._all[name].itemsize = np.dtype(name).itemsize  # (what a TensorDescriptor reads)
    return cls._all[name]

  def __str__(self):
    return self.name


class Host:
  """A NumPy array as a kernel argument (what the interpreter reads from a tensor)."""

  def __init__(self, array):
    self.array = array
    self.dtype = _Dtype(array.dtype.name)

  def data_ptr(self):
    return self.array.ctypes.data


def _operand_descs(a, b, cfg):
  """The operands' descriptors the launchers make on the host (backends/launch.operand_descs;
  16-bit operands: b is [K, N])."""
  from triton.tools.tensor_descriptor import TensorDescriptor
  (m, k), n = a.shape, b.shape[1]
  return (TensorDescriptor(Host(a), [m, k], [k, 1], [cfg.block_m, cfg.block_k]),
          TensorDescriptor(Host(b), [k, n], [n, 1], [cfg.block_k, cfg.block_n]))


def _buffer(nbytes, align=4096):
  """Zeroed host bytes at an `align`-aligned address."""
  raw = np.zeros(nbytes + align, np.uint8)
  start = (-raw.ctypes.data) % align
  return raw[start:start + nbytes]


def _references(case, rank, a, b, pieces):
  """(output, {peer: what `rank` pushes into its slot of that peer's workspace}) of the unfused
  computation in f32; pieces: {src: its piece} for every src but `rank` (AG: its shard; GEMM+RS:
  its partial of rank's output rows, summed in rank order after rank's own, as the kernels do)."""
  a, b = a.astype(np.float32), b.astype(np.float32)
  others = [r for r in range(case.world) if r != rank]
  if case.op == "ag":
    gathered = np.concatenate([a if src == rank else pieces[src].astype(np.float32)
                               for src in range(case.world)])
    return gathered @ b, {r: a for r in others}
  rows = case.m // case.world
  partial = (a @ b).astype(case.out_dtype).astype(np.float32)
  out = partial[rank * rows:(rank + 1) * rows].copy()
  for src in others:
    out += pieces[src].astype(np.float32)
  return out, {r: partial[r * rows:(r + 1) * rows] for r in others}


def run(op, world, split_k, block_m, block_n, m, k, n, spare=0, split_tail=0, pack_shards=False,
        rank=0, num_comm=2, out_dtype="", num_sms=16):
  """Rank `rank` of a loopback group: rank 0 with the loopback benchmark's own fixture
  (bench/loopback/fixture.py and its set-up kernel), another rank with the same layout made
  here (its workspace at that rank's place in the table, its peers' pieces in the slots of
  every other source, their counters armed on the host)."""
  from jax_autooverlap.backends.launch import (ag_grid, copy_block, kernel_constants, pack,
                                               partials_type, rs_grid, split_from)
  from jax_autooverlap.bench.loopback import fixture
  from jax_autooverlap.kernels.ag_gemm import ag_gemm_kernel
  from jax_autooverlap.kernels.gemm_rs import gemm_rs_kernel
  from jax_autooverlap.kernels.loopback import ARMED, loopback_arm_kernel
  from jax_autooverlap.runtime import workspace
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import KernelConfig
  case = fixture.Case(op, m, k, n, dtype="float16", world=world, spare=spare, out=out_dtype)
  cfg = KernelConfig(block_m=block_m, block_n=block_n, num_warps=block_m // 16, chunks=2,
                     num_comm=num_comm, split_k=split_k, split_tail=split_tail,
                     pack_shards=pack_shards)
  if not 0 <= rank < world:
    raise ValueError(f"rank {rank} is not in a group of {world}")
  rng = np.random.default_rng(world * 100 + split_k)
  a = rng.standard_normal(case.a_shape).astype(np.float16)
  b = (rng.standard_normal(case.b_shape) / np.sqrt(case.b_shape[0])).astype(np.float16)
  others = [r for r in range(world) if r != rank]
  pieces = {src: rng.standard_normal(case.piece_shape).astype(case.piece_dtype)
            for src in others}
  ws0 = _buffer(fixture.workspace_bytes(case))  # this rank's workspace
  peer_ws = _buffer((world - 1) * fixture.peer_stride(case))
  if rank == 0:
    ws0[:] = fixture.rank0_workspace(case, [pieces[src] for src in others])
  for src in others if rank else ():
    raw = pieces[src].view(np.uint8).reshape(-1)
    for parity in (0, 1):
      off = fixture.piece_offset(case, parity, src)
      ws0[off:off + raw.size] = raw
  peer_address = {r: peer_ws.ctypes.data + i * fixture.peer_stride(case)
                  for i, r in enumerate(others)}
  table = fixture.address_table([ws0.ctypes.data if r == rank else peer_address[r]
                                 for r in range(world)])
  want_out, want_pushes = _references(case, rank, a, b, pieces)
  rank_arg = np.full(1, rank, np.int32)
  rows, kk, cols = case.a_shape[0], case.a_shape[1], case.b_shape[1]
  if op == "ag":
    tm, tn, num_comm, num_ctas, tiles = ag_grid(rows, cols, world, cfg, num_sms)
  else:
    _, tm, tn, num_ctas, tiles = rs_grid(rows, cols, world, cfg, num_sms)
  # what the launchers refuse
  why = (select.unsupported(rows if op == "ag" else rows // world, kk, cols, np.float16,
                            case.out_dtype, cfg, op)
         or select.split_k_unsupported(cfg, tiles, kk))
  if why:
    raise ValueError(why)
  consts = kernel_constants(cfg, world, tm, num_ctas, 1.0, 0,
                            workspace.parity_bytes(world, fixture.workspace_bytes(case)))
  partials = np.zeros(partials_type(cfg, tiles, kk, "interpret").shape, np.float32)
  first_split = split_from(cfg, tiles)
  scratch = np.zeros(num_ctas * 1024, np.uint8)
  n_flags = 2 * world * workspace.MAX_CHUNKS
  flags = ws0[workspace.FLAGS_OFFSET:workspace.FLAGS_OFFSET + 4 * n_flags].view(np.int32)
  copies = copy_block(rows, kk, cfg.block_m, world, num_comm, pack_shards) if op == "ag" else {}
  problems = []
  for call in range(2):
    if rank == 0:
      arm_block = 1 << (max(table.size, n_flags) - 1).bit_length()
      table_out = np.zeros_like(table)
      loopback_arm_kernel[(1,)](Host(table), Host(table_out), TABLE_LEN=table.size, WORLD=world,
                                FLAGS_OFF=workspace.FLAGS_OFFSET,
                                MAX_CHUNKS=workspace.MAX_CHUNKS, BLOCK=arm_block)
    else:  # what the set-up kernel does for rank 0: every other source's counters armed
      table_out = table
      flags.reshape(2, world, workspace.MAX_CHUNKS)[:, others] = ARMED.value
    parity = int(ws0[:4].view(np.int32)[0]) % 2
    out = np.zeros(case.out_shape, case.out_dtype)
    if op == "ag":
      gathered = np.zeros(16, np.float16)
      ag_gemm_kernel[(num_ctas,)](
          Host(a), *_operand_descs(a, b, cfg), Host(table_out), Host(rank_arg), Host(out), Host(gathered),
          Host(partials), Host(np.zeros(4, np.int64)), Host(scratch), M_SHARD=rows, K=kk,
          N=cols, NUM_COMM=num_comm,
          **copies, RETURN_GATHERED=False, SPLIT_K=split_k,
          SPLIT_FROM=first_split, PACK=pack(cfg, "ag", rows, cols), **consts)
    else:
      gemm_rs_kernel[(num_ctas,)](
          *_operand_descs(a, b, cfg), Host(table_out), Host(rank_arg), Host(out), Host(partials),
          Host(np.zeros(4, np.int64)), Host(scratch), M=rows, K=kk, N=cols, SPLIT_K=split_k, SPLIT_FROM=first_split,
          PACK=pack(cfg, "rs", rows // world, cols), **consts)
    err = np.abs(out.astype(np.float32) - want_out).max() / np.abs(want_out).max()
    if err > 1e-2:
      problems.append(f"call {call}: output off by {err:.3g}")
    for i, r in enumerate(others):
      want = want_pushes[r]
      off = i * fixture.peer_stride(case) + fixture.piece_offset(case, parity, rank)
      pushed = peer_ws[off:off + fixture.piece_bytes(case)].view(case.piece_dtype).reshape(
          case.piece_shape).astype(np.float32)
      perr = np.abs(pushed - want).max() / max(np.abs(want).max(), 1e-6)
      if perr > 1e-2:
        problems.append(f"call {call}: push to peer {r} off by {perr:.3g}")
      if op == "ag":  # a chunk has arrived at (its row tiles) * PUSH_PARTS
        start = i * fixture.peer_stride(case) + workspace.FLAGS_OFFSET
        got = peer_ws[start:start + 4 * n_flags].view(np.int32).reshape(
            2, world, workspace.MAX_CHUNKS)[parity, rank]
        per = consts["TILES_PER_CHUNK"]
        want = [min(per, tm - c * per) * copies["PUSH_PARTS"] for c in range(-(-tm // per))]
        if list(got[:len(want)]) != want or got[len(want):].any():
          problems.append(f"call {call}: counters at peer {r} {list(got[:len(want) + 1])}, "
                          f"want {want}")
    header = ws0[:16].view(np.int32)
    own = flags.reshape(2, world, workspace.MAX_CHUNKS)[parity, rank]
    if header[0] != call + 1 or header[1] != 0 or header[2 + parity] != 0 or own.any():
      problems.append(f"call {call}: epoch {header[0]}, done {header[1]}, tile counter "
                      f"{header[2 + parity]}, own split counters {np.count_nonzero(own)} "
                      f"nonzero after the call")
  return problems


def main(argv):
  op, world, split_k, block_m, block_n = argv[0], *map(int, argv[1:5])
  m, k, n = map(int, argv[5:8]) if len(argv) > 5 else (256, 512, 384)
  spare = int(argv[8]) if len(argv) > 8 else 0
  split_tail = int(argv[9]) if len(argv) > 9 else 0
  pack_shards = len(argv) > 10 and argv[10] == "1"
  rank = int(argv[11]) if len(argv) > 11 else 0
  num_comm = int(argv[12]) if len(argv) > 12 else 2
  out_dtype = argv[13] if len(argv) > 13 else ""
  problems = run(op, world, split_k, block_m, block_n, m, k, n, spare, split_tail, pack_shards,
                 rank, num_comm, out_dtype)
  print("OK" if not problems else "FAIL: " + "; ".join(problems))
  return 0 if not problems else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
