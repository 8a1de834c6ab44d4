"""The rewrite: find collective/matmul pairs in a traced program and fuse them."""
from jax_autooverlap.rewrite._jax import forward_mode, make_jaxpr
from jax_autooverlap.rewrite.analysis import analyze, collect
from jax_autooverlap.rewrite.inline import inline_fp8_calls
from jax_autooverlap.rewrite.interpreter import Interpreter, RewriteError, register_rule
from jax_autooverlap.rewrite.match import Match, Report
from jax_autooverlap.rewrite.plan import Plan

__all__ = ["Plan", "analyze", "collect", "forward_mode", "inline_fp8_calls", "make_jaxpr",
           "Interpreter", "RewriteError", "register_rule", "Match",
           "Report"]
