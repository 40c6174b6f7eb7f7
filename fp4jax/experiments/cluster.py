"""A study's runs as jobs of a cluster's scheduler, through submitit (optional: `pip install fp4jax[cluster]`).

`executor(kind, folder, cpus, params)` makes a submitit executor:
  "auto"    Slurm where there is one, else this machine (submitit's AutoExecutor);
  "slurm"   Slurm (refused where there is none);
  "local"   each job a process on this machine (submitit's local executor);
each job one task of `cpus` cores; `params` ("KEY=VALUE,...": timeout_min,
slurm_partition, gpus_per_node, mem_gb, ... as submitit names them) on top.
Its logs go to `folder`.

`run(jobs, target, on_end, executor, in_flight)` submits target(slot, *job)
for each job, at most `in_flight` at once (None: all), and calls
on_end(job, exitcode) here as each ends (0: returned; 1: raised or exited,
its error and log printed), in the order they end. `pinned(slot, cpus,
target, *args)` is what a job runs: it pins the job's process to `cpus` of
its cores (the slot-th block of them, so jobs side by side on one machine
take different cores) before target(*args): a run's bits depend on the
number of cores its process has, and a scheduler may grant more (hyper-
threads) than were asked for.

SIGINT or SIGTERM here cancels every job in flight once (Slurm sends it
SIGTERM, the local executor SIGINT: a run saves a checkpoint and stops),
waits for them, and starts no more; run() returns the signal's name. Each
run stays resumable and recorded as the runner records it: the same
command resumes it.
"""

import os
import time

from fp4jax import errors
from fp4jax.experiments import parallel

KINDS = {"auto": None, "slurm": "slurm", "local": "local"}
POLL_S = 1.0


def _value(text):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_params(text) -> dict:
  """{key: value} of "KEY=VALUE,..." (values int, float or str); UserError naming a bad entry."""
  out = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    key, eq, value = (x.strip() for x in item.partition("="))
    if not eq or not key:
      raise errors.UserError(f"config.ablation.executor_params entry {item!r} is not "
                             "KEY=VALUE (e.g. 'timeout_min=240,slurm_partition=gpu')")
    out[key] = _value(value)
  return out


def check(kind, params=""):
  """UserError (one line) for an executor kind not in KINDS or bad params."""
  if kind not in KINDS:
    raise errors.UserError(f"config.ablation.executor={kind!r} is not one of "
                           f"{', '.join(KINDS)} (or '' for processes on this machine)")
  parse_params(params)


def executor(kind, folder, cpus, params=""):
  """A submitit executor of `kind` (KINDS), one task of `cpus` cores a job,
  logs in `folder`; UserError when submitit is missing or refuses."""
  check(kind, params)
  try:
    import submitit  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise errors.UserError(f"config.ablation.executor={kind!r} needs submitit: "
                           "pip install 'fp4jax[cluster]'") from None
  try:
    ex = submitit.AutoExecutor(folder=folder, cluster=KINDS[kind])
    ex.update_parameters(cpus_per_task=cpus, tasks_per_node=1, nodes=1,
                         **parse_params(params))
  except (RuntimeError, ValueError, NameError) as e:
    raise errors.UserError(f"config.ablation.executor={kind!r}: {e}") from None
  return ex


def pinned(slot, cpus, target, *args):
  """target(*args) with this process pinned to the slot-th block of `cpus`
  of its cores (the block taken modulo how many blocks there are)."""
  cores = sorted(os.sched_getaffinity(0))
  blocks = max(1, len(cores) // cpus)
  start = (slot % blocks) * cpus
  os.sched_setaffinity(0, cores[start:start + cpus])
  return target(*args)


def _error_line(error) -> str:
  """The line that names a failed job's error: its traceback's last, else the first."""
  text = str(error).strip()
  parts = text.split("-" * 22)
  lines = (parts[1] if len(parts) > 2 else text).strip().splitlines()
  return (lines[-1] if len(parts) > 2 else lines[0]) if lines else type(error).__name__


def _exitcode(job) -> int:
  """0 when the job returned; else 1, its error and log printed."""
  error = job.exception()
  if error is None:
    return 0
  print(f"ablation: job {job.job_id} failed: {_error_line(error)} (its log: "
        f"{job.paths.stderr})", flush=True)
  return 1


def run(jobs, target, on_end, ex, in_flight=None) -> str | None:
  """Submits target(slot, *job) per job on `ex`, at most `in_flight` at once;
  on_end(job, exitcode) here as each ends. Returns the name of the signal
  that stopped it, or None."""
  todo, running = list(jobs), {}  # submitit job -> (job, slot)
  limit = in_flight or len(todo)

  def cancel(signum):
    del signum
    for job in running:
      job.cancel(check=False)

  with parallel.PassOnSignals(cancel, lambda: len(running)) as signals:
    while todo or running:
      free = sorted(set(range(limit)) - {slot for _, slot in running.values()})
      while free and todo and not signals.received:
        job, slot = todo.pop(0), free.pop(0)
        running[ex.submit(target, slot, *job)] = (job, slot)
      if not running:
        break
      ended = [j for j in running if j.done()]
      for j in ended:
        on_end(running.pop(j)[0], _exitcode(j))
      if not ended:
        time.sleep(POLL_S)
  return signals.received
