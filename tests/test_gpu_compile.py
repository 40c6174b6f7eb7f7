"""fp4jax's GPU paths through XLA's real GPU compiler, for H200 and B200, without a GPU.

The tests that compile need jax's CUDA plugin (the `gpu-compile` extra; `make
test-gpu-compile PYTHON=python3.12`) and skip without it. They assert on what
the compiler made of each program (fp4jax.bench.gpu_compile): the optimized
HLO's GEMMs and, read from the compiled binary, the tensor-core instructions
of their kernels. What MXFP8 and NVFP4 on the native backend become is
asserted as found, so a change in XLA shows up here.
"""

import collections
import importlib.util
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from fp4jax import shard_local
from fp4jax.bench import gpu_binary, gpu_compile, gpu_fit, gpu_shards, hlo_stats
from fp4jax.train import step as train_step
from tests.helpers import exit_2_line, main_in_process

PLUGIN = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
needs_plugin = pytest.mark.skipif(
    not PLUGIN, reason='needs the CUDA plugin: pip install -e ".[gpu-compile]" (Python >= 3.12)')
# Blackwell's MMAs that read FP4/FP8 elements with their block scales.
BLOCK_SCALED_TCGEN05 = {"UTCOMMA block-scaled", "UTCQMMA block-scaled"}


@pytest.fixture(scope="module", params=("h200", "b200"))
def mesh(request):
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  devices = gpu_compile.target_devices(request.param)
  return request.param, jax.sharding.Mesh(np.asarray(devices), ("d",))


_CACHE = {}


def linear(mesh, recipe, backend, route=None):
  """The compiled `linear` Row of one arm (compiled once per module run)."""
  target, m = mesh
  key = (target, recipe, backend, route)
  if key not in _CACHE:
    (_CACHE[key],) = gpu_compile.linear_rows(m, sass=True, arms=((recipe, backend, route),))
  return _CACHE[key]


def roles(row):
  """{role: [gemm]} of a linear Row."""
  out = collections.defaultdict(list)
  for g in row.gemms:
    if g.get("role"):
      out[g["role"]].append(g)
  return out


def assert_block_scaled_fp4(row, target):
  """Every role is one block-scaled GEMM reading FP4 elements and E8M0 scales; its
  kernel runs a block-scaled tcgen05 MMA on Blackwell and Hopper's 16-bit wgmma on
  the H200; no other GEMM than rotations."""
  assert row.compiled, row.error
  by_role = roles(row)
  assert sorted(by_role) == ["dgrad", "fprop", "wgrad"], row.gemms
  for role, gemms in by_role.items():
    (g,) = gemms
    assert g["kind"] == "block-scaled (scaled-dot)", (role, g)
    assert g["operands"] == ["f4e2m1fn", "f4e2m1fn"], (role, g)
    assert g["kernel_kind"] == "__triton_nested_gemm_fusion", (role, g)
    if target == "b200":
      assert set(g["mma"]) <= BLOCK_SCALED_TCGEN05 and g["mma"], (role, g)
    else:  # Hopper has no FP4 units: the kernel widens the elements for a 16-bit wgmma
      assert set(g["mma"]) == {"HGMMA"}, (role, g)
  assert all(g["kind"] == "rotation" for g in row.gemms if not g.get("role"))


@needs_plugin
def test_targets_are_the_datasheet_devices(mesh):
  target, m = mesh
  (device,) = m.devices.flat
  want = {"h200": ("NVIDIA H200", "9.0"), "b200": ("NVIDIA B200", "10.0")}[target]
  assert (device.device_kind, str(device.compute_capability)) == want


@needs_plugin
def test_the_h100_target_is_the_datasheet_device_and_hosts_split_the_devices():
  """h100 (80 GB, compute capability 9.0) as 2 hosts of 8: devices 0-7 on the first."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  devices = gpu_compile.abstract_devices("h100", 16, hosts=2)
  assert {(d.device_kind, str(d.compute_capability)) for d in devices} == {
      ("NVIDIA H100 80GB HBM3", "9.0")}
  assert [d.process_index for d in devices] == [0] * 8 + [1] * 8


@needs_plugin
@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4-dh16"])
def test_mxfp4_on_native_is_a_block_scaled_gemm_with_fp4_operands(mesh, recipe):
  assert_block_scaled_fp4(linear(mesh, recipe, "native"), mesh[0])


@needs_plugin
def test_the_check_fails_on_mxfp4_routed_through_scaled_matmul(mesh):
  """The planted bug: MXFP4 through jax.nn.scaled_matmul is dequantize + a float32 dot."""
  row = linear(mesh, "mxfp4", "native", "scaled_matmul")
  with pytest.raises(AssertionError):
    assert_block_scaled_fp4(row, mesh[0])
  assert {g["kind"] for g in roles(row)["fprop"]} == {"dot f32"}


@needs_plugin
def test_mxfp8_and_nvfp4_on_native_become_what_was_found(mesh):
  """As found with jax 0.12.0.1: without a device XLA hands no block-scaled GEMM to
  cuDNN; jax.nn.scaled_matmul's MXFP8 becomes dequantize + float32 dots in loop
  fusions (no tensor-core instruction on B200); NVFP4's Fprop and Dgrad run on
  xla (the weight's 16x16 tiles) as bf16 GEMMs, its Wgrad like MXFP8's."""
  target = mesh[0]
  mxfp8 = roles(linear(mesh, "mxfp8", "native"))
  for gemms in mxfp8.values():
    assert [(g["kind"], g["kernel_kind"]) for g in gemms] == [("dot f32", "kLoop")]
    if target == "b200":
      assert not gemms[0]["mma"]
  nvfp4 = roles(linear(mesh, "nvfp4", "native"))
  assert [g["kind"] for g in nvfp4["fprop"] + nvfp4["dgrad"]] == ["dot bf16", "dot bf16"]
  assert [(g["kind"], g["kernel_kind"]) for g in nvfp4["wgrad"]] == [("dot f32", "kLoop")]


@needs_plugin
@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4-dh16", "fp8"])
def test_mosaic_runs_every_role_on_hopper_fp8_tensor_cores(mesh, recipe):
  """Fprop, Dgrad and Wgrad are each fp4jax's Mosaic GPU kernel reading FP8 operands
  (E2M1 held as E4M3; fp8's E5M2 gradients as they are), and its SASS is Hopper's
  FP8 wgmma, QGMMA, alone (Blackwell has no wgmma: the backend is Hopper's)."""
  if mesh[0] != "h200":
    pytest.skip("wgmma is Hopper's (sm_90a)")
  row = linear(mesh, recipe, "mosaic")
  assert row.compiled, row.error
  by_role = roles(row)
  assert sorted(by_role) == ["dgrad", "fprop", "wgrad"], row.gemms
  for role, gemms in by_role.items():
    (g,) = gemms
    assert g["kind"] == "Mosaic GPU", (role, g)
    assert set(g["operands"]) <= {"f8e4m3fn", "f8e5m2"}, (role, g)
    assert set(g["mma"]) == {"QGMMA"}, (role, g)
  assert all(g["kind"] == "rotation" for g in row.gemms if not g.get("role"))
  if recipe != "fp8":  # MX operands: one Triton quantize_fp8 call each (fp8's: XLA)
    assert row.triton_calls >= 6, row.triton_calls


@needs_plugin
def test_the_xla_backend_emulates_with_bf16_gemms(mesh):
  for g in linear(mesh, "mxfp4", "xla").gemms:
    assert g["kind"] == "dot bf16" and g["operands"] == ["bf16", "bf16"], g


@needs_plugin
def test_the_pallas_recipe_holds_compiled_kernels(mesh):
  """interpret=None follows the lowering target: compiled for the GPU, the pallas
  backend's quantizers are Triton calls (interpreted, there would be none)."""
  row = linear(mesh, "mxfp4-dh16", "pallas")
  assert row.compiled and row.triton_calls >= 3, row


@needs_plugin
def test_every_pallas_kernel_compiles_to_triton(mesh):
  target, m = mesh
  rows = gpu_compile.kernel_rows(m, sass=False)
  assert len(rows) == 18
  for row in rows:
    assert row.compiled, (row.recipe, row.error)
    assert row.triton_calls == 1, row.recipe


@needs_plugin
def test_the_tiny_train_step_compiles(mesh):
  target, m = mesh
  (row,) = gpu_compile.step_rows("step-tiny", list(m.devices.flat), sass=False,
                                 arms=(("mxfp4-dh16", "native", None),))
  assert row.compiled, row.error
  assert row.memory_mib > 0
  kinds = collections.Counter(g["kind"] for g in row.gemms)
  # 4 blocks x 7 linears x 3 GEMMs; attention and the head stay unquantized.
  assert kinds["block-scaled (scaled-dot)"] == 84, kinds


@needs_plugin
def test_the_tiny_train_step_on_mosaic_is_qgmma(mesh):
  """Every quantized GEMM of the mxfp4-dh16 train step is the Mosaic GPU kernel on QGMMA."""
  target, m = mesh
  if target != "h200":
    pytest.skip("wgmma is Hopper's (sm_90a)")
  (row,) = gpu_compile.step_rows("step-tiny", list(m.devices.flat), sass=True,
                                 arms=(("mxfp4-dh16", "mosaic", None),))
  assert row.compiled, row.error
  mosaic = [g for g in row.gemms if g["kind"] == "Mosaic GPU"]
  assert len(mosaic) == 84  # 4 blocks x 7 linears x 3 GEMMs
  assert all(set(g["mma"]) == {"QGMMA"} for g in mosaic), mosaic
  assert not any(g["kind"].startswith(("dot f8", "block-scaled")) for g in row.gemms)


_TCGEN05_PTX = """.version 8.8
.target sm_100a
.address_size 64
.visible .entry k(.param .u64 pa, .param .u64 pb)
{{
  .reg .b32 %r<8>;
  .reg .b64 %rd<4>;
  .reg .pred %p<2>;
  ld.param.u64 %rd1, [pa];
  ld.param.u64 %rd2, [pb];
  mov.u32 %r1, 0;
  mov.u32 %r2, 0;
  mov.u32 %r4, 64;
  mov.u32 %r5, 96;
  setp.ne.u32 %p1, %r2, 0;
  mov.u32 %r3, 32;
  tcgen05.mma.cta_group::1.kind::{kind} [%r1], {a}, %rd2, %r2{scales}, %p1;
  ret;
}}
"""


@needs_plugin
@pytest.mark.parametrize("a", ["%rd1", "[%r3]"], ids=["a_in_shared", "a_in_tensor_memory"])
@pytest.mark.parametrize("kind,want", [
    ("f16", "UTCHMMA"), ("f8f6f4", "UTCQMMA"),
    ("mxf8f6f4.block_scale", "UTCQMMA block-scaled"),
    ("mxf4.block_scale", "UTCOMMA block-scaled"),
    ("mxf4nvf4.block_scale.scale_vec::4X", "UTCOMMA.4X block-scaled")])
def test_sass_names_each_tcgen05_kind(tmp_path, kind, want, a):
  """The known answer: ptxas's own translation of each tcgen05.mma kind, its A
  operand in shared memory (a descriptor) or in tensor memory."""
  ptxas = os.path.join(os.path.dirname(gpu_binary._nvdisasm()), "ptxas")
  scales = ", [%r4], [%r5]" if "block_scale" in kind else ""
  (tmp_path / "k.ptx").write_text(_TCGEN05_PTX.format(kind=kind, scales=scales, a=a))
  subprocess.run([ptxas, "-arch", "sm_100a", str(tmp_path / "k.ptx"), "-o",
                  str(tmp_path / "k.cubin")], check=True)
  assert gpu_binary.sass_mma((tmp_path / "k.cubin").read_bytes()) == {want: 1}


def test_gemms_name_the_kernel_and_operand_types():
  hlo = """
%fused_gemm (p0: f4e2m1fn[8,64], p1: f4e2m1fn[16,64], p2: f8e8m0fnu[8,2], p3: f8e8m0fnu[16,2]) -> f32[8,16] {
  %p0 = f4e2m1fn[8,64]{1,0} parameter(0)
  %p1 = f4e2m1fn[16,64]{1,0} parameter(1)
  %p2 = f8e8m0fnu[8,2]{1,0} parameter(2)
  %p3 = f8e8m0fnu[16,2]{1,0} parameter(3)
  ROOT %sd = f32[8,16]{1,0} scaled-dot(%p0, %p1, %p2, %p3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%loop (q0: f32[8,64], q1: f32[64,16]) -> f32[8,16] {
  %q0 = f32[8,64]{1,0} parameter(0)
  %q1 = f32[64,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f4e2m1fn[8,64], b: f4e2m1fn[16,64], c: f8e8m0fnu[8,2], e: f8e8m0fnu[16,2], x: f32[8,64], y: f32[64,16]) -> f32[8,16] {
  %a = f4e2m1fn[8,64]{1,0} parameter(0)
  %b = f4e2m1fn[16,64]{1,0} parameter(1)
  %c = f8e8m0fnu[8,2]{1,0} parameter(2)
  %e = f8e8m0fnu[16,2]{1,0} parameter(3)
  %x = f32[8,64]{1,0} parameter(4)
  %y = f32[64,16]{1,0} parameter(5)
  %fusion.1 = f32[8,16]{1,0} fusion(%a, %b, %c, %e), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %wrapped = f32[8,16]{1,0} fusion(%x, %y), kind=kLoop, calls=%loop
  ROOT %add = f32[8,16]{1,0} add(%fusion.1, %wrapped)
}
"""
  got = [(g["op"], g["operands"], g["shape"], g["k"], g["kernel"], g["kernel_kind"])
         for g in hlo_stats.gemms(hlo)]
  assert got == [("scaled-dot", ["f4e2m1fn", "f4e2m1fn"], [8, 16], 64, "fusion.1",
                  "__triton_nested_gemm_fusion"),
                 ("dot", ["f32", "f32"], [8, 16], 64, "wrapped", "kLoop")]


def test_a_mosaic_gpu_gemm_names_its_cubin_kernel():
  """A Mosaic GPU custom call is a GEMM when its module names an fp4jax kernel; its
  kernel is the cubin's (NAME_mosaic_gpu_kernel), found by the SASS reader."""
  hlo = r"""
ENTRY %main (a: f8e4m3fn[256,512], b: f8e5m2[384,512]) -> f32[256,384] {
  %a = f8e4m3fn[256,512]{1,0} parameter(0)
  %b = f8e5m2[384,512]{1,0} parameter(1)
  ROOT %mpmd_map.0 = f32[256,384]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", backend_config={module = "ML\EFR\00fp4jax_hopper_gemm_256x384x512\00\00fp4jax_hopper_gemm_256x384x512_mosaic_gpu\00"}
}
"""
  (g,) = hlo_stats.gemms(hlo)
  assert (g["operands"], g["shape"], g["kernel"], hlo_stats.gemm_kind(g)) == (
      ["f8e4m3fn", "f8e5m2"], [256, 384], "fp4jax_hopper_gemm_256x384x512_mosaic_gpu_kernel",
      "Mosaic GPU")
  assert g["k"] == 512  # a[M, K] -> out[M, N]
  assert hlo_stats.gemms(hlo.replace("fp4jax_", "other_")) == []  # not fp4jax's: not counted


_LOOP_HLO = """
%fused_dot (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %d = bf16[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (b: (s32[], bf16[8,16], bf16[2,4])) -> (s32[], bf16[8,16], bf16[2,4]) {
  %b = (s32[], bf16[8,16]{1,0}, bf16[2,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%b), index=1
  %w = bf16[2,4]{1,0} get-tuple-element(%b), index=2
  %g = bf16[16,4]{1,0} all-gather(%w), replica_groups={}, dimensions={0}
  %f = bf16[8,4]{1,0} fusion(%x, %g), kind=kLoop, calls=%fused_dot
  ROOT %t = (s32[], bf16[8,16]{1,0}, bf16[2,4]{1,0}) tuple(%i, %x, %w)
}

%cond (c: (s32[], bf16[8,16], bf16[2,4])) -> pred[] {
  %c = (s32[], bf16[8,16]{1,0}, bf16[2,4]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: (s32[], bf16[8,16], bf16[2,4])) -> (s32[], bf16[8,16], bf16[2,4]) {
  %a = (s32[], bf16[8,16]{1,0}, bf16[2,4]{1,0}) parameter(0)
  %r = bf16[2,4]{1,0} all-reduce(%a), replica_groups={}, to_apply=%cond
  ROOT %loop = (s32[], bf16[8,16]{1,0}, bf16[2,4]{1,0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
}
"""


def test_a_loop_body_runs_its_trip_count_times():
  """What gpu_fit counts per step: a while body's GEMMs and collectives once per iteration."""
  assert hlo_stats.executions(_LOOP_HLO) == {"main": 1, "cond": 1, "body": 32, "fused_dot": 32}
  (g,) = hlo_stats.gemms(_LOOP_HLO)
  assert (g["computation"], g["k"], g["kernel"]) == ("fused_dot", 16, "f")
  assert gpu_shards.collectives(_LOOP_HLO) == {"all-gather": (1, 128), "all-reduce": (1, 16)}
  assert gpu_shards.collectives(_LOOP_HLO, per_run=True) == {"all-gather": (32, 32 * 128),
                                                               "all-reduce": (1, 16)}
  unknown = _LOOP_HLO.replace('"n":"32"', '"n":"x"')  # no trip count XLA knows: once
  assert hlo_stats.executions(unknown)["body"] == 1


def test_snappy_decodes_literals_and_overlapping_copies():
  # 11 bytes: the literal "hello", then a copy of 6 bytes from 5 back (it overlaps itself).
  stream = bytes([11, (5 - 1) << 2]) + b"hello" + bytes([((6 - 4) << 2) | 1, 5])
  assert gpu_binary._snappy(stream, 0) == b"hellohelloh"
  assert gpu_binary._snappy(bytes([11, 0x09, 5]), 0) is None  # a copy before any output


def test_differences_name_what_changed():
  gemm = dict(kind="dot bf16", kernel_kind="kLoop", op="dot", operands=["bf16", "bf16"],
              mma={"HMMA": 8})
  row = dict(program="linear", recipe="mxfp4", backend="native", compiled=True, error=None,
             gemms=[gemm])
  report = dict(rows=[row])
  assert gpu_compile.differences(report, report) == []
  other = dict(rows=[dict(row, gemms=[dict(gemm, mma={"UTCOMMA": 6})])])
  (line,) = gpu_compile.differences(report, other)
  assert "HMMA" in line and "UTCOMMA" in line


def test_a_report_without_kernel_binaries_says_so(monkeypatch):
  """jax 0.11.2's executables hold no kernel binaries: the row names that instead of
  leaving its SASS empty."""
  monkeypatch.setattr(gpu_binary, "cubins", lambda compiled: [])
  row = gpu_compile.Row("linear", "mxfp4", "native", compiled=True)
  gpu_compile._add_sass(row, compiled=None)
  assert row.sass_error.startswith("no kernel binaries in jax ")
  assert "SASS not read: no kernel binaries" in gpu_compile.markdown([row])


# The command line's arguments, checked before anything needs the CUDA plugin.


def _compile_refused(capsys, *argv):
  """gpu_compile's one line on stderr and exit status 2 for argv."""
  return exit_2_line(capsys, gpu_compile.main, argv)


@pytest.mark.parametrize("arms, names", [
    ("mxfp4:native:bogus", ("arm 'mxfp4:native:bogus': unknown native route 'bogus'; "
                            "allowed: scaled_matmul, scaled_dot",)),
    ("mxfp4", ("arm 'mxfp4': want RECIPE:BACKEND or RECIPE:native:ROUTE",)),
    ("mxfp4:native:scaled_dot:x", ("want RECIPE:BACKEND or RECIPE:native:ROUTE",)),
    ("mxfp4:pallas:scaled_dot", ("a route ('scaled_dot') is for the native backend only",)),
    ("nope:xla", ("unknown recipe 'nope'; allowed: bf16, ",)),
    ("mxfp4:cuda", ("unknown backend 'cuda'; allowed: xla, pallas, native, mosaic",)),
    ("bf16:xla,mxfp4:xla,bf16:xla", ("arm 'bf16:xla': named twice",)),
    (",", ("no arm in ','",)),
], ids=["route", "no_backend", "too_many", "route_off_native", "recipe", "backend", "twice",
        "empty"])
def test_arms_name_the_part_that_is_wrong(capsys, arms, names):
  line = _compile_refused(capsys, "--target", "b200", "--arms", arms)
  assert line.startswith("python -m fp4jax.bench gpu_compile: error: argument --arms: "), line
  for name in names:
    assert name in line, (name, line)


def test_arms_and_programs_are_checked_against_the_target_before_compiling(capsys):
  """mosaic (CAPABILITY_MAJOR 9) is refused for the B200 description (10.0), read
  from its file, without the CUDA plugin; `auto` has no device to pick by."""
  assert gpu_compile.target_capability("b200") == (10, 0)
  assert gpu_compile.target_capability("h200") == (9, 0)
  line = _compile_refused(capsys, "--target", "b200", "--arms", "bf16:xla,mxfp4:mosaic")
  assert line == ("gpu_compile: --arms: arm 'mxfp4:mosaic': mosaic is for compute "
                  "capability 9.x only (Hopper); target b200 is 10.0"), line
  line = _compile_refused(capsys, "--target", "h200", "--arms", "mxfp4:auto")
  assert "arm 'mxfp4:auto': backend auto picks by this process's device" in line, line
  gpu_compile.check_arms((("mxfp4", "xla", None),), (10, 0), "b200")
  line = _compile_refused(capsys, "--target", "b200", "--what", "linear,kernels,linear")
  assert "argument --what: program 'linear' is named twice" in line, line


def test_an_against_file_that_is_not_a_report_is_refused_before_compiling(capsys, tmp_path):
  path = tmp_path / "other.json"
  path.write_text('{"rows": [{"program": "linear"}], "device": "x", "versions": {}}')
  line = _compile_refused(capsys, "--target", "b200", "--against", str(path))
  assert line.startswith(f"gpu_compile: --against {str(path)!r}: not a gpu_compile report: "
                         "rows[0] must be an object with the fields program, "), line


# --- the kernel backends on 8 GPUs: each device quantizes and multiplies its shard -----------


@pytest.fixture(scope="module")
def h200x8():
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  return gpu_compile.abstract_devices("h200", 8)


def assert_no_kernel_sees_the_global_batch(row):
  """Every Triton / Mosaic GPU kernel and every GEMM of a gpu_shards row reads one
  device's tokens (no operand, output or contraction of all of them)."""
  assert row["kernels"] or row["gemms"], row
  assert not row["global_batch"], (
      f"{row['recipe']} {row['backend']}: kernels or GEMMs on all {gpu_shards.TOKENS} tokens: "
      f"{row['global_batch']}")


@needs_plugin
@pytest.mark.parametrize("backend", ["xla", "pallas", "mosaic"])
def test_a_sharded_dense_layer_runs_its_kernels_on_each_devices_tokens(h200x8, backend):
  """The Dense layer, 3,072 tokens over 8 H200s (fp4jax.bench.gpu_shards): each quantize
  kernel, Mosaic GPU GEMM and XLA GEMM reads 384 tokens, nothing is all-gathered, and
  the one all-reduce is Wgrad's sum over the devices' tokens (for the kernel backends,
  bf16's one all-reduce in float32). xla (XLA partitions its jnp program) is the control."""
  row = gpu_shards.row(h200x8, "mxfp4", backend, per_shard=True)
  assert_no_kernel_sees_the_global_batch(row)
  local = gpu_shards.TOKENS // 8
  assert any(local in gpu_shards.dims(k) for k in row["kernels"]) or backend == "xla", row
  if backend == "mosaic":
    assert sum(k.startswith("mosaic") for k in row["kernels"]) == 3, row
  assert set(row["collectives"]) == {"all-reduce"}, row["collectives"]
  count, nbytes = row["collectives"]["all-reduce"]
  if backend in ("pallas", "mosaic"):  # dW [K, N] in float32: the devices' partial Wgrads, summed
    assert (count, nbytes) == (1, gpu_shards.K * gpu_shards.N * 4), row
  else:
    assert count == 1 and nbytes in (gpu_shards.K * gpu_shards.N * 2,
                                     gpu_shards.K * gpu_shards.N * 4), row


@needs_plugin
def test_native_mxfp4_does_not_compile_on_8_gpus_yet(h200x8):
  """As found with jax 0.12.1: XLA cannot compile a scaled-dot in a program of several
  devices (its MHLO round trip has no such op: "failed to legalize operation
  'mhlo.unknown'", inside a shard_map too), so the native backend's MXFP4 GEMMs, which
  compile for one GPU, do not for 8. When this fails, native compiles sharded: give it
  the check above."""
  with pytest.raises(Exception, match="Unable to convert MHLO to StableHLO"):
    gpu_shards.row(h200x8, "mxfp4", "native", per_shard=True)


@needs_plugin
def test_under_fsdp_mosaic_gathers_the_weight_and_reduce_scatters_its_gradient(h200x8):
  """The layer on mesh 1x8x1 (w's K split over fsdp): as bf16, one all-gather of the
  bf16 weight and one reduce-scatter of dW (here in float32), and the kernels read
  one device's tokens."""
  row = gpu_shards.row(h200x8, "mxfp4", "mosaic", per_shard=True, mesh_sizes=(1, 8, 1))
  assert_no_kernel_sees_the_global_batch(row)
  k, n = gpu_shards.K, gpu_shards.N
  assert row["collectives"] == {"all-gather": (1, k * n * 2),
                                "reduce-scatter": (1, k // 8 * n * 4)}, row["collectives"]


@needs_plugin
def test_the_check_fails_on_the_layer_without_its_operands_specs(h200x8):
  """The planted bug: without specs (the layer before fp4jax.shard_local) the pallas
  backend's kernels quantize all 3,072 tokens on every device, after an all-gather."""
  row = gpu_shards.row(h200x8, "mxfp4", "pallas", per_shard=False)
  with pytest.raises(AssertionError, match="kernels or GEMMs on all 3072 tokens"):
    assert_no_kernel_sees_the_global_batch(row)
  assert row["collectives"]["all-gather"][0] >= 1


# --- gpu_fit: a config's whole train step on 8 GPUs, compiled without them ---------------------

# The tiny Llama (8 x 128 tokens: 256 per batch shard), mxfp4-dh16 on pallas, 8 H200s.
TINY_FIT = ("--target", "h200", "--devices", "8", "--config", "configs/default.py",
            "--config.quant.name=mxfp4-dh16", "--config.quant.backend=pallas",
            "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")


@pytest.fixture
def fresh_step():
  """The train step traced anew (make_programs and jit cache it) before and after."""
  def clear():
    train_step._programs.cache_clear()
    jax.clear_caches()
  clear()
  yield
  clear()


@needs_plugin
def test_gpu_fit_says_the_tiny_step_fits_with_its_figures(tmp_path, fresh_step):
  out = tmp_path / "fit.json"
  rc, text = main_in_process(gpu_fit.main, TINY_FIT + ("--out", str(out)))
  assert rc == 0, text
  report = json.loads(out.read_text())
  assert text.strip().splitlines()[-1] == report["verdict"]
  assert report["verdict"].startswith("configs/default.py (mxfp4-dh16 on pallas, mesh 2x2x2, "
                                      "micro_batch 8): FITS 8 x NVIDIA H200: "), report["verdict"]
  mem = report["memory"]
  assert mem["total"] == mem["arguments"] + mem["outputs"] + mem["temporaries"] - mem["aliased"]
  assert 0 < mem["total"] < report["device_memory"] == 141 * 2**30
  assert report["tokens_per_device"] == 256
  triton = [k for k in report["kernels"] if k["kind"] == "triton"]
  assert triton and not any(k["whole_batch"] for k in report["kernels"]), report["kernels"]
  # Each scanned block's GEMMs counted once per block: the compiled GEMMs (with their
  # Hadamard rotations) are the model's 6N + attention FLOPs.
  assert abs(report["gemm_flops"] / report["model_flops"] - 1) < 0.05, report
  assert {"all-gather", "all-reduce", "reduce-scatter"} <= set(report["collectives"])
  # The same figures against a GPU with a MiB less than the step needs.
  small = dict(report, device_memory=mem["total"] - 2**20)
  assert gpu_fit.verdict(small).endswith(
      f"DOES NOT FIT 8 x NVIDIA H200: {mem['total'] / 2**20:.1f} MiB per device, 1.0 MiB over "
      f"the {(mem['total'] - 2**20) / 2**20:.1f} MiB each has"), gpu_fit.verdict(small)


@needs_plugin
def test_gpu_fit_flags_kernels_on_the_whole_micro_batch(monkeypatch, fresh_step):
  """The planted bug: without the mesh (as before fp4jax.shard_local) the pallas kernels
  quantize all 8 x 128 tokens on every device; the verdict names it, exit status 1."""
  monkeypatch.setattr(shard_local, "active_mesh", lambda: None)
  rc, text = main_in_process(gpu_fit.main, TINY_FIT)
  assert rc == 1, text
  assert "WHOLE MICRO-BATCH" in text
  assert text.strip().splitlines()[-1].endswith(
      "kernel calls read or write the whole micro-batch (1,024 tokens) on every device"), text


@pytest.mark.parametrize("target, extra, names", [
    ("a100", (), ("argument --target: invalid choice: 'a100'",)),
    ("h200", ("--hosts", "3"), ("gpu_fit: --devices 8 is not divisible by --hosts 3",)),
    ("h200", ("--config.mesh.data=4",),
     ("mesh data=4, fsdp=1, tensor=1 needs 4 devices, but 8 are",)),
    ("h200", ("--config.quant.name=mxfp4", "--config.mesh.data=1", "--config.mesh.fsdp=8"),
     ("layer blocks/attn/q: fprop", "local size 16", "MX block 32")),
    ("h200", ("--config.micro_batch=4", "--config.batch_size=4"),
     ("micro_batch 4 (config.micro_batch; 0 = batch_size) is not divisible by the 8 batch",)),
    ("h200", ("--config.mesh.dta=2",), ("unknown config key --config.mesh.dta (did you mean",)),
    ("b200", ("--config.quant.backend=mosaic",),
     ("mosaic is for compute capability 9.x only (Hopper); target b200 is 10.0",)),
    ("h200", ("--config.quant.name", "mxfp4"),
     ("unrecognized arguments: --config.quant.name mxfp4",)),
], ids=["target", "hosts", "mesh", "block", "micro_batch", "key", "mosaic_on_b200", "no_equals"])
def test_gpu_fit_refuses_bad_input_in_one_line(capsys, target, extra, names):
  """Checked before anything compiles (and before the CUDA plugin is needed)."""
  argv = ["--target", target, "--config", "configs/default.py", *extra]
  line = exit_2_line(capsys, gpu_fit.main, argv)
  for name in names:
    assert name in line, (name, line)
