"""Host cost of launching a fused op, against XLA's own cuBLAS call (one GPU).

    python -m jax_autooverlap.bench.launch_cost [--out bench/results] [--calls 2000]

Programs on a one-GPU mesh, each a single small matmul (256 x 256 x 256 bf16,
a few microseconds of GPU work, so a call's wall time is its host cost):
  gemm            jax.jit(x @ w): XLA's cuBLAS call
  ag_matmul       ao.jit of all_gather(x) @ w with the Triton kernel (world 1)
  matmul_rs       ao.jit of psum_scatter(x @ w) with the Triton kernel (world 1)
  triton_trivial  a one-line Triton kernel through jax-triton (the launcher's own cost)
For each: `sync_us`, the median wall time of one call waited for
(block_until_ready), and `async_us`, the per-call time of 200 calls
dispatched back to back (host-bound: the launch cost), both the median over
rounds that interleave the programs (host noise hits them alike); and
`loop_us`, per iteration of 100 chained calls in one program (GPU time, no
host), and the size of the launch's opaque (jaxlib hashes
it on every launch: _compat.py).  Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

from jax_autooverlap.bench import common

log = common.logger("launch_cost")

def _sync_us(fn, args, calls):
  """Median wall time of one call waited for."""
  import jax
  import numpy as np
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times) * 1e6)


def _async_us(fn, args, calls=200):
  """Per-call time of calls dispatched back to back."""
  import jax
  t0 = time.perf_counter()
  outs = [fn(*args) for _ in range(calls)]
  jax.block_until_ready(outs)
  return (time.perf_counter() - t0) / calls * 1e6


def _loop_us(fn, args, iters=100):
  """Per-iteration time of `iters` chained calls inside one program (one dispatch): the GPU
  time of a call plus the loop's own step, with the host out of the picture."""
  import jax
  import numpy as np
  looped = jax.jit(lambda *a: jax.lax.fori_loop(0, iters, lambda i, x: fn(x, *a[1:]), a[0]))
  jax.block_until_ready(looped(*args))
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    jax.block_until_ready(looped(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times) / iters * 1e6)


def _trivial_triton():
  import jax
  import triton
  import triton.language as tl
  from jax_autooverlap._compat import import_jax_triton
  jt = import_jax_triton()

  @triton.jit
  def add_one(x_ptr, o_ptr, n: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

  def call(x):
    return jt.triton_call(x, kernel=add_one, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.size // 1024,), n=x.size, BLOCK=1024)
  return jax.jit(call)


def opaque_bytes(fn, args) -> int:
  """Bytes of the largest custom-call opaque (jax-triton: zlib'd kernel proto) in the program."""
  import re
  text = fn.lower(*args).as_text()
  sizes = [len(m) for m in re.findall(r'opaque = "((?:[^"\\]|\\.)*)"', text)]
  return max(sizes, default=0)


def programs(size=256):
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P
  import jax_autooverlap as ao

  gpu = [d for d in jax.devices() if d.platform == "gpu"][:1]
  if not gpu:
    raise SystemExit("launch_cost: needs an NVIDIA GPU")
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpu)
  cfg = ao.OverlapConfig(impl="triton")
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (size, size), jnp.bfloat16)
  w = jax.random.normal(k2, (size, size), jnp.bfloat16)
  smap = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  ag = ao.jit(smap(lambda x, w: lax.all_gather(x, "x", axis=0, tiled=True) @ w), overlap_config=cfg)
  rs = ao.jit(smap(lambda x, w: lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)),
              overlap_config=cfg)
  for f in (ag, rs):
    assert all(m.fused and m.impl.startswith("triton") for m in f.explain(x, w)), f.explain(x, w)
  return {
      "gemm": (jax.jit(lambda x, w: x @ w), (x, w)),
      "ag_matmul": (ag, (x, w)),
      "matmul_rs": (rs, (x, w)),
      "triton_trivial": (_trivial_triton(), (jnp.zeros((size * size,), jnp.float32),)),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jax_autooverlap.bench.launch_cost",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="bench/results", help="folder for the JSON (default %(default)s)")
  ap.add_argument("--calls", type=int, default=3000, help="synchronous calls timed per program")
  ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median over rounds)")
  args = ap.parse_args(argv)
  import jax
  import jaxlib
  import numpy as np
  progs = programs()
  for name, (fn, fargs) in progs.items():  # compile and warm up
    for _ in range(50):
      jax.block_until_ready(fn(*fargs))
  # Rounds interleave the programs, so that a slow phase of the host hits them all alike.
  sync, asyn = {n: [] for n in progs}, {n: [] for n in progs}
  for r in range(args.rounds):
    log(f"round {r + 1}/{args.rounds}")
    for name, (fn, fargs) in progs.items():
      sync[name].append(_sync_us(fn, fargs, args.calls // args.rounds))
      asyn[name].append(_async_us(fn, fargs))
  rows = [{"program": n, "sync_us": float(np.median(sync[n])), "sync_min_us": min(sync[n]),
           "sync_max_us": max(sync[n]), "async_us": float(np.median(asyn[n])),
           "loop_us": _loop_us(*progs[n]), "opaque_bytes": opaque_bytes(*progs[n])}
          for n in progs]
  base = next(r for r in rows if r["program"] == "gemm")
  gpu = jax.devices()[0].device_kind
  print(f"\nLaunch cost on one {gpu} (256x256x256 bf16; medians, us)")
  print(f"{'program':<16}{'sync_us':>9}{'(min-max)':>15}{'async_us':>10}{'loop_us':>9}"
        f"{'sync - gemm':>13}{'async - gemm':>14}{'opaque B':>10}")
  for r in rows:
    r["sync_minus_gemm_us"] = r["sync_us"] - base["sync_us"]
    r["async_minus_gemm_us"] = r["async_us"] - base["async_us"]
    spread = f"{r['sync_min_us']:.1f}-{r['sync_max_us']:.1f}"
    print(f"{r['program']:<16}{r['sync_us']:>9.1f}{spread:>15}{r['async_us']:>10.1f}"
          f"{r['loop_us']:>9.1f}{r['sync_minus_gemm_us']:>13.1f}{r['async_minus_gemm_us']:>14.1f}"
          f"{r['opaque_bytes']:>10}")
  date = datetime.date.today().isoformat()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{gpu.replace(' ', '-')}-{date}-launch-cost.json"
  meta = {"bench": "launch_cost", "gpu": gpu, "date": date, "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "size": 256}
  path.write_text(json.dumps([dict(meta, **r) for r in rows], indent=1))
  print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
  main()
