"""What a CPU benchmark ran on: the processor and the instructions that set bf16 GEMM speed.

fp4jax's GEMMs of bf16 operands are bf16 x bf16 -> float32 dots, which
XLA:CPU runs as bf16 GEMMs: faster than float32 ones on a CPU with bf16
instructions (avx512_bf16, amx_bf16, Arm's bf16), slower on one without, where
the xla backend runs them as float32 GEMMs of the same values
(fp4jax.backends.xla.bf16_gemm), so timings and their ratios move from one CPU
to another (docs/performance-log.md).
"""

import os
import platform

import jax

from fp4jax import cpuinfo
from fp4jax.backends import xla

VECTOR_FLAGS = ("avx512f", "avx2", "asimd")


def cpu_description(path=cpuinfo.CPUINFO) -> str:
  """'MODEL, N CPUs, VECTOR, bf16 instructions: FLAGS' from the cpuinfo file at
  `path`; the machine type alone where it is missing (macOS, Windows)."""
  fields = cpuinfo.fields(path)
  if fields is None:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
  model = fields.get("model name") or platform.machine()
  flags = cpuinfo.flags(fields)
  vector = next((f for f in VECTOR_FLAGS if f in flags), "no AVX2")
  bf16 = cpuinfo.bf16_flags(flags)
  return (f"{model}, {os.cpu_count()} CPUs, {vector}, "
          f"bf16 instructions: {' '.join(bf16) if bf16 else 'none'}")


def describe() -> str:
  """cpu_description() on jax's CPU backend, else the first device's kind."""
  if jax.default_backend() == "cpu":
    return cpu_description()
  return f"{jax.devices()[0].device_kind}, {jax.device_count()} devices"


def gemm_line() -> str:
  """'xla GEMMs of bf16 values in DTYPE (why)': fp4jax.backends.xla.bf16_gemm()."""
  choice = xla.bf16_gemm()
  return f"xla GEMMs of bf16 values in {choice.dtype} ({choice.why})"
