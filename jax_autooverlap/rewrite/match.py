"""What the rewrite found: one `Match` per candidate collective, and the `Report`."""
from __future__ import annotations

import dataclasses
from typing import Any

from jax_autooverlap.reasons import code_of


FUSED, UNFUSED, SKIPPED, PENDING = "fused", "unfused", "skipped", "pending"


def status_of(impl: str) -> str:
  """Status of a rewritten match from the planner's note (ops.planning.describe), which
  starts with what runs: "unfused ..." where the plain collective and matmul run; a note
  coded "first_call" is a shape whose first call measures which runs."""
  if code_of(impl) == "first_call":
    return PENDING
  return UNFUSED if impl.startswith("unfused") else FUSED

PHASES = {"fwd": "forward pass", "bwd": "backward pass (a transpose / VJP)",
          "remat": "forward recomputed in the backward pass (jax.checkpoint)"}


@dataclasses.dataclass(frozen=True)
class Match:
  """A collective next to a dot_general inside a shard_map body (or implied by the sharding
  types of a program without shard_map: origin "explicit").

  kind: "ag_matmul" (all_gather -> dot_general) or "matmul_rs"
    (dot_general -> psum_scatter).
  status: "fused" (a fused op runs: the reference ring or the GPU kernel),
    "unfused" (rewritten into the fused op, which runs the plain collective
    and matmul here: forced by OverlapConfig(impl="unfused") or chosen by the
    tuner; `impl` says which), "pending" (rewritten into the fused op; no
    measured verdict for its shape yet: its first call times the kernel
    against the unfused program and keeps the faster) or "skipped" (left as
    written; `reason` says why).
  impl: what runs for a rewritten match on the program's platform.
  operand: which dot operand is gathered ("lhs"/"rhs"), or whose free dim is
    scattered; dim_kind: "free", "contracting" or "batch" for that dim.
  collective_dim: all_gather_dimension / scatter_dimension as written.
  lhs_shape/rhs_shape/out_shape: the dot_general's per-device shapes (for a
    sum of matmuls, those of the one matmul over concatenated contracting dims).
  n_dots: dot_generals fed by one gather (one is fused; the others reuse its
    gathered value), or matmuls summed before one psum_scatter.
  note: more about a rewritten match (e.g. the other operand's own gather).
  phase: "fwd", "bwd" (inside a transpose / VJP) or "remat" (the forward
    recomputed by jax.checkpoint in the backward pass).
  source / dot_source: the user's source lines of the collective and of the
    matmul; path: where in the program (nesting of jit/shard_map/scan/...).
  origin: "shard_map" (a collective in a shard_map body) or "explicit" (a
    collective implied by the sharding types of a program without shard_map).
  code: the stable code of `reason` (skipped) or of the planner's note (rewritten).
  function: in the report of a program that calls ao.jit functions, the one whose rewrite
    this row is from ("" for the program's own candidates).
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
  note: str = ""
  phase: str = "fwd"
  dot_source: str = ""
  origin: str = "shard_map"  # or "explicit": implied by explicit-sharding types, no shard_map
  code: str = ""  # the reason's code (jax_autooverlap/reasons.py): why skipped, or what runs
  function: str = ""  # the ao.jit function whose rewrite this row is from (in a larger program)

  def __post_init__(self):
    if not self.code:  # the code the reason (skipped) or the planner's note (rewritten) carries
      object.__setattr__(self, "code", code_of(self.reason if self.status == SKIPPED else self.impl))

  @property
  def fused(self) -> bool:
    return self.status == FUSED

  @property
  def rewritten(self) -> bool:
    """The program holds the fused op here (status fused, unfused or pending)."""
    return self.status in (FUSED, UNFUSED, PENDING)


def _shape(s):
  return "-" if s is None else "x".join(map(str, s)) or "()"


def _table(rows):
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return lines


@dataclasses.dataclass
class Report:
  """All candidates of one traced program; `str(report)` is a readable table."""
  matches: list[Match] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)  # what was looked at, if empty
  functions: tuple[str, ...] = ()  # the ao.jit functions whose rewrites the rows come from

  @property
  def has_regions(self) -> bool:
    return bool(self.functions)

  def add_region(self, function: str, report: "Report") -> None:
    """Take the rows (and, where it found none, the notes) of an ao.jit function's rewrite."""
    self.matches.extend(m if m.function else dataclasses.replace(m, function=function)
                        for m in report.matches)
    if not report.matches:
      self.notes.extend(f"{function}: {note}" for note in report.notes)
    self.functions = tuple(dict.fromkeys((*self.functions, function, *report.functions)))

  @property
  def fused(self) -> list[Match]:
    return [m for m in self.matches if m.status == FUSED]

  @property
  def unfused(self) -> list[Match]:
    return [m for m in self.matches if m.status == UNFUSED]

  @property
  def skipped(self) -> list[Match]:
    return [m for m in self.matches if m.status == SKIPPED]

  @property
  def pending(self) -> list[Match]:
    """Rows whose first call measures the kernel against the unfused program."""
    return [m for m in self.matches if m.status == PENDING]

  def mark_skipped(self, match: Match, reason) -> bool:
    """Replace `match` (this very object, wherever listed) by a skipped copy; False if absent."""
    found = False
    for i, m in enumerate(self.matches):
      if m is match:
        self.matches[i] = dataclasses.replace(match, status=SKIPPED, reason=reason, impl=None,
                                              code=code_of(reason))
        found = True
    return found

  def __len__(self):
    return len(self.matches)

  def __iter__(self):
    return iter(self.matches)

  def __str__(self):
    if not self.matches:
      return "\n".join(["jax_autooverlap: no all_gather/psum_scatter next to a dot_general was "
                        "found."] + [f"  {note}" for note in self.notes])
    functions = any(m.function for m in self.matches)  # rows of ao.jit functions in a program
    head = ("#", *(("function",) if functions else ()), "pass", "kind", "status", "axis", "dim",
            "lhs", "rhs", "out", "dtype", "path")
    rows, details = [head], []
    for i, m in enumerate(self.matches):
      dim = f"{m.collective_dim}" + (f" ({m.operand} {m.dim_kind})" if m.operand else "")
      axis = f"{m.axis_name}" + (f"={m.axis_size}" if m.axis_size else "")
      kind = m.kind + (" [explicit]" if m.origin == "explicit" else "")
      rows.append((str(i), *((m.function or "-",) if functions else ()), m.phase, kind, m.status,
                   axis, dim, _shape(m.lhs_shape), _shape(m.rhs_shape), _shape(m.out_shape),
                   m.dtype or "-", m.path or "/"))
      why = [f"impl: {m.impl}" if m.rewritten else f"why: {m.reason}"]
      if m.n_dots > 1:
        why.append(f"{m.n_dots} matmuls share the gather" if m.kind == "ag_matmul" else
                   f"sum of {m.n_dots} matmuls, one GEMM over their concatenated contracting dims")
      if m.note:
        why.append(m.note)
      collective = "all_gather" if m.kind == "ag_matmul" else "psum_scatter"
      where = f"matmul at {m.dot_source or '?'}; {collective} at {m.source or '?'}"
      if m.phase == "bwd":  # JAX gives a VJP's equations the lines of the ops they differentiate
        where = f"VJP of the matmul at {m.dot_source or '?'} and the collective at {m.source or '?'}"
      details.append((i, "; ".join(why), where))
    lines = _table(rows)
    for i, why, where in details:
      lines += [f"{i:>2}: {why}", f"    {where}"]
    if any(m.phase != "fwd" for m in self.matches):
      lines.append("pass: " + "; ".join(f"{k} = {v}" for k, v in PHASES.items()))
    counts = f"{len(self.fused)} fused, {len(self.skipped)} skipped"
    if self.pending:
      counts += f", {len(self.pending)} pending (measured on the first call)"
    if self.unfused:
      counts += f", {len(self.unfused)} unfused (the plain collective and matmul run)"
    return "\n".join(lines + [counts])
