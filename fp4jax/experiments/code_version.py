"""Which code and how many cores made a study's run: recorded with it, and kept one.

A last-bit change of the code, or another number of cores in a run's
process (XLA's CPU thread pool is that large and splits some reductions by
it), moves a tiny run as much as the effects a study measures: a run is
made by one code version on one core count. `current(cpus)` says what this
process is: a SHA-256 over fp4jax's source files (the code, with any
uncommitted edit), the git commit the package is in (None outside git;
informative only) and cpus. `mismatch(saved, now)` names what differs.

The same code on the same core count still gives other bits in another
environment: another CPU model (XLA compiles for the host's instructions)
or other releases of jax, jaxlib, numpy or ml_dtypes (E3's seed-0 run of R0,
retrained on another machine from the same code on one core, differed from
its first logged loss on). `environment()` records those; a study that spans
machines keeps them per run and its report says which runs were made where.
"""

import functools
import hashlib
import importlib.metadata
import os
import platform
import subprocess

import fp4jax

_PACKAGE = os.path.dirname(os.path.abspath(fp4jax.__file__))


@functools.cache
def source_hash() -> str:
  """SHA-256 over the relative path and bytes of every .py file of fp4jax."""
  digest = hashlib.sha256()
  for folder, _, files in sorted(os.walk(_PACKAGE)):
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      digest.update(os.path.relpath(path, os.path.dirname(_PACKAGE)).encode() + b"\0")
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
  """{"code": source_hash(), "commit": git HEAD or None, "cpus": cpus,
  "environment": environment()}."""
  return {"code": source_hash(), "commit": _commit(), "cpus": cpus,
          "environment": environment()}


# The releases whose numerics reach a run's bits (jax's CPU and GPU code is jaxlib's).
PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes", "flax", "optax")


def _cpu() -> str:
  """The CPU's model and a digest of its instruction-set flags (Linux), else the machine."""
  fields = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
  except OSError:
    return platform.machine()
  flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode())
  return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family')} "
          f"model {fields.get('model')}, flags {flags.hexdigest()[:12]})")


def _version(name):
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.cache
def environment() -> dict:
  """{"python", "cpu", "xla_flags", "packages": {name: version or None}} of this process."""
  return {"python": platform.python_version(), "cpu": _cpu(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "packages": {name: _version(name) for name in PACKAGES}}


def environment_changes(saved, now) -> str:
  """"" when the run record `saved` (a wall.json) was last made in `now`'s
  environment (or recorded none), else the differences in words."""
  if not saved.get("environments"):
    return ""
  made = saved["environments"][-1]
  here = now["environment"]
  out = [f"{key} {made.get(key)!r} -> {here[key]!r}" for key in ("python", "cpu", "xla_flags")
         if made.get(key) != here[key]]
  packages = made.get("packages", {})
  out += [f"{name} {packages.get(name)} -> {version}"
          for name, version in here["packages"].items() if packages.get(name) != version]
  return ", ".join(out)


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
