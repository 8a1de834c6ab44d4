"""The GEMM+RS kernel's tile order, run on CPU through Triton's interpreter.

`tile_of` is the kernel's own @triton.jit code (no copy); a subprocess with
TRITON_INTERPRET=1 evaluates it for every tile, and the order must hold the
properties the kernel's deadlock-freedom rests on, for any world size.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CASES = [  # world, TM, TN, GROUP_M
    (2, 5, 3, 2), (2, 16, 4, 8), (2, 1, 5, 8), (3, 9, 2, 4), (4, 6, 3, 8), (8, 9, 2, 2),
]
_WALK = """
import json, sys
from triton.runtime.interpreter import _implicit_cvt as cvt
from jax_autooverlap.kernels.gemm_rs import tile_of
out = {}
for world, tm_, tn_, group_m in json.loads(sys.argv[1]):
  order = [tile_of(cvt(t), world, tm_, tn_, group_m) for t in range(world * tm_ * tn_)]
  out[f"{world},{tm_},{tn_},{group_m}"] = [[int(v.handle.data[0]) for v in x] for x in order]
print("WALK" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def orders():
  env = dict(os.environ, TRITON_INTERPRET="1")
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_WALK), json.dumps(CASES)],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.split("WALK", 1)[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}-tm{}-tn{}-g{}".format(*c))
def test_order_covers_every_tile_once_and_own_tiles_come_last(orders, case):
  world, tm_, tn_, group_m = case
  order = [tuple(x) for x in orders[",".join(map(str, case))]]
  assert sorted(order) == [(j, m, n) for j in range(world) for m in range(tm_) for n in range(tn_)]
  # j = world-1 is the GPU's own rows: every GPU hands them out only after all of its
  # remote tiles, which never wait, so an own tile only waits for tiles already handed out.
  owners = [j for j, _, _ in order]
  assert owners == sorted(owners)
  # within an owner, tiles go GROUP_M rows at a time over all columns (L2 reuse of b)
  for j in range(world):
    rows = [m for jj, m, _ in order if jj == j]
    for g in range(0, len(rows), group_m * tn_):
      block = rows[g:g + group_m * tn_]
      assert max(block) - min(block) < group_m
