"""End-to-end training-step benchmark: a Llama-style decoder stack, jax.jit vs XLA's overlap vs ao.jit.

    python -m jax_autooverlap.bench model [--model llama3-8b,llama3-70b] [--tokens 4096,8192,16384]
                                          [--variants tp,fsdp] [--out bench/results] [--smoke]

The model is plain JAX: RMSNorm, grouped-K/V causal attention
(jax.nn.dot_product_attention, cuDNN on GPU) with rotary embeddings, fused
Q/K/V and O projections, a SwiGLU MLP (fused gate/up projection).  Megatron
tensor + sequence parallelism is written in one shard_map: activations
[seq, batch, hidden] are sequence-sharded over "tp", all_gathered (tiled)
before the column-parallel projections and psum_scattered after the
row-parallel ones.  The "fsdp" variant adds a second mesh axis: weights are
also sharded on their contracting dim over "fsdp" (gathered per layer,
gradients reduce-scattered by autodiff) and the batch is data-parallel over
it.  bf16 parameters and activations, f32 loss (mean squared error of the
final-normed stack output against a random target: no embedding or LM head),
layers under lax.scan with jax.checkpoint, and a full training step:
value_and_grad + Adam (optax if installed, else a few lines of plain JAX).

For every configuration (model dims x tokens per step x variant) the three
implementations run the same program on the same inputs from the same
initial parameters: `jax.jit`, `jax.jit` with XLA's overlap flags, `ao.jit`.
Each runs --warmup + --steps training steps, one synchronous step at a time;
step time is the median of the timed steps.  The losses of the first steps
must agree with jax.jit's to bf16 tolerance (checked, flagged, exit status 1
otherwise).  A configuration or implementation that fails is recorded as an
error row; the run goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import time

from jax_autooverlap.bench.__main__ import _gpu_name, _log, _versions

IMPLS = ("jax.jit", "jax.jit+xla_overlap", "ao.jit")
# XLA's own overlap machinery.  The windowed einsum applies to dots that GSPMD
# partitions; in this shard_map program the collectives are explicit, so it
# mostly brings the latency-hiding scheduler.  Each flag is passed as a jit
# compiler option where XLA accepts it as one, else through XLA_FLAGS in a
# child process (the flags are process-wide there).
XLA_OVERLAP_FLAGS = ("xla_gpu_threshold_for_windowed_einsum_mib=0,"
                     "xla_gpu_multi_streamed_windowed_einsum=true,"
                     "xla_gpu_enable_latency_hiding_scheduler=true")
H100_H200_BF16_DENSE_TFLOPS = 989.0  # the spec-sheet dense bf16 peak of both (SXM)
CPU_NOTE = ("CPU timings show no overlap gains (virtual CPU devices share the host's cores; "
            "collectives are memory copies): this run checks that everything runs and agrees")


@dataclasses.dataclass(frozen=True)
class ModelDims:
  name: str
  hidden: int
  ffn: int
  heads: int
  kv_heads: int
  head_dim: int
  max_layers: int  # the real model's depth: never run deeper


MODELS = {m.name: m for m in (
    ModelDims("llama3-8b", 4096, 14336, 32, 8, 128, 32),
    ModelDims("llama3-70b", 8192, 28672, 64, 8, 128, 80),
    ModelDims("tiny", 128, 256, 16, 8, 8, 2),  # CPU smoke test
)}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One benchmarked configuration: model dims, depth, tokens per step and mesh."""
  dims: ModelDims
  layers: int
  tokens: int
  seq: int
  batch: int
  variant: str  # "tp" or "fsdp"
  tp: int
  fsdp: int  # 1 in the "tp" variant

  @property
  def world(self) -> int:
    return self.tp * self.fsdp

  @property
  def mesh_desc(self) -> str:
    return f"tp={self.tp}" if self.variant == "tp" else f"fsdp={self.fsdp},tp={self.tp}"


def make_config(dims: ModelDims, layers: int, tokens: int, seq: int, variant: str, world: int,
                fsdp: int) -> RunConfig:
  """The configuration, or ValueError naming the constraint the mesh or dims break."""
  fsdp = fsdp if variant == "fsdp" else 1
  if variant not in ("tp", "fsdp"):
    raise ValueError(f"variant must be 'tp' or 'fsdp', got {variant!r}")
  if fsdp < 1 or world % fsdp:
    raise ValueError(f"{variant}: world size {world} is not divisible by fsdp={fsdp}")
  tp = world // fsdp
  # data parallel over fsdp needs a batch divisible by it: shorter sequences if needed
  seq = min(seq, tokens // fsdp)
  if seq < 1 or tokens % seq:
    raise ValueError(f"tokens={tokens} is not a multiple of the sequence length {seq}")
  batch = tokens // seq
  for what, n in (("heads", dims.heads), ("kv_heads", dims.kv_heads), ("ffn", dims.ffn),
                  ("sequence length", seq)):
    if n % tp:
      raise ValueError(f"{variant}: {what}={n} is not divisible by tp={tp}")
  if batch % fsdp:
    raise ValueError(f"{variant}: batch={batch} (tokens={tokens}, seq={seq}) is not divisible "
                     f"by fsdp={fsdp}")
  if variant == "fsdp":
    for what, n in (("hidden", dims.hidden), ("ffn/tp", dims.ffn // tp),
                    ("heads*head_dim/tp", dims.heads * dims.head_dim // tp)):
      if n % fsdp:
        raise ValueError(f"fsdp: contracting dim {what}={n} is not divisible by fsdp={fsdp}")
  return RunConfig(dims, layers, tokens, seq, batch, variant, tp, fsdp)


# ---------------------------------------------------------------------------------------------
# Sizes: parameters, FLOPs, memory

def layer_param_count(d: ModelDims) -> int:
  qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
  return d.hidden * qkv + d.heads * d.head_dim * d.hidden + 3 * d.hidden * d.ffn + 2 * d.hidden


def model_flops_per_step(c: RunConfig) -> float:
  """Training FLOPs of one step, 3x the forward (remat's recompute not counted, as MFU has it):
  2 per multiply-add of every projection, plus causal attention (QK^T and PV, half the square)."""
  d = c.dims
  proj = 2 * c.tokens * (layer_param_count(d) - 2 * d.hidden)
  attn = 2 * c.batch * c.seq * c.seq * d.heads * d.head_dim  # 2 matmuls x 2 flops x 1/2 causal
  return 3.0 * c.layers * (proj + attn)


def memory_estimate_bytes(c: RunConfig, layers: int, attention: str) -> float:
  """Peak bytes per device of a training step with `layers` layers (a deliberate overestimate:
  XLA's own analysis of the compiled step, on CPU, was 15-25 % lower for the 70B dims).

  Per parameter: bf16 value and gradient, Adam's two f32 moments, 2 bytes of
  slack.  Per layer: the bf16 residual stream saved by
  remat.  Once: the working set of one layer's recomputed forward and its
  backward on the sequence-gathered tokens (and, in the fsdp variant, its
  gathered weights and their gradients); attention scores when the XLA
  attention (not the flash-style cuDNN kernel) materialises them.
  """
  d = c.dims
  params = layer_param_count(d) / c.world
  tokens_dev = c.tokens / c.world
  gathered = c.tokens / c.fsdp  # tokens on one device after the sequence gather
  qkv_cols = (d.heads + 2 * d.kv_heads) * d.head_dim / c.tp
  act_cols = 6 * d.hidden + 3 * qkv_cols + 2 * d.heads * d.head_dim / c.tp + 8 * d.ffn / c.tp
  work = gathered * act_cols * 2
  if attention == "xla":
    work += 2 * 4 * (c.batch / c.fsdp) * (d.heads / c.tp) * c.seq * c.seq
  if c.variant == "fsdp":
    work += 2 * 2 * layer_param_count(d) / c.tp
  per_layer = params * (2 + 2 + 8 + 2) + tokens_dev * d.hidden * 2
  return 1.2 * (layers * per_layer + work + 4 * tokens_dev * d.hidden * 2)


def layers_that_fit(c: RunConfig, budget_bytes: float, attention: str) -> int:
  n = 0
  while n < c.dims.max_layers and memory_estimate_bytes(c, n + 1, attention) <= budget_bytes:
    n += 1
  return n


# ---------------------------------------------------------------------------------------------
# The model, per device inside shard_map

def _rms_norm(x, w, eps=1e-5):
  import jax.numpy as jnp
  from jax import lax
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x, theta=500000.0):
  """Rotary position embedding on [batch, seq, heads, head_dim] (positions 0..seq-1)."""
  import jax.numpy as jnp
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq  # [seq, half]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _layer(c: RunConfig, attention: str, x, p):
  """One decoder layer on the sequence-sharded residual stream x[seq/tp, batch, hidden]."""
  import jax
  from jax import lax
  d = c.dims
  nq, nkv, hd = d.heads // c.tp, d.kv_heads // c.tp, d.head_dim

  def weight(w):  # FSDP: the contracting-dim shard of every device on the fsdp axis
    return lax.all_gather(w, "fsdp", axis=0, tiled=True) if c.variant == "fsdp" else w

  def gather_seq(h):  # column-parallel input: the full sequence
    return lax.all_gather(h, "tp", axis=0, tiled=True)

  def scatter_seq(y):  # row-parallel output: summed over tp, sequence-sharded again
    return lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)

  qkv = gather_seq(_rms_norm(x, p["attn_norm"])) @ weight(p["wqkv"])  # [seq, batch, cols]
  seq, batch = qkv.shape[:2]
  heads = lambda t, n: t.reshape(seq, batch, n, hd).transpose(1, 0, 2, 3)  # [b, s, n, hd]
  q = _rope(heads(qkv[..., :nq * hd], nq))
  k = _rope(heads(qkv[..., nq * hd:(nq + nkv) * hd], nkv))
  v = heads(qkv[..., (nq + nkv) * hd:], nkv)
  o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
  o = o.transpose(1, 0, 2, 3).reshape(seq, batch, nq * hd)
  x = x + scatter_seq(o @ weight(p["wo"]))
  gate_up = gather_seq(_rms_norm(x, p["mlp_norm"])) @ weight(p["w_gate_up"])
  f = gate_up.shape[-1] // 2
  return x + scatter_seq((jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:]) @ weight(p["w_down"]))


def _param_specs(c: RunConfig):
  """PartitionSpecs of the stacked [layers, ...] parameters (global shapes in _param_shapes)."""
  from jax.sharding import PartitionSpec as P
  if c.variant == "fsdp":
    col, row = P(None, "fsdp", "tp"), P(None, ("tp", "fsdp"), None)
  else:
    col, row = P(None, None, "tp"), P(None, "tp", None)
  return {"layers": {"attn_norm": P(), "mlp_norm": P(), "wqkv": col, "wo": row,
                     "w_gate_up": col, "w_down": row},
          "final_norm": P()}


def _param_shapes(c: RunConfig):
  """Global shapes.  The column blocks of device t along "tp" hold its own heads' [q | k | v]
  (and [gate | up]) columns: the layout each device's slice is read in."""
  d, L = c.dims, c.layers
  qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
  return {"layers": {"attn_norm": (L, d.hidden), "mlp_norm": (L, d.hidden),
                     "wqkv": (L, d.hidden, qkv), "wo": (L, d.heads * d.head_dim, d.hidden),
                     "w_gate_up": (L, d.hidden, 2 * d.ffn), "w_down": (L, d.ffn, d.hidden)},
          "final_norm": (d.hidden,)}


def _data_spec(c: RunConfig):
  from jax.sharding import PartitionSpec as P
  return P("tp", "fsdp" if c.variant == "fsdp" else None, None)  # [seq, batch, hidden]


def make_mesh(c: RunConfig, devices):
  import jax
  auto = jax.sharding.AxisType.Auto
  if c.variant == "fsdp":
    return jax.make_mesh((c.fsdp, c.tp), ("fsdp", "tp"), axis_types=(auto, auto),
                         devices=devices[:c.world])
  return jax.make_mesh((c.tp,), ("tp",), axis_types=(auto,), devices=devices[:c.world])


def make_loss(c: RunConfig, mesh, attention: str):
  """loss(params, x, target): f32 mean squared error of the final-normed stack output."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  axes = ("fsdp", "tp") if c.variant == "fsdp" else ("tp",)
  layer = jax.checkpoint(lambda x, p: _layer(c, attention, x, p))

  def per_device(params, x, target):
    x, _ = lax.scan(lambda h, p: (layer(h, p), None), x, params["layers"])
    err = _rms_norm(x, params["final_norm"]).astype(jnp.float32) - target.astype(jnp.float32)
    return lax.psum(jnp.sum(err * err), axes) / (c.tokens * c.dims.hidden)

  data = _data_spec(c)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(_param_specs(c), data, data),
                       out_specs=jax.sharding.PartitionSpec())


def init_params(c: RunConfig, mesh, seed: int):
  """Deterministic parameters (the same on every call), created sharded on the devices."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  shapes, specs = _param_shapes(c), _param_specs(c)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

  def init():
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, shape in zip(keys, leaves):
      if len(shape) == 3:  # a stacked weight [layers, fan_in, fan_out]
        w = jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[1])
      else:  # a norm scale
        w = jnp.ones(shape, jnp.float32)
      out.append(w.astype(jnp.bfloat16))
    return jax.tree.unflatten(tree, out)

  return jax.jit(init, out_shardings=shardings)()


def make_batches(c: RunConfig, mesh, seed: int, count: int = 2):
  """`count` fresh random (x, target) pairs [seq, batch, hidden] bf16, sequence-sharded."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  sharding = NamedSharding(mesh, _data_spec(c))
  shape = (c.seq, c.batch, c.dims.hidden)

  def make(key):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, shape, jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(k2, shape, jnp.float32).astype(jnp.bfloat16))

  f = jax.jit(make, out_shardings=(sharding, sharding))
  return [f(jax.random.key(seed + 1000 + i)) for i in range(count)]


def attention_impl(requested: str, platform: str, head_dims) -> str:
  """"cudnn" or "xla": auto is cuDNN on GPU when its causal GQA attention compiles and
  differentiates for every head dim used (probed on a small problem), else XLA's."""
  if requested != "auto":
    return requested
  if platform != "gpu":
    return "xla"
  import jax
  import jax.numpy as jnp
  attend = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()
  try:
    for hd in sorted(head_dims):
      q, kv = jnp.ones((1, 256, 2, hd), jnp.bfloat16), jnp.ones((1, 256, 1, hd), jnp.bfloat16)
      jax.block_until_ready(jax.jit(jax.grad(attend, argnums=(0, 1, 2)))(q, kv, kv))
  except Exception as e:  # noqa: BLE001 - fall back, say why
    _log(f"cuDNN attention unavailable ({type(e).__name__}: {str(e)[:300]}); using XLA's")
    return "xla"
  return "cudnn"


# ---------------------------------------------------------------------------------------------
# Optimizer and training step

def make_optimizer(name: str, lr: float):
  """(description, init(params) -> state, update(grads, state, params) -> (params, state))."""
  import jax
  import jax.numpy as jnp
  if name == "adam":
    try:
      import optax
    except ImportError:
      optax = None
    if optax is not None:
      tx = optax.adam(lr, mu_dtype=jnp.float32)

      def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

      return f"optax.adam(lr={lr}, f32 moments)", tx.init, update

    b1, b2, eps = 0.9, 0.999, 1e-8

    def init(params):
      zeros = lambda: jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)  # p's sharding
      return {"step": jnp.zeros((), jnp.int32), "mu": zeros(), "nu": zeros()}

    def update(grads, state, params):
      step = state["step"] + 1
      g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], g32)
      nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], g32)
      t = step.astype(jnp.float32)
      scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
      new = jax.tree.map(
          lambda p, m, v: (p.astype(jnp.float32) - scale * m / (jnp.sqrt(v) + eps)).astype(p.dtype),
          params, mu, nu)
      return new, {"step": step, "mu": mu, "nu": nu}

    return f"adam (plain JAX, lr={lr}, f32 moments)", init, update
  if name == "sgd":
    update = lambda grads, state, params: (
        jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads), state)
    return f"sgd (plain JAX, lr={lr})", lambda params: {}, update
  raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def make_train_step(loss, opt_update):
  import jax

  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    params, opt_state = opt_update(grads, opt_state, params)
    return params, opt_state, value

  return train_step


# ---------------------------------------------------------------------------------------------
# XLA overlap flags

def parse_flags(spec: str) -> dict[str, str]:
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, value = item.lstrip("-").partition("=")
    if not sep:
      raise ValueError(f"--xla-overlap-flags: expected name=value, got {item!r}")
    out[name] = value
  return out


def _option_value(value: str):
  low = value.lower()
  if low in ("true", "false"):
    return low == "true"
  try:
    return int(value)
  except ValueError:
    return value


def split_compiler_options(flags: dict[str, str]) -> tuple[dict, dict]:
  """(flags XLA accepts as jit compiler options, flags it does not): probed on a tiny program."""
  import jax
  import jax.numpy as jnp
  accepted, rejected = {}, {}
  for name, value in flags.items():
    try:
      jax.jit(lambda x: x + 1, compiler_options={name: _option_value(value)}).lower(
          jnp.ones(2)).compile()
      accepted[name] = _option_value(value)
    except Exception:  # noqa: BLE001 - XLA: "No such compile option"
      rejected[name] = value
  return accepted, rejected


# ---------------------------------------------------------------------------------------------
# Running one implementation on one configuration

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
  opt_state = jax.tree.map(
      lambda a: a if a.sharding.device_set == params["final_norm"].sharding.device_set
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
    extra.update(_explain_counts(fn, params, opt_state, batches[0]))
    _log(f"  ao.explain: {extra['fused']} fused {extra['fused_impls']}, "
         f"{extra['skipped']} skipped {extra['skip_reasons']}")
  else:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

  losses, times = [], []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    params, opt_state, loss = fn(params, opt_state, batches[i % len(batches)])
    jax.block_until_ready((params, opt_state, loss))
    dt = time.perf_counter() - t0
    losses.append(float(loss))
    if i == 0:
      extra["first_step_s"] = round(dt, 3)  # compile (and rewrite) included
    if i >= args.warmup:
      times.append(dt)
  del params, opt_state, batches
  step_s = float(np.median(times))
  return {"step_ms": round(step_s * 1e3, 3), "step_ms_min": round(min(times) * 1e3, 3),
          "step_ms_max": round(max(times) * 1e3, 3), "tokens_per_s": round(c.tokens / step_s, 1),
          "loss": [round(v, 6) for v in losses[:args.loss_steps]],
          "all_finite": bool(np.all(np.isfinite(losses))), **extra}


def _run_impl_in_child(c: RunConfig, impl: str, args, env_flags: dict) -> dict:
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


def _loss_check(rec: dict, ref: dict | None, rtol: float):
  if ref is None or "loss" not in ref or "loss" not in rec or rec is ref:
    return
  n = min(len(rec["loss"]), len(ref["loss"]))
  diff = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(rec["loss"][:n], ref["loss"][:n])),
             default=0.0)
  rec["loss_rel_diff"] = float(f"{diff:.3g}")
  rec["loss_agrees"] = bool(diff <= rtol) and rec["all_finite"]


# ---------------------------------------------------------------------------------------------
# Command line

def _parser():
  ap = argparse.ArgumentParser(
      prog="python -m jax_autooverlap.bench model",
      description="End-to-end training step of a Llama-style decoder stack (Megatron tensor + "
                  "sequence parallelism in shard_map, bf16, remat'd layers under scan, Adam): "
                  "jax.jit vs jax.jit with XLA's overlap flags vs ao.jit, same inputs, one run. "
                  "Writes <GPU>-x<world>-<date>-model.json under --out and prints a table last; "
                  "progress goes to stderr.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--model", default="llama3-8b,llama3-70b",
                  help=f"comma-separated layer dims to run, of {', '.join(MODELS)} (tiny: CPU smoke)")
  ap.add_argument("--tokens", default="4096,8192,16384",
                  help="comma-separated tokens per training step (global batch x sequence length)")
  ap.add_argument("--seq", type=int, default=4096,
                  help="sequence length; batch = tokens / seq (shorter sequences when the fsdp "
                       "variant's data parallelism needs a larger batch)")
  ap.add_argument("--variants", default="tp,fsdp",
                  help="comma-separated: tp (all devices on one tensor/sequence-parallel axis), "
                       "fsdp (weights also sharded on the contracting dim over an fsdp axis of "
                       "size --fsdp, batch data-parallel over it); skipped where the mesh or dims "
                       "do not fit")
  ap.add_argument("--fsdp", type=int, default=2, help="size of the fsdp axis in the fsdp variant")
  ap.add_argument("--layers", type=int, default=None,
                  help="decoder layers; default: as many as the memory estimate fits on one "
                       "device (--mem-gb), for every configuration of a model, capped at the "
                       "real model's depth")
  ap.add_argument("--mem-gb", type=float, default=None,
                  help="device memory budget for the layer estimate; default: the device's "
                       "allocator limit, else 0.9 x 141 GB (one H200)")
  ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS))
  ap.add_argument("--steps", type=int, default=10, help="timed training steps per implementation")
  ap.add_argument("--warmup", type=int, default=2,
                  help="untimed steps first (the first compiles); losses count from step 0")
  ap.add_argument("--loss-steps", type=int, default=3,
                  help="losses of the first N steps recorded and compared with jax.jit's")
  ap.add_argument("--loss-rtol", type=float, default=2e-2,
                  help="relative tolerance of that comparison (bf16)")
  ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                  help="adam: optax.adam when optax is installed, else plain JAX")
  ap.add_argument("--lr", type=float, default=1e-3, help="learning rate")
  ap.add_argument("--attention", choices=["auto", "cudnn", "xla"], default="auto",
                  help="jax.nn.dot_product_attention implementation; auto: cudnn on GPU where a "
                       "probe of it compiles, xla otherwise")
  ap.add_argument("--xla-overlap-flags", default=XLA_OVERLAP_FLAGS,
                  help="comma-separated name=value XLA flags of the jax.jit+xla_overlap variant: "
                       "jit compiler options where XLA accepts them, else XLA_FLAGS of a child "
                       "process")
  ap.add_argument("--xla-flags-via", choices=["auto", "env"], default="auto",
                  help="auto: compiler options where accepted; env: always a child process with "
                       "XLA_FLAGS")
  ap.add_argument("--peak-tflops", type=float, default=None,
                  help="per-device dense bf16 peak for MFU; default 989 on H100/H200 (spec "
                       "sheet), none (no MFU) elsewhere")
  ap.add_argument("--seed", type=int, default=0, help="seed of parameters and inputs")
  ap.add_argument("--out", default="bench/results", help="directory of the JSON file")
  ap.add_argument("--tag", default="",
                  help="file name suffix, <GPU>-x<world>-<date>-model-<tag>.json, so that runs "
                       "split over several calls on one day do not overwrite each other")
  ap.add_argument("--smoke", action="store_true",
                  help="seconds-long CPU check: --model tiny --tokens 256 --seq 128 --steps 2 "
                       "--warmup 1 --loss-steps 2 (each where left at its default)")
  ap.add_argument("--child-timeout", type=int, default=1800, help=argparse.SUPPRESS)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return ap


SMOKE = {"model": "tiny", "tokens": "256", "seq": 128, "steps": 2, "warmup": 1, "loss_steps": 2}


def _parse(argv):
  ap = _parser()
  args = ap.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE.items():
      if getattr(args, k) == ap.get_default(k):
        setattr(args, k, v)
  for name in args.model.split(","):
    if name not in MODELS:
      ap.error(f"--model: unknown {name!r}; known: {', '.join(MODELS)}")
  for impl in args.impls.split(","):
    if impl not in IMPLS:
      ap.error(f"--impls: unknown {impl!r}; known: {', '.join(IMPLS)}")
  if args.steps < 1 or args.warmup < 0 or args.loss_steps < 0:
    ap.error("--steps must be >= 1, --warmup and --loss-steps >= 0")
  args.xla_flag_dict = parse_flags(args.xla_overlap_flags)
  return args


def _configs(args, world, budget, errors):
  """RunConfigs to run, in order; configurations that cannot be built go to `errors`."""
  out = []
  for name in args.model.split(","):
    dims = MODELS[name]
    built = []
    for tokens in map(int, args.tokens.split(",")):
      for variant in args.variants.split(","):
        try:
          built.append(make_config(dims, args.layers or dims.max_layers, tokens, args.seq,
                                   variant, world, args.fsdp))
        except ValueError as e:
          errors.append({"model": name, "tokens": tokens, "variant": variant,
                         "error": f"not run: {e}"})
    if args.layers is None and built:
      layers = min(layers_that_fit(c, budget, args.attention_impl) for c in built)
      _log(f"{name}: {layers} layers fit every configuration (estimate, "
           f"{budget / 1e9:.0f} GB budget per device)")
      if layers == 0:
        for c in built:
          errors.append({"model": name, "tokens": c.tokens, "variant": c.variant,
                         "error": "not run: not even one layer fits the memory estimate"})
        continue
      built = [dataclasses.replace(c, layers=layers) for c in built]
    out.extend(built)
  return out


def _base_record(c: RunConfig, impl, gpu, versions, date):
  return {"bench": "model", "model": c.dims.name, "tokens": c.tokens, "world_size": c.world,
          "impl": impl, "variant": c.variant, "mesh": c.mesh_desc, "layers": c.layers,
          "seq": c.seq, "batch": c.batch, "hidden": c.dims.hidden, "ffn": c.dims.ffn,
          "heads": c.dims.heads, "kv_heads": c.dims.kv_heads, "dtype": "bfloat16",
          "gpu": gpu, "versions": versions, "date": date,
          "fused": None, "skipped": None}  # ao.explain's counts, on ao.jit rows


def _table(records, platform, peak):
  head = ("model", "tokens", "variant", "mesh", "L", "impl", "step_ms", "tokens/s", "mfu",
          "vs jit", "fused/skip", "loss[0]", "loss ok")
  rows = [head]
  best_jit = {}
  for r in records:
    if r.get("step_ms") and r["impl"] != "ao.jit":
      key = (r["model"], r["tokens"], r["variant"])
      best_jit[key] = min(best_jit.get(key, math.inf), r["step_ms"])
  errors = []
  for r in records:
    if "error" in r:
      errors.append(f"[{len(errors) + 1}] {r['model']} tokens={r['tokens']} "
                    f"{r.get('variant', '-')} {r.get('impl') or ''}: {r['error'][:400]}")
      rows.append((r["model"], str(r["tokens"]), r.get("variant", "-"), r.get("mesh", "-"),
                   str(r.get("layers", "-")), r.get("impl") or "-", f"ERROR [{len(errors)}]",
                   "", "", "", "", "", ""))
      continue
    best = best_jit.get((r["model"], r["tokens"], r["variant"]))
    vs = f"{best / r['step_ms']:.3f}x" if best else "-"
    fs = f"{r['fused']}/{r['skipped']}" if r.get("fused") is not None else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    ok = {True: "yes", False: "NO"}.get(r.get("loss_agrees"),
                                        "ref" if r["impl"] == "jax.jit" else "-")
    rows.append((r["model"], str(r["tokens"]), r["variant"], r["mesh"], str(r["layers"]),
                 r["impl"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.0f}", mfu, vs, fs,
                 f"{r['loss'][0]:.5f}" if r["loss"] else "-", ok))
  widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
  lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  notes = errors + ["vs jit: the best jax.jit variant's step time / this step time (>1: faster)",
           f"mfu: model FLOPs (6.N.tokens + causal attention, remat not counted) / "
           f"(step time x devices x {peak} TFLOP/s)" if peak else "mfu: no peak known for "
           "this device (--peak-tflops)"]
  if platform == "cpu":
    notes.append("NOTE: " + CPU_NOTE)
  return "\n".join(lines + notes)


def main(argv=None) -> int:
  # Parameters, gradients and Adam's moments take most of an H200: let XLA's
  # allocator have 90% of it (its default is 75%) unless the user chose.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
  args = _parse(argv)
  import jax

  devices = jax.devices()
  platform, world = devices[0].platform, len(devices)
  args.attention_impl = attention_impl(args.attention, platform,
                                       {MODELS[m].head_dim for m in args.model.split(",")})

  if args.child:  # one implementation of one configuration; the record on stdout
    c = _configs(args, world, math.inf, [])[0]
    accepted, _ = split_compiler_options(args.xla_flag_dict)
    rec = run_impl(c, args.child, args, devices, accepted)
    rec["xla_flags_via"] = "XLA_FLAGS (child process)"
    print(json.dumps(rec))
    return 0

  stats = devices[0].memory_stats() or {}
  budget = (args.mem_gb * 1e9 if args.mem_gb else stats.get("bytes_limit") or 0.9 * 141e9)
  gpu, versions = _gpu_name(), _versions()
  date = datetime.date.today().isoformat()
  kind = devices[0].device_kind
  peak = args.peak_tflops or (H100_H200_BF16_DENSE_TFLOPS
                              if any(s in kind for s in ("H100", "H200")) else None)
  impls = args.impls.split(",")
  if args.xla_flags_via == "env":
    accepted, rejected = {}, dict(args.xla_flag_dict)
  else:
    accepted, rejected = split_compiler_options(args.xla_flag_dict)
  if "jax.jit+xla_overlap" in impls:
    _log(f"XLA overlap flags as compiler options: {accepted or 'none'}; "
         f"through XLA_FLAGS in a child process: {rejected or 'none'}")
  _log(f"{world} x {kind} ({platform}); attention {args.attention_impl}; "
       f"peak {peak or '-'} TFLOP/s; {CPU_NOTE if platform == 'cpu' else ''}")

  not_run = []
  configs = _configs(args, world, budget, not_run)
  records = [{"bench": "model", "world_size": world, "gpu": gpu, "versions": versions,
              "date": date, "impl": None, **e} for e in not_run]
  for e in not_run:
    _log(f"{e['model']} tokens={e['tokens']} {e['variant']}: {e['error']}")
  for c in configs:
    _log(f"{c.dims.name} tokens={c.tokens} {c.variant} ({c.mesh_desc}) layers={c.layers} "
         f"seq={c.seq} batch={c.batch}: estimate "
         f"{memory_estimate_bytes(c, c.layers, args.attention_impl) / 1e9:.1f} GB per device")
    ref = None
    for impl in impls:
      rec = _base_record(c, impl, gpu, versions, date)
      _log(f"  {impl} ...")
      try:
        if impl == "jax.jit+xla_overlap" and rejected:
          got = _run_impl_in_child(c, impl, args, {**{k: str(v) for k, v in accepted.items()},
                                                   **rejected})
        else:
          got = run_impl(c, impl, args, devices, accepted)
          if impl == "jax.jit+xla_overlap":
            got["xla_flags_via"] = "jit compiler_options"
        rec.update(got)
        flops = model_flops_per_step(c)
        rec["model_tflops_per_step"] = round(flops / 1e12, 3)
        rec["peak_tflops"] = peak
        rec["mfu"] = (round(flops / (rec["step_ms"] / 1e3 * c.world * peak * 1e12), 4)
                      if peak else None)
        if impl == "jax.jit":
          ref = rec
        _loss_check(rec, ref, args.loss_rtol)
        _log(f"  {impl}: {rec['step_ms']:.2f} ms/step, {rec['tokens_per_s']:.0f} tokens/s, "
             f"losses {rec['loss']}" + ("" if rec.get("loss_agrees", True) else
                                        f"  DISAGREE with jax.jit ({rec['loss_rel_diff']:.2e})"))
      except Exception as e:  # noqa: BLE001 - an error row; the other runs go on
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        _log(f"  {impl} failed: {rec['error'][:600]}")
      if platform == "cpu":
        rec["note"] = CPU_NOTE
      records.append(rec)
      gc.collect()

  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{gpu}-x{world}-{date}-model{'-' + args.tag if args.tag else ''}.json"
  path.write_text(json.dumps(records, indent=1))
  if "jax.jit+xla_overlap" in impls:
    print(f"jax.jit+xla_overlap flags: {args.xla_overlap_flags.replace(',', ' ')}")
  print(f"Training step, bf16, {world}x {kind}, median of {args.steps} steps after {args.warmup} "
        f"warm-up")
  print(_table(records, platform, peak))
  print(f"wrote {path}")
  disagree = [r for r in records if r.get("loss_agrees") is False]
  if disagree:
    print(f"FAIL: {len(disagree)} run(s) disagree with jax.jit's losses beyond rtol "
          f"{args.loss_rtol}", file=sys.stderr)
    return 1
  return 0
