"""What keeps a workdir whole: its lock, its config on resume, its history.

- `WorkdirLock`: WORKDIR/lock (JSON: pid, host, run id, start time) is taken
  at start-up and removed on every exit, and the run holds an OS lock
  (fcntl.flock) on the workdir folder itself, open for the run's life, so a
  removed lock file lets no second run in. A second run on the same workdir
  is refused with the holder's pid and host; a lock whose process is dead
  (same host) is stale and taken over with a message. The processes of one
  multi-host run share the workdir: process 0 takes the lock with a run id it
  broadcasts to the others, who check that the lock holds that id.
- `check_resume_config`: a workdir belongs to the config its checkpoints
  carry (config.json for checkpoints from before they carried it; both read
  by fp4jax.train.run_layout, which names every file of a workdir). Only the
  keys in RESUMABLE_KEYS may differ when it is run again; any other
  difference is refused (naming the keys and the values in effect) unless
  the caller overrides, which is recorded in history/<n>/resume_override.json.
- `set_aside_history`: metrics rows a (re)start would drop (all of them for a
  start at step 0; those after the checkpoint's step for a resume) are kept:
  metrics.jsonl, summary.json and config.json are copied to
  WORKDIR/history/<n>/ first, with a message naming it.
- `remove_summary`: summary.json describes a run that ended; a run that
  trains again (a finished run resumed with more steps, say) removes it
  before its first step, so a run killed on the way has none and no reader
  (the ablation report and runner, `fp4jax.train.run_layout.read_summary`)
  takes it for finished at the old step.

Every write to an existing file is atomic (fp4jax.train.atomic), and a full
disk at any of them is one line (errors.DiskFull) that leaves no lock and no
partial history/ behind.
"""

import errno
import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time

import jax
from jax.experimental import multihost_utils
import numpy as np

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import metrics_log
from fp4jax.train import run_layout

# Config keys that may differ between the config.json of a workdir and the
# config it is resumed with (a key also covers everything below it). Every
# other key (model, quant, data, batch_size, micro_batch, seq_len, dtype,
# seed, lr and its schedule, optimizer, eval set) is fixed by the workdir.
# `steps` may grow or shrink: the cosine schedule follows the new value (with
# min_lr_ratio=1.0 the rate is constant after warm-up, so nothing already run changes).
RESUMABLE_KEYS = ("steps", "eval_every", "log_every", "checkpoint_every",
                  "keep_checkpoints", "async_checkpointing", "target_eval_loss",
                  "max_bad_steps", "mesh", "distributed", "quant.residuals",
                  "profile", "peak_tflops", "wandb")


class WorkdirError(errors.UserError):
  """The workdir cannot be used as asked (exit status 2 in the CLIs)."""


def json_default(x):
  """json.dump default: NumPy / JAX values as lists, tuples as lists."""
  if isinstance(x, (np.generic, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, tuple):
    return list(x)
  return str(x)


def write_json(path, obj):
  """Writes obj as JSON to path atomically (fp4jax.train.atomic); a file
  that already holds exactly that is left alone."""
  text = json.dumps(obj, indent=2, default=json_default)
  try:
    with open(path) as f:
      if f.read() == text:
        return
  except (OSError, UnicodeDecodeError):
    pass
  atomic.write_text(path, text)


def prepare(workdir, what="workdir"):
  """Creates `workdir` if needed; WorkdirError if it is not a writable dir
  (`what`: how the messages name it, e.g. "--results folder")."""
  if os.path.islink(workdir) and not os.path.exists(workdir):
    raise WorkdirError(f"{what} {workdir!r} is a symbolic link to "
                       f"{os.readlink(workdir)!r}, which does not exist; "
                       "create that directory, or remove the link to have "
                       f"the {what} created here.")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"{what} {workdir!r} is a file, not a directory; "
                       "give a directory (it is created if missing).")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    if e.errno == errno.ENOSPC:
      raise errors.disk_full(workdir, None) from None
    raise WorkdirError(f"cannot create {what} {workdir!r}: "
                       f"{e.strerror}") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"{what} {workdir!r} is not writable; give a "
                       "directory you can write to.")


# ---------------------------------------------------------------------------
# The lock.


def _pid_alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


def _run_id():
  """An id every process of this run agrees on (process 0's random token)."""
  token = np.frombuffer(os.urandom(8), np.uint8)
  if jax.process_count() > 1:
    token = np.asarray(multihost_utils.broadcast_one_to_all(token))
  return bytes(token.astype(np.uint8)).hex()


class WorkdirLock:
  """WORKDIR/lock for one run (all processes of it); see the module doc."""

  def __init__(self, workdir):
    self.path = run_layout.lock_file(workdir)
    self.run_id = None
    self._held = False
    self._folder_fd = None  # the workdir, flock-ed while the run holds it

  def acquire(self):
    """Takes the lock (process 0) or checks it (others); WorkdirError if
    another run holds it. Returns self."""
    self.run_id = _run_id()
    error = None
    if jax.process_index() == 0:
      try:
        self._create()
      except WorkdirError as e:
        error = e
    if jax.process_count() > 1:
      ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
      if error is None and not int(ok):
        error = WorkdirError(f"process 0 could not lock {self.path} (see its "
                             "output)")
      if error is None and jax.process_index() > 0:
        error = self._check_shared()
    if error is not None:
      raise error
    errors.on_signal_exit(self.release)
    return self

  def _record(self):
    return dict(pid=os.getpid(), host=socket.gethostname(), run_id=self.run_id,
                processes=jax.process_count(),
                started=time.strftime("%Y-%m-%d %H:%M:%S"))

  def _lock_folder(self):
    """Takes the OS lock of the workdir folder; WorkdirError while another
    process holds it (whether or not its lock file is still there)."""
    fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
        return  # no flock on this file system: the lock file alone guards
      holder = self._read()
      where = (f"process {holder.get('pid')} on host {holder.get('host')}"
               if holder else "another process, whose lock file "
               f"{self.path} was removed")
      raise WorkdirError(
          f"workdir {os.path.dirname(self.path)!r} is in use by {where} (it "
          "holds the workdir's OS lock); wait for it to finish or use another "
          "workdir.") from None
    self._folder_fd = fd

  def _unlock_folder(self):
    if self._folder_fd is not None:
      os.close(self._folder_fd)  # closing releases the flock
      self._folder_fd = None

  def _create(self):
    """Takes the folder's OS lock, then writes the record to a temporary
    file and links it as the lock: the lock appears whole or not at all (a
    full disk or a kill leaves none)."""
    self._lock_folder()
    try:
      self._link_record()
    except BaseException:
      self._unlock_folder()
      raise

  def _link_record(self):
    tmp = f"{self.path}.{os.getpid()}.tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(self._record(), f)
        f.flush()
        os.fsync(f.fileno())
      for _ in range(2):  # the second try follows a stale lock's removal
        try:
          os.link(tmp, self.path)
        except FileExistsError:
          self._take_over_if_stale()
          continue
        self._held = True
        return
    except OSError as e:
      if e.errno == errno.ENOSPC:
        raise errors.disk_full(self.path, None) from None
      raise
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    raise WorkdirError(f"could not take the lock {self.path}")

  def _read(self):
    try:
      return records.read(records.LockRecord, self.path)
    except records.RecordError:
      if not os.path.exists(self.path):
        return None
      return {}  # being written, or damaged: treated as held

  def _take_over_if_stale(self):
    holder = self._read()
    if holder is None:
      return  # released meanwhile
    host, pid = holder.get("host"), holder.get("pid")
    if host == socket.gethostname() and isinstance(pid, int) and (
        not _pid_alive(pid)):
      os.remove(self.path)
      print(f"fp4jax: took over the stale lock {self.path} of process {pid} "
            f"on {host}, which is no longer running.", file=sys.stderr,
            flush=True)
      return
    where = (f"process {pid} on host {host} (since {holder.get('started')})"
             if holder else "another process (unreadable lock file)")
    raise WorkdirError(
        f"workdir {os.path.dirname(self.path)!r} is in use by {where}; wait "
        f"for it to finish, use another workdir, or delete {self.path} if "
        "that process is gone.")

  def _check_shared(self):
    """Processes > 0: a lock visible here must be this run's."""
    holder = self._read()
    if holder is None:  # the workdir is not shared with process 0
      return None
    if holder.get("run_id") != self.run_id:
      return WorkdirError(
          f"workdir {os.path.dirname(self.path)!r} is locked by process "
          f"{holder.get('pid')} on host {holder.get('host')}, which is not "
          "process 0 of this run.")
    return None

  def release(self):
    """Removes the lock if this process holds it (safe to call twice)."""
    errors.forget_signal_exit(self.release)
    if not self._held:
      return
    self._held = False
    try:
      holder = self._read()
      if holder and holder.get("run_id") == self.run_id:
        os.remove(self.path)
    finally:
      self._unlock_folder()


# ---------------------------------------------------------------------------
# The config on resume.


def flat(tree, prefix=""):
  """{"a.b.c": leaf} of a nested dict (dicts flattened, other values leaves)."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flat(value, name + "."))
    else:
      out[name] = value
  return out


def _resumable(key):
  return any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)


# Config blocks compared by what they resolve to ("resolved" block's key).
_RESOLVED_BLOCKS = {"model": "model", "quant": "recipe"}


def _in_effect(tree):
  """{flat key: value} of a resolved config dict, the model.* and quant.*
  keys as they resolved (the LlamaConfig fields, the Recipe's config) where
  its "resolved" block has them, so a preset's None placeholder stands for
  the preset's value and an override equal to it changes nothing."""
  resolved = tree.get("resolved") or {}
  out = {}
  for key, value in tree.items():
    if key == "resolved":
      continue
    block = resolved.get(_RESOLVED_BLOCKS.get(key))
    if isinstance(block, dict):
      out.update(flat(block, f"{key}."))
    else:
      out.update(flat({key: value}))
  return out


def config_differences(requested, saved):
  """[(key, saved value, requested value)] of the keys that may not change.

  requested, saved: resolved config dicts (as in config.json: the config
  and its "resolved" block). model and quant are compared by the values in
  effect (_in_effect: what shows is never a placeholder); a change of name
  (model.name, quant.name) comes first, and a recipe whose name alone
  differs (an override that names a value already in effect) is the same. Keys only one side has (a key added
  to or removed from fp4jax since the workdir was written) are not compared.
  """
  requested = json.loads(json.dumps(requested, default=json_default))
  new, old = _in_effect(requested), _in_effect(saved)
  keys = sorted(new.keys() & old.keys(), key=lambda k: (k.count(".") > 1, k))
  diffs = [(k, old[k], new[k]) for k in keys
           if new[k] != old[k] and not _resumable(k)]
  if [k for k, _, _ in diffs if k.startswith("quant.")] == ["quant.name"]:
    diffs = [d for d in diffs if d[0] != "quant.name"]  # a label, same recipe
  return diffs


def _saved_config(workdir):
  """(the config this workdir's run was started with or None, where from).

  The checkpoint's copy comes first, so the check does not depend on
  config.json, which a user can lose. WorkdirError when only config.json
  could tell, but it is missing, damaged or not a config, while there are
  checkpoints to resume.
  """
  path = run_layout.config_file(workdir)
  from_json, problem = run_layout.saved_config(workdir)
  saved = run_layout.checkpoint_config(workdir)
  if saved is not None:
    if problem is not None and os.path.exists(path):
      dst = _keep_records(workdir)
      print(f"fp4jax: {path} {problem}; the checkpoint's copy of the config "
            f"is used and config.json is written again (the old one is kept "
            f"in {dst})", file=sys.stderr, flush=True)
    return saved, "its checkpoint"
  if problem is None:
    return from_json, run_layout.CONFIG
  if checkpointing.committed_steps(run_layout.checkpoints(workdir)):
    raise WorkdirError(
        f"{path} {problem}, and the checkpoints of this workdir are older "
        "than the ones that carry their config, so nothing tells which "
        "config they belong to: restore config.json, use another workdir, "
        "or pass --override_resume to resume them with this config.")
  return None, None


def _tokenizer_difference(resolved, saved_resolved):
  """[("data.tokenizer", saved, now)] when the run recorded its tokenizer
  (fp4jax.data.tokenizers.identity: absolute path, content hash) and the
  tokenizer now is another file or other content; else []."""
  saved, now = saved_resolved.get("tokenizer"), resolved.get("tokenizer")
  if not isinstance(saved, dict) or now is None or saved == now:
    return []
  show = lambda t: f"{t.get('path')} (sha256 {str(t.get('sha256'))[:12]})"
  return [("data.tokenizer", show(saved), show(now))]


def check_resume_config(workdir, config, resolved, *, override=False):
  """Refuses to continue `workdir` with a config that changes fixed keys.

  resolved: the "resolved" block of `config` (model: the LlamaConfig
  fields, recipe: the Recipe's config) that gives a preset's placeholders
  their values, and tokenizer: its identity, compared with the one the run
  recorded (a relative data.tokenizer may name another folder now). Returns the differing keys (empty when the workdir holds no
  run or nothing fixed differs); WorkdirError unless `override` when there
  are, or when the workdir's config cannot be known.
  """
  requested = dict(config.to_dict(), resolved=resolved)
  try:
    saved, source = _saved_config(workdir)
  except WorkdirError:
    if not override:
      raise
    saved, source = None, None
  if saved is None:
    return []
  diffs = config_differences(requested, saved) + _tokenizer_difference(
      requested["resolved"], saved.get("resolved") or {})
  if diffs and not override:
    shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diffs[:6])
    more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    raise WorkdirError(
        f"workdir {workdir!r} holds a run with another config (from "
        f"{source}: {shown}{more}); only {', '.join(RESUMABLE_KEYS)} may "
        "change on resume. Use a new workdir, the config it was run with, or "
        "--override_resume to continue this run with the new values.")
  if diffs:
    dst = record_override(workdir, {"override_resume": [
        dict(key=k, was=old, now=new) for k, old, new in diffs]})
    print(f"fp4jax: resuming with changed {', '.join(k for k, _, _ in diffs)} "
          f"(override); the previous config.json and the changes are kept in "
          f"{dst}", file=sys.stderr, flush=True)
  return [k for k, _, _ in diffs]


# ---------------------------------------------------------------------------
# History.


def record_override(workdir, note):
  """Keeps the run's records and `note` (a dict: what --override_resume
  accepted) as resume_override.json in a new history/<n>/; returns it."""
  return _keep_records(workdir, {run_layout.RESUME_OVERRIDE: json.dumps(
      note, indent=2, default=json_default)})


def set_aside_history(workdir, start_step):
  """Copies the run's records to WORKDIR/history/<n>/ when a start at
  `start_step` would drop metrics rows; returns that directory or None.

  metrics_log.MetricsError (one line naming it) for a damaged row other
  than a half-written last one: nothing is dropped before it is repaired.
  """
  path = run_layout.metrics_file(workdir)
  if not os.path.exists(path):
    return None
  steps = [row["step"] for row in metrics_log.read_metrics(workdir)]
  with open(path) as f:
    lines = sum(1 for line in f if line.strip())
  steps += [math.inf] * (lines - len(steps))  # a half-written last line
  dropped = [s for s in steps if s > start_step or start_step == 0]
  if not dropped:
    return None
  dst = _keep_records(workdir)
  why = ("there is no readable checkpoint, so the run starts again at step 0 "
         f"and metrics.jsonl starts afresh ({len(dropped)} rows)"
         if start_step == 0 else f"the newest readable checkpoint is at step "
         f"{start_step}, so the {len(dropped)} metrics rows after it are "
         "dropped from metrics.jsonl")
  print(f"fp4jax: {why}; the previous metrics.jsonl, config.json and "
        f"summary.json are kept in {dst}", file=sys.stderr, flush=True)
  return dst



def remove_summary(workdir):
  """Removes WORKDIR/summary.json (the file a symbolic link there points to,
  so the link stays), durably: the removal is one atomic step, and the
  folder is fsync-ed after it. Nothing to do when there is none."""
  path = os.path.realpath(run_layout.summary_file(workdir))
  try:
    os.remove(path)
  except FileNotFoundError:
    return
  atomic.fsync_dir(os.path.dirname(path))


def _keep_records(workdir, extra=None):
  """Copies metrics.jsonl, summary.json, config.json to a new
  WORKDIR/history/<n>/ (n = 1, 2, ...: nothing is replaced); returns it.

  `extra`: {file name: text} written there too. The copy is made in
  history/.<n>.partial and renamed to <n> when complete, so history/ never
  holds a half copy (a partial one a killed run left is removed here).
  """
  root = run_layout.history(workdir)
  partial = None
  try:
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
      if name.startswith(".") and name.endswith(".partial"):
        shutil.rmtree(os.path.join(root, name))
    n = 1
    while os.path.exists(os.path.join(root, str(n))):
      n += 1
    dst = os.path.join(root, str(n))
    partial = os.path.join(root, f".{n}.partial")
    os.makedirs(partial)
    for name in run_layout.RECORDS:
      if os.path.exists(os.path.join(workdir, name)):
        shutil.copy2(os.path.join(workdir, name), partial)
    for name, text in (extra or {}).items():
      with open(os.path.join(partial, name), "w") as f:
        f.write(text)
    for hook in atomic.BEFORE_RENAME:
      hook(partial)
    os.rename(partial, dst)
  except OSError as e:
    if partial is not None:
      shutil.rmtree(partial, ignore_errors=True)
    if e.errno == errno.ENOSPC:
      needed = sum(os.path.getsize(os.path.join(workdir, name))
                   for name in run_layout.RECORDS
                   if os.path.exists(os.path.join(workdir, name)))
      raise errors.disk_full(root, needed) from None
    raise
  atomic.fsync_dir(root)
  return dst
