"""Validation loss against tokens for several runs, in one PNG.

  python -m fp4jax.plot runs/a runs/b -o curves.png [--labels A B] [--title T]

Each run is a workdir written by fp4jax.train.trainer (its metrics.jsonl rows that
carry an eval_loss). A run's label defaults to its directory name and recipe.
OUT's extension names the image format (png, pdf, svg, ...); any other name
(a run's config.json, a folder, a name without one) is refused in one line
before anything is drawn, and so is an OUT that is a symbolic link or lies
inside a run or a checkpoint (run_layout.check_output_file: a plot never
writes over a run's files). The image is written atomically
(fp4jax.train.atomic): a reader sees the old file or the new one.
"""

import argparse
import io
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib.backend_bases import FigureCanvasBase  # pylint: disable=g-import-not-at-top

from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import run_layout
from fp4jax.train.metrics_log import read_metrics


def eval_curve(workdir):
  """(tokens, eval_loss) lists of a run, in step order (non-finite kept).

  UserError when `workdir` is not a directory, has no evaluated rows or a
  damaged row (a half-written last row, of a run in progress, is skipped).
  """
  if not os.path.isdir(workdir):
    raise errors.UserError(f"run directory {workdir!r} does not exist; give "
                           "workdirs written by train.py")
  rows = [r for r in read_metrics(workdir) if r.get("eval_loss") is not None]
  if not rows:
    raise errors.UserError(f"{workdir}: no metrics.jsonl rows with an "
                           "eval_loss")
  rows.sort(key=lambda r: r["step"])
  return [r["tokens"] for r in rows], [r["eval_loss"] for r in rows]


def _label(workdir):
  name = os.path.basename(os.path.normpath(workdir))
  try:
    recipe = run_layout.recipe_name(workdir)
  except records.RecordError:
    return name
  return name if recipe == name else f"{name} ({recipe})"


def check_out(out):
  """`out` as the OS resolves it (run_layout.output_path); UserError unless it
  names an image file by an extension matplotlib writes (it would add .png
  to a name without one, and refuse others late), and where no command
  writes (run_layout.check_output_file: not a symbolic link, nowhere inside
  a run or a checkpoint)."""
  formats = FigureCanvasBase.get_supported_filetypes()
  out = run_layout.output_path(out, "-o")
  extension = os.path.splitext(out)[1][1:].lower()
  if os.path.isdir(out) or extension not in formats:
    raise errors.UserError(f"-o {out!r} is not the name of an image file; give one "
                           f"ending in {', '.join('.' + f for f in sorted(formats))}")
  run_layout.check_output_file(out, "-o")
  return out


def plot_runs(workdirs, out, labels=None, title=None):
  """Draws every run's eval-loss curve into `out` (an image, `check_out`);
  returns `out`."""
  out = check_out(out)
  labels = labels or [_label(w) for w in workdirs]
  if len(labels) != len(workdirs):
    raise errors.UserError(f"{len(labels)} labels for {len(workdirs)} runs")
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for workdir, label in zip(workdirs, labels):
    tokens, losses = eval_curve(workdir)
    ax.plot(tokens, [l if math.isfinite(l) else math.nan for l in losses],
            marker="o", markersize=3, label=label)
  ax.set_xlabel("tokens")
  ax.set_ylabel("validation loss")
  ax.grid(True, alpha=0.3)
  ax.legend()
  if title:
    ax.set_title(title)
  fig.tight_layout()
  image = io.BytesIO()
  fig.savefig(image, dpi=120, format=os.path.splitext(out)[1][1:].lower())
  plt.close(fig)
  atomic.write_text(out, image.getvalue())
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m fp4jax.plot", description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", help="run directories")
  parser.add_argument("-o", "--out", default="eval_loss.png",
                      help="output image (its extension names the format: png, pdf, svg, ...)")
  parser.add_argument("--labels", nargs="+", help="one label per run")
  parser.add_argument("--title")
  args = parser.parse_args(argv)
  try:
    print(plot_runs(args.workdirs, args.out, args.labels, args.title))
  except errors.UserError as e:
    return errors.report(parser.prog, e)
  except OSError as e:  # the output PNG cannot be written
    return errors.report(parser.prog, f"cannot write {args.out!r}: {e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
