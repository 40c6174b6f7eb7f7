"""A study's rules, declared in a file before its first run, and proof of when.

The file (JSON, committed with the study, e.g. results/<study>/DECLARATION.json):

  {"study": "ablation_tiny",
   "baseline": "fp8",                 the recipe every claim is paired against
   "primary": "late_mean",            per seed and recipe: "late_mean", the mean
                                      validation loss over the evaluations at
                                      tokens >= late_from x the last, or "final"
   "late_from": 0.5,
   "smallest_effect_tokens": 0.05,    the smallest effect of interest, as extra
                                      tokens; in nats through the baseline's
                                      own late slope dL/d ln(tokens)
   "alpha": 0.05, "correction": "holm", "power": 0.8,
   "diverged": "exclude",             what a diverged run counts as (optional;
                                      default "exclude", see below)
   "claims": [{"text": "...", "contrasts": [
       {"label": "mxfp4-sr - mxfp4", "weights": {"mxfp4-sr": 1, "mxfp4": -1},
        "direction": ">"}]}]}       ">", "<" or "!=" (fp4jax.experiments.hypothesis_tests)

A claim holds when all its contrasts do; its p-value is the largest of its
contrasts' (intersection-union), and Holm runs over the claims.

A run diverged when one of its validation losses is not finite or the
trainer stopped it on non-finite steps (fp4jax.experiments.report.
diverged_runs); the report names every such run. `diverged` says what it
counts as (DIVERGED): "exclude" (the default) leaves its seed out of the
contrasts the run is in, and each verdict says on how many of the seeds it
stands; "inconclusive" judges no claim with a diverged run among its
contrasts' seeds.

The ablation runner calls `record(workdir, path)` before its first run: it
writes WORKDIR/declaration_record.json (the file's SHA-256 and the time) once
and never overwrites it. `status(workdir, path)` compares: "declared" (same
hash), "changed" (the file differs from the one recorded at the start) or
"undeclared" (nothing was recorded: the rules came after the runs, so any
verdict is exploratory).
"""

import dataclasses
import datetime
import hashlib
import json
import os

from fp4jax import errors
from fp4jax import records
from fp4jax.experiments import hypothesis_tests

RECORD = "declaration_record.json"
PRIMARY = ("late_mean", "final")
CORRECTIONS = ("holm",)
# What a diverged run counts as (the declaration's "diverged").
DIVERGED_DEFAULT = "exclude"
DIVERGED = {
    "exclude": "a seed where a run of a contrast diverged is left out of that contrast, "
               "and each verdict says on how many of the seeds it stands (fewer than 2 "
               "left: not judged, its p taken as 1 in Holm)",
    "inconclusive": "a claim with a diverged run among its contrasts' seeds is not judged "
                    "(inconclusive, its p taken as 1 in Holm)"}


@dataclasses.dataclass(frozen=True)
class Contrast:
  """sum_r weights[r] * primary[r] per seed; `direction` of the claimed effect."""
  label: str
  weights: dict[str, float]
  direction: str


@dataclasses.dataclass(frozen=True)
class Claim:
  """a claim of a declaration"""
  text: str
  contrasts: tuple


@dataclasses.dataclass(frozen=True)
class Declaration:
  """a study's declaration file"""
  study: str
  baseline: str
  primary: str
  late_from: float
  smallest_effect_tokens: float
  alpha: float
  correction: str
  power: float
  claims: tuple
  diverged: str = DIVERGED_DEFAULT
  path: str = ""


def _need(cond, path, message):
  if not cond:
    raise errors.UserError(f"declaration {path!r}: {message}")


def load(path) -> Declaration:
  """The Declaration in `path`; UserError naming the bad entry."""
  raw = records.read(Declaration, path)
  _need(raw["primary"] in PRIMARY, path,
        f"primary {raw['primary']!r} is not one of {', '.join(PRIMARY)}")
  _need(raw["correction"] in CORRECTIONS, path,
        f"correction {raw['correction']!r} is not one of {', '.join(CORRECTIONS)}")
  diverged = raw.get("diverged", DIVERGED_DEFAULT)
  _need(diverged in DIVERGED, path,
        f"diverged {diverged!r} is not one of {', '.join(DIVERGED)}")
  for key in ("late_from", "alpha", "power"):
    _need(0 < raw[key] < 1, path, f"{key} must lie in (0, 1), got {raw[key]!r}")
  _need(raw["smallest_effect_tokens"] > 0, path, "smallest_effect_tokens must be > 0")
  _need(raw["claims"], path, "no claims")
  claims = []
  for i, c in enumerate(raw["claims"]):
    records.check(Claim, c, f"{path}: claims[{i}]")
    _need(c["contrasts"], path, f"claim {c['text']!r} has no contrasts")
    contrasts = []
    for j, k in enumerate(c["contrasts"]):
      records.check(Contrast, k, f"{path}: claims[{i}].contrasts[{j}]")
      _need(k.get("direction") in hypothesis_tests.DIRECTIONS, path,
            f"contrast {k.get('label')!r}: direction {k.get('direction')!r} is not one of "
            f"{', '.join(hypothesis_tests.DIRECTIONS)}")
      contrasts.append(Contrast(k["label"], dict(k["weights"]), k["direction"]))
    claims.append(Claim(c["text"], tuple(contrasts)))
  return Declaration(raw["study"], raw["baseline"], raw["primary"], float(raw["late_from"]),
                     float(raw["smallest_effect_tokens"]), float(raw["alpha"]),
                     raw["correction"], float(raw["power"]), tuple(claims), diverged,
                     str(path))


def file_hash(path) -> str:
  """SHA-256 (hex) of the file's bytes; UserError when it cannot be read."""
  try:
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError as e:
    raise errors.UserError(f"cannot read the declaration {path!r}: {e.strerror}") from None


def read_record(workdir) -> dict | None:
  file = os.path.join(workdir, RECORD)
  if not os.path.exists(file):
    return None
  return records.read(records.DeclarationRecord, file)


def record(workdir, path, check=load) -> dict:
  """Writes WORKDIR/declaration_record.json for `path` unless one exists; returns the record.
  `check(path)` first (a study's declaration: `load`; the trend's umbrella
  declaration, fp4jax.experiments.trend, passes its own)."""
  check(path)
  existing = read_record(workdir)
  if existing is not None:
    return existing
  rec = {"path": str(path), "sha256": file_hash(path),
         "recorded_utc": datetime.datetime.now(datetime.timezone.utc).isoformat()}
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, RECORD), "w") as f:
    json.dump(rec, f, indent=1)
  return rec


def status(workdir, path) -> str:
  """"declared", "changed" or "undeclared" (see the module docstring)."""
  rec = read_record(workdir)
  if rec is None:
    return "undeclared"
  return "declared" if rec["sha256"] == file_hash(path) else "changed"
