"""One implementation of the model benchmark run on one configuration: --warmup + --steps
training steps from the shared initial state, timed one synchronous step at a time (in this
process, or in a child process whose XLA_FLAGS carry the flags XLA takes no other way), and
its losses checked against jax.jit's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from jax_autooverlap.bench import common
from jax_autooverlap.bench.model.llama import (RunConfig, init_params, make_batches, make_loss,
                                               make_mesh)
from jax_autooverlap.bench.model.train import make_optimizer, make_train_step

IMPLS = ("jax.jit", "jax.jit+xla_overlap", "ao.jit")
log = common.logger("model")


def _explain_counts(step, params, opt_state, batch):
  import collections

  import jax_autooverlap as ao
  report = ao.explain(step, params, opt_state, batch)
  impls = collections.Counter(m.impl or "?" for m in report.fused)
  reasons = collections.Counter(m.reason for m in report.skipped)
  return {"fused": len(report.fused), "skipped": len(report.skipped),
          "fused_impls": dict(impls), "skip_reasons": dict(reasons)}


def run_impl(c: RunConfig, impl: str, args, devices, xla_options: dict) -> dict:
  """Train --warmup + --steps steps of one implementation from the shared initial state."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_autooverlap as ao
  mesh = make_mesh(c, devices)
  attention = args.attention_impl
  opt_desc, opt_init, opt_update = make_optimizer(args.optimizer, args.lr)
  params = init_params(c, mesh, args.seed)
  # eager: zeros_like keeps each parameter's sharding; scalars (step counts)
  # land on one device and are replicated over the mesh
  on_mesh = params["final_norm"].sharding.device_set
  opt_state = jax.tree.map(
      lambda a: a if a.sharding.device_set == on_mesh
      else jax.device_put(a, NamedSharding(mesh, P())), opt_init(params))
  batches = make_batches(c, mesh, args.seed)
  shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
  out_shardings = (*shardings, NamedSharding(mesh, P()))
  step = make_train_step(make_loss(c, mesh, attention), opt_update)
  kw = dict(donate_argnums=(0, 1), out_shardings=out_shardings)
  extra = {"optimizer": opt_desc, "attention": attention}
  if impl == "jax.jit":
    fn = jax.jit(step, **kw)
  elif impl == "jax.jit+xla_overlap":
    fn = jax.jit(step, compiler_options=xla_options or None, **kw)
    extra["xla_flags"] = args.xla_overlap_flags
  elif impl == "ao.jit":
    fn = ao.jit(step, **kw)
  else:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

  losses, times = [], []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    params, opt_state, loss = fn(params, opt_state, batches[i % len(batches)])
    jax.block_until_ready((params, opt_state, loss))
    dt = time.perf_counter() - t0
    losses.append(float(loss))
    if i == 0:  # compile, rewrite and (ao.jit) first-call measurement included
      extra["first_step_s"] = round(dt, 3)
    if i >= args.warmup:
      times.append(dt)
  if impl == "ao.jit":  # after the first call: what its measurements chose
    extra.update(_explain_counts(fn, params, opt_state, batches[0]))
    log(f"  ao.explain: {extra['fused']} fused {extra['fused_impls']}, "
        f"{extra['skipped']} skipped {extra['skip_reasons']}")
  del params, opt_state, batches
  step_s = float(np.median(times))
  return {"step_ms": round(step_s * 1e3, 3), "step_ms_min": round(min(times) * 1e3, 3),
          "step_ms_max": round(max(times) * 1e3, 3), "tokens_per_s": round(c.tokens / step_s, 1),
          "loss": [round(v, 6) for v in losses[:args.loss_steps]],
          "all_finite": bool(np.all(np.isfinite(losses))), **extra}


def run_impl_in_child(c: RunConfig, impl: str, args, env_flags: dict) -> dict:
  """The XLA-flag variant in a child process whose XLA_FLAGS carry the flags."""
  flags = " ".join(f"--{k}={v}" for k, v in env_flags.items())
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
  argv = [sys.executable, "-m", "jax_autooverlap.bench", "model", "--child", impl,
          "--model", c.dims.name, "--tokens", str(c.tokens), "--variants", c.variant,
          "--layers", str(c.layers), "--seq", str(args.seq), "--fsdp", str(args.fsdp),
          "--steps", str(args.steps), "--warmup", str(args.warmup),
          "--loss-steps", str(args.loss_steps), "--optimizer", args.optimizer, "--lr", str(args.lr),
          "--attention", args.attention_impl, "--seed", str(args.seed),
          "--xla-overlap-flags", args.xla_overlap_flags]
  proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.child_timeout)
  sys.stderr.write(proc.stderr)
  if proc.returncode != 0:
    raise RuntimeError(f"child process failed (rc {proc.returncode}): {proc.stderr[-800:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def loss_check(rec: dict, ref: dict | None, rtol: float):
  if ref is None or "loss" not in ref or "loss" not in rec or rec is ref:
    return
  n = min(len(rec["loss"]), len(ref["loss"]))
  diff = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(rec["loss"][:n], ref["loss"][:n])),
             default=0.0)
  rec["loss_rel_diff"] = float(f"{diff:.3g}")
  rec["loss_agrees"] = bool(diff <= rtol) and rec["all_finite"]
