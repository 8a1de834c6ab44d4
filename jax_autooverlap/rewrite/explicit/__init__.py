"""Collective matmuls of programs without shard_map, read from explicit-sharding types:
the sharding algebra (sharding.py), the matcher (matcher.py), the actions the
interpreter runs (actions.py) and, when nothing is found, what was looked at (survey.py)."""
from jax_autooverlap.rewrite.explicit.matcher import match
from jax_autooverlap.rewrite.explicit.survey import survey

__all__ = ["match", "survey"]
