"""Version shims (no GPU needed): the global-scratch redirection of _compat.py."""
import pytest

from jax_autooverlap import _compat

_PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u64 .ptr .global .align 1 k_param_2,
	.param .u64 .ptr .global .align 1 k_param_3
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_2];
	ld.param.b64 	%rd12, [k_param_12];
}
"""


def test_redirect_reads_the_scratch_operand_instead_of_the_implicit_pointer():
  out = _compat.redirect_scratch_param(_PTX, "k")
  # params: 0 input, 1 scratch operand, 2 implicit global scratch, 3 implicit profile scratch
  assert "[k_param_2]" not in out and out.count("[k_param_1]") == 1
  assert "[k_param_0]" in out and "[k_param_12]" in out  # other parameters untouched


def test_redirect_refuses_unexpected_ptx():
  with pytest.raises(RuntimeError, match="no .entry"):
    _compat.redirect_scratch_param(_PTX, "other")
  with pytest.raises(RuntimeError, match="2 parameters"):
    _compat.redirect_scratch_param(".entry k(\n .param .u64 k_param_0,\n .param .u64 k_param_1\n)", "k")


def test_only_registered_kernels_are_rewritten_and_oversized_scratch_is_refused():
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class Compiled:
    binary: str
    name: str
    global_scratch_size: int | None
    global_scratch_align: int | None

  other = Compiled(_PTX, "not_ours", 512, 128)
  assert _compat._scratch_as_operand(other) is other
  _compat._lean_kernels.add("k")
  try:
    out = _compat._scratch_as_operand(Compiled(_PTX, "k", 512, 128))
    assert out.global_scratch_size is None and out.global_scratch_align is None
    assert "[k_param_2]" not in out.binary
    with pytest.raises(RuntimeError, match="needs 4096 bytes"):
      _compat._scratch_as_operand(Compiled(_PTX, "k", 4096, 128))
  finally:
    _compat._lean_kernels.discard("k")


def test_lean_kernels_are_built_without_ttir():
  made = []

  class Lib:
    version = 7

    @staticmethod
    def TritonKernel(*args):
      made.append(args)

  lib = _compat._KernelLibWithoutTtir(Lib())
  assert lib.version == 7  # everything else passes through
  _compat._lean_kernels.add("k")
  try:
    lib.TritonKernel("k", 8, 1, 1000, "ptx", "ttir text", 90, 512, 128)
    lib.TritonKernel("other", 8, 1, 1000, "ptx", "ttir text", 90)
  finally:
    _compat._lean_kernels.discard("k")
  assert made == [("k", 8, 1, 1000, "ptx", "", 90, 512, 128),
                  ("other", 8, 1, 1000, "ptx", "ttir text", 90)]
