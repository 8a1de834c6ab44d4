"""What the rewrite found: one `Match` per candidate collective, and the `Report`."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Match:
  """A collective next to a dot_general inside a shard_map body (or implied by the sharding
  types of a program without shard_map: origin "explicit").

  kind: "ag_matmul" (all_gather -> dot_general) or "matmul_rs"
    (dot_general -> psum_scatter).
  status: "fused" or "skipped"; reason says why a candidate was skipped.
  impl: what runs for a fused match on the program's platform.
  operand: which dot operand is gathered ("lhs"/"rhs"), or whose free dim is
    scattered; dim_kind: "free", "contracting" or "batch" for that dim.
  collective_dim: all_gather_dimension / scatter_dimension as written.
  lhs_shape/rhs_shape/out_shape: the dot_general's per-device shapes.
  n_dots: dot_generals fed by one gather (the first is fused; the others
    reuse its gathered value).
  source: the user's source line of the collective; path: where in the
    program (nesting of jit/shard_map/scan/...).
  origin: "shard_map" (a collective in a shard_map body) or "explicit" (a
    collective implied by the sharding types of a program without shard_map).
  """
  kind: str
  status: str
  reason: str
  axis_name: Any
  axis_size: int | None
  collective_dim: int
  operand: str | None = None
  dim_kind: str | None = None
  lhs_shape: tuple[int, ...] | None = None
  rhs_shape: tuple[int, ...] | None = None
  out_shape: tuple[int, ...] | None = None
  dtype: str | None = None
  n_dots: int = 1
  impl: str | None = None
  source: str = ""
  path: str = ""
  origin: str = "shard_map"  # or "explicit": implied by explicit-sharding types, no shard_map

  @property
  def fused(self) -> bool:
    return self.status == "fused"


def _shape(s):
  return "-" if s is None else "x".join(map(str, s)) or "()"


@dataclasses.dataclass
class Report:
  """All candidates of one traced program; `str(report)` is a readable table."""
  matches: list[Match] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)  # what was looked at, if empty

  @property
  def fused(self) -> list[Match]:
    return [m for m in self.matches if m.status == "fused"]

  @property
  def skipped(self) -> list[Match]:
    return [m for m in self.matches if m.status == "skipped"]

  def __len__(self):
    return len(self.matches)

  def __iter__(self):
    return iter(self.matches)

  def __str__(self):
    if not self.matches:
      return "\n".join(["jax_autooverlap: no all_gather/psum_scatter next to a dot_general was "
                        "found."] + [f"  {note}" for note in self.notes])
    head = ("#", "kind", "status", "axis", "dim", "lhs", "rhs", "out", "dtype", "impl / reason",
            "source")
    rows = [head]
    for i, m in enumerate(self.matches):
      dim = f"{m.collective_dim}" + (f" ({m.operand} {m.dim_kind})" if m.operand else "")
      note = m.impl if m.fused else m.reason
      if m.n_dots > 1:
        note = f"{note}; {m.n_dots} dots share the gather"
      axis = f"{m.axis_name}" + (f"={m.axis_size}" if m.axis_size else "")
      kind = m.kind + (" [explicit]" if m.origin == "explicit" else "")
      rows.append((str(i), kind, m.status, axis, dim, _shape(m.lhs_shape), _shape(m.rhs_shape),
                   _shape(m.out_shape), m.dtype or "-", note or "", m.source))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    summary = f"{len(self.fused)} fused, {len(self.skipped)} skipped"
    return "\n".join(lines + [summary])
