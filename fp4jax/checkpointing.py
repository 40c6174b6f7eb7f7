"""Checkpoints of a training run with orbax: save, keep the last few, restore.

A checkpoint holds two items: `state` (the TrainState pytree, saved sharded)
and `data` (the data iterator's JSON state: `data_item` reads it); orbax's
folder names stay in this module (`is_checkpoint`, `committed_steps`). A
checkpoint that cannot be read is moved aside to `<set_aside_to>/<step>`
(`<step>.2`, ... when that name is taken: nothing there is ever replaced)
with a warning and the previous one is tried, so a run killed while
writing, or a damaged disk, costs at most one checkpoint interval. A
readable checkpoint whose arrays do not fit the requested state (another
model shape or optimizer: any array name or shape that differs) is not
corrupt: `CheckpointMismatch` is raised, one line naming the first
difference, and it stays where it is; every read of a checkpoint
(`restore_latest`, `restore_params`) checks that before it reads. A
checkpoint whose parameters or optimizer state hold NaN or Inf is damaged
(a training loop never saves one: non-finite steps are not applied) and is
set aside like an unreadable one when `restore_latest` reads it.

A save that fails for lack of space, at once or (asynchronous saves) in the
background, raises errors.DiskFull naming the directory and the size of the
state, from `save`, `check` (which a training loop calls before each step,
so that no step runs after a failed save) or `wait`. The uncommitted step's
temporary folder is removed (freeing its space), so the previous checkpoints
are what a rerun resumes; orbax's own log records of the failure, tracebacks
included, are dropped (the DiskFull line says it).
"""

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import sys

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
from etils import epath
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils

from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic

try:  # orbax's reader of a step's _CHECKPOINT_METADATA (its own checks)
  from orbax.checkpoint._src.metadata.step_metadata_serialization import (  # pylint: disable=g-import-not-at-top
      deserialize as _read_step_metadata)
except ImportError:  # another orbax layout: orbax alone judges the file
  _read_step_metadata = None

_STEP_METADATA = "_CHECKPOINT_METADATA"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class _DropDiskFullLogs(logging.Filter):
  """Drops log records of an ENOSPC (reported as one DiskFull line)."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not (errors.is_disk_full(error)
                or "No space left on device" in record.getMessage())


_DISK_FULL_LOGS = _DropDiskFullLogs()


@contextlib.contextmanager
def _failed_reads_stopped():
  """Within it, an orbax read that fails first stops the reads it started.

  orbax 0.12 (0.12.8 is the newest) runs each restore as one coroutine in a
  fresh asyncio loop (`asyncio_utils.run_sync`) and closes that loop as soon
  as the coroutine raises, while the other reads of the failed `asyncio.gather`
  (tasks awaiting tensorstore futures) still run. Each of those that ends
  later has tensorstore call `call_soon_threadsafe` on the closed loop, which
  prints a "RuntimeError: Event loop is closed" traceback: dozens for one
  corrupt checkpoint, in most runs. Here the coroutine that raises first
  cancels the loop's other tasks and waits for them, as `asyncio.run` does
  before it closes a loop, and then keeps the loop from being closed: a read
  already in tensorstore's threads may still end and call back (after the
  cancelling alone: 1 of 15 runs of tests/test_trainer.py's three damage
  cases with two busy cores beside them, 0 of 15 with the loop kept open), and
  on an open loop that callback is queued and dropped instead of raising. `run_sync` is wrapped only within
  this block.
  """
  run_sync = asyncio_utils.run_sync
  asyncio_utils.run_sync = lambda coro: run_sync(_stopping_others_on_error(
      coro))
  try:
    yield
  finally:
    asyncio_utils.run_sync = run_sync


# Loops of failed restores, kept open (never run again) for late callbacks.
_LOOPS_OF_FAILED_READS = []


async def _stopping_others_on_error(coro):
  """Awaits `coro`; if it raises, cancels and awaits the other tasks of the
  loop (dropping their errors: those of reads cut short), leaves the loop
  open when its runner closes it, and re-raises."""
  try:
    return await coro
  except BaseException:
    this = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not this]
    for task in others:
      task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    loop = asyncio.get_running_loop()
    loop.close = functools.partial(_LOOPS_OF_FAILED_READS.append, loop)
    raise


def _first_cause(error):
  """The innermost cause of `error` as "Type: its first line" (orbax wraps
  the tensorstore error, which names the file, in one that prints a spec)."""
  while error.__cause__ is not None:
    error = error.__cause__
  lines = str(error).strip().splitlines() or [""]
  return f"{type(error).__name__}: {lines[0][:300]}"


class CheckpointMismatch(errors.UserError):
  """A readable checkpoint holds another tree or other shapes than asked."""


def _leaf_shapes(tree):
  """{"params/block_0/attn/q/kernel": shape} of a pytree's array leaves."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if leaf is None or not hasattr(leaf, "shape"):
      continue
    out[leaf_name(path)] = tuple(leaf.shape)
  return out


def leaf_name(path):
  """"params/block_0/attn/q/kernel" of a pytree key path."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)


def _shards_finite(x):
  """Whether every element of array `x` that this process holds is finite
  (an array of integers, or a host array, is checked where it is).

  Each shard is checked on its own device (replicas once), so no check is a
  collective: an all-reduce per tensor, dispatched right after a restore
  while its host-to-device copies are still pending, can leave one device's
  participant waiting for a CPU thread until XLA's collective timeout aborts
  the process (seen with 8 virtual CPU devices on 2 loaded cores)."""
  if not isinstance(x, jax.Array):
    x = np.asarray(x)
    return not jnp.issubdtype(x.dtype, jnp.inexact) or bool(np.all(np.isfinite(x)))
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return True
  return all(bool(jnp.all(jnp.isfinite(shard.data)))
             for shard in x.addressable_shards if shard.replica_id == 0)


def non_finite(params):
  """"" when every array leaf of `params` (parameters, or a whole training
  state: optimizer moments included) is finite, else the one-line "holds
  NaN or Inf in N tensor(s): block_0/mlp/down/kernel, ..." naming them
  (every process gets the same answer)."""
  leaves = jax.tree_util.tree_leaves_with_path(jax.block_until_ready(params))
  finite = np.array([_shards_finite(x) for _, x in leaves], np.int32)
  if jax.process_count() > 1:  # a tensor is bad when any process holds a bad shard
    finite = np.min(multihost_utils.process_allgather(finite), axis=0)
  bad = [leaf_name(p) for (p, _), ok in zip(leaves, finite) if not ok]
  if not bad:
    return ""
  return (f"holds NaN or Inf in {len(bad)} tensor(s): {', '.join(bad[:4])}"
          f"{', ...' if len(bad) > 4 else ''}")


def _mismatch(saved, wanted):
  """A description of how two {path: shape} maps differ ("" if they agree):
  names asked that the checkpoint lacks, names it holds that were not asked,
  and names whose shapes differ, each counted and its first named."""
  missing = sorted(wanted.keys() - saved.keys())
  extra = sorted(saved.keys() - wanted.keys())
  shapes = sorted(k for k in saved.keys() & wanted.keys()
                  if saved[k] != wanted[k])
  parts = []
  if shapes:
    parts.append(f"{len(shapes)} arrays have other shapes, e.g. {shapes[0]} "
                 f"{saved[shapes[0]]} in the checkpoint vs "
                 f"{wanted[shapes[0]]} asked")
  if missing:
    parts.append(f"{len(missing)} arrays are not in it, e.g. {missing[0]}")
  if extra:
    parts.append(f"{len(extra)} arrays of it are not asked, e.g. {extra[0]}")
  return "; ".join(parts)


def _saved_leaf_shapes(state_dir):
  """{name: shape} of the arrays the checkpoint item `state_dir` holds, from
  its metadata; None when that cannot be read (the restore then says why)."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    with _failed_reads_stopped():
      saved = handler.metadata(epath.Path(state_dir))
    return _leaf_shapes(getattr(saved, "tree", saved)) or None
  except Exception:  # pylint: disable=broad-except
    return None
  finally:
    handler.close()


class Checkpoints:
  """A directory of step-numbered checkpoints, the last `keep` of them kept."""

  def __init__(self, directory, *, keep, set_aside_to, async_save=True,
               data_kind=None):
    """set_aside_to: the folder unreadable checkpoints are moved to.
    data_kind: None, or the fp4jax.records kind the `data` item must fit
    (one that does not is set aside like an unreadable checkpoint)."""
    self.directory = os.path.abspath(atomic.resolved(directory))  # `link/..` as the OS
    self._set_aside_to = set_aside_to
    self._data_kind = data_kind
    self._nbytes = None  # of the last state saved
    self._pending = False  # an asynchronous save not yet checked
    self._manager = None
    logging.getLogger("absl").addFilter(_DISK_FULL_LOGS)  # orbax logs there
    for step in committed_steps(self.directory):
      problem = _step_metadata_problem(os.path.join(self.directory, str(step)))
      if problem:  # orbax's manager would fail on it at once, and every time
        self._set_aside(step, problem)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers=dict(state=ocp.StandardCheckpointHandler(),
                           data=ocp.JsonCheckpointHandler()))

  def steps(self):
    """Committed checkpoint steps, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step, state, data_state):
    """Starts saving `state` and the iterator's `data_state` as `step`.

    A step already on disk is left as it is (a resumed run that ends where it
    started saves nothing new). errors.DiskFull if this or an earlier
    asynchronous save ran out of space.
    """
    if step in self._manager.all_steps():
      return
    self._nbytes = sum(x.nbytes for x in jax.tree.leaves(state)
                       if hasattr(x, "nbytes"))
    with self._saving():
      self._manager.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state),
              data=ocp.args.JsonSave(data_state)),
          force=True)
    self._pending = True

  @contextlib.contextmanager
  def _saving(self):
    """Around orbax's saves: a failed write stops the others it started
    (_failed_reads_stopped: no "Event loop is closed" tracebacks), and an
    error that is ENOSPC becomes DiskFull."""
    try:
      with _failed_reads_stopped():
        yield
    except Exception as e:  # pylint: disable=broad-except
      if not errors.is_disk_full(e):
        raise
      for name in os.listdir(self.directory):
        if _TMP_SUFFIX in name:  # the failed step's, never committed
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      raise errors.disk_full(self.directory, self._nbytes) from None

  def check(self):
    """Raises the error (errors.DiskFull for ENOSPC) of an asynchronous save
    that has failed; returns at once while it is still running."""
    if self._pending and not self._manager.is_saving_in_progress():
      self.wait()

  def restore_latest(self, abstract_state):
    """Returns (step, state, data_state) of the newest usable checkpoint.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings; the
    state comes back with those shardings (so it may be restored onto another
    mesh). A newer checkpoint that cannot be read, or whose state holds NaN
    or Inf (`non_finite`: parameters and optimizer state, each shard checked
    where it lies), is set aside with a warning. Returns None when there is
    no usable checkpoint; CheckpointMismatch when the newest readable one
    holds other arrays than `abstract_state` (`_check_fits`).
    """
    wanted = _leaf_shapes(abstract_state)
    for step in reversed(self.steps()):
      self._check_fits(step, wanted)
      try:
        with _failed_reads_stopped():
          restored = self._manager.restore(
              step,
              args=ocp.args.Composite(
                  state=ocp.args.StandardRestore(abstract_state),
                  data=ocp.args.JsonRestore()))
        if self._data_kind is not None:
          records.check(self._data_kind, restored["data"],
                        _data_item_file(self.directory, step))
      except Exception as e:  # pylint: disable=broad-except
        # Orbax and tensorstore raise many types for unreadable files.
        self._set_aside(step, _first_cause(e))
        continue
      bad = non_finite(restored["state"])
      if bad:  # parameters or optimizer state: damaged (never saved so)
        self._set_aside(step, f"its state {bad}", unusable=True)
        continue
      return step, restored["state"], restored["data"]
    return None

  def _check_fits(self, step, wanted):
    """CheckpointMismatch if the metadata of `step` is readable and its
    arrays differ from `wanted` (names or shapes: _mismatch); an unreadable
    one is left to the restore."""
    try:
      with _failed_reads_stopped():
        saved = self._manager.item_metadata(step)["state"]
      saved = _leaf_shapes(getattr(saved, "tree", saved))
    except Exception:  # pylint: disable=broad-except
      return
    if not saved:
      return
    why = _mismatch(saved, wanted)
    if why:
      raise CheckpointMismatch(
          f"the checkpoint at step {step} in {self.directory} does not fit "
          f"this config ({why}); it is readable and was left in place. Run "
          "with the config it was written with (config.json), or use a new "
          "workdir.")

  def _set_aside(self, step, why, unusable=False):
    """Moves an unreadable (or `unusable`: readable but damaged) checkpoint
    out of the way, with a warning saying `why`."""
    src = os.path.join(self.directory, str(step))
    dst_dir = self._set_aside_to
    os.makedirs(dst_dir, exist_ok=True)
    dst, n = os.path.join(dst_dir, str(step)), 1
    while os.path.exists(dst):
      n += 1
      dst = os.path.join(dst_dir, f"{step}.{n}")
    shutil.move(src, dst)
    logging.warning(
        "Checkpoint at step %d %s (%s); moved it to %s and falling back to "
        "the previous checkpoint.", step,
        "cannot be used" if unusable else "could not be read", why, dst)
    if self._manager is not None:
      self._manager.reload()

  def wait(self):
    """Blocks until pending asynchronous saves are committed."""
    self._pending = False
    with self._saving():
      self._manager.wait_until_finished()

  def close(self):
    self._manager.close()


def _step_metadata_problem(step_dir):
  """Why orbax cannot use `step_dir`/_CHECKPOINT_METADATA, or "" (fine, or
  absent: orbax then does without). Checked with orbax's own reader."""
  path = os.path.join(step_dir, _STEP_METADATA)
  if _read_step_metadata is None or not os.path.exists(path):
    return ""
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError):
    return ""  # not JSON at all: orbax reads it as empty and goes on
  try:
    _read_step_metadata(value)
  except Exception as e:  # pylint: disable=broad-except
    return f"{path}: {_first_cause(e)}"
  return ""


def is_checkpoint(path):
  """True when `path` is the folder of one checkpoint (it holds the state item)."""
  return os.path.isdir(os.path.join(path, "state"))


def committed_steps(directory):
  """Steps of the committed checkpoints under `directory`, oldest first.

  Read-only (no manager is created): orbax commits a step by renaming its
  temporary folder to the bare step number.
  """
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and is_checkpoint(os.path.join(directory, name)))


def _data_item_file(directory, step):
  """The file of checkpoint `step`'s JSON item (orbax's JsonCheckpointHandler)."""
  return os.path.join(directory, str(step), "data", "metadata")


def data_item(directory, step, kind):
  """The JSON item of checkpoint `step` under `directory` (what `save` got as
  data_state), read without a manager and checked against records.`kind`;
  records.RecordError when it is missing, unreadable or of another shape."""
  return records.read(kind, _data_item_file(directory, step))


class CheckpointUnreadable(errors.UserError):
  """No checkpoint asked for (or older) can be read."""


def restore_params_newest(directory, step, abstract_params, *, fall_back=True):
  """(step, params) of checkpoint `step` under `directory` (restore_params),
  or, when it cannot be read and `fall_back`, of the newest older one that
  can, saying on stderr which was damaged. CheckpointUnreadable, one line
  naming the step and why, when none can; CheckpointMismatch (restore_params)
  when a readable one holds another model."""
  steps = [s for s in committed_steps(directory) if s <= step] if fall_back else [step]
  damaged = []
  for candidate in reversed(steps or [step]):
    try:
      with _failed_reads_stopped():
        params = restore_params(directory, candidate, abstract_params)
    except CheckpointMismatch:
      raise  # readable, of another model: no older one would fit either
    except Exception as e:  # pylint: disable=broad-except
      damaged.append(f"step {candidate} ({_first_cause(e)})")
      continue
    if damaged:
      print(f"fp4jax: the checkpoint at {damaged[0]} in {directory} cannot be "
            f"read; using step {candidate}, the newest readable one",
            file=sys.stderr, flush=True)
    return candidate, params
  others = [s for s in committed_steps(directory) if s != step]
  raise CheckpointUnreadable(
      f"the checkpoint at {damaged[0]} in {directory} cannot be read" + (
          f"; its other checkpoints: {others}" if not fall_back else
          f", nor any of the {len(damaged) - 1} before it" if len(damaged) > 1 else
          ", and there is none before it"))


def restore_params(directory, step, abstract_params):
  """Only the parameters of checkpoint `step` under `directory`.

  `abstract_params` is a pytree of jax.ShapeDtypeStruct with shardings (the
  TrainState's `params`); each process reads the parts its devices hold.
  Returns the params pytree of jax.Array. The checkpoint's parameters must
  be exactly those asked, every name and shape (read from its metadata
  first): CheckpointMismatch, one line naming the first difference, when
  not (a config.json that describes another model than its checkpoints).
  """
  item = {"params": abstract_params}
  state_dir = os.path.join(os.path.abspath(atomic.resolved(directory)), str(step), "state")
  saved = _saved_leaf_shapes(state_dir)
  if saved is not None:
    why = _mismatch({k: v for k, v in saved.items() if k.startswith("params/")},
                    _leaf_shapes(item))
    if why:
      raise CheckpointMismatch(
          f"the checkpoint at step {step} in {directory} does not hold the "
          f"model asked ({why}); it was left in place. The run's config.json "
          "must describe the model its checkpoints hold.")
  restored = ocp.PyTreeCheckpointer().restore(
      state_dir,
      args=ocp.args.PyTreeRestore(
          item=item,
          restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True))
  return restored["params"]
