"""Benchmarks (programs that print tables and write JSON, not tests; nothing in the package
imports them): `python -m jax_autooverlap.bench --help`.

  __main__     the command line; ag|rs: the fused ops on all local GPUs against the unfused
               program, the rivals and the overlap floor
  loopback/    ag|rs --loopback: a fused kernel's compute path on one GPU, as rank 0 of a
               group of 2, 4 or 8
  shapes       shapes --loopback: the LLM shape list (data/llm_shapes.json) in loopback
  model/       model: a Llama-style training step end to end
  calibrate    calibrate: the cost model's parameters on this machine
  gemm_check   the cost model's GEMM time against cuBLAS on model shapes
  engine       the Gluon engine's GEMM against cuBLAS
  launch_cost  the host cost of launching a fused op
  timeline     per-tile timelines of the Gluon kernels (loopback --trace)
  timing       device time of contestants on one GPU (CUPTI, interleaved rounds)
  common       what they share: progress lines, versions, GPU name, relative error
The records they write: bench/records/README.md.
"""
