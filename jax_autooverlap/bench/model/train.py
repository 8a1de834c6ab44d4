"""The training step the model benchmark times: value_and_grad of the loss, then an optimizer
update (Adam through optax if installed, else a few lines of plain JAX; or SGD)."""
from __future__ import annotations


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
