"""Find the fusable collective/matmul pairs of a traced program and plan the rewrite.

One traversal walks a closed jaxpr, recursing into every sub-jaxpr found in
equation params (jit, shard_map, scan, while, cond, remat, custom_jvp/vjp,
and any other higher-order primitive), and hands each jaxpr to a matcher:
inside shard_map bodies the matcher of explicit collectives
(rewrite/shardmap.py), elsewhere the one of the collectives implied by
explicit-sharding types (rewrite/explicit/).  A higher-order equation whose
sub-jaxprs get a fused op is marked for the interpreter to rebuild.  The
traversal does not enter what is already rewritten: the fused ops' own
bodies, and the regions of ao.jit functions (rewrite/regions.py), whose
reports it takes instead (their rows marked with the function).
"""
from __future__ import annotations

import numpy as np

import dataclasses

from jax_autooverlap.ops import registry
from jax_autooverlap.reasons import Reason
from jax_autooverlap.rewrite import _jax, explicit, regions
from jax_autooverlap.rewrite.match import SKIPPED, Report
from jax_autooverlap.rewrite.plan import Plan
from jax_autooverlap.rewrite.shardmap import ShardMapMatcher
from jax_autooverlap.tuning.config import OverlapConfig


def analyze(closed_jaxpr, config: OverlapConfig | None = None) -> Plan:
  plan = Plan()
  _Walker(plan, config or OverlapConfig()).walk(closed_jaxpr.jaxpr, False, "", None)
  if not plan.report.matches and not plan.report.functions:  # what was looked at, what to do
    plan.report.notes.extend(explicit.survey(closed_jaxpr))
  return plan


OUTSIDE = ("outside any ao.jit function: runs as written (decorate the function that holds it, "
           "e.g. the training step, with ao.jit to fuse it)")


def collect(closed_jaxpr, outside: bool = False) -> Report:
  """The report of a traced program as it runs: the rows of every ao.jit region in it (marked
  with the function) and, with `outside`, the candidates outside every region (skipped: they
  run as written)."""
  plan = analyze(closed_jaxpr, OverlapConfig(impl="unfused"))  # outside: found, never planned
  report = plan.report
  rows = []
  for m in report.matches:
    if not m.function:
      if not outside:
        continue
      why = OUTSIDE if m.status != SKIPPED else f"{OUTSIDE}; also: {m.reason}"
      m = dataclasses.replace(m, status=SKIPPED, reason=Reason("outside_ao_jit", why), impl=None,
                              code="outside_ao_jit")
    rows.append(m)
  return Report(rows, report.notes, report.functions)


def _concrete(mesh):
  try:  # a concrete Mesh knows its devices; an AbstractMesh does not
    np.asarray(mesh.devices)
    return mesh
  except Exception:
    return None


class _Walker:

  def __init__(self, plan: Plan, config: OverlapConfig):
    self.plan = plan
    self.config = config
    self.shard_map = ShardMapMatcher(plan, config)

  def walk(self, jaxpr, manual: bool, path: str, mesh, phase: str = "fwd") -> bool:
    """Analyse one jaxpr; True if it (or anything inside) gets a fused op."""
    changed = False
    for i, eqn in enumerate(jaxpr.eqns):
      region = regions.of_eqn(eqn)
      if region is not None:
        self.plan.report.add_region(region.function, region.report)
        continue
      if registry.is_core_call(eqn):  # a fused op (called directly): already what runs
        continue
      name = eqn.primitive.name
      sub_manual = manual or name == "shard_map"
      sub_mesh = _concrete(eqn.params.get("mesh")) if name == "shard_map" else mesh
      sub_path = f"{path}/{name}" + (f"({eqn.params['name']})" if "name" in eqn.params else "")
      sub_phase = _jax.phase(eqn, phase)
      first = len(self.plan.report.matches)
      for sub in _jax.sub_jaxprs(eqn.params):
        if self.walk(sub, sub_manual, sub_path, sub_mesh, sub_phase):
          self.plan.rebuild.add((id(jaxpr), i))
          changed = True
      if (id(jaxpr), i) in self.plan.rebuild:
        self.plan.inside[(id(jaxpr), i)] = self.plan.report.matches[first:]
    if manual:
      changed |= self.shard_map.match(jaxpr, path or "/", mesh, phase)
    else:  # no shard_map: collectives implied by explicit-sharding types
      changed |= explicit.match(self.plan, self.config, jaxpr, path or "/", phase)
    return changed
