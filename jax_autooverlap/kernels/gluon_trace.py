"""A per-tile timeline of the Gluon kernels' consumers, for the loopback benchmark's --trace.

Built in only where a launch asks for it (TRACE = 1; otherwise no code and a 4-element
placeholder operand): the trace is int64 [num_ctas, 1 + SLOTS, FIELDS] (tl_trace.py's layout,
whose last two fields these kernels leave zero).  Row 0 of a CTA holds (%globaltimer, %clock64)
read together when its consumers start, to align CTAs, and both again when they end; row 1 + j
holds the CTA's j-th tile: (tile number, then %clock64 when the consumers had its number, when
its main loop had finished, and when its epilogue had issued its TMA store); the last row
(FRAME) holds %clock64 at the kernel's first statement and after its last (before and after the
partitions: descriptors, the call's state, the partitions' join, finish_call), then zeros.  Tiles
past TILE_SLOTS are not recorded.  The clock is the SM's cycle counter (bench/timeline.py turns
it into ns with the clock rate seen between the CTA's two %globaltimer reads).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from jax_autooverlap.kernels.sync import clock64, globaltimer

SLOTS = gl.constexpr(256)
FIELDS = gl.constexpr(6)
GOT_TILE = gl.constexpr(1)
MAIN_DONE = gl.constexpr(2)
EPILOGUE_DONE = gl.constexpr(3)
TILE_SLOTS = gl.constexpr(SLOTS.value - 1)  # tiles in rows 1 .. SLOTS - 1
FRAME = SLOTS  # the last row: the kernel's entry and exit clocks


@gluon.jit
def start(trace_ptr, TRACE: gl.constexpr):
  """Consumers, first thing: the CTA's (globaltimer, clock64) pair."""
  if TRACE:
    row = trace_ptr + gl.program_id(0) * (1 + SLOTS) * FIELDS
    gl.store(row, globaltimer())
    gl.store(row + 1, clock64())


@gluon.jit
def stamp(trace_ptr, j, t, field: gl.constexpr, TRACE: gl.constexpr):
  """Consumers: the clock at event `field` of the CTA's j-th tile t."""
  if TRACE:
    if j < TILE_SLOTS:
      row = trace_ptr + (gl.program_id(0) * (1 + SLOTS) + 1 + j) * FIELDS
      if field == GOT_TILE:
        gl.store(row, t.to(gl.int64))
      gl.store(row + field, clock64())


@gluon.jit
def end(trace_ptr, TRACE: gl.constexpr):
  """Consumers, last thing: a second globaltimer in row 0 (with the clock, the CTA's clock rate)."""
  if TRACE:
    row = trace_ptr + gl.program_id(0) * (1 + SLOTS) * FIELDS
    gl.store(row + 2, globaltimer())
    gl.store(row + 3, clock64())


@gluon.jit
def kernel_entry(trace_ptr, TRACE: gl.constexpr):
  """The kernel's first statement (every warp of the CTA): the clock, in the FRAME row."""
  if TRACE:
    gl.store(trace_ptr + (gl.program_id(0) * (1 + SLOTS) + FRAME) * FIELDS, clock64())


@gluon.jit
def kernel_exit(trace_ptr, TRACE: gl.constexpr):
  """The kernel's last statement, after the partitions' join: the clock, in the FRAME row."""
  if TRACE:
    gl.store(trace_ptr + (gl.program_id(0) * (1 + SLOTS) + FRAME) * FIELDS + 1, clock64())
