"""Why a collective was not fused, or why a fused op runs the unfused program: a stable code
with a message.

`Reason` is the message itself (a str, what `ao.explain` prints) carrying a `code` from
`CODES`, so that tests and tools check the code, never the wording.
"""
from __future__ import annotations

CODES = {
    # the rewrite: a collective next to a matmul left as written
    "untiled": "an untiled collective without the reshape that makes it a tiled one",
    "add_between": "an add sits between the gather and the matmul",
    "used_on_the_way": "the gathered value is used elsewhere on its way to the matmul",
    "multi_axis": "a collective over several mesh axes",
    "axis_index_groups": "a collective with axis_index_groups",
    "layout_splits_dim": "a layout op splits the gathered or scattered dim",
    "no_sharding_type": "a layout op whose result has no usable sharding type",
    "both_operands": "the gathered value is both operands of the matmul",
    "batch_dim": "the gathered or scattered dim is a batch dim of the matmul",
    "dtype": "an operand or the result has a dtype the fused ops do not take",
    "operand_from_gather": "the matmul's other operand is computed from the gathered value",
    "one_per_matmul": "the matmul already holds another fused op (one per matmul)",
    "operand_emitted_later": "the matmul's other operand comes from a fused op emitted later",
    "used_before": "the gathered value is used before the matmul",
    "sum_other_terms": "the scattered value adds matmuls and other terms",
    "result_used_elsewhere": "the matmul result is also used elsewhere",
    "sum_layouts_differ": "the summed matmuls reach the sum through different layout ops",
    "sum_not_mergeable": "the summed matmuls cannot be one GEMM",
    "communicates_besides": "the matmul communicates besides this collective",
    "impl_unavailable": "the forced implementation cannot run here",
    "fp8_scale_layout": "an fp8 operand's scale is per row, column or block, not per tensor",
    "fp8_one_operand": "one matmul operand is fp8 (or dequantized from fp8), the other is not",
    "fp8_gathered_used": "the gathered value is also used unquantized: an fp8 gather would not "
                         "replace it",
    "fp8_result": "an fp8 matmul whose result is not bf16 or f32",
    "internal_error": "the library failed while rewriting this match (kept as written)",
    "outside_ao_jit": "outside every ao.jit function of the program: runs as written",
    # the planner: the fused op runs the unfused program (or cannot run the kernel)
    "forced": "OverlapConfig(impl=...) chose the implementation",
    "platform_at_lowering": "no concrete mesh at trace time: chosen at lowering",
    "not_gpu": "the mesh is not on NVIDIA GPUs: the reference ring runs",
    "no_kernel": "no GPU kernel covers this form (e.g. contracting-dim gathers)",
    "mixed_dtypes": "the operands have different dtypes",
    "axis_size_1": "an axis of size 1: a plain matmul",
    "batched": "a batched matmul; the kernel covers 2-D operands",
    "unsupported_shape": "the kernel cannot run this shape, dtype or config",
    "never_measured": "no verdict or cost model for this GPU kind, group size and dtype",
    "first_call": "no verdict yet: the first call measures the kernel against the unfused program",
    "measure_failed": "the first-call measurement failed or its processes did not agree: unfused",
    "tuner_unfused": "measured or predicted: the unfused program is faster",
    "workspace": "the symmetric workspace does not cover the axis' groups",
    "kernel": "the GPU kernel runs",
}


class Reason(str):
  """A reason's message (the str itself) with its code (one of CODES)."""

  code: str

  def __new__(cls, code: str, message: str):
    if code not in CODES:
      raise ValueError(f"Reason: unknown code {code!r}")
    obj = super().__new__(cls, message)
    obj.code = code
    return obj

  def __reduce__(self):
    return Reason, (self.code, str(self))


def code_of(reason) -> str:
  """The code of a Reason, "" for a plain string."""
  return getattr(reason, "code", "")
