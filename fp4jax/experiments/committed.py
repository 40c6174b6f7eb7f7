"""A study's results folder, kept in git, from which an interrupted study resumes.

The runs train in a scratch workdir (checkpoints, locks); each finished run's
records (RUN_FILES) are copied into RESULTS/<run>/ as it completes, with a
MANIFEST.json (sha256 of each file) written last, and the folder moved into
place in one rename, so a RESULTS/<run>/ either is complete or is not there.
`is_complete` checks the manifest against the files: a study run again (on
another machine, from a fresh clone) skips those runs and trains only the rest.

`git_commit(paths, message)` commits exactly `paths` (git commit --only):
changes staged for other paths stay staged and out of the commit.
"""

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import run_layout

RUN_FILES = run_layout.RECORDS + (run_layout.WALL,)
MANIFEST = "MANIFEST.json"
FINISHED = ("completed", "target_reached", "diverged")


def _sha256(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def is_complete(run_dir) -> bool:
  """True when run_dir's manifest lists the run's own files (RUN_FILES), each
  inside run_dir and matching its hash, and its summary says the run finished."""
  try:
    files = records.read(records.Manifest, os.path.join(run_dir, MANIFEST))["files"]
    if not set(RUN_FILES) <= set(files) or not all(
        records.inside(run_dir, n) for n in files):
      return False
    if any(_sha256(os.path.join(run_dir, name)) != digest for name, digest in files.items()):
      return False
    summary = records.read(records.Summary, run_layout.summary_file(run_dir))
  except (OSError, records.RecordError):
    return False
  return summary["status"] in FINISHED


def publish(src, dst):
  """Copies src's RUN_FILES (those present) to dst
  atomically: a new sibling temporary folder (.NAME.tmp.XXXX), its manifest
  last, then a rename. An existing dst is replaced (the caller checks that it
  is published records: fp4jax.experiments.ablation); no other folder is
  removed. Returns dst."""
  parent = os.path.realpath(os.path.dirname(dst) or os.curdir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.tmp.")
  files = {}
  for name in RUN_FILES:
    if os.path.exists(os.path.join(src, name)):
      shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
      files[name] = _sha256(os.path.join(tmp, name))
  with open(os.path.join(tmp, MANIFEST), "w") as f:
    json.dump({"files": files}, f, indent=2, sort_keys=True)
  os.chmod(tmp, 0o777 & ~atomic.umask())  # mkdtemp creates 0700
  old = None
  if os.path.exists(dst):
    old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.old.")
    os.replace(dst, old)  # over the new empty folder
  os.replace(tmp, dst)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
  return dst


def _git(args, cwd):
  return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


def check_repository(paths):
  """(the repository's top folder, `paths` relative to it) when the paths
  (which need not exist yet) are inside one git work tree; UserError naming
  the first that is not."""
  paths = [os.path.abspath(p) for p in paths]
  cwd = paths[0]
  while not os.path.isdir(cwd):  # the nearest folder that exists
    cwd = os.path.dirname(cwd)
  top = _git(["rev-parse", "--show-toplevel"], cwd)
  if top.returncode:
    raise errors.UserError(f"--git_commit: {paths[0]!r} is not in a git work tree "
                           f"({top.stderr.strip()})")
  root = top.stdout.strip()
  rel = [os.path.relpath(os.path.realpath(p), os.path.realpath(root)) for p in paths]
  outside = [p for p, r in zip(paths, rel) if r.startswith("..")]
  if outside:
    raise errors.UserError(f"--git_commit: {outside[0]!r} is not inside the repository "
                           f"{root!r}, so it cannot be committed with the results")
  return root, rel


def git_commit(paths, message) -> str | None:
  """Commits exactly `paths` (files or folders of one repository) with `message`;
  returns the new commit's hash, or None when nothing in them changed.

  Other staged or unstaged changes are left as they were. errors.UserError
  when the paths are not in a git work tree or git refuses.
  """
  root, rel = check_repository(paths)
  steps = (["add", "--", *rel],
           ["commit", "--quiet", "--only", "-m", message, "--", *rel])
  if not _git(["status", "--porcelain", "--", *rel], root).stdout.strip():
    return None
  for args in steps:
    out = _git(args, root)
    if out.returncode:
      raise errors.UserError(f"--git_commit: git {args[0]} failed: "
                             f"{(out.stderr or out.stdout).strip().splitlines()[-1:]}")
  return _git(["rev-parse", "HEAD"], root).stdout.strip()
