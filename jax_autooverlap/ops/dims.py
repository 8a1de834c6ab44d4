"""The dimensions of a dot_general: batch, contracting and free dims of each operand."""
from __future__ import annotations


class DotDims:
  """Batch, contracting and free dims of both operands of a dot_general."""

  def __init__(self, dn, lhs_ndim, rhs_ndim):
    (lc, rc), (lb, rb) = dn
    self.lb, self.rb = tuple(map(int, lb)), tuple(map(int, rb))
    self.lc, self.rc = tuple(map(int, lc)), tuple(map(int, rc))
    self.lf = tuple(d for d in range(lhs_ndim) if d not in self.lb + self.lc)
    self.rf = tuple(d for d in range(rhs_ndim) if d not in self.rb + self.rc)

  def side(self, operand: int):
    """(batch, contracting, free) of one operand and of the other one."""
    mine = (self.lb, self.lc, self.lf) if operand == 0 else (self.rb, self.rc, self.rf)
    other = (self.rb, self.rc, self.rf) if operand == 0 else (self.lb, self.lc, self.lf)
    return mine, other
