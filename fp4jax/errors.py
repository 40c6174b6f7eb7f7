"""User errors and how the command-line programs report them.

A user error (a bad config value, a file that cannot be read, a workdir in
use) is a `UserError`: the programs print it as one line, `PROG: message`,
and exit with status 2; a traceback means a bug. `did_you_mean` adds the
"did you mean" hint to an unknown name.

A full disk is a `DiskFull` (also a UserError, so exit status 2): one line
naming the path that could not be written, the space the write needed and
the space free there (`disk_full`); `is_disk_full` recognises ENOSPC in an
error or anything it wraps (orbax and tensorstore wrap it in their own
exceptions).

`exit_on_signals(prog[, what])` makes SIGINT / SIGTERM during start-up (imports,
compilation, restoring a checkpoint: before the training loop installs its
own handlers, which save a checkpoint) print one line and end the process at
once with status 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
It leaves through os._exit: raising KeyboardInterrupt inside an import or
while native threads (XLA, tensorstore, grain) start can crash the
interpreter on its way out. Functions registered with `on_signal_exit` (the
workdir lock's release, an export's partial folder) run first. A command
that is not a training run (an export) passes its own `what`;
`exit_at_once` is the same exit for a second signal while a run saves. This module imports no JAX, so a CLI can
install the handlers before its heavy imports.
"""

import difflib
import errno
import os
import shutil
import signal
import sys

_CLEANUPS = []


class UserError(ValueError):
  """A mistake in what the user gave (reported as one line, exit status 2)."""


class DiskFull(UserError):
  """A write failed for lack of space (ENOSPC); nothing was half-written."""


def _size(nbytes):
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if nbytes >= scale:
      return f"{nbytes / scale:.1f} {unit}"
  return f"{int(nbytes)} bytes"


def disk_full(path, needed):
  """DiskFull for a write of `needed` bytes (None: unknown) to `path`."""
  directory = path
  while directory and not os.path.isdir(directory):
    directory = os.path.dirname(directory)
  try:
    free = _size(shutil.disk_usage(directory or ".").free) + " free"
  except OSError:
    free = "free space unknown"
  need = f"needs about {_size(needed)}" if needed else "needs more space"
  return DiskFull(f"no space left on the disk of {path!r}: the write {need} "
                  f"({free}); free some space or use another disk, then run "
                  "again (nothing written was kept half-done).")


def is_disk_full(error):
  """True if `error`, or an error it was raised from, is ENOSPC."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if getattr(error, "errno", None) == errno.ENOSPC or (
        "No space left on device" in str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def did_you_mean(name, allowed, prefix=""):
  """" (did you mean 'PREFIXx'?)" for the closest x of `allowed` to `name`,
  or ""."""
  close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
  return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def on_signal_exit(fn):
  """Registers fn() to run when a start-up signal ends the process."""
  _CLEANUPS.append(fn)


def forget_signal_exit(fn):
  if fn in _CLEANUPS:
    _CLEANUPS.remove(fn)


def exit_at_once(prog, signum, what):
  """Prints `prog: SIGNAME what`, runs the on_signal_exit functions and ends
  the process with status 128 + signum (no traceback, no unwinding)."""
  print(f"{prog}: {signal.Signals(signum).name} {what}", file=sys.stderr,
        flush=True)
  for fn in list(_CLEANUPS):
    try:
      fn()
    except Exception:  # pylint: disable=broad-except
      pass  # leaving anyway; a stale lock is detected on the next start
  os._exit(128 + signum)  # pylint: disable=protected-access


def exit_on_signals(prog, what="during start-up; stopped before training "
                    "began (nothing to save)."):
  """Installs handlers of SIGINT and SIGTERM for program `prog` that end it
  at once with the one line `prog: SIGNAME what` (exit_at_once)."""

  def handle(signum, frame):
    del frame
    exit_at_once(prog, signum, what)

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, handle)


def report(prog, error):
  """Prints `error` as the one line `prog: message`; returns exit status 2."""
  print(f"{prog}: {error}", file=sys.stderr, flush=True)
  return 2
