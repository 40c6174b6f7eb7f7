"""The trend over widths recovers a slope planted in synthetic runs, and its fit is scipy's."""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fp4jax.experiments import declaration, trend

PARAMS = {64: 200_000, 128: 800_000, 192: 1_800_000}
N_8B = 7_000_000_000
SLOPES = {64: -0.30, 128: -0.20, 192: -0.15}   # fp8's dL/d ln(tokens) per width
C0, C1 = -1.2, 0.1                           # planted: y = C0 + C1 ln(N) (ln extra tokens)
NOISE = 0.004


def test_the_fit_is_scipys_linregress():
  rng = np.random.default_rng(0)
  x = rng.normal(size=12)
  y = 0.3 * x + rng.normal(size=12)
  fit, ref = trend.fit_line(x, y), scipy_stats.linregress(x, y)
  assert fit.slope == pytest.approx(ref.slope, rel=1e-12)
  assert fit.intercept == pytest.approx(ref.intercept, rel=1e-12)
  assert fit.se_slope == pytest.approx(ref.stderr, rel=1e-10)
  assert fit.slope_p() == pytest.approx(ref.pvalue, rel=1e-8)
  # the line's standard error at x0 by the textbook formula, written out
  x0 = 5.0
  s2 = ((y - ref.intercept - ref.slope * x) ** 2).sum() / 10
  se = math.sqrt(s2 * (1 / 12 + (x0 - x.mean()) ** 2 / ((x - x.mean()) ** 2).sum()))
  assert fit.line_at(x0)[1] == pytest.approx(se, rel=1e-12)


def test_a_line_needs_three_points_at_two_widths():
  with pytest.raises(ValueError):
    trend.fit_line([1.0, 1.0, 1.0], [0.0, 1.0, 2.0])


def _write_run(path, tokens_T, loss_T, status="completed"):
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, (t, l) in enumerate(zip(tokens_T, loss_T)):
      f.write(json.dumps(dict(step=step, tokens=int(t), eval_loss=float(l))) + "\n")
  for name, obj in (("summary.json", dict(status=status, step=len(tokens_T) - 1)),
                    ("wall.json", dict(wall_s=1.0))):
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)


def _study(folder, seeds=4, diverge=None, slopes=None, without=(), rule="exclude", trend=None):
  """fp8's curves L = 5 + slope ln(t / 1e3) exactly; W = fp8 + delta with
  delta / -slope = C0 + C1 ln(N) +- NOISE (alternating signs: the per-width mean is exact).
  slopes: fp8's slope per width (default SLOPES; where it is not negative,
  delta = that value x 0.01 nats: W still worse than fp8). without: widths
  whose folder holds its declaration and no runs. rule: the per-width
  declarations' `diverged`. trend: keys added to the umbrella's "trend".
  Each width's declaration is recorded before its runs, as the ablation does."""
  slopes = {**SLOPES, **(slopes or {})}
  claims = [{"contrast": "CW = W - fp8", "direction": ">", "text": "grows", "paper": "+15%"},
            {"contrast": "CZ = Z - fp8", "direction": "!=", "text": "flat", "paper": ""}]
  decl = {"study": "synthetic", "design": {"non_embedding_parameters": {str(w): n for w, n in PARAMS.items()},
                                            "parameters_at_8B": {"non_embedding": N_8B}},
          "trend": {"claims": claims, "smallest_slope": 0.005,
                    "descriptive": [{"contrast": "CD = W-2 - fp8", "paper": "+8-9%"}],
                    **(trend or {})}}
  os.makedirs(folder)
  with open(os.path.join(folder, "DECLARATION.json"), "w") as f:
    json.dump(decl, f)
  for w, n in PARAMS.items():
    sub = os.path.join(folder, f"w{w}")
    os.makedirs(sub)
    with open(os.path.join(sub, "DECLARATION.json"), "w") as f:
      json.dump({"study": f"w{w}", "baseline": "fp8", "primary": "late_mean", "late_from": 0.5,
                 "smallest_effect_tokens": 0.05, "alpha": 0.05, "correction": "holm", "power": 0.8,
                 "diverged": rule, "claims": [{"text": "x", "contrasts": [
                     {"label": "CW", "weights": {"W": 1, "fp8": -1}, "direction": ">"}]}]}, f)
    declaration.record(sub, os.path.join(sub, "DECLARATION.json"))
    if w in without:
      continue
    tokens_T = np.linspace(1e3, 9e3, 9)
    base_T = 5 + slopes[w] * np.log(tokens_T / 1e3)
    scale = -slopes[w] if slopes[w] < 0 else 0.01
    y = C0 + C1 * math.log(n)
    for s in range(seeds):
      noisy = y + (NOISE if s % 2 else -NOISE)
      _write_run(os.path.join(sub, f"fp8_seed{s}"), tokens_T, base_T + 0.01 * s)
      w_T = base_T + 0.01 * s + noisy * scale
      if diverge == (w, s):
        w_T = np.concatenate([w_T[:-1], [np.nan]])
      _write_run(os.path.join(sub, f"W_seed{s}"), tokens_T, w_T)
      _write_run(os.path.join(sub, f"W-2_seed{s}"), tokens_T, w_T)
      _write_run(os.path.join(sub, f"Z_seed{s}"), tokens_T, base_T + 0.01 * s
                 + (NOISE if s % 2 else -NOISE) * scale)
  return folder


def test_the_planted_slope_and_its_8b_value_come_back(tmp_path):
  folder = _study(str(tmp_path / "study"))
  _, _, done = trend.analyse(folder)
  by = {o.label: o for o, _ in done}
  cw = by["CW"]
  assert cw.fit.slope == pytest.approx(C1, abs=1e-9)
  assert cw.fit.line_at(math.log(N_8B))[0] == pytest.approx(C0 + C1 * math.log(N_8B), abs=1e-8)
  assert cw.verdict == "supported" and cw.interval[0] > 0
  assert all(len(v) == 4 for v in cw.by_width.values())
  # no planted slope: the flat contrast's interval holds 0 and lies inside +-0.005
  cz = by["CZ"]
  assert abs(cz.fit.slope) < 1e-9 and cz.verdict == "contradicted"
  assert by["CD"].verdict is None  # descriptive: the arm name with '-' parses
  text = trend.write(folder)
  assert "| CW = W - fp8 |" in text and "supported" in text
  assert os.path.getsize(os.path.join(folder, "trend.png")) > 0


def test_a_diverged_seed_is_left_out_of_its_width(tmp_path):
  folder = _study(str(tmp_path / "study"), diverge=(128, 1))
  _, _, done = trend.analyse(folder)
  cw = next(o for o, _ in done if o.label == "CW")
  assert len(cw.by_width[128]) == 3 and 1 not in cw.by_width[128]
  assert len(cw.by_width[64]) == 4


def test_a_contrast_that_is_not_label_a_minus_b_is_one_line_exit_2(tmp_path):
  folder = _study(str(tmp_path / "study"), seeds=2)
  path = os.path.join(folder, "DECLARATION.json")
  decl = json.load(open(path))
  decl["trend"]["claims"][0]["contrast"] = "CW=W-fp8"
  json.dump(decl, open(path, "w"))
  out = subprocess.run([sys.executable, "-m", "fp4jax.experiments.trend", folder],
                       capture_output=True, text=True, check=False)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().count("\n") == 0 and "'CW=W-fp8'" in out.stderr


def _outcomes(folder):
  return {o.label: o for o, _ in trend.analyse(folder)[2]}


def _edit(path, **changes):
  with open(path) as f:
    obj = json.load(f)
  for key, value in changes.items():
    obj[key] = value if not isinstance(value, dict) else {**obj.get(key, {}), **value}
  with open(path, "w") as f:
    json.dump(obj, f)


def test_a_diverged_run_keeps_its_claim_unjudged_where_its_width_declares_inconclusive(tmp_path):
  folder = _study(str(tmp_path / "study"), diverge=(128, 1), rule="inconclusive")
  by = _outcomes(folder)
  assert len(by["CW"].by_width[128]) == 3  # the seed is still left out of the fit shown
  assert by["CW"].verdict.startswith("not judged") and "w128" in by["CW"].verdict
  assert "diverged: inconclusive" in by["CW"].verdict
  assert by["CZ"].verdict == "contradicted"  # its arms did not diverge: judged as before
  text = trend.write(folder)
  assert "supported" not in text


@pytest.mark.parametrize("width,slope", [(64, 0.05), (128, 0.0)])
def test_extra_tokens_need_a_falling_baseline_else_that_width_is_withheld(tmp_path, width, slope):
  folder = _study(str(tmp_path / "study"), slopes={width: slope})
  by = _outcomes(folder)  # no sign flip, no OverflowError
  assert by["CW"].by_width[width] == {} and all(by["CW"].by_width[w] for w in PARAMS if w != width)
  assert by["CW"].verdict.startswith("not judged") and f"w{width}" in by["CW"].verdict
  text = trend.write(folder)
  note = next(line for line in text.splitlines() if line.startswith(f"- w{width}:"))
  assert "not falling" in note and f"{slope:+.4f}" in note.replace("-0.0000", "+0.0000")


def test_a_folder_it_cannot_write_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
  folder = _study(str(tmp_path / "study"), seeds=2)
  os.chmod(folder, 0o555)
  if os.geteuid() == 0:  # root writes through modes: refuse writes there as the kernel would
    real_open = open

    def read_only_open(file, mode="r", *args, **kwargs):
      if any(c in mode for c in "wax+") and os.path.abspath(str(file)).startswith(folder + os.sep):
        raise PermissionError(13, "Permission denied", str(file))
      return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only_open)
  try:
    assert trend.main(["trend", folder]) == 2
  finally:
    os.chmod(folder, 0o755)
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("python -m fp4jax.experiments.trend: ")
  assert "Permission denied" in err and folder in err


@pytest.mark.parametrize("folder_too", [False, True])
def test_a_declared_width_without_runs_withholds_the_verdicts(tmp_path, folder_too):
  folder = _study(str(tmp_path / "study"), without=(192,))
  if folder_too:
    shutil.rmtree(os.path.join(folder, "w192"))
  by = _outcomes(folder)
  assert by["CW"].verdict.startswith("not judged") and "w192" in by["CW"].verdict
  text = trend.write(folder)
  note = next(line for line in text.splitlines() if line.startswith("- w192:"))
  assert "no runs" in note and "needs all 3" in text and "supported" not in text


def test_a_declaration_that_asks_for_fewer_widths_is_judged_without_one_and_says_so(tmp_path):
  folder = _study(str(tmp_path / "study"), without=(192,), trend={"min_widths": 2})
  by = _outcomes(folder)
  assert by["CW"].verdict == "supported"
  text = trend.write(folder)
  assert any(line.startswith("- w192:") and "no runs" in line for line in text.splitlines())
  assert "trend.min_widths = 2" in text


def test_a_line_that_cannot_be_fitted_says_how_many_points_it_has(tmp_path):
  folder = _study(str(tmp_path / "study"), without=(64, 192), trend={"min_widths": 2})
  by = _outcomes(folder)
  assert len(by["CW"].by_width[128]) == 4 and by["CW"].fit is None
  assert "4 points at 1 width" in by["CW"].verdict
  assert "fewer than 3 points" not in trend.write(folder)


def test_every_run_left_out_is_named_with_its_width(tmp_path):
  folder = _study(str(tmp_path / "study"), diverge=(128, 1))
  _edit(os.path.join(folder, "w64", "Z_seed2", "summary.json"), status="interrupted")
  text = trend.write(folder)
  out = [line for line in text.splitlines() if line.startswith("- w")]
  diverged = next(line for line in out if line.startswith("- w128: W seed 1 "))
  assert "diverged" in diverged and "CW" in diverged and "CD" not in diverged
  assert any(line.startswith("- w128: W-2 seed 1 ") and "CD" in line for line in out)
  unfinished = next(line for line in out if line.startswith("- w64: Z seed 2 "))
  assert "not finished" in unfinished and "CZ" in unfinished
  assert len(_outcomes(folder)["CZ"].by_width[64]) == 3


def test_the_umbrella_declaration_is_recorded_and_an_edit_after_it_is_exploratory(tmp_path):
  folder = _study(str(tmp_path / "study"))
  path = os.path.join(folder, "DECLARATION.json")
  first = trend.write(folder)
  assert "EXPLORATORY" not in first
  record = declaration.read_record(folder)
  assert record and record["sha256"] == declaration.file_hash(path)
  _edit(path, trend={"smallest_slope": 0.5})
  edited = trend.write(folder)
  assert "EXPLORATORY" in edited.splitlines()[2] and "DECLARATION.json" in edited.splitlines()[2]
  assert declaration.read_record(folder) == record  # never overwritten


def test_a_width_declaration_edited_after_its_runs_began_makes_the_trend_exploratory(tmp_path):
  folder = _study(str(tmp_path / "study"))
  _edit(os.path.join(folder, "w64", "DECLARATION.json"), late_from=0.25)
  text = trend.write(folder)
  assert "EXPLORATORY" in text.splitlines()[2] and "w64" in text.splitlines()[2]


def test_the_committed_study_matches_its_recorded_declarations():
  folder = os.path.join(os.path.dirname(__file__), os.pardir, "results", "stage_widths")
  assert declaration.status(folder, os.path.join(folder, "DECLARATION.json")) == "declared"
  for w in (64, 128, 192):
    sub = os.path.join(folder, f"w{w}")
    assert declaration.status(sub, os.path.join(sub, "DECLARATION.json")) == "declared"
