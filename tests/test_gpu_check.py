"""The Python side of benchmarks/gpu_check.sh at tiny sizes on the CPU.

The script runs on a GPU only in sessions lent one; these tests keep every
stage's code working in between: kernel counts of an HLO text, the bit
comparison of the crosscheck, the training-throughput arithmetic and the
summary's goals, plus the env stage, a tiny linear and a crosscheck round
trip through the saved reference file.
"""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import backends
from fp4jax.bench import crosscheck, gpu_check, gpu_compile, gpu_plan, gpu_summary, hlo_stats
from fp4jax.bench import train_speed
from fp4jax.bench import kernels as bench_kernels
from fp4jax.train import cli
from tests.helpers import exit_2_line, jaxpr_equations

_HLO = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %neg = f32[8]{0} negate(%param_0)
  ROOT %exp = f32[8]{0} exponential(%neg)
}

%command_buffer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %f1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  ROOT %g = f32[8]{0} custom-call(%f1), custom_call_target="__cublas$gemm"
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %c = f32[] constant(1)
  %f0 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %t = (f32[8]{0}, f32[]) tuple(%f0, %c)
  %g0 = f32[8]{0} get-tuple-element(%t), index=0
  ROOT %cb = f32[8]{0} call(%g0), to_apply=%command_buffer
}
"""


def test_kernel_counts_follow_calls_and_skip_fused_and_bookkeeping():
  assert hlo_stats.kernel_counts(_HLO) == {"fusion": 2, "custom-call": 1}
  assert not hlo_stats.kernel_counts("no module here")


def test_compare_counts_differing_elements_per_row_class():
  x, row_class = crosscheck.inputs(rows_per_class=2, n=64)
  assert x.shape == (2 * len(crosscheck.CLASSES), 64)
  nan_row = list(row_class).index(crosscheck.CLASSES.index("nan"))
  assert np.isnan(x[nan_row]).sum() == 1
  sub = x[row_class == crosscheck.CLASSES.index("f32 subnormal")]
  assert (np.abs(sub[sub != 0]) < np.finfo(np.float32).tiny).all()

  assert crosscheck.compare(x, x.copy(), row_class)["mismatched"] == 0
  other = x.copy()
  other[nan_row, 3] = np.nextafter(other[nan_row, 3], np.float32(np.inf))
  got = crosscheck.compare(other, x, row_class)
  assert got["mismatched"] == 1 and got["by_class"] == {"nan": 1}
  payload = x.copy()
  where = np.isnan(payload)
  payload.view(np.uint32)[where] ^= 1  # another NaN payload: not a mismatch
  got = crosscheck.compare(payload, x, row_class)
  assert got["mismatched"] == 0 and got["nan_payload"] == where.sum() == 2
  codes = np.arange(16, dtype=np.uint8)
  assert crosscheck.compare(codes, codes[::-1].copy())["mismatched"] == 16
  assert "error" in crosscheck.compare(codes, codes[:8])


def test_crosscheck_round_trip_through_the_reference_file(tmp_path, monkeypatch):
  all_cases = crosscheck.quantize_cases()
  keep = ["quantize floor bfloat16 axis 0", "fake_quantize H16 float32 axis -1"]
  monkeypatch.setattr(crosscheck, "quantize_cases", lambda: {k: all_cases[k] for k in keep})
  monkeypatch.setattr(crosscheck, "dot_cases", lambda: {})
  ref = str(tmp_path / "ref.npz")
  crosscheck.save_reference(ref, 1, 64, (32, 32, 32))
  rows = crosscheck.check(ref, 1, 64, (32, 32, 32))
  assert [r["case"] for r in rows] == keep
  for r in rows:
    for label in ("pallas vs xla", "xla vs reference", "pallas vs reference"):
      assert r[label]["mismatched"] == 0 and r[label]["elements"] > 0, (r["case"], label)
  assert "| quantize floor bfloat16 axis 0 | 0 / " in crosscheck.markdown(rows, "cpu")


def test_gemm_kinds_tell_block_scaled_from_plain_dots():
  hlo = """ENTRY %main () -> f32[] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %r = f32[64,16]{1,0} parameter(1)
  %a = f32[64,96]{1,0} custom-call(%x, %y, %s, %t), custom_call_target="__cudnn$blockScaledDot"
  %b = f32[64,96]{1,0} scaled-dot(%x, %y, %s, %t), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %c = f32[64,96]{1,0} custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8"
  %d = f32[64,96]{1,0} dot(%p0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %e = f32[64,16]{1,0} dot(%r, %h), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
  kinds = hlo_stats.gemm_kinds(hlo)
  assert kinds == {"block-scaled (cuDNN)": 1, "block-scaled (scaled-dot)": 1, "cuBLAS": 1,
                   "dot bf16": 1, "rotation": 1}
  assert hlo_stats.gemm_summary(kinds).startswith("block-scaled (cuDNN) 1, block-scaled (")


def test_gemms_read_an_h200s_compiled_hlo():
  """Lines as an H200 compiled them (jax 0.11.2): cuBLAS's tuple-shaped (result,
  workspace) custom call, and a Triton GEMM fusion whose tile configuration comes
  before its kind."""
  config = ('backend_config={"fusion_backend_config":{"block_level_fusion_config":'
            '{"num_warps":"8","output_tiles":[{"sizes":["128","256"]}]},'
            '"kind":"__triton_nested_gemm_fusion"},"operation_queue_id":"0"}')
  hlo = f"""%gemm_computation (p0: bf16[64,128], p1: bf16[128,96]) -> bf16[64,96] {{
  %p0 = bf16[64,128]{{1,0}} parameter(0)
  %p1 = bf16[128,96]{{1,0}} parameter(1)
  ROOT %d = bf16[64,96]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (x: bf16[64,128], w: bf16[128,96], u: f32[64,128], v: f32[128,96]) -> bf16[64,96] {{
  %x = bf16[64,128]{{1,0}} parameter(0)
  %w = bf16[128,96]{{1,0}} parameter(1)
  %u = f32[64,128]{{1,0}} parameter(2)
  %v = f32[128,96]{{1,0}} parameter(3)
  %custom-call.1 = (f32[64,96]{{1,0}}, s8[33554432]{{0}}) custom-call(%u, %v), custom_call_target="__cublas$lt$matmul"
  ROOT %gemm_fusion = bf16[64,96]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%gemm_computation, {config}
}}
"""
  got = [(g["op"], g["operands"], g["shape"], g["kernel"], g["kernel_kind"])
         for g in hlo_stats.gemms(hlo)]
  assert got == [("dot", ["bf16", "bf16"], [64, 96], "gemm_fusion", "__triton_nested_gemm_fusion"),
                 ("custom-call", ["f32", "f32"], [64, 96], "custom-call.1", "__cublas$lt$matmul")]
  assert hlo_stats.gemm_kinds(hlo) == {"dot bf16": 1, "cuBLAS f32": 1}


def test_native_stage_reports_gemm_kinds_and_the_missing_fp4_units(tmp_path):
  result, md = gpu_check.native_stage(True, str(tmp_path))
  if backends.jax_version() < backends.MIN_JAX["native"]:
    assert "needs jax >= 0.11" in result["skipped"] and md.startswith("skipped: ")
    return
  assert not result["fp4_units"] and "platform is 'cpu'" in md and "the emulation" in md
  rows = {r["name"]: r for r in result["tables"][0]["rows"]}
  assert set(rows) == set(bench_kernels.BASELINES) | {f"{n} ({b})" for n in gpu_check.NATIVE_RECIPES
                                            for b in gpu_check.NATIVE_BACKENDS}
  assert all("dot " in r["gemms"] and r["TFLOP/s"] > 0 for r in rows.values())  # the CPU: plain dots


def test_dependencies_come_from_pyproject():
  names = gpu_check.dependencies()
  assert {"jax", "grain", "ml-collections", "hypothesis", "tensorboardX"} <= set(names)
  versions = gpu_check.package_versions(["numpy", "surely-not-a-package"])
  assert versions["numpy"] and versions["surely-not-a-package"] is None


def test_env_and_tiny_linear_stages(tmp_path):
  env, md = gpu_check.env_stage(True, str(tmp_path))
  assert env["backend"] == "cpu" and env["pallas_interprets"] is True
  assert "| grain |" in md
  rows = bench_kernels.linear_rows((64, 64, 32), ["mxfp4"], ["pallas"], 1,
                                   hlo_dir=str(tmp_path))
  by_name = {r["name"]: r for r in rows}
  assert set(by_name) == set(bench_kernels.BASELINES) | {"mxfp4 (pallas)"}
  assert by_name[bench_kernels.BASELINE]["vs_bf16"] == 1.0
  for r in rows:
    assert r["ms"] > 0 and r["kernels"] >= 1
    assert math.isclose(r["TFLOP/s"], 6 * 64 * 64 * 32 / (r["ms"] * 1e-3) / 1e12)
  assert len(os.listdir(tmp_path)) == 3  # one HLO text per variant
  table = bench_kernels.markdown(rows, bench_kernels.LINEAR_COLUMNS, "layer")
  assert table.count("\n") == 4 and "| mxfp4 (pallas) |" in table


def test_the_bf16_baselines_keep_every_gemm_on_bf16_operands():
  """The layer's forward and backward GEMMs all read bf16, as in a bf16 model (a
  float32-output lax.dot_general would run the backward on float32 operands)."""
  x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((32, 16), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  variants = bench_kernels.linear_variants([], [])
  assert set(variants) == set(bench_kernels.BASELINES)
  for name, fn in variants.items():
    jaxpr = jax.make_jaxpr(fn)(x, w, dy)
    dots = [e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3, name
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), name



def _write(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f)


def test_summary_checks_each_goal(tmp_path):
  w = str(tmp_path)
  with open(os.path.join(w, "stages.tsv"), "w") as f:
    f.write("env\t0\t5\t60\nlinear\t124 (timed out)\t150\t150\n")
  _write(os.path.join(w, "quantize.json"), {"rows": [
      {"name": "negate (copy)", "copy_fraction": 1.0},
      {"name": "pallas quantize row", "copy_fraction": 0.8},
      {"name": "pallas quantize col +H16", "copy_fraction": 0.5},
      {"name": "pallas quantize col", "error": "XlaRuntimeError: boom"}]})
  _write(os.path.join(w, "linear.json"), {"tables": [{"shape": [16384, 4096, 14336], "rows": [
      {"name": "mxfp4-dh16 (xla)", "vs_bf16": 2.0},
      {"name": "mxfp4-dh16 (pallas)", "vs_bf16": 1.2}]}]})
  for recipe, backend, tps in (("bf16", "xla", 1000.0), ("mxfp4-dh16", "pallas", 800.0)):
    _write(os.path.join(w, f"train_{recipe}_{backend}.json"), dict(
        recipe=recipe, backend=backend, tokens_per_s=tps, step_s=1.0, mfu=0.3,
        peak_gib=10.0, final_loss=5.0))
  _write(os.path.join(w, "crosscheck.json"), {"rows": [
      {"case": "a", "pallas vs xla": {"mismatched": 3, "elements": 10}},
      {"case": "b", "pallas vs xla": {"error": "failed"}}]})
  _write(os.path.join(w, "env.json"), {"backend": "gpu", "pallas_interprets": True})
  with open(os.path.join(w, "pytest.xml"), "w") as f:
    f.write('<testsuites><testsuite tests="9" failures="1" errors="0" skipped="2">'
            '</testsuite></testsuites>')
  result, md = gpu_summary.summarize(w)
  met = {g["goal"].split(":")[0]: (g["value"], g["met"]) for g in result["goals"]}
  result = {**result, "goals": gpu_summary.goals(w, ["xla", "pallas"])}
  assert met["pallas quantize row"] == (0.8, True)
  assert met["pallas quantize col +H16"] == (0.5, False)
  assert met["pallas quantize col"] == (None, None)
  assert met["linear mxfp4-dh16 (xla) at [16384, 4096, 14336]"] == (2.0, False)
  assert met["linear mxfp4-dh16 (pallas) at [16384, 4096, 14336]"] == (1.2, True)
  assert met["train step mxfp4-dh16 (pallas)"] == (pytest.approx(1.25), True)
  assert met["pallas vs xla, same device"] == (4, False)
  assert met["GPU tests failed or errored"] == (1, False)
  assert met["Pallas interprets on the GPU (1 = yes"] == (1, False)
  assert result["tests"] == {"tests": 9, "failures": 1, "errors": 0, "skipped": 2}
  assert "| linear | 124 (timed out) | 150 | 150 |" in md
  with open(os.path.join(w, "pytest.xml"), "w") as f:  # a tests stage that ran nothing
    f.write('<testsuites><testsuite tests="2" failures="0" errors="0" skipped="2">'
            '</testsuite></testsuites>')
  met = {g["goal"]: (g["value"], g["met"]) for g in gpu_summary.goals(w)}
  assert met["GPU tests failed or errored"] == (None, None)


def test_summary_says_why_each_goal_went_unmeasured_in_the_checks_order(tmp_path):
  """Correctness, the layer, the train step, the quantize kernels: a goal whose stage
  timed out, ran out of budget or was not planned names that stage and how it ended."""
  w = str(tmp_path)
  with open(os.path.join(w, "plan.tsv"), "w") as f:
    f.write("env\t20\ncrosscheck\t60\nlinear\t70\ntrain_bf16_xla\t50\n"
            "train_mxfp4-dh16_mosaic\t65\ntests\t45\n")
  with open(os.path.join(w, "stages.tsv"), "w") as f:
    f.write("env\t0\t3\t20\ncrosscheck\t0\t40\t60\nlinear\t124 (timed out)\t70\t70\n"
            "train_bf16_xla\t0\t40\t50\ntrain_mxfp4-dh16_mosaic\t137 (timed out)\t75\t65\n"
            "tests\tnot run\t0\tbudget spent\n")
  _write(os.path.join(w, "train_bf16_xla.json"), dict(recipe="bf16", backend="xla",
                                                      tokens_per_s=1000.0))
  _write(os.path.join(w, "crosscheck.json"), {"rows": [
      {"case": "a", "pallas vs xla": {"mismatched": 0, "elements": 10}}]})
  got = gpu_summary.goals(w, ["xla", "pallas", "mosaic"])
  names = [g["goal"] for g in got]
  order = ["GPU tests", "pallas vs xla", "Pallas interprets", "linear mxfp4-dh16 (xla)",
           "linear mxfp4-dh16 (pallas)", "linear fp8 (mosaic)", "linear mxfp4 (mosaic)",
           "linear mxfp4-dh16 (mosaic)", "train step mxfp4-dh16 (mosaic)",
           "pallas quantize row"]
  assert [next(i for i, n in enumerate(names) if n.startswith(o)) for o in order] == sorted(
      next(i for i, n in enumerate(names) if n.startswith(o)) for o in order)
  why = {g["goal"].split(":")[0]: g["why"] for g in got}
  limit = {g["goal"].split(":")[0]: g["limit"] for g in got}
  assert why["GPU tests failed or errored"] == "stage tests not run: budget spent"
  assert why["pallas vs xla, same device"] is None
  assert why["Pallas interprets on the GPU (1 = yes"] == (
      "stage env ended (0) without this number: see its log")
  assert why["linear mxfp4 (mosaic) at the 8B MLP shape"] == (
      "stage linear exited 124 (timed out) after 70 s of its 70 s box")
  assert limit["linear fp8 (mosaic) at the 8B MLP shape"] == 0.7
  assert why["train step mxfp4-dh16 (mosaic)"] == (
      "stage train_mxfp4-dh16_mosaic exited 137 (timed out) after 75 s of its 65 s box")
  assert limit["train step mxfp4-dh16 (mosaic)"] == 1.0
  assert why["pallas quantize row"] == "stage quantize is not in this call's plan"
  _, md = gpu_summary.summarize(w)
  assert "| pallas quantize col: fraction of copy bandwidth | not measured: stage quantize" in md


def test_summary_of_an_empty_work_dir(tmp_path):
  result, md = gpu_summary.summarize(str(tmp_path))
  assert result["stages"] == [] and "# fp4jax GPU check" in md
  assert all(g["value"] is None and g["why"].endswith("is not in this call's plan")
             for g in result["goals"])


def test_the_plan_fits_the_budget_in_priority_order():
  """env, crosscheck, linear, the train arms, tests, quantize; native and compile only
  with block-scaled FP4 units; over the budget, train arms go from the last."""
  three = ["xla", "pallas", "mosaic"]
  stages, left = gpu_plan.plan(9.0, backend_names=three)
  names = [n for n, _ in stages]
  assert names[:3] == ["env", "crosscheck", "linear"] and names[-2:] == ["tests", "quantize"]
  arms = names[3:-2]
  assert arms == ["train_bf16_xla", "train_mxfp4-dh16_mosaic", "train_fp8_mosaic"]
  assert "train_fp8_pallas" not in arms and any("train_fp8_pallas: the same program" in l
                                                for l in left)
  assert sum(box for _, box in stages) <= gpu_plan.BUDGET_S
  lines = gpu_plan.describe(stages, left, gpu_plan.BUDGET_S)
  assert lines[len(stages)].endswith("s of the 500 s budget: fits")
  two, _ = gpu_plan.plan(9.0, backend_names=["xla", "pallas"])
  assert [n for n, _ in two if n.startswith("train_")] == [
      "train_bf16_xla", "train_mxfp4-dh16_pallas", "train_mxfp4-dh16_xla", "train_fp8_xla"]
  blackwell, left = gpu_plan.plan(10.0, backend_names=three)
  assert [n for n, _ in blackwell][-2:] == ["native", "compile"]
  assert sum(box for _, box in blackwell) <= gpu_plan.BUDGET_S
  assert ('train_fp8_xla: over the 500 s budget (a call with GPU_CHECK_STAGES="env train" '
          'runs it)') in left
  alone, _ = gpu_plan.plan(9.0, ("env", "train"), backend_names=three)
  assert len(alone) == 1 + 6 and sum(box for _, box in alone) <= gpu_plan.BUDGET_S
  assert gpu_check.QUANTIZE_SIZE ** 2 * 2 >= 2 ** 30  # bf16 bytes


def _plan_refused(capsys, *argv):
  """gpu_plan's one line on stderr and exit status 2 for argv."""
  return exit_2_line(capsys, gpu_plan.main, argv)


@pytest.mark.parametrize("argv, names", [
    (("--cc", "nan"), ("'nan' is not a compute capability", "MAJOR.MINOR")),
    (("--cc", "inf"), ("'inf' is not a compute capability",)),
    (("--cc", "-9.0"), ("'-9.0' is not a compute capability",)),
    (("--cc", "0"), ("'0' is not a compute capability",)),
    (("--budget", "-100"), ("argument --budget: '-100': want a positive",)),
    (("--budget", "0"), ("argument --budget: '0'",)),
    (("--stages", ""), ("--stages '': no stage named; want at least one of env, ",)),
    (("--stages", " , "), ("no stage named",)),
    (("--stages", "env,linear,env"), ("--stages 'env,linear,env': stage 'env' is named "
                                      "twice; each stage runs once",)),
    (("--stages", "env nope"), ("unknown stage 'nope'; allowed: env, crosscheck",)),
], ids=["cc_nan", "cc_inf", "cc_negative", "cc_zero", "budget_negative", "budget_zero",
        "stages_empty", "stages_blank", "stages_twice", "stages_unknown"])
def test_the_plan_refuses_what_cannot_be_planned(capsys, argv, names):
  line = _plan_refused(capsys, *argv)
  assert line.startswith(("gpu_plan: --stages ", "python -m fp4jax.bench gpu_plan: error: "))
  for name in names:
    assert name in line, (name, line)


def test_the_plan_leaves_native_out_on_a_jax_that_cannot_run_it(monkeypatch, capsys):
  """Compute capability 10 on jax < 0.11 (fp4jax.backends.MIN_JAX): the native
  stage is left out with the backend's own reason, the compile stage kept."""
  monkeypatch.setattr(backends, "jax_version", lambda: (0, 10, 2))
  stages, left = gpu_plan.plan(10.0)
  names = [n for n, _ in stages]
  assert "native" not in names and "compile" in names, names
  assert any(l.startswith("native: backend 'native' needs jax >= 0.11") for l in left), left
  assert not any(l.startswith("backend native") for l in left), left
  gpu_plan.main(["--cc", "10.0", "--stages", "env,native"])
  out = capsys.readouterr()
  assert out.out == "env\t20\n" and "left out: native: backend 'native' needs jax" in out.err
  monkeypatch.setattr(backends, "jax_version", lambda: (0, 11, 2))
  assert "native" in [n for n, _ in gpu_plan.plan(10.0)[0]]


def test_the_script_prints_its_plan_and_refuses_unknown_arguments():
  env = dict(os.environ, PYTHON=sys.executable)
  done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--plan"], env=env,
                        capture_output=True, text=True, check=False, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "sum of the boxes" in done.stderr and "budget: fits" in done.stderr
  assert "train_bf16_xla" in done.stderr
  done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--nope"], env=env,
                        capture_output=True, text=True, check=False, timeout=120)
  assert done.returncode == 2 and done.stderr.strip() == (
      "gpu_check: unknown argument --nope (allowed: --dry-run, --plan)")


def test_compile_arms_are_recipe_backend_pairs():
  assert gpu_compile._arms("bf16:xla,mxfp4:native:scaled_matmul") == (
      ("bf16", "xla", None), ("mxfp4", "native", "scaled_matmul"))
  with pytest.raises(Exception, match="arm 'bf16:nope': unknown backend 'nope'; allowed: "):
    gpu_compile._arms("bf16:nope")
  assert gpu_compile.STEP_CONFIGS["step-125m-scanned"] == ("configs/ablation_gpu.py", True)


def test_train_config_is_trimmed():
  cfg = train_speed.run_config(cli.load_config_file("configs/ablation_gpu.py"),
                               "mxfp4-dh16", "pallas", 5, tiny=True)
  assert "ablation" not in cfg and "diagnostics" not in cfg
  assert (cfg.steps, cfg.eval_every, cfg.checkpoint_every, cfg.eval_batches) == (5, 5, 5, 1)
  assert (cfg.quant.name, cfg.quant.backend, cfg.model.name) == ("mxfp4-dh16", "pallas", "tiny")
  full = train_speed.run_config(cli.load_config_file("configs/ablation_gpu.py"),
                                "bf16", "xla", 20)
  assert (full.model.name, full.batch_size, full.seq_len) == ("llama-125m", 32, 1024)
  assert full.model.scan_layers is False
  scanned = train_speed.run_config(cli.load_config_file("configs/ablation_gpu.py"),
                                   "bf16", "xla", 3, tiny=True, scan_layers=True)
  assert scanned.model.scan_layers is True  # the dry run's tiny model scans too


def test_a_python_that_cannot_import_jax_stops_the_check_with_exit_2(tmp_path):
  """Before any stage runs (the stages would each fail and the check exit 0)."""
  env = dict(os.environ, DRY_RUN="1", PYTHON=str(tmp_path / "nope" / "python"),
             OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"))
  done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], env=env, capture_output=True,
                        text=True, check=False)
  assert done.returncode == 2, done.stdout + done.stderr
  assert done.stderr.count("\n") == 1 and "cannot import jax" in done.stderr, done.stderr


def test_the_paths_and_tests_the_script_names_exist():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "benchmarks", "gpu_check.sh"), encoding="utf-8") as f:
    script = f.read()
  copied = re.findall(r'"\$REPO/([^"]+)"', script)
  assert "fp4jax" in copied and "tests" in copied
  assert [p for p in copied if not os.path.exists(os.path.join(root, p))] == []
  named = re.findall(r"(tests/\w+\.py)::(\w+)", script)
  assert len(named) >= 3
  for path, test in named:
    with open(os.path.join(root, path), encoding="utf-8") as f:
      assert f"def {test}(" in f.read(), f"{path}::{test}"
