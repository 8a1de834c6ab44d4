"""The XLA flags of the `jax.jit+xla_overlap` variant: parsed from the command line and split
into those XLA takes as jit compiler options and those that only XLA_FLAGS (a child process,
the flags being process-wide) can carry."""
from __future__ import annotations

# XLA's own overlap machinery.  The windowed einsum applies to dots that GSPMD
# partitions; in this shard_map program the collectives are explicit, so it
# mostly brings the latency-hiding scheduler.  Each flag is passed as a jit
# compiler option where XLA accepts it as one, else through XLA_FLAGS in a
# child process (the flags are process-wide there).
XLA_OVERLAP_FLAGS = ("xla_gpu_threshold_for_windowed_einsum_mib=0,"
                     "xla_gpu_multi_streamed_windowed_einsum=true,"
                     "xla_gpu_enable_latency_hiding_scheduler=true")


def parse_flags(spec: str) -> dict[str, str]:
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, value = item.lstrip("-").partition("=")
    if not sep:
      raise ValueError(f"--xla-overlap-flags: expected name=value, got {item!r}")
    out[name] = value
  return out


def option_value(value: str):
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
      jax.jit(lambda x: x + 1, compiler_options={name: option_value(value)}).lower(
          jnp.ones(2)).compile()
      accepted[name] = option_value(value)
    except Exception:  # noqa: BLE001 - XLA: "No such compile option"
      rejected[name] = value
  return accepted, rejected
