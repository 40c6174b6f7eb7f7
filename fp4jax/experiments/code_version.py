"""Which code and how many cores made a study's run: recorded with it, and kept one.

A last-bit change of the code, or another number of cores in a run's
process (XLA's CPU thread pool is that large and splits some reductions by
it), moves a tiny run as much as the effects a study measures: a run is
made by one code version on one core count. `current(cpus)` says what this
process is: a SHA-256 over fp4jax's source files (the code, with any
uncommitted edit), the git commit the package is in (None outside git;
informative only) and cpus. `mismatch(saved, now)` names what differs.
"""

import functools
import hashlib
import os
import subprocess

import fp4jax

_PACKAGE = os.path.dirname(os.path.abspath(fp4jax.__file__))
# fp4jax.kernels is installed from the repository's kernels/ (pyproject).
_SOURCES = (_PACKAGE, os.path.join(os.path.dirname(_PACKAGE), "kernels"))


@functools.cache
def source_hash() -> str:
  """SHA-256 over the relative path and bytes of every .py file of fp4jax."""
  digest = hashlib.sha256()
  for root in _SOURCES:
    for folder, dirs, files in sorted(os.walk(root)):
      dirs.sort()
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(folder, name)
        digest.update(os.path.relpath(path, os.path.dirname(root)).encode() + b"\0")
        with open(path, "rb") as f:
          digest.update(f.read() + b"\0")
  return digest.hexdigest()


def _commit():
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_PACKAGE, capture_output=True,
                         text=True, check=False, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def current(cpus) -> dict:
  """{"code": source_hash(), "commit": git HEAD or None, "cpus": cpus}."""
  return {"code": source_hash(), "commit": _commit(), "cpus": cpus}


def mismatch(saved, now) -> str:
  """"" when `saved` (a run's record, keys missing in older runs) and `now`
  name the same code and core count, else what differs, in words."""
  out = []
  if saved.get("code") not in (None, now["code"]):
    out.append(f"code {saved['code'][:12]} (commit {saved.get('commit')}) -> "
               f"{now['code'][:12]} (commit {now['commit']})")
  if saved.get("cpus") not in (None, now["cpus"]):
    out.append(f"cores {saved['cpus']} -> {now['cpus']}")
  return ", ".join(out)
