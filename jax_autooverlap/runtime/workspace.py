"""Symmetric workspace: one device buffer per GPU of a mesh and axis, reachable by its peers.

Each GPU's workspace holds (byte offsets):
  0                  epoch: calls completed on this GPU (int32)
  4                  done: CTAs of the running call that finished (int32)
  8                  tile counters int32[2 parity]: next output tile to hand out
  ERROR_SLOT_OFFSET  address (uint64) of this process's error record (pinned host
                     memory); per process, so it lives here and not in the
                     kernels' address table, which is the same in every process
  FLAGS_OFFSET       arrival counters int32[2 parity][world][MAX_CHUNKS]
  buffer_offset(w)   parity 0's buffers [world][rows x cols] elements (a call's gather buffers
                     or partial-sum slots)
  + parity_bytes     parity 1's buffers: half of the buffer area, whatever the call's size

Invariants the kernels rely on:
- A workspace serves the fused calls over ONE axis of a mesh: every GPU of a group runs the
  same sequence of them (SPMD), so the epochs of all GPUs advance in lockstep and
  parity = epoch % 2 agrees.  (Calls over another axis have other peers, whose progress
  these calls do not order: they get a workspace of their own.)
- A call writes a peer's parity slot p only after it finished its previous
  call, which needed that peer's data of the previous call, which the peer
  sent only after finishing the call before: so slot p of the peer is no
  longer read.  Counters of slot p are zeroed by the last CTA of each call.
- Slot p is the same bytes for every call on a workspace, whatever its size (parity 1
  starts half-way through the buffer area): a call on slot p never touches the other
  slot, which the call before it may still be reading on a peer.  (With slots packed
  by the call's own size, an fp8 gather's slot 1 overlapped a bf16 reduce-scatter's
  slot 0 and corrupted it: measured on one H200, 2026-12-02.)
- The workspaces of a device set are allocated together (runtime/symmetric.py:
  device i's at the same address in every process), zeroed, and only grow; a
  grown set is new memory (epochs start at 0 everywhere) and old sets stay
  mapped until exit, since programs compiled earlier hold their addresses as
  constants.

Set-up and growth are collective over the processes owning the mesh's devices
(runtime/rendezvous.py): planning asks `support` (which sets the device set up
once and allocates a first workspace) and falls back to the unfused program
with the same reason in every process when it fails; kernels ask `workspace`
for their size at trace time, growing it collectively.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import struct
import threading

import numpy as np

from jax_autooverlap.runtime import cuda, rendezvous, symmetric, topology

_REGISTRIES = itertools.count()
ERROR_SLOT_OFFSET = 128  # must match kernels/sync.py ERROR_SLOT_OFFSET
FLAGS_OFFSET = 256
MAX_CHUNKS = 64
_ALIGN = 1024


def flags_bytes(world: int) -> int:
  return 2 * world * MAX_CHUNKS * 4


def buffer_offset(world: int) -> int:
  return -(-(FLAGS_OFFSET + flags_bytes(world)) // _ALIGN) * _ALIGN


def required_bytes(world: int, shard_bytes: int) -> int:
  """A workspace that holds the world's shards of shard_bytes in each parity slot."""
  return buffer_offset(world) + 2 * (-(-world * shard_bytes // 16) * 16)


def parity_bytes(world: int, nbytes: int) -> int:
  """Byte distance from parity slot 0's buffers to slot 1's in a workspace of nbytes: half
  the buffer area (16-byte aligned, as TMA wants), the same for every call on it."""
  return (nbytes - buffer_offset(world)) // 2 // 16 * 16


def kernel_bytes(op: str, world: int, rows: int, k: int, cols: int, dtype, out_dtype) -> int:
  """Workspace a kernel needs per GPU for per-device a[rows, k] @ b[k, cols]: AG+GEMM
  ("ag_rows") buffers the shards of a, GEMM+RS ("rs_rows") the partial output slots."""
  if op == "ag_rows":
    return required_bytes(world, rows * k * np.dtype(dtype).itemsize)
  if op == "rs_rows":
    return required_bytes(world, (rows // world) * cols * np.dtype(out_dtype).itemsize)
  raise ValueError(f"kernel_bytes: no GPU kernel for {op!r}")


@dataclasses.dataclass(frozen=True)
class Support:
  """Can the fused kernels run over an axis of a mesh: ok, or why not; how groups are spread."""
  ok: bool
  reason: str  # why not, or how the groups are spread ("1 process", "2 processes")
  processes: int = 1  # processes per group


@dataclasses.dataclass(frozen=True)
class Workspace:
  """Workspaces of every device of a mesh (flat order): the same addresses in every process."""
  addresses: tuple[int, ...]
  nbytes: int
  num_sms: int  # the smallest SM count among the mesh's processes' GPUs


class _DeviceSet:
  """The state of one ordered device set (a mesh's devices) and axis, identical in every
  process."""

  def __init__(self, devices: tuple, axis_name: str):
    self.devices = devices
    ids = ",".join(str(d.id) for d in devices)
    self.key = hashlib.sha1(f"{ids}|{axis_name}".encode()).hexdigest()[:16]
    self.name = (f"mesh devices [{ids}]" if len(ids) < 60 else f"mesh devices [{ids[:57]}...]") \
        + f", axis {axis_name!r}"
    self.processes = topology.mesh_processes(devices)
    self.hosts: dict[int, str] | None = None
    self.num_sms = 0
    self.error: str | None = None  # set-up failed (the same reason in every process)
    # The smallest size whose allocation failed, and why: larger requests fail at once
    # (in every process alike), smaller ones may still grow the workspace.
    self.failed: tuple[int, str] | None = None
    self.generation = 0
    self.nbytes = 0
    self.current: symmetric.SymmetricMemory | None = None
    self.retired: list[symmetric.SymmetricMemory] = []  # still referenced by compiled programs


class WorkspaceRegistry:
  """Workspaces keyed by the ordered tuple of devices of a mesh and the axis; grown on
  demand."""

  def __init__(self, driver=None, allocator: symmetric.SymmetricAllocator | None = None):
    self.driver = driver or cuda  # runtime/cuda.py's functions (loads libcuda on first call)
    self.allocator = allocator or symmetric.CuMemAllocator(self.driver)
    self._lock = threading.RLock()
    self._sets: dict[tuple, _DeviceSet] = {}
    self._error_record = None
    self._atexit = False
    # Session tags start with the registry's number: registries are made in the same order
    # in every process (normally just REGISTRY), and two must never share a tag.
    self._tag = f"r{next(_REGISTRIES)}"

  def support(self, mesh, axis_name: str | None, nbytes: int = 1) -> Support:
    """Whether the fused kernels can run over `axis_name` of `mesh` with workspaces of nbytes
    (collective when it sets up or grows them).  axis_name may be None for a 1-axis mesh.
    """
    if axis_name is None:
      if len(mesh.axis_names) != 1:
        raise ValueError(f"support: which axis of the mesh {tuple(mesh.axis_names)}? "
                         "(axis_name is needed for meshes of several axes)")
      axis_name = mesh.axis_names[0]
    with self._lock:
      ds = self._set(mesh, axis_name)
      if ds.error:
        return Support(False, ds.error)
      topo = topology.classify(np.asarray(mesh.devices), mesh.axis_names, axis_name, ds.hosts)
      if topo.kind == topology.MULTI_HOST:
        return Support(False, topo.describe())
      try:
        self._grow(ds, nbytes)
      except symmetric.SetupError as e:
        return Support(False, str(e))
      return Support(True, topo.describe(), topo.processes_per_group)

  def workspace(self, mesh, axis_name: str, nbytes: int) -> Workspace:
    """Workspaces of at least nbytes per device of the mesh for the calls over axis_name
    (grown collectively if needed)."""
    with self._lock:
      ds = self._set(mesh, axis_name)
      try:
        if ds.error:
          raise symmetric.SetupError(ds.error)
        self._grow(ds, nbytes)
      except symmetric.SetupError as e:
        raise RuntimeError(f"fused kernel on {ds.name}: no symmetric workspace ({e})") from None
      return Workspace(ds.current.addresses(), ds.nbytes, ds.num_sms)

  def _set(self, mesh, axis_name: str) -> _DeviceSet:
    devices = tuple(np.asarray(mesh.devices).flat)
    key = (tuple(d.id for d in devices), axis_name)
    ds = self._sets.get(key)
    if ds is None:
      ds = self._sets[key] = _DeviceSet(devices, axis_name)
      self._set_up(ds)
    return ds

  def _set_up(self, ds: _DeviceSet):
    """Agree once on every process's host and SM count (the same table everywhere)."""
    me = rendezvous.process_index()
    if me not in ds.processes:
      ds.error = f"process {me} owns no device of {ds.name}"
      return
    session = rendezvous.Session(f"{self._tag}/setup/{ds.key}", ds.processes,
                                 f"set-up of {ds.name}")
    ok, reason, info = True, "", {}
    try:
      sms = min(self.driver.sm_count(o) for o in self._local_ordinals(ds, me))
      info = session.exchange("hosts", {"host": rendezvous.host_id(), "sms": sms})
    except Exception as e:  # noqa: BLE001 (any failure is this process's vote)
      ok, reason = False, f"{type(e).__name__}: {e}"
    decision = session.decide(ok, reason)
    if not decision.ok:
      ds.error = f"set-up of the processes of {ds.name} failed: {decision.reason}"
      return
    ds.hosts = {int(p): v["host"] for p, v in info.items()}
    ds.num_sms = min(v["sms"] for v in info.values())

  @staticmethod
  def _local_ordinals(ds: _DeviceSet, me: int) -> list[int]:
    return [d.local_hardware_id for d in ds.devices if d.process_index == me]

  def _grow(self, ds: _DeviceSet, nbytes: int):
    if ds.current is not None and ds.nbytes >= nbytes:
      return
    if ds.error:
      raise symmetric.SetupError(ds.error)
    size = max(nbytes, 2 * ds.nbytes)
    if ds.failed is not None and size >= ds.failed[0]:
      raise symmetric.SetupError(ds.failed[1])
    me = rendezvous.process_index()
    ds.generation += 1
    session = rendezvous.Session(f"{self._tag}/ws/{ds.key}/{ds.generation}", ds.processes,
                                 f"workspace {ds.generation} of {ds.name}")
    slots = [symmetric.Slot(d.process_index, ds.hosts[d.process_index],
                            d.local_hardware_id if d.process_index == me else None)
             for d in ds.devices]
    try:
      mem = self.allocator.allocate(session, slots, me, size, self._init_header)
    except symmetric.SetupError as e:
      ds.failed = (size, f"symmetric workspace of {size} bytes per GPU ({self.allocator.name}) "
                   f"failed: {e}")
      raise symmetric.SetupError(ds.failed[1]) from None
    if not self._atexit:
      atexit.register(self.close)
      self._atexit = True
    if ds.current is not None:
      ds.retired.append(ds.current)
    ds.current, ds.nbytes = mem, mem.stride

  def _init_header(self, address: int, ordinal: int):
    record = self.error_record(ordinal)
    self.driver.write(ordinal, address + ERROR_SLOT_OFFSET,
                      struct.pack("<Q", record.device_address))

  def existing_error_record(self):
    return self._error_record

  def error_record(self, ordinal: int = 0):
    with self._lock:
      if self._error_record is None:
        self._error_record = self.driver.error_record(ordinal)
      return self._error_record

  def close(self):
    """Release every workspace (at exit: no program may run afterwards)."""
    with self._lock:
      me = rendezvous.process_index()
      for ds in self._sets.values():
        if ds.current is None:
          continue
        for o in set(self._local_ordinals(ds, me)):
          try:
            self.driver.synchronize(o)  # nothing in flight may touch the memory
          except Exception:  # noqa: BLE001 (e.g. the context was lost after a timeout)
            pass
        for mem in ds.retired + [ds.current]:
          mem.release()
        ds.retired, ds.current, ds.nbytes = [], None, 0
        ds.error = "released"
      self.allocator.close()


REGISTRY = WorkspaceRegistry()
