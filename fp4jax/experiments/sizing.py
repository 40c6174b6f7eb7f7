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
seed count up to `max_seeds`. Wall seconds per run, per arm (median over
its seeds, `wall.json`), price a design.
"""

import dataclasses
import json
import math
import sys

import numpy as np
from absl import app, flags

from fp4jax.experiments import hypothesis_tests, report, stats


@dataclasses.dataclass(frozen=True)
class _Declared:
  """What report.smallest_effect reads of a declaration."""
  baseline: str
  late_from: float
  smallest_effect_tokens: float


def per_seed(runs, plus, minus, late_from=0.5) -> list:
  """[late mean of `plus` - late mean of `minus`] over the seeds both ran."""
  means = {arm: {r.seed: stats.late_mean(r.tokens_T, r.loss_T, late_from) for r in runs[arm]}
           for arm in (plus, minus)}
  seeds = sorted(set(means[plus]) & set(means[minus]))
  return [means[plus][s] - means[minus][s] for s in seeds]


def seeds_needed(sd, smallest, alpha, power=0.8, max_seeds=40):
  """Fewest n (2..max_seeds) with hypothesis_tests.mde(sd, n, alpha, power) <= smallest, or None."""
  for n in range(2, max_seeds + 1):
    if hypothesis_tests.mde(sd, n, alpha, power) <= smallest:
      return n
  return None


def size(runs, contrasts, baseline, claims, alpha=0.05, power=0.8, late_from=0.5,
         smallest_effect_tokens=0.05, max_seeds=40) -> dict:
  """The JSON-ready sizing of `contrasts` ({label: (plus, minus)}) on `runs` (report.load_runs)."""
  slope, smallest = report.smallest_effect(
      runs, _Declared(baseline, late_from, smallest_effect_tokens))
  level = alpha / claims
  out = {"baseline_late_slope": slope, "smallest_effect_nats": smallest,
         "alpha_per_claim": level, "power": power, "contrasts": {}}
  for label, (plus, minus) in contrasts.items():
    values = per_seed(runs, plus, minus, late_from)
    sd = float(np.std(values, ddof=1))
    out["contrasts"][label] = {
        "per_seed": values, "sd": sd,
        "seeds_needed": seeds_needed(sd, smallest, level, power, max_seeds),
        "mde_by_seeds": {n: hypothesis_tests.mde(sd, n, level, power) for n in range(3, max_seeds + 1)}}
  out["wall_s_per_run"] = {arm: float(np.median([r.wall_s for r in rs if r.wall_s]))
                           for arm, rs in runs.items()}
  return out


_RESULTS = flags.DEFINE_string("results", None, "a finished study's results folder")
_CONTRASTS = flags.DEFINE_multi_string("contrast", [], "LABEL=PLUS-MINUS (arm names)")
_BASELINE = flags.DEFINE_string("baseline", "A0", "the arm whose late slope sets the smallest effect")
_CLAIMS = flags.DEFINE_integer("claims", 1, "claims of the planned study (Holm's strictest level)")
_MAX_SEEDS = flags.DEFINE_integer("max_seeds", 40, "largest seed count considered")


def main(argv):
  del argv
  contrasts = {}
  for text in _CONTRASTS.value:
    label, _, arms = text.partition("=")
    plus, _, minus = arms.partition("-")
    contrasts[label] = (plus, minus)
  runs = report.load_runs(_RESULTS.value)
  out = size(runs, contrasts, _BASELINE.value, _CLAIMS.value, max_seeds=_MAX_SEEDS.value)
  json.dump(out, sys.stdout, indent=1, default=lambda x: None if math.isnan(x) else x)
  print()


if __name__ == "__main__":
  flags.mark_flag_as_required("results")
  app.run(main)
