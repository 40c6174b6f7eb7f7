"""The host CPU as Linux describes it in /proc/cpuinfo: its model and instruction-set flags.

Which instructions the CPU has sets how fast XLA:CPU runs a GEMM of bf16
operands: with bf16 ones (x86 `avx512_bf16`, `amx_bf16`; Arm `bf16`) faster
than a float32 GEMM, without them slower (fp4jax.backends.xla picks its GEMM
dtype from that; fp4jax.bench.machine prints it).
"""

import functools

# Linux /proc/cpuinfo names: x86 "flags", Arm "Features".
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
CPUINFO = "/proc/cpuinfo"


def fields(cpuinfo=CPUINFO) -> dict | None:
  """{field: value} of the first processor listed in `cpuinfo` (a path);
  None where the file cannot be read (macOS, Windows)."""
  try:
    with open(cpuinfo, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  out = {}
  for line in lines:
    key, sep, value = line.partition(":")
    if sep:
      out.setdefault(key.strip(), value.strip())
  return out


def flags(info: dict | None) -> frozenset:
  """The instruction-set flags of `fields`' answer (empty for None)."""
  return frozenset(((info or {}).get("flags") or (info or {}).get("Features") or "").split())


def bf16_flags(cpu_flags) -> tuple:
  """The BF16_FLAGS among `cpu_flags`, in BF16_FLAGS' order."""
  return tuple(f for f in BF16_FLAGS if f in cpu_flags)


@functools.cache
def host_flags() -> frozenset:
  """flags(fields()) of this machine, read once per process."""
  return flags(fields())
