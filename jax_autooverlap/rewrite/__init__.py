"""The rewrite: find collective/matmul pairs in a traced program and fuse them."""
from jax_autooverlap.rewrite.analysis import analyze
from jax_autooverlap.rewrite.plan import Plan
from jax_autooverlap.rewrite.interpreter import Interpreter, RewriteError, register_rule
from jax_autooverlap.rewrite.match import Match, Report

__all__ = ["Plan", "analyze", "Interpreter", "RewriteError", "register_rule", "Match", "Report"]
