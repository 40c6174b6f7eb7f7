"""The sizing command on a hand-made study: what it refuses, in one line
with exit status 2, and strict JSON when it answers."""

import json
import math
import os
import subprocess
import sys

import pytest

from fp4jax import errors
from fp4jax.experiments import sizing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(folder, seeds=3, diverged_seed=None):
  """A0 and A1 with `seeds` seeds (no wall.json); A1 of `diverged_seed` NaN."""
  for seed in range(seeds):
    for arm, shift in (("A0", 0.0), ("A1", 0.01 * (1 + seed))):
      path = os.path.join(folder, f"{arm}_seed{seed}")
      os.makedirs(path)
      with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(0, 9):
          loss = 4.0 - 0.3 * math.log(1 + step) + shift
          if arm == "A1" and seed == diverged_seed and step >= 6:
            loss = math.nan
          f.write(json.dumps(dict(step=step, tokens=step * 100, eval_loss=loss)) + "\n")
  return folder


@pytest.mark.parametrize("args, match", [
    (["--contrast=C1=A1-A9"], r"--contrast='C1=A1-A9': no arm 'A9'; the arms are A0, A1$"),
    (["--contrast=A1-A0"], r"--contrast='A1-A0' is not LABEL=PLUS-MINUS \(e.g. C1=A1-A2\)"),
    (["--contrast=C1=A1-A0", "--claims=0"], r"--claims=0 must be >= 1$"),
    (["--contrast=C1=A1-A0", "--baseline=B0"], r"--baseline='B0' has no runs; the arms are "
     "A0, A1"),
    (["--contrast=C1=A1-A0", "--results=missing"], r"--results='missing' is not a directory"),
    (["--contrast=C1=A1-A0", "--contrast=C1=A0-A1"], r"label 'C1' is given more than once"),
    ([], r"usage: python -m fp4jax.experiments.sizing --results=FOLDER --contrast="),
], ids=["unknown-arm", "no-label", "claims-0", "no-baseline", "no-results", "twice", "none"])
def test_bad_arguments_are_refused_naming_what_exists(tmp_path, args, match):
  results = _study(str(tmp_path / "study"))
  given = dict(a[2:].split("=", 1) for a in args)
  with pytest.raises(errors.UserError, match=match):
    sizing.sizing(given.get("results", results), [a[len("--contrast="):] for a in args
                                                   if a.startswith("--contrast=")],
                  given.get("baseline", "A0"), int(given.get("claims", 1)))


def test_a_spread_of_one_seed_is_refused_and_a_diverged_seed_is_listed(tmp_path):
  with pytest.raises(errors.UserError, match=r"C1=A1-A0 has 1 seed\(s\) where both arms ran; "
                     "a spread needs 2 or more"):
    sizing.sizing(_study(str(tmp_path / "one"), seeds=1), ["C1=A1-A0"])
  out = sizing.sizing(_study(str(tmp_path / "nan"), diverged_seed=2), ["C1=A1-A0"])
  assert out["contrasts"]["C1"]["diverged_left_out"] == ["A1 seed 2"]
  assert out["contrasts"]["C1"]["per_seed"] == pytest.approx([0.01, 0.02])
  with pytest.raises(errors.UserError, match=r"has 1 seed\(s\) where both arms ran \(1 "
                     r"diverged runs left out\)"):
    sizing.sizing(_study(str(tmp_path / "nan2"), seeds=2, diverged_seed=1), ["C1=A1-A0"])


def _sizing(*args):
  return subprocess.run([sys.executable, "-m", "fp4jax.experiments.sizing", *args], cwd=ROOT,
                        capture_output=True, text=True, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
def test_the_command_exits_2_in_one_line_and_answers_in_strict_json(tmp_path):
  results = _study(str(tmp_path / "study"))
  out = _sizing(f"--results={results}", "--contrast=A1-A0")
  assert out.returncode == 2 and not out.stdout, out.stderr
  assert out.stderr.strip().splitlines() == [
      "python -m fp4jax.experiments.sizing: --contrast='A1-A0' is not LABEL=PLUS-MINUS "
      "(e.g. C1=A1-A2); the arms are A0, A1"]
  out = _sizing(f"--results={results}", "--contrast=C1=A1-A0", "--max_seeds=3")
  assert out.returncode == 0, out.stderr

  def refuse(name):
    raise AssertionError(f"{name} in the JSON")

  answer = json.loads(out.stdout, parse_constant=refuse)
  assert answer["wall_s_per_run"] == {"A0": None, "A1": None}  # no wall.json
  assert answer["contrasts"]["C1"]["sd"] == pytest.approx(0.01)
