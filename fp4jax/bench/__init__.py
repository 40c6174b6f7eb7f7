"""Benchmarks that print ratios measured in one run: `python -m fp4jax.bench NAME`.

Benchmarks (NAME): dot_general (one quantized GEMM vs lax.dot_general),
kernels (quantization vs the bandwidth limit), memory (saved residuals per
token), train_step (tokens/s per recipe, interleaved), train_speed (one
recipe's throughput and MFU), crosscheck (the same bits on two backends),
gemm_dtype (a bf16 GEMM's three dtype routes), gpu_plan, gpu_check and
gpu_summary (the plan, stages and summary of benchmarks/gpu_check.sh), gpu_compile (every GPU
path through XLA's GPU compiler, without a GPU), gpu_shards (a Dense layer
sharded over 8 GPUs through that compiler: the tokens each kernel reads),
gpu_fit (a config's train step compiled for N GPUs on H hosts without them:
memory per device against the GPU's, FLOPs, collectives, kernels),
sass_loops (each Hopper GEMM kernel's main loop read from its SASS without a
GPU: instruction mix, spills and the ceiling against bf16's peak),
study_throughput (a study's
runs per hour, one at a time vs side by side). Helpers: hlo_stats (kernel
counts of optimized HLO), gpu_binary (tensor-core instructions read from a
compiled GPU binary), machine (what a CPU benchmark ran on).

Each benchmark module has `parser()` (its argparse flags) and `main(argv)`;
`positive_int` and `choice_list` are the flag types they share, so a bad
value is one argparse line with exit status 2.
"""

import argparse


def positive_int(text):
  """argparse type: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def choice_list(allowed, what):
  """argparse type: comma-separated names, each one of `allowed`."""

  def parse(text):
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
      raise argparse.ArgumentTypeError(
          f"unknown {what} {bad[0] if bad else text!r}; allowed: "
          f"{', '.join(allowed)}")
    return names

  return parse
