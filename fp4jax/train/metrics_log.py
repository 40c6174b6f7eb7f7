"""Where a run's numbers go: metrics.jsonl, TensorBoard, and a progress line.

Only process 0 writes (`enabled=False` elsewhere). metrics.jsonl holds one
JSON object per logged step; non-finite floats are written as NaN/Infinity
(Python's json reads them back). `read_metrics` is the one reader of it
(trainer, plot, report): it skips a half-written last line, which a run in
progress or a killed one leaves, and names any other damaged line.
"""

import errno
import json
import math
import os
import sys
import time

from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import run_layout


class MetricsError(errors.UserError):
  """A line of metrics.jsonl other than the last one is not a JSON row."""


def read_metrics(workdir):
  """Returns the rows of WORKDIR/metrics.jsonl as a list of dicts.

  A last line that does not parse (being written, or cut by a kill) is
  skipped; MetricsError names any other line that does not, and any row
  that is not a records.MetricsRow (a step that is not an integer, ...).
  """
  path = run_layout.metrics_file(workdir)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = [(i + 1, line) for i, line in enumerate(f) if line.strip()]
  rows = []
  for k, (number, line) in enumerate(lines):
    try:
      row = json.loads(line)
    except ValueError as e:
      if k == len(lines) - 1:
        break
      raise MetricsError(f"{path} line {number} is not a JSON row ({e}); "
                         "repair or delete that line") from None
    try:
      rows.append(records.check(records.MetricsRow, row, f"{path} line {number}"))
    except records.RecordError as e:
      raise MetricsError(f"{e}; repair or delete that line") from None
  return rows


def _truncate_after(path, step):
  """Drops rows with row["step"] > step (left by a run killed after `step`).

  Rewrites the file (atomically) only when a row is dropped.
  """
  if not os.path.exists(path):
    return
  with open(path) as f:
    text = f.read()
  rows = [line + "\n" for line in text.splitlines() if line.strip()]
  kept = [line for line in rows if row_step(line) <= step]
  if len(kept) < len(rows) or "".join(kept) != text:
    atomic.write_text(path, "".join(kept))


def row_step(line):
  """A row's step; inf for a line a killed run left half-written."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


def _append(path, line):
  """Appends `line`; on a full disk, cuts the file back to its old end (no
  half row) and raises errors.DiskFull."""
  size = os.path.getsize(path) if os.path.exists(path) else 0
  try:
    with open(path, "a") as f:
      f.write(line)
      f.flush()
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    with open(path, "r+") as f:
      f.truncate(size)
    raise errors.disk_full(path, len(line)) from None


def _tensorboard_writer(logdir):
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tensorboardX.SummaryWriter(logdir)


class MetricsLog:
  """Appends metric rows to metrics.jsonl and TensorBoard; prints progress.

  `start_step` is the step the run (re)starts from: rows a killed run wrote
  after it (all rows, for a fresh start at step 0, which logs step 0 again)
  are dropped so the file describes one consistent history. `sinks`: more
  destinations of the rows, each with write(row) and close() (e.g.
  fp4jax.train.wandb_log).
  """

  def __init__(self, workdir, *, total_steps, start_step, enabled=True,
               sinks=(), clock=time.monotonic):
    self.enabled = enabled
    self.total_steps = total_steps
    self._path = run_layout.metrics_file(workdir)
    self._tty = sys.stdout.isatty()
    self._clock = clock
    self._first = None  # (clock, step) at the first row after start_step
    self._start_step = start_step
    self._tb = None
    self._sinks = tuple(sinks)
    if enabled:
      _truncate_after(self._path, start_step if start_step else -1)
      self._tb = _tensorboard_writer(run_layout.tensorboard(workdir))

  def write(self, row):
    """Appends one row (a dict with at least "step") and shows progress."""
    if not self.enabled:
      return
    _append(self._path, json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, row["step"])
      self._tb.flush()
    for sink in self._sinks:
      sink.write(row)
    self._progress(row)

  def _progress(self, row):
    step = row["step"]
    eta = self._eta(step)
    width = 24
    filled = int(width * step / max(self.total_steps, 1))
    parts = [f"[{'#' * filled}{'.' * (width - filled)}] "
             f"{step}/{self.total_steps}"]
    for key, fmt in (("loss", ".4f"), ("eval_loss", ".4f"),
                     ("tokens_per_s", ",.0f")):
      if row.get(key) is not None:
        parts.append(f"{key} {row[key]:{fmt}}")
    parts.append(f"ETA {_duration(eta)}")
    line = "  ".join(parts)
    if self._tty:
      sys.stdout.write("\r" + line.ljust(110))
    else:
      sys.stdout.write(line + "\n")
    sys.stdout.flush()

  def _eta(self, step):
    """Seconds left at `step`, at the rate of the steps after the first row
    past start_step: the steps up to that row include compiling the train
    step, which would inflate the estimate many times over on a short run
    (NaN, shown as "?", until a second row comes)."""
    if step <= self._start_step:
      return math.nan
    now = self._clock()
    if self._first is None:
      self._first = (now, step)
    since, first_step = self._first
    if step == first_step:
      return math.nan
    return (now - since) / (step - first_step) * (self.total_steps - step)

  def close(self):
    if self._tb is not None:
      self._tb.close()
    for sink in self._sinks:
      sink.close()
    if self.enabled and self._tty:
      sys.stdout.write("\n")


def _duration(seconds):
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 60}:{seconds % 60:02d}"
