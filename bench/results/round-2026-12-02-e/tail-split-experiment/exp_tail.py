"""Experiment (untracked): why the tail split did not pay.  Variants of the tl AG kernel."""
import dataclasses, json, os
import jax
from jax_autooverlap.bench import timing
from jax_autooverlap.bench.loopback.fixture import Case, Loopback
from jax_autooverlap.bench.loopback.programs import fused_program, gemm_program
from jax_autooverlap.bench.loopback.cli import kernel_names
from jax_autooverlap.runtime import cuda
from jax_autooverlap.tuning.config import KernelConfig

dev = jax.devices()[0]
sms = cuda.sm_count(dev.local_hardware_id)
C = KernelConfig(chunks=4, num_comm=32)
R = lambda **kw: dataclasses.replace(C, **kw)
cases = {
  (4096, 4096, 6144, 4): {"m32": C, "m32-t2k2": R(split_k=2, split_tail=2),
                          "m32-t60k2": R(split_k=2, split_tail=60), "m32-t64k2": R(split_k=2, split_tail=64),
                          "m8": R(num_comm=8), "m8-t60k2": R(num_comm=8, split_k=2, split_tail=60),
                          "m16": R(num_comm=16)},
  (4096, 8192, 10240, 8): {"m32": C, "m32-t2k2": R(split_k=2, split_tail=2),
                           "m32-t28k4": R(split_k=4, split_tail=28), "m32-t60k2": R(split_k=2, split_tail=60),
                           "m32-t60k4": R(split_k=4, split_tail=60), "m16": R(num_comm=16),
                           "m16-t44k2": R(num_comm=16, split_k=2, split_tail=44)},
}
out = {}
for (m, k, n, w), variants in cases.items():
  case = Case("ag", m, k, n, world=w)
  lb = Loopback(case, dev)
  cont = {"cublas": (gemm_program(case), lb.gemm_args(), None)}
  for name, cfg in variants.items():
    prog = fused_program(case, cfg, sms)
    res = lb.check(prog)
    print(case.label, w, name, res, flush=True)
    if res["rel_err"] < 2e-2 and res["bit_identical_repeat"]:
      cont[name] = (prog, lb.fused_args(), kernel_names("tl", "ag"))
  timed = timing.time_interleaved(cont, 7, 20)
  g = timed["cublas"][0]
  for name, (ms, _) in timed.items():
    print(f"{case.label} w{w} {name:12s} {ms * 1e3:8.1f} us  {ms / g:.3f} x cuBLAS", flush=True)
  out[f"{case.label}-w{w}"] = {name: ms for name, (ms, _) in timed.items()}
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "exp_tail.json"), "w"), indent=1)
