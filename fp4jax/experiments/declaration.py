"""A study's declaration: its rules, fixed in a file before its first run.

`config.ablation.declaration` names the file (any text: the primary
statistic, the smallest effect of interest, the contrasts and their
directions, the multiplicity correction, the predictions). At the study's
start the runner calls `record`: the first time, before any run has
finished, it writes RESULTS/DECLARED.json (the file's sha256 and the UTC
time); on every later start the file must still have that hash, else the
study is refused. A declaration recorded when finished runs were already
there is recorded as late. `note` is the line the report prints about it.
"""

import datetime
import hashlib
import json
import os

from fp4jax import errors

RECORD = "DECLARED.json"


def _sha256(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _read(results_dir):
  path = os.path.join(results_dir, RECORD)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def record(path, results_dir, finished_runs=()) -> str:
  """Records (or checks) the declaration `path` for the study in `results_dir`.

  finished_runs: the study's runs already finished (a first record with any
  is marked late). Returns RESULTS/DECLARED.json's path. errors.UserError
  when the file is missing or differs from the recorded hash.
  """
  if not os.path.isfile(path):
    raise errors.UserError(f"the declaration {path!r} does not exist; a study declares its "
                           "rules in that file before its first run")
  digest, saved = _sha256(path), _read(results_dir)
  out = os.path.join(results_dir, RECORD)
  if saved is not None:
    if saved["sha256"] != digest:
      raise errors.UserError(
          f"the declaration {path!r} changed after the study began (sha256 {digest[:12]}, "
          f"recorded {saved['sha256'][:12]} at {saved['recorded_utc']}); restore it "
          f"(git checkout) or start a new study in another results folder")
    return out
  os.makedirs(results_dir, exist_ok=True)
  with open(out, "w") as f:
    json.dump(dict(file=os.path.basename(path), sha256=digest,
                   recorded_utc=datetime.datetime.now(datetime.timezone.utc)
                   .strftime("%Y-%m-%dT%H:%M:%SZ"),
                   late=sorted(finished_runs)), f, indent=2)
    f.write("\n")
  return out


def note(path, results_dir) -> str:
  """One markdown line: the declaration's hash and whether it held (for table.md)."""
  saved = _read(results_dir)
  if saved is None:
    return "Declaration: none recorded (exploratory analysis)."
  now = _sha256(path) if os.path.isfile(path) else None
  if now != saved["sha256"]:
    return (f"**Declaration changed after the study began** (recorded sha256 "
            f"{saved['sha256'][:12]} at {saved['recorded_utc']}, now "
            f"{now[:12] if now else 'missing'}): these verdicts do not follow rules fixed "
            "in advance.")
  if saved["late"]:
    return (f"**Declaration recorded late** ({saved['recorded_utc']}, after "
            f"{len(saved['late'])} runs had finished): exploratory.")
  return (f"Declaration {saved['file']} (sha256 {saved['sha256'][:12]}), recorded "
          f"{saved['recorded_utc']} before the first run; unchanged since.")
