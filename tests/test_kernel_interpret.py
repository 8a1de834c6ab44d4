"""The `tl` fused kernels executed on the CPU by Triton's interpreter (tests/interpret_kernels.py)
as rank 0 (and a few other ranks) of loopback groups of 2, 4 and 8: output and pushes against
the unfused result, the counters zero after each of two calls; with and without split-K
(kernels/split_k.py; of every tile or of the last ones only), full and ragged tiles, shards
packed into the row tiles, workspaces sized for the call and grown beyond it, 16-bit and
float32 products.  What they
compute, not how CTAs or GPUs order memory (that is for the GPU tests).
"""
import pathlib
import subprocess
import sys

import pytest
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]

if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
  pytest.skip("Triton's interpreter before 3.9 cannot loop over tensor bounds (split-K's k "
              "range)", allow_module_level=True)

CASES = [  # op, world, split_k, block_m, block_n, global M, K, N
    ("ag", 2, 1, 128, 256, 256, 512, 1024),
    ("ag", 4, 1, 64, 64, 256, 512, 384),
    ("ag", 4, 3, 64, 128, 600, 512, 640),     # ragged shards and columns
    ("ag", 8, 2, 64, 64, 512, 512, 512),
    ("rs", 2, 1, 64, 128, 1200, 512, 640),    # ragged rows and columns
    ("rs", 4, 2, 64, 64, 256, 512, 384),
    ("rs", 4, 3, 64, 128, 600, 2048, 320),    # ragged, split-K
    ("rs", 8, 4, 64, 64, 128, 4096, 512),     # 16 rows per owner
    ("rs", 4, 1, 64, 128, 256, 800, 384),     # K = 200 per GPU: a ragged last k-block
    ("rs", 4, 3, 64, 128, 600, 800, 320),     # ragged k-block, split-K
    # workspaces grown for a larger call (runtime/workspace.py): parity slot 1 lies half-way
    # through the buffer area, not right after slot 0
    ("ag", 2, 1, 64, 128, 256, 512, 384, 3 * 4096 + 48),
    ("rs", 4, 2, 64, 64, 256, 512, 384, 100_000),
    # only the last tiles split (KernelConfig.split_tail): 8 tiles, the last 5 in parts
    ("ag", 4, 2, 64, 64, 256, 512, 384, 0, 5),
    ("ag", 8, 3, 64, 64, 512, 512, 512, 0, 9),   # 16 tiles, 9 split in 3, split tiles of 2 sources
    ("rs", 4, 2, 64, 64, 256, 512, 384, 0, 3),
    # the shards packed into the row tiles (KernelConfig.pack_shards): 16-row shards, 4 per
    # 64-row tile (two row tiles); 8 per 128-row tile of a group of 4 (half the tile beyond
    # the gathered rows); 32-row shards without split-K
    ("ag", 8, 2, 64, 64, 128, 256, 128, 0, 0, 1),
    ("ag", 4, 2, 128, 64, 64, 256, 128, 0, 0, 1),
    ("ag", 8, 1, 128, 128, 256, 512, 256, 0, 0, 1),
    # the same for GEMM+RS's owners' rows: 16-row owners, split-K (the last part pushes the
    # peers' rows and sums the own ones); 8 per 128-row tile of a group of 4; ragged columns
    ("rs", 8, 2, 64, 64, 128, 2048, 128, 0, 0, 1),
    ("rs", 4, 2, 128, 64, 64, 1024, 128, 0, 0, 1),
    ("rs", 8, 3, 64, 128, 256, 2048, 320, 0, 0, 1),
    # as another rank than 0: the order of sources and owners, the own shard's or rows' place
    ("ag", 4, 1, 64, 64, 256, 512, 384, 0, 0, 0, 2),
    ("rs", 4, 2, 64, 64, 256, 512, 384, 0, 0, 0, 3),
    ("ag", 8, 3, 64, 64, 512, 512, 512, 0, 9, 0, 6),
    ("ag", 8, 2, 64, 64, 128, 256, 128, 0, 0, 1, 5),   # packed: its own row tile is the second
    ("rs", 8, 2, 64, 64, 128, 2048, 128, 0, 0, 1, 5),
    ("ag", 4, 2, 128, 64, 64, 256, 128, 0, 0, 1, 3),
    # 24-row shards: the movers copy them in 32-row blocks, ragged (launch.copy_block)
    ("ag", 8, 1, 128, 64, 192, 512, 128),
    # more movers than push units: pushes in column parts (8 of a 32-row shard; 2 at w = 8);
    # packed, the own shard in parts (2; 4) that every CTA claims (launch.copy_block)
    ("ag", 2, 1, 64, 128, 64, 4096, 256, 0, 0, 0, 0, 8),
    ("ag", 8, 2, 64, 64, 128, 2048, 128, 0, 0, 1, 5, 8),
    ("ag", 4, 2, 128, 64, 64, 4096, 128, 0, 0, 1, 0, 4),
    # a group of one (the benchmark's tl kernel alone, bench/loopback/cli.alone_case): no peers;
    # the local GEMM of Llama-3-8B Q/K/V at TP 8, M = 128 with its packed config's tiles, split
    # and 32 movers; GEMM+RS split 4; ragged rows without split
    ("ag", 1, 8, 128, 128, 128, 4096, 768, 0, 0, 0, 0, 32),
    ("rs", 1, 4, 64, 256, 128, 2048, 512),
    ("ag", 1, 1, 64, 128, 200, 1024, 384),
    # a 4-byte product of 16-bit operands (preferred_element_type=float32; the tuner's
    # 128x128 tiles): the output, and GEMM+RS's partials pushed and summed in float32
    ("ag", 2, 1, 128, 128, 256, 512, 512, 0, 0, 0, 0, 2, "float32"),
    ("rs", 2, 1, 128, 128, 512, 512, 512, 0, 0, 0, 0, 2, "float32"),
    ("rs", 4, 3, 64, 128, 600, 2048, 320, 0, 0, 0, 0, 2, "float32"),   # ragged, split-K
    ("rs", 8, 4, 64, 64, 128, 4096, 512, 0, 0, 1, 0, 2, "float32"),    # packed, split-K
    ("ag", 8, 2, 64, 64, 128, 256, 128, 0, 0, 1, 5, 2, "float32"),     # packed, rank 5
    # tl's 128x256 tiles of a float32 product: the AG stores them, GEMM+RS sums and stores its
    # own ones, in column halves (a ragged last column tile: its right half is all outside)
    ("ag", 2, 1, 128, 256, 256, 512, 640, 0, 0, 0, 0, 2, "float32"),
    ("rs", 2, 1, 128, 256, 512, 512, 640, 0, 0, 0, 0, 2, "float32"),
    ("rs", 4, 1, 128, 256, 600, 1024, 512, 0, 0, 0, 3, 2, "float32"),  # ragged rows, rank 3
    # the AG's packed tiles of 128x256 (select.PACKED_WIDE): 16-row shards, split in 2; 64-row
    # shards whole, as rank 5
    ("ag", 8, 2, 128, 256, 128, 512, 512, 0, 0, 1),
    ("ag", 8, 1, 128, 256, 512, 512, 768, 0, 0, 1, 5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-w{}-k{}-{}x{}-{}x{}x{}".format(*c)
                         + (f"-spare{c[8]}" if len(c) > 8 and c[8] else "")
                         + (f"-tail{c[9]}" if len(c) > 9 and c[9] else "")
                         + ("-packed" if len(c) > 10 and c[10] else "")
                         + (f"-rank{c[11]}" if len(c) > 11 and c[11] else "")
                         + (f"-movers{c[12]}" if len(c) > 12 else "")
                         + (f"-{c[13]}" if len(c) > 13 else ""))
def test_tl_kernel_in_the_interpreter_matches_unfused(case):
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interpret_kernels.py"),
                         *map(str, case)], capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "OK", (
      proc.stdout[-2000:] + proc.stderr[-3000:])


def test_movers_copy_blocks_cover_a_tiles_rows_of_the_shard_in_wide_blocks():
  """The tl AG movers' copy blocks (one load then one store each, latency-bound): rows
  covering a row tile's part of the shard, no more (16 at least), columns filling 16K elements
  that divide K; large shards keep the 128x128 blocks."""
  from jax_autooverlap.backends.launch import copy_block
  def block(*args):
    return {k: v for k, v in copy_block(*args).items() if k.startswith("COPY_")}
  assert block(16, 8192, 128) == {"COPY_ROWS": 16, "COPY_COLS": 1024}  # 8 blocks, not 64
  assert block(24, 512, 128) == {"COPY_ROWS": 32, "COPY_COLS": 512}
  assert block(4096, 8192, 128) == {"COPY_ROWS": 128, "COPY_COLS": 128}
  assert block(4096, 8192 + 64, 128) == {"COPY_ROWS": 128, "COPY_COLS": 64}
  assert block(100, 4096, 64) == {"COPY_ROWS": 64, "COPY_COLS": 256}
  assert block(1, 64, 128) == {"COPY_ROWS": 16, "COPY_COLS": 64}


def test_small_shards_are_copied_in_column_parts_over_the_movers():
  """A push unit (a row tile to a peer) in as many column parts as the movers cover, a
  divisor of its blocks; packed, the own shard one block per part; large shards whole."""
  from jax_autooverlap.backends.launch import copy_block

  def parts(*args):
    c = copy_block(*args)
    return c["PUSH_PARTS"], c["OWN_PARTS"]
  # TP 8, M = 128: 16-row shards, 8 blocks of 16 x 1024; 7 peers, 32 movers: 4 parts each
  assert parts(16, 8192, 128, 8, 32, True) == (4, 8)
  assert parts(16, 8192, 128, 8, 8, True) == (2, 8)      # 8 movers: 2 >= 8 / 7
  assert parts(16, 8192, 128, 8, 32, False) == (4, 1)
  assert parts(16, 8192, 128, 8, 16, False) == (2, 1)    # 3 <= 16 / 7 divides not 8
  assert parts(16, 5120, 64, 8, 32, False) == (5, 1)    # 5 blocks of 16 x 1024
  assert parts(32, 4096, 64, 2, 8, False) == (8, 1)     # one unit, 8 blocks of 32 x 512
  assert parts(4096, 8192, 128, 8, 32, False) == (1, 1)  # 224 units: whole
  assert parts(1, 64, 128, 2, 16, True) == (1, 1)       # one block
  # a group of 1 (tests/test_gpu_capture.py's mesh) pushes nothing: no division by its 0 units
  assert parts(1024, 1024, 128, 1, 8, False) == (8, 1)  # (its parts are never pushed)


def test_split_k_beyond_its_counters_is_refused():
  """More split tiles than a rank's own row of counters (64) would count into the next row:
  the launchers and the tuner refuse it (the interpreter run shows what it would do)."""
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interpret_kernels.py"), "rs", "4",
                         "2", "64", "128", "1024", "512", "640"], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode != 0
  assert "split_k=2 takes at most 64 output tiles per call, this shape has 80" in proc.stderr


def test_packed_shards_that_do_not_fill_a_tile_exactly_are_refused():
  """pack_shards needs shards that fill a tile's rows exactly, two or more times: 24-row shards
  in 64-row tiles would put a shard across two tiles (the launchers and the tuner refuse it)."""
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interpret_kernels.py"), "ag", "4",
                         "2", "64", "64", "96", "256", "128", "0", "0", "1"], capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode != 0
  assert "shards of 24 rows to fill a tile of block_m=64 rows" in proc.stderr
