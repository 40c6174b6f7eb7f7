"""What the trainer prints after its summary: where the run's files are and
the commands that use them, spelled with the interpreter that trained, so
each works as printed (`.venv/bin/python -m ...` after `make train`,
`python -m ...` in an activated environment)."""

import os
import shlex
import shutil
import sys

from fp4jax.train import run_layout


def python_command(executable=None, path=None):
  """How a shell names this interpreter: "python" when that is what PATH
  (`path`, default $PATH) finds, as in an activated virtual environment;
  else its path, relative when it lies below the current folder."""
  executable = os.path.abspath(executable or sys.executable)
  found = shutil.which("python", path=path)
  if found and os.path.abspath(found) == executable:
    return "python"
  relative = os.path.relpath(executable)
  return executable if relative.startswith("..") else relative


def outputs_and_next(workdir, checkpoint_steps, python="python"):
  """Lines naming the run's files and, once it has a checkpoint, the
  commands to plot, sample, evaluate and export it (a Hugging Face folder;
  docs/export.md has the packed FP4 and llama.cpp forms)."""
  saved = f"steps {', '.join(map(str, checkpoint_steps))}" if checkpoint_steps else "none saved"
  files = [("metrics", run_layout.metrics_file(workdir), "a JSON row per logged step"),
           (run_layout.CHECKPOINTS, run_layout.checkpoints(workdir) + os.sep, saved),
           ("summary", run_layout.summary_file(workdir), "how the run ended"),
           ("config", run_layout.config_file(workdir), "the resolved config")]
  if os.path.isdir(run_layout.tensorboard(workdir)):
    files.append((run_layout.TENSORBOARD, run_layout.tensorboard(workdir) + os.sep, "TensorBoard events"))
  lines = [f"outputs in {workdir}"] + [f"  {name:<12} {path}  ({what})"
                                       for name, path, what in files]
  if not checkpoint_steps:
    return "\n".join(lines)
  beside = os.path.normpath(workdir)  # outputs go beside the run: none may go inside
  if os.path.basename(beside) in (".", ".."):
    beside = os.path.abspath(beside)
  run, py = shlex.quote(workdir), python
  commands = [("plot", f"{py} -m fp4jax.plot {run} -o {shlex.quote(beside + '.png')}"),
              ("sample", f"{py} -m fp4jax.generate {run} --prompt 'def '"),
              ("evaluate", f"{py} -m fp4jax.evaluate {run}"),
              ("export", f"{py} -m fp4jax.convert export {run} {shlex.quote(beside + '-hf')}")]
  return "\n".join(lines + ["next:"] + [f"  {name:<12} {command}" for name, command in commands])
