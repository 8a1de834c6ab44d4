"""One own-tile round of the Gluon GEMM+RS epilogue in isolation (GPU machine only; an experiment).

    python3 bench/own_round.py [--rounds 7] [--out DIR] [--background-only]

The fused GEMM+RS kernel spends ~2.2 us per peer on each own tile at TP 8 (15.5 us of a tile's
epilogue; docs/NOTES.md, twelfth round): a round TMA-loads the peer's 128x256 bf16 partial
(64 KB) into the epilogue buffer, waits for it, reads it in the accumulator's layout and adds
it, then a CTA barrier.  Neither the aggregate DRAM bandwidth (the own tiles spread over the
kernel: unchanged) nor DRAM latency (every partial prefetched into L2: unchanged) explains it.
This kernel runs only such rounds, on GRID CTAs of 8 warps (the fused kernel's consumers), and
times them in-kernel (globaltimer per CTA), so the round's parts can be told apart:

  mode full   free the buffer (store_wait, fence, barrier), TMA load, wait, read + add, barrier
  mode tma    the same without the read and add: the TMA load and its wait
  mode read   the read + add and barrier only, on a tile loaded once
  mode nofence  full without the proxy fence and store wait before each load (a barrier only:
              not a correct ordering in general, it prices that fence)
  mode ldg    no TMA and no shared memory: each thread loads its elements of the partial in the
              accumulator's layout from global memory (past L1) and adds them; the rounds
              unrolled, so the loads of several peers can be in flight at once (the way round
              a one-box-at-a-time TMA path, if that is what costs)
  mode halves / quarters  full with the tile in 2 / 4 column blocks, each on its own barrier,
              the accumulator split likewise (gluon_engine.split_columns): a block of the next
              round is loaded as soon as this round's is read, so loads overlap the adds

each from DRAM (every CTA and round its own tile; 60 MB at 7 rounds on 132 CTAs) and from L2
(every CTA the same ROUNDS tiles), on 132 CTAs and on 16.  Then full and halves on 16 CTAs
beside 116 background CTAs that TMA-load 64 KB boxes of L2-resident tiles, at a GEMM main
loop's rate (one per 950 ns) or unpaced: in the fused kernel, own tiles summed while the
other CTAs run their main loops cost ~2 us per peer where the round alone on 16 CTAs takes
0.7-1 us (docs/NOTES.md, thirteenth round); this asks whether the L2 traffic of those main
loops is what they share (--background-only: only these).  Prints ns per round (median
over the summing CTAs, of the second call) and writes own_round.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier  # noqa: E402

from jax_autooverlap._compat import lean_launch  # noqa: E402
from jax_autooverlap.kernels import gluon_engine as eng  # noqa: E402
from jax_autooverlap.kernels.sync import clock64, globaltimer  # noqa: E402

BLOCK_M, BLOCK_N, WARPS = 128, 256, 8
MODES = {"full": 0, "tma": 1, "read": 2, "ldg": 3, "nofence": 4, "halves": 5, "quarters": 6}


@lean_launch
@gluon.jit
def own_round_kernel(parts_ptr, clocks_ptr, sums_ptr, scratch_ptr, ROWS_TOTAL: gl.constexpr,
                     N: gl.constexpr, ROUNDS: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, MODE: gl.constexpr, SHARED: gl.constexpr,
                     SUMMERS: gl.constexpr, BG_PACE_NS: gl.constexpr, BG_BOXES: gl.constexpr):
  """CTAs below SUMMERS run the rounds; with BG_BOXES > 0 the others are background loaders."""
  layout: gl.constexpr = eng.mma_layout(BLOCK_N, gl.num_warps(), gl.bfloat16)
  desc = eng.make_desc(parts_ptr, [ROWS_TOTAL, N], [N, 1], [BLOCK_M, BLOCK_N])
  c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], desc.layout)
  bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
  mbarrier.init(bar, count=1)
  pid = gl.program_id(0)
  if MODE >= 5:  # the tile in PARTS column blocks, each with its own barrier
    PARTS: gl.constexpr = 2 if MODE == 5 else 4
    W: gl.constexpr = BLOCK_N // PARTS
    part_desc = eng.make_desc(parts_ptr, [ROWS_TOTAL, N], [N, 1], [BLOCK_M, W])
    part_bars = gl.allocate_shared_memory(gl.int64, [PARTS, 1], mbarrier.MBarrierLayout())
    for h in gl.static_range(PARTS):
      mbarrier.init(part_bars.index(h), count=1)
  if pid < SUMMERS:
    # a zero the compiler cannot see (the clock is < 2**62): as in the fused kernel, the
    # accumulator holds unknown values, so no add of a round is folded away
    acc = gl.full([BLOCK_M, BLOCK_N], (clock64() >> 62).to(gl.float32), gl.float32, layout)
    if MODE == 2:  # one tile, loaded before the clock starts
      mbarrier.expect(bar, desc.block_type.nbytes)
      eng.tma_load(desc, [0, 0], bar, c_smem)
      mbarrier.wait(bar, 0)
    tl.debug_barrier()
    t0 = clock64()
    g0 = globaltimer()
    if MODE == 3:
      rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
      cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
      offs = rows[:, None] * N + cols[None, :]
      for r in gl.static_range(ROUNDS):
        row = _tile_row(pid, r, ROUNDS, BLOCK_M, SHARED)
        acc += gl.load(parts_ptr + row.to(gl.int64) * N + offs, cache_modifier=".cg").to(
            gl.float32)
      tl.debug_barrier()
    if MODE >= 5:
      # round r + 1's block h is loaded as soon as every warp has read round r's: while the
      # warps add the other blocks, it is in flight
      accs = eng.split_columns(acc, PARTS)
      for h in gl.static_range(PARTS):
        eng.load_epilogue_block(part_desc, _tile_row(pid, 0, ROUNDS, BLOCK_M, SHARED), 0, h,
                                c_smem, part_bars)
      for r in range(ROUNDS):
        summed = ()
        for h in gl.static_range(PARTS):
          mbarrier.wait(part_bars.index(h), r & 1)
          block = eng.epilogue_block(c_smem, h, W).load(accs[h].type.layout)
          summed = summed + (eng.add_partial(accs[h], block),)
          fence_async_shared()
          tl.debug_barrier()
          if r + 1 < ROUNDS:
            eng.load_epilogue_block(part_desc, _tile_row(pid, r + 1, ROUNDS, BLOCK_M, SHARED),
                                    0, h, c_smem, part_bars)
        accs = summed
      acc = eng.join_columns(accs)
    for r in range(ROUNDS if MODE < 3 or MODE == 4 else 0):
      if MODE != 2:
        row = _tile_row(pid, r, ROUNDS, BLOCK_M, SHARED)
        if MODE == 4:
          tl.debug_barrier()
        else:
          eng.free_epilogue_buffer()
        mbarrier.expect(bar, desc.block_type.nbytes)
        eng.tma_load(desc, [row, 0], bar, c_smem)
        mbarrier.wait(bar, r & 1)
      if MODE != 1 and MODE != 3:
        acc += c_smem.load(layout).to(gl.float32)
        tl.debug_barrier()
    g1 = globaltimer()
    t1 = clock64()
    gl.store(clocks_ptr + pid * 2, (g1 - g0).to(gl.int64))
    gl.store(clocks_ptr + pid * 2 + 1, (t1 - t0).to(gl.int64))
    gl.store(sums_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))  # keeps the reads live
  if BG_BOXES > 0:  # (a constexpr: kernels without background loaders have no such code)
    if pid >= SUMMERS:
      _background(desc, c_smem, bar, pid, clocks_ptr, ROWS_TOTAL, BLOCK_M, BG_PACE_NS,
                  BG_BOXES)


@gluon.jit
def _background(desc, c_smem, bar, pid, clocks_ptr, ROWS_TOTAL: gl.constexpr,
                BLOCK_M: gl.constexpr, PACE_NS: gl.constexpr, BOXES: gl.constexpr):
  """A stand-in for the other CTAs' main loops: TMA-load BOXES 64 KB boxes of the buffer's last
  8 tiles (L2-resident, as a GEMM's operands mostly are) into the buffer, one every PACE_NS
  (0: as fast as they come); records (ns, boxes).  The loop counts boxes, not time: each
  thread reads its own clock, and a time limit let threads of a CTA leave the loop at
  different iterations (a hang at the next barrier, seen unpaced on the GPU)."""
  LAST: gl.constexpr = ROWS_TOTAL // BLOCK_M - 1
  g0 = globaltimer()
  for n in range(BOXES):
    mbarrier.expect(bar, desc.block_type.nbytes)
    eng.tma_load(desc, [(LAST - pid % 8) * BLOCK_M, 0], bar, c_smem)
    mbarrier.wait(bar, n & 1)
    if PACE_NS > 0:  # a delay only: the next iteration's barrier brings the threads together
      while globaltimer() - g0 < (n + 1) * PACE_NS:
        pass
  gl.store(clocks_ptr + pid * 2, (globaltimer() - g0).to(gl.int64))
  gl.store(clocks_ptr + pid * 2 + 1, gl.to_tensor(BOXES).to(gl.int64))


@gluon.jit
def _tile_row(pid, r, ROUNDS: gl.constexpr, BLOCK_M: gl.constexpr, SHARED: gl.constexpr):
  """First row of the tile a CTA adds in round r: its own (DRAM), or round r's for all (L2)."""
  if SHARED:
    return r * BLOCK_M
  else:
    return (pid * ROUNDS + r) * BLOCK_M


def program(grid: int, rounds: int, mode: str, shared: bool, rows_total: int,
            summers: int | None = None, bg_pace_ns: int = 0, bg_boxes: int = 48):
  """(jitted f(parts) -> (ns and cycles [grid, 2] int64, sums [grid] f32), parts' spec).
  summers < grid: the other CTAs are background loaders (_background: their rows of the
  first output are (ns, boxes loaded))."""
  import jax
  import numpy as np
  from jax_autooverlap._compat import import_jax_triton, scratch_out_type
  jt = import_jax_triton()
  spec = jax.ShapeDtypeStruct((rows_total, BLOCK_N), jax.numpy.bfloat16)

  def f(parts):
    clocks, sums, _ = jt.triton_call(
        parts, kernel=own_round_kernel, name="ao_own_round",
        out_type=(jax.ShapeDtypeStruct((grid, 2), np.int64),
                  jax.ShapeDtypeStruct((grid,), np.float32), scratch_out_type(grid)),
        grid=(grid,), num_warps=WARPS, compute_capability=90, ROWS_TOTAL=rows_total, N=BLOCK_N,
        ROUNDS=rounds, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MODE=MODES[mode], SHARED=shared,
        SUMMERS=grid if summers is None else summers, BG_PACE_NS=bg_pace_ns,
        BG_BOXES=bg_boxes if summers is not None and summers < grid else 0)
    return clocks, sums
  return jax.jit(f), spec


def _measure(parts, want_row_sums, grid, rounds, mode, shared, rows_total, summers=None,
             bg_pace_ns=0):
  """One configuration, its second call: a row of the table (the summing CTAs' ns per round,
  their sums checked; with background CTAs, the rate those loaded at)."""
  import jax
  import numpy as np
  f, _ = program(grid, rounds, mode, shared, rows_total, summers, bg_pace_ns)
  f(parts)
  clocks, sums = jax.block_until_ready(f(parts))
  clocks, sums = np.asarray(clocks), np.asarray(sums)
  n = grid if summers is None else summers
  # what the rounds added: each CTA's tiles (mode read: tile 0, ROUNDS times)
  tiles = [[0] * rounds if mode == "read" else
           list(range(rounds)) if shared else
           [c * rounds + r for r in range(rounds)] for c in range(n)]
  want = np.array([want_row_sums[t].sum() for t in tiles])
  ok = bool(mode == "tma" or np.allclose(sums[:n], want, rtol=2e-2, atol=2.0))
  row = dict(grid=grid, summers=n, source="L2" if shared else "DRAM", mode=mode,
             ns_per_round=float(np.median(clocks[:n, 0])) / rounds,
             ns_per_round_max=float(clocks[:n, 0].max()) / rounds,
             cycles_per_round=float(np.median(clocks[:n, 1])) / rounds, sums_ok=ok)
  if n < grid:
    box = BLOCK_M * BLOCK_N * 2
    gbps = clocks[n:, 1] * box / np.maximum(clocks[n:, 0], 1)  # bytes per ns = GB/s
    row.update(bg_pace_ns=bg_pace_ns, bg_gbps_per_cta=float(np.median(gbps)),
               bg_tbps=float(gbps.sum()) / 1e3)
  return row


def _print(row):
  bg = (f"; {row['grid'] - row['summers']} background CTAs "
        f"{'paced ' + str(row['bg_pace_ns']) + ' ns' if row['bg_pace_ns'] else 'unpaced'}: "
        f"{row['bg_gbps_per_cta']:.0f} GB/s each, {row['bg_tbps']:.1f} TB/s"
        if "bg_tbps" in row else "")
  print(f"[own_round] grid {row['grid']:3d} {row['source']:4s} {row['mode']:4s}: "
        f"{row['ns_per_round']:7.0f} ns/round (max {row['ns_per_round_max']:.0f}), "
        f"{row['cycles_per_round']:6.0f} cycles; sums {'ok' if row['sums_ok'] else 'WRONG'}"
        + bg, flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--background-only", action="store_true",
                  help="only the runs with background loaders (16 CTAs summing, 116 loading)")
  args = ap.parse_args()
  import jax
  import numpy as np
  rows_total = 132 * args.rounds * BLOCK_M
  parts = jax.device_put(jax.random.normal(jax.random.key(0), (rows_total, BLOCK_N),
                                           jax.numpy.bfloat16))
  want_row_sums = np.asarray(parts, np.float32).reshape(-1, BLOCK_M * BLOCK_N).sum(axis=1)
  rows = []
  for grid in () if args.background_only else (132, 16):
    for shared in (False, True):
      for mode in MODES if not shared else [m for m in MODES if m != "read"]:  # read: no source
        rows.append(_measure(parts, want_row_sums, grid, args.rounds, mode, shared, rows_total))
        _print(rows[-1])
  # 16 CTAs summing beside 116 that load 64 KB boxes from L2: at a GEMM main loop's rate
  # (a 128x256x64 k-block's 48 KB per ~0.7 us: 64 KB per ~950 ns) and as fast as they can
  for shared in (False, True):
    for mode in ("full", "halves"):
      for pace in (None, 950, 0):
        rows.append(_measure(parts, want_row_sums, 16 if pace is None else 132, args.rounds,
                             mode, shared, rows_total, 16, pace or 0))
        _print(rows[-1])
  out = pathlib.Path(args.out) / "own_round.json"
  out.write_text(json.dumps(dict(rounds=args.rounds, device=str(jax.devices()[0].device_kind),
                                 rows=rows), indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
