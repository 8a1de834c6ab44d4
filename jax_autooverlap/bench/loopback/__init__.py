"""Loopback benchmark: a fused kernel's compute path on ONE GPU, against cuBLAS doing the same work.

    python -m jax_autooverlap.bench ag|rs --loopback [--world W] [--shapes 4096x8192x8192,...]

The fused kernel runs as rank 0 of a group of W (--world, default 2) whose
W - 1 peers are workspace buffers on the same GPU (fixture.py):
  ag  the peers' shards are already in rank 0's gather buffer and their
      arrival counters are set (kernels/loopback.py), so remote tiles never
      wait; rank 0's pushes land in the peers' buffers;
  rs  the peers' partial tiles of rank 0's rows are already in rank 0's
      slots, counters set; rank 0's pushes of each peer's tiles land in that
      peer's buffer.
So the tile order, the waits (their first poll), the epilogue and the push
(at same-GPU bandwidth, not NVLink) are timed at the per-rank shapes of a
group of W, without W GPUs.

Shapes are global M x K x N of the W-GPU op (as in `python -m
jax_autooverlap.bench`); the local work of one GPU is
  ag  [M, K] @ [K, N/W]   (its shard is M/W of the M rows)
  rs  [M, K/W] @ [K/W, N] (it owns M/W output rows)
Contestants (programs.py), run interleaved (rounds of back-to-back calls of each in turn):
  gemm_alone  the local GEMM through XLA (cuBLAS)
  ours        the fastest correct fused variant autotuning would time (cli.py
              fused_variants: the tuner's config on each engine, GEMM+RS on the
              Gluon engine with and without a consumer partition per warpgroup,
              and for small shapes narrower tiles and split-K; fields `engine`,
              `kernel`)
  ours_tl     the fastest of those on the plain `tl` engine
  engine_alone  the Gluon engine's plain GEMM (kernels/gluon_gemm.py) on the same
              local work, with the tiles of the fastest Gluon variant: what the fused
              kernel costs over its engine
              (in the table; its records go to *-engine-alone.json with mode "engine",
              so the *-loopback.json records are gemm_alone, ours, ours_tl and
              engine_alone_tl)
  engine_alone_tl  ours_tl's kernel alone: its config on the same local GEMM in a
              group of one (cli.alone_case, alone_config: its tiles, split and
              movers, no peers, nothing pushed), so the tl kernel's GEMM and
              per-call costs against what its communication adds
Times are device times of the contestant's kernels (bench/timing.py: jax.profiler,
CUPTI), without the loopback set-up kernel: per round the mean per call, then the
median over rounds (`round_ms` keeps every round: the spread, e.g. under the
power cap; `kernels` the kernel names counted).  Without device events (no
CUPTI) wall-clock batches are used instead (field `timing`).  Every fused contestant is first checked
against the unfused computation (jnp on the same GPU): its output, and what
it pushed into each peer's buffer; a wrong one is reported and not timed.
The records' fields: bench/records/README.md.
"""
from jax_autooverlap.bench.loopback.cli import (alone_case, alone_config, bench_case,
                                                fused_variants, kernel_configs, main, trace_case,
                                                variant_name)
from jax_autooverlap.bench.loopback.fixture import WORLD, Case, Loopback
from jax_autooverlap.bench.loopback.programs import engine_program, fused_program, gemm_program

__all__ = ["WORLD", "Case", "Loopback", "fused_program", "engine_program", "gemm_program",
           "kernel_configs", "fused_variants", "variant_name", "bench_case", "trace_case", "main",
           "alone_case", "alone_config"]
