"""What a CPU benchmark ran on: the processor and the instructions that set bf16 GEMM speed.

fp4jax's GEMMs of bf16 operands are bf16 x bf16 -> float32 dots, which
XLA:CPU runs as bf16 GEMMs: faster than float32 ones on a CPU with bf16
instructions (avx512_bf16, amx_bf16, Arm's bf16), slower on one without, so
timings and their ratios move from one CPU to another (docs/performance-log.md).
"""

import os
import platform

import jax

# Linux /proc/cpuinfo names: x86 "flags", Arm "Features".
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
VECTOR_FLAGS = ("avx512f", "avx2", "asimd")


def cpu_description(cpuinfo="/proc/cpuinfo") -> str:
  """'MODEL, N CPUs, VECTOR, bf16: FLAGS' from `cpuinfo` (a path); the
  machine type alone where the file is missing (macOS, Windows)."""
  try:
    with open(cpuinfo) as f:
      lines = f.read().splitlines()
  except OSError:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
  fields = {}
  for line in lines:
    key, sep, value = line.partition(":")
    if sep:
      fields.setdefault(key.strip(), value.strip())
  model = fields.get("model name") or platform.machine()
  flags = set((fields.get("flags") or fields.get("Features") or "").split())
  vector = next((f for f in VECTOR_FLAGS if f in flags), "no AVX2")
  bf16 = [f for f in BF16_FLAGS if f in flags]
  return (f"{model}, {os.cpu_count()} CPUs, {vector}, "
          f"bf16 instructions: {' '.join(bf16) if bf16 else 'none'}")


def describe() -> str:
  """cpu_description() on jax's CPU backend, else the first device's kind."""
  if jax.default_backend() == "cpu":
    return cpu_description()
  return f"{jax.devices()[0].device_kind}, {jax.device_count()} devices"
