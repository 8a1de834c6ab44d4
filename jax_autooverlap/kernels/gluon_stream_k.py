"""Stream-K tail for the Gluon engine's static persistent schedule (a prototype on the engine alone,
kernels/gluon_gemm.py; not yet measured on a GPU: bench/NOTES.md).

T tiles of KB k-blocks on P CTAs end in a partial wave when P does not divide T: with R = T mod P,
P - R SMs idle for a whole tile time (8192x2048x4096 in 128x256 tiles: 1,024 tiles are 7.76
waves of 132).  Here the first T // P - 1 waves run whole tiles (data-parallel, tile c + i P on
CTA c); the k-blocks of the last P + R tiles, in tile order, are split evenly: CTA c takes
[c W / P, (c + 1) W / P) of those W = (P + R) KB k-blocks, so every CTA ends after the same work.

Each CTA's share is at least one tile's k-blocks, so a tile is split between at most two CTAs,
c and c + 1: c runs the tile's head (from k-block 0) as the LAST piece of its share and owns the
tile's epilogue; c + 1 runs the tail as the FIRST piece of its share, stores its partial sum
and releases a flag that c acquires before adding it.  c + 1 never waits before that release,
so the owner's bounded wait is short and no cycle of waits exists.
"""
from triton.experimental import gluon


def waves_before_tail(tiles: int, ctas: int) -> int:
  """Waves of whole tiles before the split tail (all of them where there is no partial wave)."""
  full, rest = divmod(tiles, ctas)
  return full - 1 if full >= 1 and rest else full


def pieces(cta: int, tiles: int, k_blocks: int, ctas: int) -> list[tuple[int, int, int]]:
  """(tile, first k-block, end k-block) of CTA `cta`'s share of the tail, in order: the
  kernel's arithmetic (_sk_share / _sk_piece in kernels/gluon_gemm.py), for tests."""
  dp = waves_before_tail(tiles, ctas)
  work = (tiles - dp * ctas) * k_blocks
  g, end, out = cta * work // ctas, (cta + 1) * work // ctas, []
  while g < end:
    k0 = g % k_blocks
    k1 = min(k_blocks, k0 + end - g)
    out.append((dp * ctas + g // k_blocks, k0, k1))
    g += k1 - k0
  return out


@gluon.constexpr_function
def whole_tiles(tiles, ctas, stream_k):
  """For kernels: tiles run whole, before the tail (all of them without stream-K);
  waves_before_tail * ctas (a constexpr function may not call Python functions)."""
  if not stream_k:
    return tiles
  full, rest = divmod(tiles, ctas)
  return (full - 1 if full >= 1 and rest else full) * ctas
