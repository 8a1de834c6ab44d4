"""Call 4 helper (call 3's, under jax.set_mesh): the fused AG at world 1 (tests/test_gpu_capture.py's mesh) called directly, so
an exception shows its traceback (the rewrite keeps such a match unfused with the message only)."""
import traceback
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import jax_autooverlap as ao
gpus = [d for d in jax.devices() if d.platform == "gpu"]
mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus[:1])
cfg = ao.OverlapConfig(impl="triton")
x = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (1024, 768), jnp.bfloat16)
for name, fn in (("ag", lambda a, b: ao.ag_matmul(a, b, "x", config=cfg)),
                 ("rs", lambda a, b: ao.matmul_rs(a, b, "x", config=cfg))):
  try:
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    with jax.set_mesh(mesh):
      out = f(x, w)
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    print(name, "ok, max abs err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))))
  except Exception:
    print(name, "FAILED"); traceback.print_exc()
