"""E5's reading on synthetic runs with planted costs: the horizon contrast tells a
data-efficiency cost (a token multiplier, the same at every horizon) from a
parameter-efficiency cost (a loss offset, more tokens where fp8's curve is flatter).

The declaration is E5's own (results/stage_cumulative/DECLARATION.json), copied
into each synthetic study folder.
"""

import json
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fp4jax import errors
from fp4jax.experiments import declaration, report, stage_cumulative

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECLARATION = ROOT / "results" / "stage_cumulative" / "DECLARATION.json"
STEPS = {"0.25": 192, "2.6": 2000}
TOKENS_PER_STEP = 1024
E, B, BETA = 1.0, 3.0, 0.3           # fp8: L = E + B (tokens / 1024)^-BETA (+ 0.01 x seed)
MULTIPLIERS = {"F": 1.04, "FD": 1.10, "FDW": 1.30, "FDWH": 1.08}
NOISE = 0.004
PRESETS = {"fp8": "fp8", "F": "mxfp4-fprop", "FD": "mxfp4-fprop-dgrad", "FDW": "mxfp4",
           "FDWH": "mxfp4-dh16"}
# Wgrad operand errors (train) and Fprop / Dgrad output errors (ref) per arm
DIAG = {"fp8": (0.027, 0.053, 0.03, 0.04), "F": (0.027, 0.053, 0.15, 0.04),
        "FD": (0.027, 0.053, 0.15, 0.16), "FDW": (0.12, 0.126, 0.15, 0.16),
        "FDWH": (0.117, 0.113, 0.15, 0.16)}


def fp8_curve(tokens_T, seed):
  """fp8's validation loss: 6.3 at step 0, then the power law."""
  t = np.maximum(tokens_T, 1.0) / TOKENS_PER_STEP
  return np.where(tokens_T > 0, E + B * t ** -BETA, 6.3) + 0.01 * seed


def _noise(horizon, seed):
  """+-NOISE, mean 0 over every 4 seeds, patterns that differ between the horizons."""
  return NOISE * ((-1) ** seed if horizon == "0.25" else (-1) ** (seed // 2))


def _write_run(path, tokens_T, loss_T, diag=None):
  os.makedirs(path)
  rows = [dict(step=int(t // TOKENS_PER_STEP), tokens=int(t), eval_loss=float(l))
          for t, l in zip(tokens_T, loss_T)]
  if diag:
    lhs, rhs, fprop, dgrad = diag
    rows[1].update({"diag/train/block_0/attn/q/wgrad/lhs_err": lhs,
                    "diag/train/block_0/attn/q/wgrad/rhs_err": rhs,
                    "diag/ref/block_0/attn/q/fprop/out_err": fprop,
                    "diag/ref/block_0/attn/q/dgrad/out_err": dgrad})
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  for name, obj in (("summary.json", dict(status="completed", step=rows[-1]["step"])),
                    ("wall.json", dict(wall_s=1.0))):
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)


def make_study(folder, cost, seeds=8, horizons=("0.25", "2.6"), diag=DIAG, diverge=None):
  """E5's folder with synthetic runs. cost "data": each arm's loss is fp8's at
  tokens / its multiplier (x exp(noise)); "param": fp8's + the offset that
  costs ln(multiplier) tokens at 0.25 (+ noise x fp8's slope there), the same
  offset at 2.6. diverge: (horizon, arm, seed) whose last evaluation is nan."""
  os.makedirs(folder)
  path = os.path.join(folder, "DECLARATION.json")
  shutil.copy(DECLARATION, path)
  for h in horizons:
    sub = os.path.join(folder, f"tpp{h}")
    declaration.record(sub, path)  # as the runner does before the first run
    with open(os.path.join(sub, "arms.json"), "w") as f:
      json.dump({arm: {"spec": f"{arm}={preset}", "recipe": preset}
                 for arm, preset in PRESETS.items()}, f)
    steps = STEPS[h]
    tokens_T = np.arange(0, steps + 1, steps // 8) * float(TOKENS_PER_STEP)
    for s in range(seeds):
      base = fp8_curve(tokens_T, s)
      _write_run(os.path.join(sub, f"fp8_seed{s}"), tokens_T, base, diag and diag["fp8"])
      for arm, m in MULTIPLIERS.items():
        if cost == "data":
          loss = np.where(tokens_T > 0, fp8_curve(tokens_T / (m * math.exp(_noise(h, s))), s),
                          base)
        else:
          loss = base + (math.log(m) + _noise(h, s)) * -short_slope()
          loss[0] = base[0]
        if diverge == (h, arm, s):
          loss[-1] = math.nan
        _write_run(os.path.join(sub, f"{arm}_seed{s}"), tokens_T, loss, diag and diag[arm])
  return folder


def late_slope(horizon):
  """fp8's dL/d ln(tokens) over the second half at a horizon, by numpy's polyfit (seed 0)."""
  steps = STEPS[horizon]
  tokens_T = np.arange(steps // 2, steps + 1, steps // 8) * float(TOKENS_PER_STEP)
  return float(np.polyfit(np.log(tokens_T), fp8_curve(tokens_T, 0), 1)[0])


def short_slope():
  return late_slope("0.25")


def test_a_token_multiplier_gives_no_horizon_contrast(tmp_path):
  folder = make_study(str(tmp_path / "e5"), "data", seeds=25)
  _, decl, spec, horizons = stage_cumulative.read(folder)
  assert (spec.plus, spec.minus, spec.long, spec.short, spec.alpha) == (
      "FDWH", "fp8", "2.6", "0.25", 0.01)
  hc = stage_cumulative.horizon_contrast(spec, horizons, math.log(1.05))
  assert hc.interval.n == 25 and abs(hc.interval.mean) < 1e-4
  assert hc.interval.lo < 0 < hc.interval.hi and hc.interval.hi < math.log(1.05)
  assert hc.verdict == "contradicted"  # a growth of 5% tokens or more is ruled out
  # the claims hold at both horizons: FDW costs more than FD and than FDWH
  for h in horizons.values():
    assert [c.verdict for c in h.claims] == ["supported", "supported"]
    assert stage_cumulative.validity_verdict(h.checks) == "met"
  text = stage_cumulative.write(folder)
  assert "**contradicted**: HC = " in text and "EXPLORATORY" not in text
  assert (tmp_path / "e5" / "stage_cumulative.md").read_text() == text
  # the stage costs come back as the planted multipliers, to first order
  assert "| FDWH - fp8 | +8." in text and "| FDW - fp8 | +3" in text
  assert "| 26-27% |" in text  # the paper's number beside FDW's, through arms.json
  assert text.index("## 0.25 tokens") < text.index("## 2.6 tokens")


def test_a_loss_offset_gives_a_horizon_contrast_that_grows_with_the_horizon(tmp_path):
  folder = make_study(str(tmp_path / "e5"), "param")
  _, _, spec, horizons = stage_cumulative.read(folder)
  hc = stage_cumulative.horizon_contrast(spec, horizons, math.log(1.05))
  # the same offset over a flatter fp8 curve: ln(1.08) x (slope at 0.25 / slope at 2.6 - 1)
  want = math.log(1.08) * (late_slope("0.25") / late_slope("2.6") - 1)
  assert want > 0.05
  assert hc.interval.mean == pytest.approx(want, abs=1e-9)
  assert hc.interval.lo > 0 and hc.verdict == "supported"
  assert hc.interval.n == 8 and hc.mde < want
  # the declared 99% Student t-interval over the seeds, written out
  v = np.array(list(hc.values.values()))
  half = scipy_stats.t.ppf(0.995, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
  assert hc.interval.hi - hc.interval.mean == pytest.approx(half, rel=1e-9)


def test_without_runs_it_says_so_and_writes_nothing(tmp_path, capsys):
  folder = tmp_path / "e5"
  folder.mkdir()
  shutil.copy(DECLARATION, folder / "DECLARATION.json")
  assert stage_cumulative.main(["x", str(folder)]) == 0
  out = capsys.readouterr().out
  assert "stage_cumulative: no runs yet" in out and "tpp0.25" in out and "tpp2.6" in out
  assert not (folder / "stage_cumulative.md").exists()
  # the runner's report on the umbrella folder names this command
  assert report.main(["x", str(folder)]) == 2
  assert f"python -m fp4jax.experiments.stage_cumulative {folder}" in capsys.readouterr().err


def test_the_committed_folder_reads():
  """results/stage_cumulative itself (read, not written): no runs yet, or a
  reading of those there are."""
  out, any_runs = stage_cumulative.text(str(DECLARATION.parent))
  assert ("## The horizon contrast" in out) if any_runs else ("no runs yet" in out)


def test_one_horizon_is_read_and_the_contrast_waits_for_the_other(tmp_path):
  folder = make_study(str(tmp_path / "e5"), "data", horizons=("0.25",))
  text = stage_cumulative.write(folder)
  assert "## 0.25 tokens per non-embedding parameter" in text
  assert text.count("- **supported**: CS") == 1
  assert "No runs yet" in text and "not judged (no runs yet at 2.6)" in text
  assert "EXPLORATORY" not in text
  with open(os.path.join(folder, "DECLARATION.json"), "a") as f:
    f.write("\n")  # any edit after the runner recorded it
  assert "**EXPLORATORY" in stage_cumulative.write(folder).split("\n")[2]


def test_a_diverged_run_leaves_its_seed_out_of_the_contrast(tmp_path):
  folder = make_study(str(tmp_path / "e5"), "param", diverge=("2.6", "FDWH", 3))
  _, _, spec, horizons = stage_cumulative.read(folder)
  hc = stage_cumulative.horizon_contrast(spec, horizons, math.log(1.05))
  assert hc.interval.n == 7 and 3 not in hc.values
  text = stage_cumulative.write(folder)
  assert "FDWH seed 3 at 2.6 diverged" in text
  assert "left out: FDWH - fp8 seed 3 at 0.25 has no point at 2.6 to pair with" in text


def test_validity_fails_when_an_arm_quantizes_the_wrong_gemm(tmp_path):
  diag = dict(DIAG, FD=DIAG["FDW"])  # FD with MXFP4 Wgrad operands
  folder = make_study(str(tmp_path / "e5"), "data", horizons=("0.25",), diag=diag)
  _, _, _, horizons = stage_cumulative.read(folder)
  checks = horizons["0.25"].checks
  assert stage_cumulative.validity_verdict(checks) == "not met"
  assert [c.met for c in checks if c.text.startswith("FD's Wgrad")] == [False]
  assert all(c.met for c in checks if not c.text.startswith("FD's Wgrad"))
  no_diag = make_study(str(tmp_path / "e5b"), "data", horizons=("0.25",), diag=None)
  checks = stage_cumulative.read(no_diag)[3]["0.25"].checks
  assert stage_cumulative.validity_verdict(checks) == "not measured"
  assert "**not met**" in stage_cumulative.write(folder)


def test_bad_input_is_one_line(tmp_path, capsys):
  assert stage_cumulative.main(["x", str(tmp_path / "gone")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "gone" in err and "DECLARATION.json" in err
  assert stage_cumulative.main(["x", "--folder=y"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "usage:" in err
  assert stage_cumulative.main(["x", "--help"]) == 0 and "usage:" in capsys.readouterr().out
  raw = json.loads(DECLARATION.read_text())
  raw["horizon_contrast"]["label"] = "HC = (FDWH - fp8 at 2.6) - (FDW - fp8 at 0.25)"
  with pytest.raises(errors.UserError, match="same contrast"):
    stage_cumulative.parse_contrast(raw["horizon_contrast"], "D.json")
  raw["horizon_contrast"]["label"] = "HC = (FDWH - fp8 at 9) - (FDWH - fp8 at 0.25)"
  (tmp_path / "e5").mkdir()
  (tmp_path / "e5" / "DECLARATION.json").write_text(json.dumps(raw))
  with pytest.raises(errors.UserError, match="horizon\\(s\\) 9"):
    stage_cumulative.read(str(tmp_path / "e5"))


def test_a_horizon_without_baseline_runs_yet_is_read_without_its_token_numbers(tmp_path):
  folder = make_study(str(tmp_path / "e5"), "data", seeds=2, horizons=("0.25",))
  shutil.rmtree(os.path.join(folder, "tpp0.25", "fp8_seed0"))
  shutil.rmtree(os.path.join(folder, "tpp0.25", "fp8_seed1"))
  text = stage_cumulative.write(folder)
  assert "| FD - F | - | 0 | - |" in text and "| FDW - fp8 | - | 0 | - | 26-27% |" in text
  assert "the smallest effect, 5% more tokens, is nan nats" in text
  assert "**not measured**" in text and "No runs yet: " in text
