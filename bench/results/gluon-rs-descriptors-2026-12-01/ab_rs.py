"""A/B (one process, interleaved): GEMM+RS loopback, descriptors before the first main loop (new)
vs after it (old, the committed kernel), same config; plus the new kernel's timeline."""
import json, os
import jax
import numpy as np
import ab_old_rs
import jax_autooverlap.kernels.gluon_gemm_rs as rs_mod
from jax_autooverlap.bench import loopback as L
from jax_autooverlap.runtime import cuda
out = os.environ.get("OUT", "/tmp/out")
dev = [d for d in jax.devices() if d.platform == "gpu"][0]
num_sms = cuda.sm_count(dev.local_hardware_id)
NEW = rs_mod.gluon_gemm_rs_kernel
rows, recs = [], []
SHAPES = ["8192x4096x4096", "4096x8192x8192", "16384x8192x8192", "16384x8192x28672", "600x1024x640"]
for shape in SHAPES:
  case = L.Case("rs", *map(int, shape.split("x")))
  lb = L.Loopback(case, dev)
  cfg = L.kernel_configs(case, dev.device_kind, ["gluon"])["gluon"]
  cont = {"gemm_alone": (L.gemm_program(), lb.gemm_args(), None),
          "engine": (L.engine_program(cfg, num_sms), lb.gemm_args(), ("gluon_gemm_kernel",))}
  for name, kern in (("old", ab_old_rs.gluon_gemm_rs_kernel), ("new", NEW)):
    rs_mod.gluon_gemm_rs_kernel = kern
    prog = L.fused_program(case, cfg, num_sms)
    chk = lb.check(prog)  # traces (and compiles) with this kernel
    ok = chk["rel_err"] <= L.MAX_REL_ERR and chk["push_rel_err"] <= L.MAX_REL_ERR and chk["bit_identical_repeat"]
    print("CHECK", shape, name, chk, "ok" if ok else "WRONG", flush=True)
    if ok:
      cont["ours_" + name] = (prog, lb.fused_args(), L.kernel_names("gluon", "rs"))
  rs_mod.gluon_gemm_rs_kernel = NEW
  if shape == SHAPES[-1]:
    continue  # ragged: correctness only
  t = L.time_interleaved(cont, 5, 20)
  g = t["gemm_alone"][0]
  row = f"rs {shape:>17} cuBLAS {g:.4f} | " + " ".join(f"{k}={v[0]/g:.4f}" for k, v in t.items() if k != "gemm_alone")
  if "ours_old" in t and "ours_new" in t:
    row += f" | new-old {1e3 * (t['ours_new'][0] - t['ours_old'][0]):+.2f} us"
  print("ROW", row, flush=True); rows.append(row)
  recs += [{"op": "rs", "shape": shape, "impl": k, "median_ms": round(v[0], 4), **v[1]} for k, v in t.items()]
  if shape == SHAPES[0]:
    s, raw = L.trace_case(case, dev)
    print("TRACE", json.dumps(s)[:3000], flush=True)
    np.savez_compressed(f"{out}/trace-new-{shape}.npz", **raw)
json.dump(recs, open(f"{out}/ab-rs-descriptors.json", "w"), indent=1)
print("\n".join(rows))
