"""The benchmark's model: a Llama-style decoder stack, per device inside one shard_map, its
configurations (dims x depth x tokens x mesh), its sizes (parameters, FLOPs, memory) and its
parameters and inputs.

RMSNorm, grouped-K/V causal attention (jax.nn.dot_product_attention, cuDNN on
GPU) with rotary embeddings, fused Q/K/V and O projections, a SwiGLU MLP (fused
gate/up projection).  Megatron tensor + sequence parallelism: activations
[seq, batch, hidden] are sequence-sharded over "tp", all_gathered (tiled)
before the column-parallel projections and psum_scattered after the
row-parallel ones.  The "fsdp" variant adds a second mesh axis: weights are
also sharded on their contracting dim over "fsdp" (gathered per layer,
gradients reduce-scattered by autodiff) and the batch is data-parallel over
it.  bf16 parameters and activations, f32 loss (mean squared error of the
final-normed stack output against a random target: no embedding or LM head),
layers under lax.scan with jax.checkpoint.
"""
from __future__ import annotations

import dataclasses
import math

from jax_autooverlap.bench import common

log = common.logger("model")


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
    log(f"cuDNN attention unavailable ({type(e).__name__}: {str(e)[:300]}); using XLA's")
    return "xla"
  return "cudnn"
