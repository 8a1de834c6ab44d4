"""The sharding algebra of explicit-sharding types: which mesh axes shard each dim of a value,
and what a dot_general or a reshard with given shardings communicates.

On meshes with Explicit axes every value's type says how it is sharded
(`f32[64@tp,32]`); a spec here is a tuple, per dim, of the mesh axes sharding it.
"""
from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

from jax_autooverlap.ops.dims import DotDims

def _entry(e) -> tuple:
  return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def spec_of(v):
  """Mesh axes sharding each dim of v's type, e.g. ((), ("tp",)); None if not usable."""
  sharding = getattr(v.aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
    return None
  parts = tuple(spec) + (None,) * (v.aval.ndim - len(spec))
  return tuple(_entry(e) for e in parts)


def mesh_of(v):
  return getattr(getattr(v.aval, "sharding", None), "mesh", None)


def drop(spec, d):
  return spec[:d] + ((),) + spec[d + 1:]


def pspec(spec) -> P:
  return P(*(None if not e else e[0] if len(e) == 1 else e for e in spec))


def local_shape(v, spec, mesh, split=None):
  """v's block per device when every axis of `spec` is manual; split=(dim, n): that dim is
  also divided by n (the shard of the fused collective's axis)."""
  shape = [size // math.prod(mesh.shape[a] for a in e) for size, e in zip(v.aval.shape, spec)]
  if split is not None:
    shape[split[0]] //= split[1]
  return tuple(shape)


def sum_axes(dd: DotDims, lhs, rhs, out):
  """Axes whose partial sums a dot_general all-reduces when nothing else communicates.

  None when the dot needs more: the result is not what the operands' shardings
  give (JAX's rule: batch dims, then lhs free, then rhs free) or a contracting
  pair is sharded differently on its two sides.
  """
  summed = set()
  for i, j in zip(dd.lc, dd.rc):
    if lhs[i] != rhs[j]:
      return None
    summed.update(lhs[i])
  if any(lhs[i] != rhs[j] for i, j in zip(dd.lb, dd.rb)):
    return None
  want = tuple(lhs[i] for i in dd.lb) + tuple(lhs[i] for i in dd.lf) + tuple(rhs[i] for i in dd.rf)
  return frozenset(summed) if want == out else None


@dataclasses.dataclass(frozen=True)
class Comm:
  """How one dot_general communicates: "local", "ag" (gathers operand's dim) or "rs"."""
  kind: str
  axis: str | None = None
  operand: int | None = None
  dim: int | None = None  # ag: the operand's gathered dim; rs: the product's scattered dim
  summed: frozenset = frozenset()  # other axes all-reduced (contracting dims sharded alike)


def classify(dd: DotDims, lhs, rhs, out) -> Comm | None:
  """What a dot_general with these operand/result shardings communicates (None: something
  this module does not fuse, e.g. two axes gathered at once)."""
  summed = sum_axes(dd, lhs, rhs, out)
  if summed is not None:
    return Comm("local", summed=summed)
  out_axes = {a for e in out for a in e}
  for x, spec in enumerate((lhs, rhs)):
    batch = dd.lb if x == 0 else dd.rb
    for d, e in enumerate(spec):
      # Only gathers the result needs: if it is replicated over the axis, XLA
      # may as well multiply the shards and gather the product.
      if len(e) != 1 or d in batch or e[0] not in out_axes:
        continue
      ops = [lhs, rhs]
      ops[x] = drop(spec, d)
      summed = sum_axes(dd, *ops, out)
      if summed is not None and e[0] not in summed:
        return Comm("ag", e[0], x, d, summed)
  nb = len(dd.lb)
  for i, j in zip(dd.lc, dd.rc):
    if len(lhs[i]) == 1 and lhs[i] == rhs[j]:
      for od in range(nb, len(out)):
        if out[od] == lhs[i]:
          summed = sum_axes(dd, drop(lhs, i), drop(rhs, j), drop(out, od))
          if summed is not None:
            return Comm("rs", lhs[i][0], dim=od, summed=summed)
  return None


def reshard_change(eqn):
  """("gather"|"scatter", axis, dim) when a reshard takes one axis off / puts one on one dim."""
  src, dst = spec_of(eqn.invars[0]), spec_of(eqn.outvars[0])
  if src is None or dst is None or len(src) != len(dst) or mesh_of(eqn.invars[0]) != mesh_of(
      eqn.outvars[0]):
    return None
  diff = [d for d in range(len(src)) if src[d] != dst[d]]
  if len(diff) != 1:
    return None
  d = diff[0]
  # Only the minor-most axis of a dim: its blocks nest inside the others' blocks.
  if len(src[d]) == len(dst[d]) + 1 and src[d][:-1] == dst[d]:
    return "gather", src[d][-1], d
  if len(dst[d]) == len(src[d]) + 1 and dst[d][:-1] == src[d]:
    return "scatter", dst[d][-1], d
  return None
