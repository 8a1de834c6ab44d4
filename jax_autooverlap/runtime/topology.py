"""Where the devices of a mesh axis live: its groups, their processes and hosts.

A fused op over mesh axis `a` runs once per group: the devices that differ
only in their index along `a`, in rank (axis-index) order.  How a group can
share its symmetric workspace depends on where its devices live:

  ONE_PROCESS  one process drives every device of the group: it maps every
               device's workspace itself.
  ONE_HOST     several processes of one host: each maps its own devices'
               workspaces and imports the others' (file descriptors over a
               Unix socket).
  MULTI_HOST   the group spans hosts: no shared memory, the op runs unfused.

Pure Python on anything with `process_index` (jax devices or stand-ins), so
that every process computes the same answer from the same (agreed) host table.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

ONE_PROCESS = "one process"
ONE_HOST = "one host"
MULTI_HOST = "several hosts"
_ORDER = (ONE_PROCESS, ONE_HOST, MULTI_HOST)


@dataclasses.dataclass(frozen=True)
class Group:
  """The devices of one group in rank order, with the process and host of each rank."""
  devices: tuple
  rank_process: tuple[int, ...]
  rank_host: tuple[str, ...]

  @property
  def processes(self) -> tuple[int, ...]:
    return tuple(sorted(set(self.rank_process)))

  @property
  def hosts(self) -> tuple[str, ...]:
    return tuple(sorted(set(self.rank_host)))

  @property
  def kind(self) -> str:
    if len(self.hosts) > 1:
      return MULTI_HOST
    return ONE_HOST if len(self.processes) > 1 else ONE_PROCESS


@dataclasses.dataclass(frozen=True)
class AxisTopology:
  """Every group of one mesh axis (groups ordered as the kernels' address table rows)."""
  axis_name: str
  world: int
  groups: tuple[Group, ...]

  @property
  def kind(self) -> str:
    """The hardest kind among the groups (one op serves every group)."""
    return max((g.kind for g in self.groups), key=_ORDER.index)

  @property
  def processes_per_group(self) -> int:
    return max(len(g.processes) for g in self.groups)

  def describe(self) -> str:
    """One phrase for ao.explain: how the groups are spread."""
    if self.kind == MULTI_HOST:
      g = next(g for g in self.groups if g.kind == MULTI_HOST)
      ranks = {h: [r for r, rh in enumerate(g.rank_host) if rh == h] for h in g.hosts}
      where = ", ".join(f"ranks {v} on host {h!r}" for h, v in ranks.items())
      return (f"the groups of axis {self.axis_name!r} span {len(g.hosts)} hosts ({where}); "
              "fused kernels need every GPU of a group on one host")
    n = self.processes_per_group
    return "1 process" if n == 1 else f"{n} processes"


def axis_groups(devices: np.ndarray, axis_names: Sequence[str], axis_name: str) -> list[tuple]:
  """Groups of `axis_name` in the row order of the kernels' address table
  (the other axes in mesh order, flattened), each in rank order."""
  ax = list(axis_names).index(axis_name)
  devices = np.asarray(devices, dtype=object)
  rows = np.moveaxis(devices, ax, -1).reshape(-1, devices.shape[ax])
  return [tuple(row) for row in rows]


def classify(devices: np.ndarray, axis_names: Sequence[str], axis_name: str,
             host_of_process: Mapping[int, str]) -> AxisTopology:
  """Groups and kinds of `axis_name` of a mesh with `devices` (shaped like the mesh).

  host_of_process maps every process owning a device of the mesh to a host
  identity (the same table in every process).
  """
  groups = []
  for row in axis_groups(devices, axis_names, axis_name):
    procs = tuple(d.process_index for d in row)
    missing = sorted({p for p in procs if p not in host_of_process})
    if missing:
      raise ValueError(f"no host known for process(es) {missing} of axis {axis_name!r}")
    groups.append(Group(row, procs, tuple(host_of_process[p] for p in procs)))
  return AxisTopology(axis_name, len(groups[0].devices), tuple(groups))


def mesh_processes(devices) -> tuple[int, ...]:
  """Distinct processes owning a device of the mesh, sorted."""
  return tuple(sorted({d.process_index for d in np.asarray(devices, dtype=object).flat}))
