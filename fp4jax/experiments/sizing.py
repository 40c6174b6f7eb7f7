"""Seeds for a study, from the per-seed spreads of one that ran.

  python -m fp4jax.experiments.sizing --results=results/horizon_tiny \
      --contrast="C1=A1-A2" --contrast="SR=A3-A0" --claims=4 --max_seeds=40

For each contrast (`LABEL=ARM-ARM` over the finished study's arms) it
prints, as JSON: the per-seed values of the primary statistic (the mean of
the paired difference of validation losses over the evaluations in the last
(1 - late_from) of training, `stats.late_mean`), their standard deviation,
the smallest effect of interest (`smallest_effect_tokens` more tokens in
nats through the baseline's late slope, `report.smallest_effect`), and the
fewest seeds whose MDE at `power` reaches it at level alpha / claims (the
strictest level Holm gives one of `claims` claims), with the MDE at each
seed count up to `max_seeds`. Seeds where a run of the contrast diverged
(`report.diverged_runs`) are left out and listed. Wall seconds per run, per
arm (median over its seeds, `wall.json`), price a design.

Refused in one line (exit status 2): a results folder that is missing or
holds no runs, a contrast that is not LABEL=PLUS-MINUS of two of its arms,
a baseline without runs or whose late slope gives no smallest effect, a
contrast with fewer than 2 seeds to spread over, claims < 1 or max_seeds < 2.
The JSON is strict: a value that does not exist is null.
"""

import dataclasses
import json
import math
import os
import sys

import numpy as np
from absl import app, flags

from fp4jax import errors
from fp4jax.experiments import declaration, hypothesis_tests, report, stats, verdicts
from fp4jax.train import cli

_PROG = "python -m fp4jax.experiments.sizing"


@dataclasses.dataclass(frozen=True)
class _Declared:
  """What report.smallest_effect reads of a declaration."""
  baseline: str
  late_from: float
  smallest_effect_tokens: float


def per_seed(runs, plus, minus, late_from=0.5) -> tuple:
  """([late mean of `plus` - late mean of `minus`] over the seeds both ran,
  [(arm, seed) of the diverged runs whose seeds were left out])."""
  means = {arm: {r.seed: stats.late_mean(r.tokens_T, r.loss_T, late_from) for r in runs[arm]}
           for arm in (plus, minus)}
  contrast = declaration.Contrast(f"{plus} - {minus}", {plus: 1, minus: -1}, "!=")
  _, values, left_out = verdicts.contrast_split(contrast, means, set(report.diverged_runs(runs)))
  return values, list(left_out)


def seeds_needed(sd, smallest, alpha, power=0.8, max_seeds=40):
  """Fewest n (2..max_seeds) with hypothesis_tests.mde(sd, n, alpha, power) <= smallest, or None."""
  for n in range(2, max_seeds + 1):
    if hypothesis_tests.mde(sd, n, alpha, power) <= smallest:
      return n
  return None


def size(runs, contrasts, baseline, claims, alpha=0.05, power=0.8, late_from=0.5,
         smallest_effect_tokens=0.05, max_seeds=40) -> dict:
  """The JSON-ready sizing of `contrasts` ({label: (plus, minus)}) on `runs`
  (report.load_runs); UserError when a number it needs cannot be measured."""
  if baseline not in runs:
    raise errors.UserError(f"--baseline={baseline!r} has no runs; the arms are "
                           f"{', '.join(runs)}{errors.did_you_mean(baseline, runs)}")
  slope, smallest = report.smallest_effect(
      runs, _Declared(baseline, late_from, smallest_effect_tokens))
  if not smallest > 0:
    raise errors.UserError(
        f"the baseline {baseline!r} gives no smallest effect: its late slope dL/d ln(tokens) "
        f"is {slope} (it needs 2 or more finite evaluations in the last {1 - late_from:.0%} "
        "of training, and a falling loss); give another --baseline")
  level = alpha / claims
  out = {"baseline_late_slope": slope, "smallest_effect_nats": smallest,
         "alpha_per_claim": level, "power": power, "contrasts": {}}
  for label, (plus, minus) in contrasts.items():
    values, left_out = per_seed(runs, plus, minus, late_from)
    if len(values) < 2:
      dropped = f" ({len(left_out)} diverged runs left out)" if left_out else ""
      raise errors.UserError(
          f"--contrast {label}={plus}-{minus} has {len(values)} seed(s) where both arms ran"
          f"{dropped}; a spread needs 2 or more")
    sd = float(np.std(values, ddof=1))
    out["contrasts"][label] = {
        "per_seed": values, "sd": sd,
        "diverged_left_out": [f"{arm} seed {seed}" for arm, seed in left_out],
        "seeds_needed": seeds_needed(sd, smallest, level, power, max_seeds),
        "mde_by_seeds": {n: hypothesis_tests.mde(sd, n, level, power) for n in range(3, max_seeds + 1)}}
  walls = {arm: [r.wall_s for r in rs if r.wall_s] for arm, rs in runs.items()}
  out["wall_s_per_run"] = {arm: float(np.median(w)) if w else None for arm, w in walls.items()}
  return out


def parse_contrast(text, arms) -> tuple:
  """(label, (plus, minus)) of `LABEL=PLUS-MINUS` over `arms` (arm names may
  hold "-": the split is the one whose two sides are arms); UserError."""
  label, eq, pair = text.partition("=")
  splits = [(pair[:i], pair[i + 1:]) for i, ch in enumerate(pair) if ch == "-"]
  if not eq or not label or not splits:
    raise errors.UserError(f"--contrast={text!r} is not LABEL=PLUS-MINUS (e.g. C1=A1-A2); "
                           f"the arms are {', '.join(arms)}")
  known = [(p, m) for p, m in splits if p in arms and m in arms and p != m]
  if len(known) == 1:
    return label, known[0]
  if known:
    raise errors.UserError(f"--contrast={text!r} splits into two arms in more than one way "
                           f"({', '.join(f'{p} - {m}' for p, m in known)})")
  unknown = [x for x in dict.fromkeys(x for pm in splits for x in pm) if x not in arms]
  named = ("no arm " + ", ".join(f"{x!r}{errors.did_you_mean(x, arms)}" for x in unknown)
           if len(splits) == 1 and unknown else f"{pair!r} is not two different arms joined "
           "by '-'")
  raise errors.UserError(f"--contrast={text!r}: {named}; the arms are {', '.join(arms)}")


def _strict(value):
  """`value` with every non-finite float replaced by None (strict JSON)."""
  if isinstance(value, dict):
    return {k: _strict(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_strict(v) for v in value]
  return None if isinstance(value, float) and not math.isfinite(value) else value


_RESULTS = flags.DEFINE_string("results", None, "a finished study's results folder")
_CONTRASTS = flags.DEFINE_multi_string("contrast", [], "LABEL=PLUS-MINUS (arm names)")
_BASELINE = flags.DEFINE_string("baseline", "A0", "the arm whose late slope sets the smallest effect")
_CLAIMS = flags.DEFINE_integer("claims", 1, "claims of the planned study (Holm's strictest level)")
_MAX_SEEDS = flags.DEFINE_integer("max_seeds", 40, "largest seed count considered")
_USAGE = (f"usage: {_PROG} --results=FOLDER --contrast=LABEL=PLUS-MINUS [--contrast=...] "
          "[--baseline=ARM] [--claims=N] [--max_seeds=N]")


def sizing(results, contrast_texts, baseline="A0", claims=1, max_seeds=40) -> dict:
  """What the command prints (before strict JSON): the sizing of the
  `--contrast` texts on the study in `results`; UserError naming a bad input."""
  if not results or not contrast_texts:
    raise errors.UserError(_USAGE)
  if not os.path.isdir(results):
    raise errors.UserError(f"--results={results!r} is not a directory; give a finished "
                           "study's results folder")
  for name, value, least in (("claims", claims, 1), ("max_seeds", max_seeds, 2)):
    if value < least:
      raise errors.UserError(f"--{name}={value} must be >= {least}")
  runs = report.load_runs(results)
  if not runs:
    raise errors.UserError(f"no runs with metrics.jsonl under {results!r}")
  contrasts = {}
  for text in contrast_texts:
    label, arms = parse_contrast(text, list(runs))
    if label in contrasts:
      raise errors.UserError(f"--contrast label {label!r} is given more than once")
    contrasts[label] = arms
  return size(runs, contrasts, baseline, claims, max_seeds=max_seeds)


def main(argv):
  if len(argv) > 1:
    return errors.report(_PROG, f"unexpected arguments {' '.join(argv[1:])!r}; {_USAGE}")
  try:
    out = sizing(_RESULTS.value, _CONTRASTS.value, _BASELINE.value, _CLAIMS.value,
                 _MAX_SEEDS.value)
  except errors.UserError as e:
    return errors.report(_PROG, e)
  json.dump(_strict(out), sys.stdout, indent=1, allow_nan=False)
  print()
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(_PROG))
