"""A study's rules, declared in a file before its first run, and proof of when.

The ablation runner calls `record(folder, path)` before its first run: it
writes FOLDER/declaration_record.json (the file's SHA-256 and the time) once
and never overwrites it. `status(folder, path)` compares: "declared" (same
hash), "changed" (the file differs from the one recorded at the start) or
"undeclared" (nothing was recorded: the rules came after the runs, so any
verdict is exploratory).
"""

import datetime
import hashlib
import json
import os

from fp4jax import errors

RECORD = "declaration_record.json"


def file_hash(path) -> str:
  """SHA-256 (hex) of the file's bytes."""
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def read_record(workdir) -> dict | None:
  file = os.path.join(workdir, RECORD)
  if not os.path.exists(file):
    return None
  with open(file) as f:
    return json.load(f)


def record(workdir, path) -> dict:
  """Writes WORKDIR/declaration_record.json for `path` unless one exists; returns the record."""
  if not os.path.isfile(path):
    raise errors.UserError(f"the declaration {path!r} does not exist; a study declares its "
                           "rules in that file before its first run")
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
  return "declared" if os.path.isfile(path) and rec["sha256"] == file_hash(path) else "changed"
