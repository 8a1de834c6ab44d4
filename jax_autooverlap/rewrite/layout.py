"""Layout-only ops the rewrite looks through, and how a sharded dim moves through them.

Between a collective and its matmul a program often reshapes, transposes or
casts the value.  To fuse, the rewrite re-applies those ops to the *shard*
(before the gather, or after the scatter), which is valid when the sharded
dim maps to one dim on the other side with the shards staying contiguous
blocks.  `dim_through` answers where the dim goes (or None), `apply_to_shard`
re-binds the op with shard sizes.
"""
from __future__ import annotations

import math

# Primitives that only move or relabel data (values unchanged up to a cast).
LAYOUT_PRIMITIVES = frozenset({
    "convert_element_type", "transpose", "reshape", "squeeze", "copy", "copy_p",
    "pvary", "pcast",
})


def _reshape_dim(src_shape, dst_shape, d: int, n: int):
  """Dim of dst holding src dim d's n contiguous blocks, or None.

  Splitting src dim d into n blocks splits the flattened array, within each
  group of prod(src[:d]) leading indices, into n equal contiguous ranges; a
  dst dim d' with the same leading product and size divisible by n splits it
  identically.
  """
  prefix = math.prod(src_shape[:d])
  acc = 1
  for j, size in enumerate(dst_shape):
    if acc == prefix and size % n == 0 and (size > 1 or n == 1):
      return j
    acc *= size
    if acc > prefix:
      return None
  return None


def dim_through(eqn, d: int, n: int, forward: bool, shape=None):
  """Where dim d of the op's input (forward) or output (backward) lands, or None.

  `shape` replaces the shape of the side d is on (the input going forward, the
  output going backward): an untiled collective's reshape is read as acting on
  the tiled shape, whose row-major layout is the same.
  """
  name = eqn.primitive.name
  in_shape = eqn.invars[0].aval.shape
  out_shape = eqn.outvars[0].aval.shape
  if shape is not None:
    if forward:
      in_shape = tuple(shape)
    else:
      out_shape = tuple(shape)
  if name in ("convert_element_type", "copy", "copy_p", "pvary", "pcast"):
    return d
  if name == "transpose":
    perm = tuple(eqn.params["permutation"])
    return perm.index(d) if forward else perm[d]
  if name == "squeeze":
    removed = sorted(int(x) % len(in_shape) for x in eqn.params["dimensions"])
    if forward:
      return None if d in removed else d - sum(r < d for r in removed)
    kept = [i for i in range(len(in_shape)) if i not in removed]
    return kept[d]
  if name == "reshape":
    if eqn.params.get("dimensions") is not None:
      return None
    return _reshape_dim(in_shape, out_shape, d, n) if forward else \
        _reshape_dim(out_shape, in_shape, d, n)
  return None


def apply_to_shard(eqn, value, out_dim: int, n: int):
  """Bind the layout op to a shard whose dim `out_dim` (of the op's output) is n times smaller."""
  params = dict(eqn.params)
  if eqn.primitive.name == "reshape":
    sizes = list(params["new_sizes"])
    sizes[out_dim] //= n
    params["new_sizes"] = tuple(sizes)
  return eqn.primitive.bind(value, **params)
