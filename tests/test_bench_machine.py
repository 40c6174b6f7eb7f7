"""fp4jax.bench.machine: the CPU line of benchmark headers, from planted /proc/cpuinfo files."""

import os

import jax

from fp4jax.bench import machine

_ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
_ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx2 fma\n"
_SAPPHIRE = ("model name\t: Intel(R) Xeon(R) Platinum 8481C\n"
             "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
_GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"


def _describe(tmp_path, text):
  path = tmp_path / "cpuinfo"
  path.write_text(text)
  return machine.cpu_description(str(path))


def test_cpu_description_names_the_model_the_vector_unit_and_the_bf16_instructions(tmp_path):
  n = os.cpu_count()
  assert (_describe(tmp_path, _ZEN4)
          == f"AMD EPYC 9R14, {n} CPUs, avx512f, bf16 instructions: avx512_bf16")
  assert _describe(tmp_path, _ZEN3) == f"AMD EPYC 7B13, {n} CPUs, avx2, bf16 instructions: none"
  assert _describe(tmp_path, _SAPPHIRE).endswith("avx512f, bf16 instructions: amx_bf16 avx512_bf16")
  arm = _describe(tmp_path, _GRAVITON3)
  assert arm.endswith(f"{n} CPUs, asimd, bf16 instructions: bf16"), arm


def test_cpu_description_without_cpuinfo_names_the_machine(tmp_path):
  text = machine.cpu_description(str(tmp_path / "missing"))
  assert text.endswith(f"{os.cpu_count()} CPUs") and "bf16" not in text


def test_describe_on_the_cpu_backend_is_the_cpu_line():
  if jax.default_backend() == "cpu":
    assert machine.describe() == machine.cpu_description()
  else:
    assert machine.describe().startswith(jax.devices()[0].device_kind)
