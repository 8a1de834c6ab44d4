"""What the analysis looked at, and what to change, for a program with no candidate."""
from __future__ import annotations

import jax

from jax_autooverlap.rewrite import _jax
from jax_autooverlap.rewrite.explicit.sharding import mesh_of

_COLLECTIVES = ("all_gather", "reduce_scatter", "psum", "psum_invariant", "all_to_all",
                "ppermute")


def survey(closed_jaxpr) -> list[str]:
  """What the analysis looked at, and what to change, for a program with no candidate."""
  seen = {"dots": 0, "smaps": 0, "collectives": 0}
  axes: dict[str, str] = {}

  def note_mesh(mesh):
    for name, kind in zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())):
      axes.setdefault(name, f"{name}={mesh.shape[name]} {getattr(kind, 'name', kind)}")

  def walk(jaxpr, manual):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "shard_map":
        seen["smaps"] += 1
        note_mesh(eqn.params.get("mesh"))
      elif manual and name in _COLLECTIVES:
        seen["collectives"] += 1
      elif not manual and name == "dot_general":
        seen["dots"] += 1
        for v in eqn.invars:
          note_mesh(mesh_of(v))
      for sub in _jax.sub_jaxprs(eqn.params):
        walk(sub, manual or name == "shard_map")

  walk(closed_jaxpr.jaxpr, False)
  note_mesh(jax.sharding.get_abstract_mesh())
  kinds = " ".join(axes.values())
  looked = (f"looked at {seen['dots']} dot_general(s) outside shard_map (mesh axes: "
            f"{', '.join(axes.values()) or 'none'}) and {seen['smaps']} shard_map bodies "
            f"({seen['collectives']} collectives inside)")
  if not seen["smaps"] and not axes:
    return [looked, "no collectives found: the program has no shard_map and no sharded values"]
  notes = [looked, "no shard_map or explicit-sharding collective found next to a matmul"]
  if "Explicit" in kinds and "Auto" not in kinds:
    notes.append("the Explicit axes' shardings imply no all-gather or reduce-scatter next to a "
                 "matmul: a gather is `reshard(x, P(...))` taking an axis off a dim that feeds "
                 "a matmul; a reduce-scatter is a matmul over a contracting dim sharded on an "
                 "axis with `out_sharding` sharding a free dim on it")
  else:
    notes.append("collectives here are inserted by XLA's partitioner; use explicit axes "
                 "(jax.make_mesh(..., axis_types=Explicit)) or shard_map")
  if seen["collectives"]:
    notes.append("inside shard_map, fused are tiled all_gather -> dot_general and dot_general "
                 "-> tiled psum_scatter (through reshapes, transposes, casts)")
  return notes
