"""The end-to-end training-step benchmark (`python -m jax_autooverlap.bench model`): cli.py runs
it; llama.py is the model, train.py the step, xla_flags.py the XLA-overlap variant's flags,
runner.py one implementation on one configuration."""
from jax_autooverlap.bench.model.cli import main

__all__ = ["main"]
