"""Runs a study's runs side by side, each in a process of its own pinned to its own cores.

`slots(parallel, cpus_per_run)` chooses the cores of each place a run can
take; `run(jobs, slots, target, on_end)` starts `target(*job)` in a child
process per job, as many at once as there are slots, and calls
`on_end(job, exitcode)` here as each ends, in the order they end.

A run's bits depend on how many cores its process has (XLA's CPU thread
pool is as large as the process's CPU affinity, and splits some reductions
by it), never on how many runs share the machine: so a study records
cpus_per_run and not parallel. A child has a process group of its own, so a
terminal's Ctrl-C reaches only this process, which passes each SIGINT or
SIGTERM on to the running children once (the first one: they checkpoint and
stop) and starts no more.
"""

import multiprocessing
import multiprocessing.connection
import os
import signal

from fp4jax import errors


def slots(parallel, cpus_per_run, cores=None) -> list:
  """The cores of each run slot: a list of tuples, or [None] (one run, not pinned).

  parallel: runs at once (0: as many as fit the cores); cpus_per_run: cores
  per run (0: one run at a time on every core, not pinned); cores: the cores
  to use (default: this process's CPU affinity). UserError when they ask for
  more cores than there are.
  """
  cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
  if parallel < 0 or cpus_per_run < 0:
    raise errors.UserError(
        f"config.ablation.parallel={parallel} and cpus_per_run={cpus_per_run} must be >= 0")
  if cpus_per_run == 0:
    if parallel > 1:
      raise errors.UserError(
          f"config.ablation.parallel={parallel} needs cpus_per_run >= 1 (0 runs one run "
          "at a time on every core)")
    return [None]
  count = parallel or max(1, len(cores) // cpus_per_run)
  if count * cpus_per_run > len(cores):
    asked = (f"config.ablation.parallel={count} x cpus_per_run={cpus_per_run}" if parallel
             else f"config.ablation.cpus_per_run={cpus_per_run}")
    raise errors.UserError(
        f"{asked} needs {count * cpus_per_run} cores; this process has {len(cores)} "
        f"({cores}): ask for fewer (cpus_per_run=0: one run at a time on every core)")
  return [tuple(cores[i * cpus_per_run:(i + 1) * cpus_per_run]) for i in range(count)]


def _child(cores, target, args):
  os.setpgrp()
  if cores is not None:
    os.sched_setaffinity(0, cores)
  target(*args)


class PassOnSignals:
  """While open: SIGINT/SIGTERM call pass_on(signum) (each time) and the first
  also stops new starts (`received` names it); count() says how many runs are
  in progress."""

  def __init__(self, pass_on, count):
    self.received = None
    self._pass_on = pass_on
    self._count = count
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.received is None:
      self.received = signal.Signals(signum).name
      print(f"\n{self.received} received: passed on to the {self._count()} runs "
            "in progress (each saves a checkpoint and stops); no new run starts.", flush=True)
    self._pass_on(signum)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def run(jobs, run_slots, target, on_end) -> str | None:
  """Runs target(*job) for each job in a child process, len(run_slots) at a
  time, each pinned to a free slot's cores; on_end(job, exitcode) runs here
  as each ends. Returns the name of the signal that stopped it, or None."""
  context = multiprocessing.get_context("spawn")
  todo, running = list(jobs), {}  # slot index -> process
  owner = {}

  def pass_on(signum):
    for process in running.values():
      if process.is_alive():
        os.kill(process.pid, signum)

  with PassOnSignals(pass_on, lambda: len(running)) as signals:
    while todo or running:
      free = [i for i in range(len(run_slots)) if i not in running]
      while free and todo and not signals.received:
        job, slot = todo.pop(0), free.pop(0)
        process = context.Process(target=_child, args=(run_slots[slot], target, job))
        process.start()
        running[slot], owner[slot] = process, job
      if not running:
        break
      sentinels = {p.sentinel: slot for slot, p in running.items()}
      # Woken each second: a signal delivered to another thread of this process
      # does not interrupt the wait, and Python runs handlers in this thread only.
      for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=1.0):
        slot = sentinels[sentinel]
        process = running.pop(slot)
        process.join()
        on_end(owner.pop(slot), process.exitcode)
  return signals.received
