"""User errors and how the command-line programs report them.

A user error (a bad config value, a file that cannot be read, a workdir in
use) is a `UserError`: the programs print it as one line, `PROG: message`,
and exit with status 2; a traceback means a bug. `did_you_mean` adds the
"did you mean" hint to an unknown name.

`exit_on_signals(prog)` makes SIGINT / SIGTERM during start-up (imports,
compilation, restoring a checkpoint: before the training loop installs its
own handlers, which save a checkpoint) print one line and end the process at
once with status 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
It leaves through os._exit: raising KeyboardInterrupt inside an import or
while native threads (XLA, tensorstore, grain) start can crash the
interpreter on its way out. Functions registered with `on_signal_exit` (the
workdir lock's release) run first. This module imports no JAX, so a CLI can
install the handlers before its heavy imports.
"""

import difflib
import os
import signal
import sys

_CLEANUPS = []


class UserError(ValueError):
  """A mistake in what the user gave (reported as one line, exit status 2)."""


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


def exit_on_signals(prog):
  """Installs the start-up handlers of SIGINT and SIGTERM for program `prog`."""

  def handle(signum, frame):
    del frame
    name = signal.Signals(signum).name
    print(f"{prog}: {name} during start-up; stopped before training began "
          "(nothing to save).", file=sys.stderr, flush=True)
    for fn in list(_CLEANUPS):
      try:
        fn()
      except Exception:  # pylint: disable=broad-except
        pass  # leaving anyway; a stale lock is detected on the next start
    os._exit(128 + signum)  # pylint: disable=protected-access

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, handle)


def report(prog, error):
  """Prints `error` as the one line `prog: message`; returns exit status 2."""
  print(f"{prog}: {error}", file=sys.stderr, flush=True)
  return 2
