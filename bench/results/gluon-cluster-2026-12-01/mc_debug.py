"""Debug the cluster engine (kernels/gluon_gemm_mc.py) on one GPU: for each DIAG variant, run the
kernel once on a small shape in a fresh process and report max error or the failure."""
import os, subprocess, sys

CHILD = r'''
import sys, jax, jax.numpy as jnp, numpy as np
from jax_autooverlap.backends.gluon import launch_gemm_cluster
m, k, n, bm, bn, st, diag, maxc = map(int, sys.argv[1:9])
a = (jax.random.normal(jax.random.key(1), (m, k), jnp.float32)).astype(jnp.bfloat16)
b = (jax.random.normal(jax.random.key(2), (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
got = jax.jit(lambda a, b: launch_gemm_cluster(a, b, block_m=bm, block_n=bn, stages=st, out_dtype=jnp.bfloat16, num_sms=132, diag=diag, max_clusters=maxc or None))(a, b)
got = np.asarray(got.astype(jnp.float32))
want = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32))
print("RESULT", m, k, n, bm, bn, st, "diag", diag, "maxc", maxc, "max abs err", float(np.abs(got - want).max()), "max |want|", float(np.abs(want).max()), flush=True)
'''

def run(args, sanitizer=False, timeout=90):
  cmd = [sys.executable, "-c", CHILD] + [str(a) for a in args]
  if sanitizer:
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "4"] + cmd
  env = dict(os.environ, XLA_FLAGS="--xla_gpu_autotune_level=0")
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = p.stdout + p.stderr
    lines = [l for l in out.splitlines() if "RESULT" in l or "=====" in l or "rror" in l][:45]
    print(f"--- {args} sanitizer={sanitizer} rc={p.returncode}\n" + "\n".join(lines), flush=True)
  except subprocess.TimeoutExpired:
    print(f"--- {args} sanitizer={sanitizer}: TIMEOUT {timeout}s", flush=True)

cases = [
    (256, 8192, 128, 1),    # one tile, 128 k-blocks: the ring wraps, warpgroup 0 only
    (256, 64, 256, 1),      # two tiles, one cluster: both warpgroups, one k-block
    (256, 1024, 512, 1),    # four tiles, one cluster, 16 k-blocks: ping-pong and wrap
    (512, 64, 128, 0),      # two clusters, one tile each
    (4096, 64, 4096, 0),    # 66 clusters, one k-block per tile
    (4096, 1024, 4096, 0),
]
for m, k, n, maxc in cases:
  run([m, k, n, 128, 128, 5, 0, maxc])
run([4096, 1024, 4096, 128, 128, 5, 0, 0], sanitizer=True, timeout=200)
