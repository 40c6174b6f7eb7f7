"""The trend over widths recovers a slope planted in synthetic runs, and its fit is scipy's."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fp4jax.experiments import trend

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


def _study(folder, seeds=4, diverge=None):
  """fp8's curves L = 5 + slope ln(t / 1e3) exactly; W = fp8 + delta with
  delta / -slope = C0 + C1 ln(N) +- NOISE (alternating signs: the per-width mean is exact)."""
  claims = [{"contrast": "CW = W - fp8", "direction": ">", "text": "grows", "paper": "+15%"},
            {"contrast": "CZ = Z - fp8", "direction": "!=", "text": "flat", "paper": ""}]
  decl = {"study": "synthetic", "design": {"non_embedding_parameters": {str(w): n for w, n in PARAMS.items()},
                                            "parameters_at_8B": {"non_embedding": N_8B}},
          "trend": {"claims": claims, "smallest_slope": 0.005,
                    "descriptive": [{"contrast": "CD = W-2 - fp8", "paper": "+8-9%"}]}}
  os.makedirs(folder)
  with open(os.path.join(folder, "DECLARATION.json"), "w") as f:
    json.dump(decl, f)
  for w, n in PARAMS.items():
    sub = os.path.join(folder, f"w{w}")
    os.makedirs(sub)
    with open(os.path.join(sub, "DECLARATION.json"), "w") as f:
      json.dump({"study": f"w{w}", "baseline": "fp8", "primary": "late_mean", "late_from": 0.5,
                 "smallest_effect_tokens": 0.05, "alpha": 0.05, "correction": "holm", "power": 0.8,
                 "claims": [{"text": "x", "contrasts": [
                     {"label": "CW", "weights": {"W": 1, "fp8": -1}, "direction": ">"}]}]}, f)
    tokens_T = np.linspace(1e3, 9e3, 9)
    base_T = 5 + SLOPES[w] * np.log(tokens_T / 1e3)
    y = C0 + C1 * math.log(n)
    for s in range(seeds):
      noisy = y + (NOISE if s % 2 else -NOISE)
      _write_run(os.path.join(sub, f"fp8_seed{s}"), tokens_T, base_T + 0.01 * s)
      w_T = base_T + 0.01 * s + noisy * -SLOPES[w]
      if diverge == (w, s):
        w_T = np.concatenate([w_T[:-1], [np.nan]])
      _write_run(os.path.join(sub, f"W_seed{s}"), tokens_T, w_T)
      _write_run(os.path.join(sub, f"W-2_seed{s}"), tokens_T, w_T)
      _write_run(os.path.join(sub, f"Z_seed{s}"), tokens_T, base_T + 0.01 * s
                 + (NOISE if s % 2 else -NOISE) * -SLOPES[w])
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
