"""fp4jax.bench.sass_loops: a kernel's main loop read from its SASS, and its ceiling.

The parser, the loop finder and the model run on a stored fixture whose answer
is known from its CUDA source (tests/data/known_loop.cu, its cubin and
nvdisasm's text of it), so they run without CUDA. One test compiles, without a
device, fp4jax's Mosaic GPU GEMM and jax's own Hopper matmul for an H200 and
reads what they became; it needs jax's CUDA plugin and skips without it.
"""

import importlib.util
import os

import pytest

from fp4jax.bench import gpu_binary, sass_loops
from tests.helpers import exit_2_line

DATA = os.path.join(os.path.dirname(__file__), "data")
PLUGIN = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
needs_plugin = pytest.mark.skipif(
    not PLUGIN, reason='needs the CUDA plugin: pip install -e ".[gpu-compile]" (Python >= 3.12)')


def _known():
  with open(os.path.join(DATA, "known_loop.sass")) as f:
    (kernel,) = sass_loops.parse(f.read()).items()
  return kernel


def test_the_main_loop_is_the_innermost_loop_with_the_tensor_instruction():
  name, (instructions, labels) = _known()
  assert name == "known_loop"
  # The tensor loop, the loop without tensor instructions, the outer loop around both,
  # and the trap's branch to itself after EXIT.
  spans = sass_loops.loops(instructions, labels)
  assert len(spans) == 4
  loop = sass_loops.main_loop(instructions, labels)
  assert [span for span in spans if span == (loop[0].address, loop[-1].address)]
  assert loop[-1].base == "BRA"
  mix = sass_loops.mix(loop)
  assert mix["tensor"] == {"HMMA.16816.F32.BF16": 1}
  assert mix["fp32"] == {"FMUL": 1, "FFMA": 2, "FADD": 0}
  assert mix["shared"] == {"LDS": 2}
  assert mix["spill"] == {"LDL": 0, "STL": 0}
  assert mix["instructions"] == 17
  assert mix["macs_per_warp"] == 16 * 8 * 16  # a warp's mma.sync is its own


def test_the_bound_follows_the_stated_machine():
  _, (instructions, labels) = _known()
  clocks, limit, ceiling = sass_loops.bound(sass_loops.mix(sass_loops.main_loop(
      instructions, labels)))
  # One SMSP: bf16 MACs 2048 / 4 per clock; 32 FP32 lanes; one issue; a quarter of
  # the SM's shared-memory wavefronts.
  assert clocks == {"tensor": 2048 / 512, "fp32": 3, "issue": 17, "shared": 2 * 4}
  assert limit == "issue"
  assert ceiling == pytest.approx(2048 / 17 / 512)


def test_wgmma_shapes_and_shared_operands():
  assert sass_loops.mma_shape("QGMMA.64x128x32.F32.E4M3.E4M3") == (64, 128, 32, "fp8", 4)
  assert sass_loops.mma_shape("HGMMA.64x256x16.F32.BF16") == (64, 256, 16, "bf16", 4)
  both = sass_loops.Instruction(0, "QGMMA.64x128x32.F32.E4M3.E4M3",
                                "R88, gdesc[UR12], RZ, !UPT, gsb0")
  b_only = sass_loops.Instruction(0, "HGMMA.64x128x16.F32.BF16", "R24, R120, gdesc[UR8], R24")
  assert sass_loops._wavefronts(both) == (64 * 32 + 128 * 32) / 128 / 4
  assert sass_loops._wavefronts(b_only) == 128 * 16 * 2 / 128 / 4
  with pytest.raises(ValueError, match="unknown tensor-core instruction"):
    sass_loops.mma_shape("HMMA.99.F32")


def test_registers_and_stack_frame_from_the_cubin():
  with open(os.path.join(DATA, "known_loop.cubin"), "rb") as f:
    image = f.read()
  assert gpu_binary.resources(image) == {"known_loop": {"registers": 16, "stack_bytes": 0}}
  assert gpu_binary.kernel_name(image) == "known_loop"


def test_ptxas_report_per_kernel():
  text = ("ptxas info    : Compiling entry function 'k_1' for 'sm_90a'\n"
          "ptxas info    : Function properties for k_1\n"
          "    380 bytes stack frame, 380 bytes spill stores, 380 bytes spill loads\n"
          "ptxas info    : Used 168 registers, used 16 barriers\n"
          "ptxas info    : Compiling entry function 'k_2' for 'sm_90a'\n"
          "ptxas info    : Used 40 registers\n")
  report = sass_loops.ptxas_report(text)
  assert report["k_1"] == ("380 bytes stack frame, 380 bytes spill stores, 380 bytes spill "
                           "loads Used 168 registers, used 16 barriers")
  assert report["k_2"] == "Used 40 registers"


@pytest.mark.parametrize("argv, names", [
    (["--target", "h200", "--shapes", "64x64"], ["64x64", "MxKxN"]),
    (["--target", "h200", "--programs", "cublas"], ["cublas", "mosaic"]),
    (["--target", "b300"], ["b300", "h200"]),
])
def test_bad_flags_exit_2_naming_what_was_given(capsys, argv, names):
  line = exit_2_line(capsys, sass_loops.main, argv)
  for name in names:
    assert name in line, line


@needs_plugin
def test_deviceless_mosaic_gemm_and_jax_matmul_loops():
  """The exact mode promotes per 32-block: per 32-K step of one warp an FP8 wgmma
  and one FMUL + one FFMA per accumulator element (64 each), in the registers a
  thread has at launch; the fast
  mode per 128; jax's bf16 Hopper matmul keeps one accumulator, does no FP32 work
  in its loop and is tensor-bound at the bf16 peak. None spills (ptxas's report)."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from fp4jax.bench import gpu_compile  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.asarray(gpu_compile.target_devices("h200")), ("d",))
  (exact,) = sass_loops.compile_program("mosaic", (256, 512, 256), mesh)
  assert exact.loop["tensor"] == {"QGMMA.64x128x32.F32.E4M3.E4M3": 1}
  assert exact.k_per_iteration == 32
  assert exact.loop["fp32"] == {"FMUL": 64, "FFMA": 64, "FADD": 0}
  assert exact.loop["spill"] == {"LDL": 0, "STL": 0}
  assert exact.registers_used <= exact.registers  # no spill even without setmaxnreg
  assert "0 bytes spill stores" in exact.ptxas
  assert exact.limit != "tensor"
  (fast,) = sass_loops.compile_program("mosaic_fast", (256, 512, 256), mesh)
  # One promotion per 128 of K: a chain of four 64 x 192 wgmmas, a quarter of the FP32
  # work per wgmma, tensor-bound.
  assert fast.loop["tensor"] == {"QGMMA.64x192x32.F32.E4M3.E4M3": 4}
  assert fast.k_per_iteration == 128
  assert fast.loop["fp32"] == {"FMUL": 96, "FFMA": 96, "FADD": 0}
  assert fast.per_wgmma["fp32"] <= 40
  assert fast.loop["spill"] == {"LDL": 0, "STL": 0}
  assert "0 bytes spill stores" in fast.ptxas
  assert fast.limit == "tensor"
  assert fast.ceiling >= 1.6
  (reference,) = sass_loops.compile_program("mgpu_bf16", (256, 512, 256), mesh)
  assert set(reference.loop["tensor"]) == {"HGMMA.64x128x16.F32.BF16"}
  assert sum(reference.loop["fp32"].values()) == 0
  assert "0 bytes spill stores" in reference.ptxas
  assert (reference.limit, round(reference.ceiling, 2)) == ("tensor", 1.0)
