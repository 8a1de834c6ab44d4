"""One process of a real multi-process jax.distributed CPU run (started by test_multiprocess.py).

usage: multiprocess_worker.py SCENARIO PROCESS_ID NUM_PROCESSES PORT
Prints one line "RESULT <json>" with what the scenario observed; the test
compares the lines of all processes.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

scenario, me, n, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
if "AO_TEST_CACHE_DIRS" in os.environ:  # one tuning cache per process (as on several hosts)
  os.environ["JAX_AUTOOVERLAP_CACHE_DIR"] = os.path.join(os.environ["AO_TEST_CACHE_DIRS"], str(me))

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
if scenario in ("nested_step", "fp8_step", "fp8_qdq", "first_call_step", "first_call_step_again"):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # between the processes' CPUs
jax.distributed.initialize(f"127.0.0.1:{port}", n, me, initialization_timeout=60)

import dataclasses  # noqa: E402
import struct  # noqa: E402


from jax_autooverlap.runtime import rendezvous as rv  # noqa: E402
from jax_autooverlap.runtime import workspace  # noqa: E402
from fake_cuda import FakeDriver  # noqa: E402

PROCS = list(range(n))
kv = rv.client()
result = {"process": me, "pid": os.getpid()}


def rendezvous_scenario():
  s = rv.Session("t/exchange", PROCS, "test exchange", timeout_s=30)
  result["exchange"] = {str(k): v for k, v in s.exchange("a", {"me": me, "sq": me * me}).items()}
  result["all_ok"] = dataclasses.asdict(s.decide(True))
  result["one_fails"] = dataclasses.asdict(
      rv.agree("t/fail", PROCS, ok=(me != 1), reason="cuMemCreate: out of memory (test)",
               timeout_s=30))
  # Process 1 arrives at "t/missing" only after process 0 gave up waiting for it.
  if me == 0:
    s = rv.Session("t/missing", PROCS, "workspace 1 of mesh devices [0,1,2,3]", timeout_s=1.5)
    try:
      s.exchange("size", 1)
      result["timeout"] = None
    except rv.RendezvousTimeout as e:
      result["timeout"] = str(e)
    result["missing_decision"] = dataclasses.asdict(s.decide(True))
    kv.key_value_set_bytes("t/go", b"1")
  else:
    kv.blocking_key_value_get_bytes("t/go", 60_000)
    s = rv.Session("t/missing", PROCS, "workspace 1 of mesh devices [0,1,2,3]", timeout_s=30)
    result["late_decision"] = dataclasses.asdict(s.decide(True))


def workspace_scenario(real_driver=False):
  """Symmetric workspace over a (dp=2, tp=2) mesh, 2 devices per process, one host: through
  the stand-in driver, or (real_driver) through runtime/cuda.py on tests/mock_libcuda.c."""
  import ctypes
  from jax_autooverlap.runtime import cuda
  if real_driver:
    drv, read = cuda, ctypes.string_at
    live = lambda: None
  else:
    drv = FakeDriver()
    read, live = drv.read, drv.live
  reg = workspace.WorkspaceRegistry(driver=drv)
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices())
  result["support"] = {a: dataclasses.asdict(reg.support(mesh, a)) for a in ("dp", "tp")}
  ws = reg.workspace(mesh, "tp", 300_000)  # grown collectively
  result["addresses"] = [hex(a) for a in ws.addresses]
  result["nbytes"], result["num_sms"] = ws.nbytes, ws.num_sms
  result["error_record"] = reg.error_record().device_address
  # Every slot's header names the error record of the process owning it: the peer's
  # slots are the peer's memory, seen through the descriptor it passed us.
  result["error_slots"] = [struct.unpack("<Q", read(a + workspace.ERROR_SLOT_OFFSET, 8))[0]
                           for a in ws.addresses]
  own = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
  drv.write(0, ws.addresses[own[0]] + 4096, f"hello from {me}".encode())
  kv.wait_at_barrier("t/written", 30_000)
  peer = [i for i, d in enumerate(mesh.devices.flat) if d.process_index != me][0]
  result["peer_wrote"] = read(ws.addresses[peer] + 4096, 12).decode()
  kv.wait_at_barrier("t/read", 30_000)
  reg.close()
  result["live_after_close"] = live()
  with open("/proc/self/maps") as f:
    result["libcuda"] = sorted({l.split()[-1] for l in f if "/libcuda.so" in l})


def planning_scenario():
  """Planning in every process: a dp axis across hosts falls back (same reason everywhere),
  tp inside a process and dp across processes of one host get the kernel."""
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P
  import jax_autooverlap as ao
  from jax_autooverlap.ops import planning
  from jax_autooverlap.runtime import context
  from jax_autooverlap.tuning import select
  from jax_autooverlap.tuning.config import KernelConfig

  # Plan as on GPUs (these CPU devices stand in for them), with a measured win everywhere.
  context.platform = lambda mesh: "gpu"
  select.choose_ag = lambda *a, **k: select.Verdict(KernelConfig(), "measured: fused kernel faster")
  workspace.REGISTRY = workspace.WorkspaceRegistry(driver=FakeDriver())
  rv.host_id = lambda: f"host-{me}"  # each process on its own host
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices(),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def f(x, w):
    return lax.all_gather(x, "dp", axis=0, tiled=True) @ w

  g = jax.shard_map(f, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P(None), check_vma=False)
  sds = (jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 64), jnp.bfloat16))
  result["explain_dp_two_hosts"] = ao.explain(g, *sds).matches[0].impl
  args = ("ag_rows", ao.OverlapConfig(), 2, (1, 32, 128, 64), jnp.bfloat16, jnp.bfloat16, mesh)
  result["plan_tp_two_hosts"] = planning.plan(*args, axis_name="tp")[::2]
  # The same devices in another order form another device set, set up with one host.
  rv.host_id = lambda: "host-shared"
  mesh2 = jax.make_mesh((2, 2), ("dp", "tp"), devices=list(jax.devices())[::-1],
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  args = args[:6] + (mesh2,)
  result["plan_dp_one_host"] = planning.plan(*args, axis_name="dp")[::2]
  result["plan_tp_one_host"] = planning.plan(*args, axis_name="tp")[::2]


def nested_step_scenario():
  """tests/gpu_two_process.py's nested_step on CPU devices (one per process), the reference
  ring for the fused ops: the scenario itself is checked here, its kernels on a GPU."""
  import jax_autooverlap as ao
  import gpu_two_process
  mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=[jax.local_devices(process_index=p)[0] for p in PROCS])
  checks = result["checks"] = {}

  def check(name, ok, detail=""):
    checks[name] = [bool(ok), str(detail)[:200]]

  gpu_two_process._nested_step(mesh, ao.OverlapConfig(impl="reference"), check, kv, "reference")


def fp8_step_scenario():
  """tests/gpu_two_process.py's fp8_step on CPU devices (one per process), the reference ring
  for the fused fp8 ops (their pure-JAX math): the scenario is checked here, its kernels on a
  GPU."""
  import jax_autooverlap as ao
  import gpu_two_process
  checks = result["checks"] = {}

  def check(name, ok, detail=""):
    checks[name] = [bool(ok), str(detail)[:600]]

  gpu_two_process._fp8_step(_one_device_per_process_mesh(), ao.OverlapConfig(impl="reference"),
                            check, kv, "reference")


def fp8_qdq_scenario():
  """tests/gpu_two_process.py's fp8_qdq (the quantize-dequantize form, forward only) on CPU
  devices (one per process), the reference ring for the fused fp8 ops."""
  import jax_autooverlap as ao
  import gpu_two_process
  checks = result["checks"] = {}

  def check(name, ok, detail=""):
    checks[name] = [bool(ok), str(detail)[:600]]

  gpu_two_process._fp8_qdq(_one_device_per_process_mesh(), ao.OverlapConfig(impl="reference"),
                           check, kv, "reference")


def _planned_as_gpus():
  """This process's CPU devices planned as GPUs: a stand-in workspace, the kernels' unfused math
  traced where a kernel is planned (as tests/conftest.py's stand_in_kernels)."""
  from jax_autooverlap.ops import registry
  from jax_autooverlap.runtime import context
  context.platform = lambda mesh: None if mesh is None else "gpu"
  workspace.REGISTRY = workspace.WorkspaceRegistry(driver=FakeDriver())
  for name in ("ag_rows", "rs_rows"):
    impls = registry.core(name).impls
    impls["triton"] = dataclasses.replace(impls["triton"], run=impls["unfused"].run)


def _one_device_per_process_mesh():
  return jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=[jax.local_devices(process_index=p)[0] for p in PROCS])


def first_call_step_scenario(again: bool):
  """tests/gpu_two_process.py's first_call scenario on CPU processes (DEFAULT config; the
  kernels' stand-ins): the first-call measurement, its agreement and its cache, for real."""
  import gpu_two_process
  _planned_as_gpus()
  checks = result["checks"] = {}

  def check(name, ok, detail=""):
    checks[name] = [bool(ok), str(detail)[:300]]

  result["info"] = gpu_two_process._first_call_step(_one_device_per_process_mesh(), check, kv,
                                                    again=again, on_gpu=False)
  from jax_autooverlap.tuning import store
  result["verdicts"] = {k: v for k, v in store.verdicts().items()
                        if v.get("source") == "first_call"}


def agree_scenario(dies: int | None):
  """First-call measurement through the planner with injected timings that differ by process
  (process 0 alone would choose candidate 0, the others candidate 1); `dies`: that process
  exits while compiling candidate 1 (the others must fall back, with one reason, no hang)."""
  import time
  import jax.numpy as jnp
  import jax_autooverlap as ao
  from jax_autooverlap.ops import measure, planning
  from jax_autooverlap.tuning import store
  _planned_as_gpus()
  times = {None: 1.0, 0: 0.8 if me == 0 else 1.3, 1: 0.9}

  @dataclasses.dataclass
  class Program:
    label: str
    case: object
    core_name: str
    cp: object

    def compile(self):
      if dies == me and self.label == "1":
        os._exit(3)

    def check(self):
      pass

    def time(self, iters):
      return times[None if self.label == "unfused" else int(self.label)]

  measure._Program, measure._Case = Program, lambda *a: None
  mesh = _one_device_per_process_mesh()
  t0 = time.monotonic()
  impl, gpu, why = planning.plan("ag_rows", ao.OverlapConfig(), n, (1, 1024, 4096, 512),
                                 jnp.bfloat16, jnp.bfloat16, mesh, axis_name="x", may_time=True)
  result["elapsed_s"] = time.monotonic() - t0
  result["impl"], result["code"], result["why"] = impl, why.code, str(why)
  result["kernel"] = None if gpu is None else dataclasses.asdict(gpu.kernel)
  path = store.user_cache_dir() / "tuning-ag.json"
  result["cache"] = json.loads(path.read_text()) if path.exists() else None
  if dies is not None:  # the coordinator (process 0) stays until every survivor has its answer
    kv.key_value_set(f"t/done/{me}", "1")
    if me == 0:
      for p in PROCS:
        if p != dies:
          kv.blocking_key_value_get(f"t/done/{p}", 60_000)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # jax.distributed's shutdown would wait for the process that died


{"rendezvous": rendezvous_scenario, "workspace": workspace_scenario,
 "nested_step": nested_step_scenario,
 "fp8_step": fp8_step_scenario,
 "fp8_qdq": fp8_qdq_scenario,
 "workspace_libcuda": lambda: workspace_scenario(real_driver=True),
 "planning": planning_scenario,
 "first_call_step": lambda: first_call_step_scenario(again=False),
 "first_call_step_again": lambda: first_call_step_scenario(again=True),
 "agree": lambda: agree_scenario(dies=None),
 "agree_dies": lambda: agree_scenario(dies=2)}[scenario]()
print("RESULT " + json.dumps(result), flush=True)
