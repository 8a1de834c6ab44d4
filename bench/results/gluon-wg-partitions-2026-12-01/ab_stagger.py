"""Experiment: engine GEMM with staggered warpgroups (kernels/gluon_gemm_stagger.py) vs the
engine and cuBLAS, interleaved in one process.  argv[1]: 'check' (small shapes, correctness)
or 'bench'."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax_autooverlap.backends.gluon import launch_gemm, launch_gemm_staggered
from jax_autooverlap.bench import loopback as L
from jax_autooverlap.runtime import cuda
from jax_autooverlap.tuning.config import KernelConfig
out = os.environ.get("OUT", "/tmp/out")
dev = [d for d in jax.devices() if d.platform == "gpu"][0]
num_sms = cuda.sm_count(dev.local_hardware_id)
cfg = KernelConfig(engine="gluon")
mode = sys.argv[1]
LAGS = [0, 1, 2]
if mode == "check":
  SHAPES = ["1000x1024x1000", "4096x2048x4096", "256x64x256"]
else:
  from jax_autooverlap.bench.engine import DEFAULT_SHAPES as SHAPES
rows, recs = [], []
for shape in SHAPES:
  m, k, n = map(int, shape.split("x"))
  k1, k2 = jax.random.split(jax.random.key(m + 3 * k + 7 * n))
  a = jax.device_put(jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16), dev)
  b = jax.device_put((jax.random.normal(k2, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16), dev)
  want = np.asarray(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(a, b))
  cont = {"gemm_alone": (jax.jit(lambda a, b: a @ b), (a, b), None),
          "engine": (jax.jit(lambda a, b: launch_gemm(a, b, kernel=cfg, out_dtype=a.dtype, num_sms=num_sms)), (a, b), ("gluon_gemm_kernel",))}
  for lag in LAGS:
    f = jax.jit(lambda a, b, lag=lag: launch_gemm_staggered(a, b, kernel=cfg, out_dtype=a.dtype, num_sms=num_sms, lag=lag))
    got = np.asarray(f(a, b)).astype(np.float32)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    same = bool(np.array_equal(np.asarray(f(a, b)), np.asarray(f(a, b))))
    ok = err < 2e-2 and same
    print("CHECK", shape, "lag", lag, f"rel_err {err:.2e} repeat_identical {same}", "ok" if ok else "WRONG", flush=True)
    if ok:
      cont[f"lag{lag}"] = (f, (a, b), ("gluon_gemm_stagger_kernel",))
  if mode == "check":
    continue
  t = L.time_interleaved(cont, 3, 10)
  g = t["gemm_alone"][0]
  row = f"{shape:>17} cuBLAS {g:.4f} | " + " ".join(f"{k}={v[0]/g:.4f}" for k, v in t.items() if k != "gemm_alone")
  print("ROW", row, flush=True); rows.append(row)
  recs += [{"shape": shape, "impl": k, "median_ms": round(v[0], 4), **v[1]} for k, v in t.items()]
if recs:
  json.dump(recs, open(f"{out}/ab-stagger.json", "w"), indent=1)
print("\n".join(rows))
