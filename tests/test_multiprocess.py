"""Multi-process groups on CPU: topology, rendezvous, descriptor passing, symmetric workspace.

Real multi-process runs start processes of tests/multiprocess_worker.py under
jax.distributed on 127.0.0.1 (CPU devices); the CUDA driver is replaced by a
stand-in (tests/fake_cuda.py) whose allocations are memfd files, so the
descriptors really travel between the processes.
"""
import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from fake_cuda import FakeDriver
from jax_autooverlap.runtime import fdshare, rendezvous, symmetric, topology, workspace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --- topology on stand-in devices -------------------------------------------

def _devices(processes):
  return [SimpleNamespace(id=i, process_index=p) for i, p in enumerate(processes)]


def _classify(processes, hosts, shape, names, axis):
  devs = np.empty(len(processes), dtype=object)
  devs[:] = _devices(processes)
  return topology.classify(devs.reshape(shape), names, axis, hosts)


def test_one_process_drives_every_gpu():
  t = _classify([0] * 8, {0: "a"}, (8,), ("tp",), "tp")
  assert t.kind == topology.ONE_PROCESS and t.world == 8 and len(t.groups) == 1
  assert t.describe() == "1 process"


def test_two_processes_one_host():
  t = _classify([0, 1], {0: "a", 1: "a"}, (2,), ("tp",), "tp")
  assert t.kind == topology.ONE_HOST and t.groups[0].processes == (0, 1)
  assert t.describe() == "2 processes"


def test_two_hosts_with_tp_inside_a_host():
  # one process per GPU, 4 GPUs per host; tp groups = rows of the (dp, tp) mesh
  hosts = {p: "a" if p < 4 else "b" for p in range(8)}
  tp = _classify(list(range(8)), hosts, (2, 4), ("dp", "tp"), "tp")
  assert tp.kind == topology.ONE_HOST and tp.describe() == "4 processes"
  assert [tuple(d.id for d in g.devices) for g in tp.groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
  dp = _classify(list(range(8)), hosts, (2, 4), ("dp", "tp"), "dp")
  assert dp.kind == topology.MULTI_HOST
  assert [tuple(d.id for d in g.devices) for g in dp.groups] == [(0, 4), (1, 5), (2, 6), (3, 7)]
  assert "span 2 hosts" in dp.describe() and "ranks [0] on host 'a'" in dp.describe()


def test_tp_spanning_hosts():
  # tp groups pair a GPU of host a with one of host b: (0, 4), (1, 5), ...
  hosts = {p: "a" if p < 4 else "b" for p in range(8)}
  devs = np.empty(8, dtype=object)
  devs[:] = _devices(range(8))
  t = topology.classify(devs.reshape(2, 4).T, ("dp", "tp"), "tp", hosts)
  assert t.kind == topology.MULTI_HOST
  assert t.groups[0].rank_host == ("a", "b")
  assert "axis 'tp' span 2 hosts" in t.describe()


def test_two_processes_of_four_gpus():
  hosts = {0: "a", 1: "a"}
  procs = [0] * 4 + [1] * 4
  tp = _classify(procs, hosts, (2, 4), ("dp", "tp"), "tp")  # tp inside a process
  assert tp.kind == topology.ONE_PROCESS and tp.describe() == "1 process"
  dp = _classify(procs, hosts, (2, 4), ("dp", "tp"), "dp")  # dp across the two processes
  assert dp.kind == topology.ONE_HOST and dp.describe() == "2 processes"
  flat = _classify(procs, hosts, (8,), ("tp",), "tp")
  assert flat.kind == topology.ONE_HOST and flat.groups[0].rank_process == tuple(procs)


def test_unknown_host_is_an_error():
  with pytest.raises(ValueError, match=r"no host known for process\(es\) \[1\]"):
    _classify([0, 1], {0: "a"}, (2,), ("tp",), "tp")


# --- in-process pieces -------------------------------------------------------

def test_in_process_session_without_jax_distributed():
  s = rendezvous.Session("t", [0], "test", me=0)
  assert s.in_process and s.exchange("a", {"x": 1}) == {0: {"x": 1}}
  assert s.decide(True) == rendezvous.Decision(True, "")
  assert s.decide(False, "boom") == rendezvous.Decision(False, "process 0: boom")
  with pytest.raises(ValueError, match="process 3 is not one of"):
    rendezvous.Session("t", [0, 1], "test", me=3)


def _cpu_mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:int(np.prod(shape))],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def test_single_process_workspace_is_symmetric_zeroed_and_grown():
  drv = FakeDriver()
  reg = workspace.WorkspaceRegistry(driver=drv)
  mesh = _cpu_mesh((2, 4), ("dp", "tp"))
  assert reg.support(mesh, "tp") == workspace.Support(True, "1 process", 1)
  ws = reg.workspace(mesh, "tp", 1000)
  stride = ws.addresses[1] - ws.addresses[0]
  assert stride == ws.nbytes == FakeDriver.GRANULARITY and ws.num_sms == 132
  assert list(ws.addresses) == [ws.addresses[0] + i * stride for i in range(8)]
  record = drv.error_record(0).device_address
  for a in ws.addresses:
    head = drv.read(a, workspace.FLAGS_OFFSET)
    slot = workspace.ERROR_SLOT_OFFSET
    assert int.from_bytes(head[slot:slot + 8], "little") == record
    assert head[:slot] == bytes(slot)  # epoch, counters zeroed
  for a in ws.addresses:  # zeroed; every device may access every device's workspace
    assert a in drv.zeroed and drv.access[a] == tuple(range(8))
  drv.write(0, ws.addresses[0], b"\x07")  # programs compiled earlier keep this memory
  bigger = reg.workspace(mesh, "tp", 3 * FakeDriver.GRANULARITY)
  assert bigger.nbytes == 3 * FakeDriver.GRANULARITY and bigger.addresses != ws.addresses
  assert drv.read(ws.addresses[0], 1) == b"\x07" and drv.live()["mapped"] == 16
  assert reg.workspace(mesh, "tp", 100).addresses == bigger.addresses  # no growth needed
  reg.close()
  assert drv.live() == {"handles": 0, "reserved": 0, "mapped": 0}


def test_each_axis_of_a_mesh_has_a_workspace_of_its_own():
  """Calls over another axis have other peers, whose progress does not order this axis's
  parity slots (runtime/workspace.py): each axis's calls get their own memory and epochs."""
  drv = FakeDriver()
  reg = workspace.WorkspaceRegistry(driver=drv)
  mesh = _cpu_mesh((2, 4), ("dp", "tp"))
  assert reg.support(mesh, "dp").ok and reg.support(mesh, "tp").ok
  dp, tp = reg.workspace(mesh, "dp", 1000), reg.workspace(mesh, "tp", 1000)
  assert not set(dp.addresses) & set(tp.addresses)
  assert reg.workspace(mesh, "dp", 1000) == dp  # the same again
  reg.close()
  assert drv.live() == {"handles": 0, "reserved": 0, "mapped": 0}


def test_workspace_failure_falls_back_with_the_reason():
  reg = workspace.WorkspaceRegistry(driver=FakeDriver(vmm=False))
  mesh = _cpu_mesh((2,), ("tp",))
  s = reg.support(mesh, "tp")
  assert not s.ok and "does not support CUDA virtual memory management" in s.reason
  assert "process 0" in s.reason
  with pytest.raises(RuntimeError, match="no symmetric workspace"):
    reg.workspace(mesh, "tp", 100)


def test_planning_sizes_the_workspace_and_falls_back_when_it_cannot(monkeypatch):
  """Planning (here on CPU devices standing in for GPUs) allocates what the kernel will need,
  so a workspace that cannot be had means the unfused program, not an error at emission."""
  import jax.numpy as jnp
  import jax_autooverlap as ao
  from jax_autooverlap.ops import planning
  from jax_autooverlap.runtime import context
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import KernelConfig
  drv = FakeDriver(memory=8 << 20)
  monkeypatch.setattr(workspace, "REGISTRY", workspace.WorkspaceRegistry(driver=drv))
  monkeypatch.setattr(context, "platform", lambda mesh: "gpu")
  monkeypatch.setattr(select, "choose_ag",
                      lambda *a, **k: select.Verdict(KernelConfig(), "measured"))
  mesh, bf16 = _cpu_mesh((2,), ("tp",)), jnp.bfloat16
  plan = lambda rows, cfg=ao.OverlapConfig(): planning.plan(
      "ag_rows", cfg, 2, (1, rows, 1024, 512), bf16, bf16, mesh, axis_name="tp")
  assert plan(512)[:3:2] == ("triton", "triton kernel (measured; tl engine)")
  need = workspace.kernel_bytes("ag_rows", 2, 512, 1024, 512, bf16, bf16)
  assert need > FakeDriver.GRANULARITY
  planned = workspace.REGISTRY.workspace(mesh, "tp", 1)
  assert planned.nbytes >= need
  assert workspace.REGISTRY.workspace(mesh, "tp", need) == planned  # emission: no growth left
  impl, _, why = plan(4096)  # 4096 x 1024 bf16 shards: 32 MiB of buffers > 8 MiB of memory
  assert impl == "unfused" and "out of memory" in why and "symmetric workspace" in why
  with pytest.raises(ValueError, match="impl='triton' cannot run here: .*out of memory"):
    plan(4096, ao.OverlapConfig(impl="triton"))
  assert plan(512)[0] == "triton"  # a failed growth leaves the workspace as it was


def test_address_table_is_built_from_symmetric_addresses():
  from jax_autooverlap.backends.triton import _address_table
  mesh = SimpleNamespace(axis_names=("dp", "tp"), devices=np.arange(8).reshape(2, 4))
  addresses = [0x7F00_0000_0000 + i * (1 << 21) for i in range(8)]
  table = _address_table(mesh, "dp", 2, addresses)  # groups (0,4), (1,5), (2,6), (3,7)
  got = [[int(t[2 * r]) | int(t[2 * r + 1]) << 32 for r in range(2)] for t in table]
  assert got == [[addresses[g], addresses[g + 4]] for g in range(4)]


def test_kernels_read_the_error_record_address_where_the_registry_writes_it():
  pytest.importorskip("triton")
  from jax_autooverlap.kernels import sync
  assert sync.ERROR_SLOT_OFFSET.value == workspace.ERROR_SLOT_OFFSET
  assert workspace.ERROR_SLOT_OFFSET + 8 <= workspace.FLAGS_OFFSET


def test_va_agreement_gives_up_when_hints_are_ignored():
  """A driver that never honours address hints: processes cannot agree on one range.
  (In-process stand-in for two processes: the session's exchanges are scripted.)"""
  class TwoProcessSession:
    tag, timeout_s = "t", 1.0

    def __init__(self):
      self.peer_va = 0x1_0000_0000_0000

    def exchange(self, step, payload):
      if step.endswith("-ok"):
        return {0: payload, 1: False}
      return {0: payload, 1: self.peer_va}

  drv = FakeDriver(honour_hints=False)
  state = symmetric._Pieces(drv)
  state.total = 1 << 20
  with pytest.raises(symmetric.SetupError, match="same address in every process"):
    symmetric.CuMemAllocator(drv)._agree_va(TwoProcessSession(), state, 1 << 16)
  state.release()
  assert drv.live()["reserved"] == 0


# --- descriptor passing between two processes --------------------------------

def test_file_descriptor_passing_between_processes():
  child = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {REPO!r})
      from jax_autooverlap.runtime import fdshare
      server = fdshare.HandleServer()
      fd = os.memfd_create("test")
      os.write(fd, b"shared bytes")
      server.offer("slot/3", fd)
      os.close(fd)
      print(server.address, server.secret, flush=True)
      sys.stdin.readline()  # serve until the parent is done
      """)
  proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  try:
    address, secret = proc.stdout.readline().split()
    fd = fdshare.fetch(address, secret, "slot/3", timeout_s=10)
    try:
      assert os.pread(fd, 12, 0) == b"shared bytes"
      os.pwrite(fd, b"S", 0)  # the same file, not a copy
    finally:
      os.close(fd)
    with pytest.raises(OSError, match="no descriptor under 'slot/4'"):
      fdshare.fetch(address, secret, "slot/4", timeout_s=10)
    with pytest.raises(OSError, match="no descriptor"):
      fdshare.fetch(address, "wrong-secret", "slot/3", timeout_s=10)
    again = fdshare.fetch(address, secret, "slot/3", timeout_s=10)
    try:
      assert os.pread(again, 12, 0) == b"Shared bytes"
    finally:
      os.close(again)
  finally:
    proc.communicate("done\n", timeout=30)


# --- real jax.distributed runs ------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_processes(scenario: str, n: int = 2, timeout: float = 150, env_extra=None,
                   dies: int | None = None) -> list[dict]:
  """Start n worker processes of one jax.distributed run; their RESULT lines, by process
  (None for process `dies`, which must exit with status 3)."""
  port = str(_free_port())
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_AUTOOVERLAP_RENDEZVOUS_TIMEOUT_S"] = "30"
  env.update(env_extra or {})
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py"),
                             scenario, str(i), str(n), port], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(n)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  results = []
  for i, (rc, out, err) in enumerate(outs):
    if i == dies:
      assert rc == 3, f"process {i} was to die (rc {rc}):\n{out[-2000:]}\n{err[-3000:]}"
      results.append(None)
      continue
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    assert rc == 0 and lines, f"process {i} (rc {rc}):\n{out[-2000:]}\n{err[-3000:]}"
    results.append(json.loads(lines[-1][len("RESULT "):]))
  return results


def test_gpu_two_process_nested_step_scenario_on_cpu_processes():
  """The two-process GPU harness's nested training step, run by two CPU processes with the
  reference ring: the step has no plain collective, and output, gradients and updates match
  the unsharded step in both processes (on a GPU the same scenario runs the kernels)."""
  for p in _run_processes("nested_step", timeout=240):
    failed = {k: v for k, v in p["checks"].items() if not v[0]}
    # rows are fused by the reference ring here ("every row fused" wants the GPU kernel)
    assert set(failed) == {"nested: every row fused"}, failed
    assert "reference" in failed["nested: every row fused"][1]
    assert len(p["checks"]) == 6


@pytest.mark.parametrize("scenario,label,rows,checks", [("fp8_step", "fp8", 5, 6),
                                                        ("fp8_qdq", "fp8_qdq", 2, 5)])
def test_gpu_two_process_fp8_scenarios_on_cpu_processes(scenario, label, rows, checks):
  """The harness's fp8 scenarios on two CPU processes (the fused fp8 ops' reference ring):
  fp8_step, the TP+SP training step (forward and recomputed forward in e4m3 x e4m3, backward in
  e5m2 x e4m3, output, gradients and updates within the fp8 tolerance of the unsharded f32
  step); fp8_qdq, the forward in the quantize-dequantize form (both rows in e4m3 x e4m3, the
  output within the fp8 tolerance of the unsharded f32 forward).  Every row fused, no plain
  collective, two calls bit-identical (on a GPU the same scenarios run the kernels)."""
  for p in _run_processes(scenario, timeout=240):
    failed = {k: v for k, v in p["checks"].items() if not v[0]}
    # rows are fused by the reference ring here ("every row fused" wants the GPU kernel)
    assert set(failed) == {f"{label}: every row fused"}, failed
    detail = failed[f"{label}: every row fused"][1]
    assert detail.count(" fused ") == rows and detail.count("reference") == rows, detail
    assert len(p["checks"]) == checks


@pytest.mark.parametrize("n", [2, 4])
def test_first_call_verdict_agreed_by_every_process(tmp_path, n):
  """Each process times the same programs, and they disagree: process 0 alone would choose
  candidate 0 (0.8 ms here, 1.3 ms in the others), the others candidate 1 (0.9 ms everywhere).
  The group's time is the slowest process's: every process takes candidate 1 and writes the
  same entry in its own cache."""
  from jax_autooverlap.tuning import select
  results = _run_processes("agree", n, env_extra={"AO_TEST_CACHE_DIRS": str(tmp_path)})
  want = dataclasses.asdict(select.default_candidates("ag", n, "bfloat16")[1])
  for p in results:
    assert p["impl"] == "triton" and p["code"] == "kernel" and p["kernel"] == want, p["why"]
    assert "fused kernel 10.0 % faster (margin 1.0 %); 0.900 ms vs unfused 1.000 ms" in p["why"]
    assert p["cache"] == results[0]["cache"] and len(p["cache"]) == 1
    (entry,) = p["cache"].values()
    assert entry["processes"] == n and entry["source"] == "first_call"


def test_first_call_when_a_process_dies_every_other_falls_back_alike(tmp_path):
  """Process 2 of 4 dies while compiling a candidate: the others stop waiting after the
  rendezvous timeout (3 s here), keep the unfused program with one reason, record nothing."""
  results = _run_processes("agree_dies", 4, dies=2, env_extra={
      "AO_TEST_CACHE_DIRS": str(tmp_path), "JAX_AUTOOVERLAP_RENDEZVOUS_TIMEOUT_S": "3"})
  survivors = [p for p in results if p is not None]
  assert len(survivors) == 3
  for p in survivors:
    assert p["impl"] == "unfused" and p["code"] == "measure_failed" and p["cache"] is None
    assert p["why"] == survivors[0]["why"] and "waiting for process(es) [2]" in p["why"]
    assert p["elapsed_s"] < 20  # bounded waits: no hang


def test_gpu_harness_first_call_scenario_on_cpu_processes(tmp_path):
  """tests/gpu_two_process.py's first_call scenario on two CPU processes (the kernels' unfused
  math stands in for them): the default config measures each shape on the first call, both
  processes take the same verdicts, the shared cache holds them, the step equals the
  unsharded one; new processes on the same cache measure nothing."""
  env = {"JAX_AUTOOVERLAP_CACHE_DIR": str(tmp_path)}
  first = _run_processes("first_call_step", timeout=300, env_extra=env)
  again = _run_processes("first_call_step_again", timeout=300, env_extra=env)
  for run in (first, again):
    for p in run:
      assert all(ok for ok, _ in p["checks"].values()), p["checks"]
      assert len(p["checks"]) == 7
      assert p["verdicts"] == first[0]["verdicts"] and p["verdicts"]
  assert [p["info"]["measured"] for p in first] == [len(first[0]["verdicts"])] * 2
  assert [p["info"]["measured"] for p in again] == [0, 0]


def test_first_call_of_the_fp8_step_on_cpu_processes(tmp_path):
  """The same with the harness's fp8 step (AO_TEST_FP8=1, gpu_two_process.py --fp8): its fp8
  matmuls are measured on the first call (the fp8 candidates' stand-ins against the unfused
  program, each within fp8.gemm_tolerance), every process agrees, the step is within the fp8
  tolerance of the unsharded f32 step, and new processes measure nothing."""
  env = {"JAX_AUTOOVERLAP_CACHE_DIR": str(tmp_path), "AO_TEST_FP8": "1"}
  first = _run_processes("first_call_step", timeout=300, env_extra=env)
  again = _run_processes("first_call_step_again", timeout=300, env_extra=env)
  for run in (first, again):
    for p in run:
      assert all(ok for ok, _ in p["checks"].values()), p["checks"]
      assert len(p["checks"]) == 7 and p["info"]["dims"].endswith(" fp8")
      assert p["verdicts"] == first[0]["verdicts"] and p["verdicts"]
      assert all(k.endswith(("float8_e4m3fn", "float8_e5m2")) for k in p["verdicts"]), p["verdicts"]
  assert [p["info"]["measured"] for p in first] == [len(first[0]["verdicts"])] * 2
  assert [p["info"]["measured"] for p in again] == [0, 0]


def test_rendezvous_agreement_and_timeout_across_processes():
  p0, p1 = _run_processes("rendezvous")
  want = {"0": {"me": 0, "sq": 0}, "1": {"me": 1, "sq": 1}}
  assert p0["exchange"] == p1["exchange"] == want
  assert p0["all_ok"] == p1["all_ok"] == {"ok": True, "reason": ""}
  # one process fails: both choose the fallback, with that process's reason
  assert p0["one_fails"] == p1["one_fails"] == {
      "ok": False, "reason": "process 1: cuMemCreate: out of memory (test)"}
  # a process that does not arrive: a bounded wait and an error naming it and the step
  assert "workspace 1 of mesh devices [0,1,2,3]" in p0["timeout"]
  assert "waiting for process(es) [1] of [0, 1]" in p0["timeout"]
  assert not p0["missing_decision"]["ok"]
  # arriving after the others decided, it adopts their decision: never a mixed choice
  assert p1["late_decision"] == p0["missing_decision"]


def _check_shared_workspace(p0, p1):
  for p in (p0, p1):
    assert p["support"]["dp"] == {"ok": True, "reason": "2 processes", "processes": 2}
    assert p["support"]["tp"] == {"ok": True, "reason": "1 process", "processes": 1}
    assert p["nbytes"] >= 300_000 and p["num_sms"] == 132
  # the same addresses in both processes: the kernels' tables are the same constants
  assert p0["addresses"] == p1["addresses"]
  # each slot is its owner's memory: its header names the owner's error record
  owners = [p0["error_record"]] * 2 + [p1["error_record"]] * 2
  assert p0["error_record"] != p1["error_record"]
  assert p0["error_slots"] == p1["error_slots"] == owners
  assert p0["peer_wrote"] == "hello from 1" and p1["peer_wrote"] == "hello from 0"


def test_symmetric_workspace_across_processes_shares_memory():
  p0, p1 = _run_processes("workspace")
  _check_shared_workspace(p0, p1)
  assert p0["live_after_close"] == p1["live_after_close"] == {
      "handles": 0, "reserved": 0, "mapped": 0}


def test_driver_bindings_across_processes_on_a_mock_libcuda(tmp_path):
  """runtime/cuda.py's ctypes calls (struct layouts, 64-bit arguments, handle types, export and
  import of descriptors, hinted reservations) against a host-memory libcuda.so.1."""
  import shutil
  cc = shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    pytest.skip("no C compiler to build the mock libcuda")
  subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"),
                  os.path.join(HERE, "mock_libcuda.c")], check=True)
  p0, p1 = _run_processes("workspace_libcuda", env_extra={
      "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"})
  assert p0["libcuda"] == p1["libcuda"] == [str(tmp_path / "libcuda.so.1")]
  _check_shared_workspace(p0, p1)


def test_planning_falls_back_across_hosts_in_every_process():
  p0, p1 = _run_processes("planning")
  for key in ("explain_dp_two_hosts", "plan_tp_two_hosts", "plan_dp_one_host",
              "plan_tp_one_host"):
    assert p0[key] == p1[key], key
  why = p0["explain_dp_two_hosts"]
  assert why.startswith("unfused program on gpu (the groups of axis 'dp' span 2 hosts")
  assert "ranks [0] on host 'host-0', ranks [1] on host 'host-1'" in why
  assert p0["plan_tp_two_hosts"] == ["triton", "triton kernel (measured: fused kernel faster; tl engine)"]
  assert p0["plan_dp_one_host"] == ["triton",
                                    "triton kernel (measured: fused kernel faster; tl engine), 2 processes"]
  assert p0["plan_tp_one_host"][0] == "triton"


def test_va_agreement_moves_above_every_reservation_when_the_highest_is_taken():
  """Round 0's candidate (the highest range reserved, the peer's) is held in this process:
  the next round asks above everything reserved, which both can have.  Two stand-in drivers,
  one per process, in lockstep through a scripted session that plays the peer's side."""
  align, total = 1 << 16, 1 << 20
  mine, peer = FakeDriver(), FakeDriver()
  peer.va_start = mine.va_start + (1 << 30)
  held = mine.address_reserve(total, align, peer.va_start)  # where the peer reserves first

  class PeerSession:
    tag, timeout_s = "t", 1.0

    def __init__(self):
      self.reserved, self.peer_ranges = [], []

    def exchange(self, step, payload):
      r = int(step[2:].split("-")[0])
      if step.endswith("-ok"):  # the peer's side of the round, as _agree_va does it
        cand = symmetric.candidate(r, self.reserved, total, align)
        got = cand in self.peer_ranges or peer.address_reserve(total, align, cand) == cand
        return {0: payload, 1: got}
      self.peer_ranges.append(peer.address_reserve(total, align, 0))
      self.reserved = [payload, self.peer_ranges[-1]]
      return dict(enumerate(self.reserved))

  session = PeerSession()
  state = symmetric._Pieces(mine)
  state.total = total
  base = symmetric.CuMemAllocator(mine)._agree_va(session, state, align)
  assert held == peer.va_start and base > max(session.reserved)
  assert base % symmetric.VA_HINT_ALIGN == 0
  assert state.ranges == [base] and base in peer.reserved
  state.release()


def test_gpu_harness_skips_a_second_first_call_run_whose_first_did_not_run(monkeypatch, capsys):
  """tests/gpu_two_process.py with a budget that leaves no time for the first run of the group
  of 8: its second run (which would measure what the first should have) is "not run" too,
  not a run whose checks fail for that reason; the group of 4 runs both."""
  sys.path.insert(0, os.path.dirname(__file__))
  import gpu_two_process as harness
  started = []

  class FakeRun:
    def __init__(self, scenario, world, env_extra=None, budget_s=0.0, timeout_s=None):
      started.append((scenario, world))
      self.scenario, self.world = scenario, world

    def finish(self):
      return [{"scenario": f"{self.scenario} x{self.world}", "process": 0, "ok": True,
               "check": "ran", "detail": ""}], "", []

  monkeypatch.setattr(harness, "Run", FakeRun)
  # batches: first_call x8, x4, then first_call_again x8, x4; 60 s kept for each one after
  assert harness.main(["--scenario", "first_call", "--world", "8,4", "--budget-s", "200"]) == 1
  assert started == [("first_call", 4), ("first_call_again", 4)]
  out = capsys.readouterr().out
  assert "first_call x8          -        FAIL    not run  [--budget-s 200 spent]" in out
  assert "first_call_again x8    -        FAIL    not run  [its first run did not run]" in out
