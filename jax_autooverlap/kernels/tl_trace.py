"""A per-unit timeline of the `tl` fused kernels (kernels/ag_gemm.py, gemm_rs.py), for the
loopback benchmark's --trace with a tl --variant: where a small fused call's time goes.

The layout is kernels/gluon_trace.py's (bench/timeline.py reads both): int64
[num_ctas, 1 + SLOTS, 4].  Row 0 of a CTA: (%globaltimer, %clock64) at its start, then both
again at its end.  Row 1 + j: the CTA's j-th work unit (a tile, or a part of a split tile:
kernels/split_k.py), then %clock64 when its waits had passed (so a CTA's first row shows its
pushes, its share of the own shard's copy and the wait for every source), when its main loop
had finished, and when its epilogue (split-K's combine, the store) had.  GEMM+RS has no wait
before a unit's main loop (its first stamp is when the unit was claimed); its epilogue is the
push of the peers' rows or, for the own rows, the wait for every peer's partials and their sum.
Two more fields split a finishing unit's epilogue where it has those steps: PARTS_IN, when a
split part's wait for the tile's other parts had passed (split_k.sum_own_rows, Spread), and
PUSHED, when the packed GEMM+RS had pushed the peers' rows and signalled their owners (the own
rows' wait and sum follow); zero where a unit has no such step.  Built in only with TRACE = 1.
"""
import triton
import triton.language as tl

from jax_autooverlap.kernels.sync import clock64, globaltimer

SLOTS = tl.constexpr(256)  # gluon_trace.py's layout (tests/test_loopback.py checks it)
FIELDS = tl.constexpr(6)
GOT_TILE = tl.constexpr(1)
MAIN_DONE = tl.constexpr(2)
EPILOGUE_DONE = tl.constexpr(3)
PARTS_IN = tl.constexpr(4)
PUSHED = tl.constexpr(5)
TILE_SLOTS = tl.constexpr(SLOTS.value - 1)  # the last row is gluon_trace.py's FRAME (zeros here)


@triton.jit
def start(trace_ptr, TRACE: tl.constexpr):
  """First thing: the CTA's (globaltimer, clock64) pair."""
  if TRACE:
    row = trace_ptr + tl.program_id(0) * (1 + SLOTS) * FIELDS
    tl.store(row, globaltimer())
    tl.store(row + 1, clock64())


@triton.jit
def stamp(trace_ptr, j, u, field: tl.constexpr, TRACE: tl.constexpr):
  """The clock at event `field` of the CTA's j-th work unit u."""
  if TRACE:
    if j < TILE_SLOTS:
      row = trace_ptr + (tl.program_id(0) * (1 + SLOTS) + 1 + j) * FIELDS
      if field == GOT_TILE:
        tl.store(row, u.to(tl.int64))
      tl.store(row + field, clock64())


@triton.jit
def end(trace_ptr, TRACE: tl.constexpr):
  """Last thing: a second globaltimer (with the clock, the CTA's clock rate)."""
  if TRACE:
    row = trace_ptr + tl.program_id(0) * (1 + SLOTS) * FIELDS
    tl.store(row + 2, globaltimer())
    tl.store(row + 3, clock64())
