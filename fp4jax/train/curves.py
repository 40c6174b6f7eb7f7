"""Validation loss against tokens for several runs, and each one's difference
from a baseline run: the figure a comparison of recipes reads.

  python -m fp4jax.plot runs/a runs/b -o curves.png [--baseline runs/a]
      [--all | --from_tokens N] [--train_loss] [--labels A B] [--title T]

Each run is a workdir written by fp4jax.train.trainer (its metrics.jsonl
rows that carry an eval_loss). Tokens are on a log axis; the evaluations
before FROM_FRACTION of the longest run's tokens are left out (`--all`
shows every one, step 0 included; `--from_tokens N` sets the cut), so the
range where recipes differ fills the figure. Bands are 95% intervals: of a
loss, from its logged eval_loss_se; of a
difference from `--baseline`, the standard error of the difference of the
validation batches' losses (eval_batch_losses) when both runs evaluated the
same batches (same data, tokenizer, sequence length and evaluation batches
in config.json), else sqrt(se^2 + se_baseline^2); each with Student's t
quantile for the number of validation batches (the normal's 1.96 when that
is not logged). `--train_loss` adds the
training loss (thin lines). The final evaluations and differences are
printed as a table. A run's label defaults to its directory name and recipe.

OUT's extension names the image format (png, pdf, svg, ...); any other name
(a run's config.json, a folder, a name without one) is refused in one line
before anything is drawn, and so is an OUT that is a symbolic link or lies
inside a run or a checkpoint (run_layout.check_output_file: a plot never
writes over a run's files). The image is written atomically
(fp4jax.train.atomic): a reader sees the old file or the new one.
"""

import argparse
import dataclasses
import io
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import ticker  # pylint: disable=g-import-not-at-top
from matplotlib.backend_bases import FigureCanvasBase  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from scipy import stats  # pylint: disable=g-import-not-at-top

from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import run_layout
from fp4jax.train.metrics_log import read_metrics

Z95 = 1.959964  # a normal's two-sided 95% quantile (the batch count unknown)
FROM_FRACTION = 0.25  # the default cut, as a fraction of the longest run's tokens
_VALIDATION_KEYS = ("data", "seq_len", "batch_size", "micro_batch", "eval_batches",
                    "eval_batch_size")


@dataclasses.dataclass(frozen=True)
class Curve:
  """A run's evaluations in step order (E of them) and its training losses (T).

  tokens [E], loss [E] (non-finite kept), se [E] (eval_loss_se; NaN where
  not logged), batch_losses: E tuples (eval_batch_losses; () where not
  logged); train_tokens [T], train_loss [T]; validation: what its evaluation
  batches depend on (config.json; None when unreadable).
  """
  tokens: np.ndarray
  loss: np.ndarray
  se: np.ndarray
  batch_losses: tuple
  train_tokens: np.ndarray
  train_loss: np.ndarray
  validation: str | None

  @property
  def batches(self):
    """[E] the validation batches of each evaluation (0 where not logged)."""
    return np.array([len(b) for b in self.batch_losses], int)


def half_width(se, batches):
  """[N] the 95% interval's half-width of means with standard errors `se` [N]
  over `batches` [N]: Student's t with batches - 1 degrees of freedom, the
  normal's where a count is below 2 (not logged)."""
  batches = np.asarray(batches)
  quantile = np.where(batches > 1, stats.t.ppf(0.975, np.maximum(batches - 1, 1)), Z95)
  return quantile * np.asarray(se)


def _number(row, key, where):
  """row[key] as a float (NaN when absent or null); UserError when it is not a number."""
  value = row.get(key)
  if value is None:
    return math.nan
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise errors.UserError(f"{where}: step {row['step']}'s {key} is {value!r}, not a number")
  return float(value)


def _batch_losses(row, where):
  """row's eval_batch_losses as a tuple of floats (() when absent); UserError
  when it is not a list of numbers."""
  losses = row.get("eval_batch_losses") or []
  if not isinstance(losses, list) or not all(
      isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
    raise errors.UserError(f"{where}: step {row['step']}'s eval_batch_losses is "
                           f"{losses!r}, not a list of numbers")
  return tuple(float(x) for x in losses)


def _validation(workdir):
  """What a run's validation batches are made from (JSON text), or None."""
  saved, _ = run_layout.saved_config(workdir)
  if saved is None:
    return None
  data = saved["resolved"].get("data")
  fingerprint = data.get("validation") if isinstance(data, dict) else None
  return json.dumps([saved.get(k) for k in _VALIDATION_KEYS] + [fingerprint], sort_keys=True)


def read_curve(workdir):
  """The Curve of `workdir`. UserError when it is not a directory, has no
  evaluated rows or a damaged row (a half-written last row, of a run in
  progress, is skipped)."""
  if not os.path.isdir(workdir):
    raise errors.UserError(f"run directory {workdir!r} does not exist; give "
                           "workdirs written by train.py")
  rows = sorted(read_metrics(workdir), key=lambda r: r["step"])
  evals = [r for r in rows if r.get("eval_loss") is not None]
  if not evals:
    raise errors.UserError(f"{workdir}: no metrics.jsonl rows with an eval_loss")
  train = [r for r in rows if r.get("loss") is not None and r.get("tokens") is not None]
  where = run_layout.metrics_file(workdir)
  return Curve(
      tokens=np.array([r["tokens"] for r in evals], np.float64),
      loss=np.array([r["eval_loss"] for r in evals], np.float64),
      se=np.array([_number(r, "eval_loss_se", where) for r in evals]),
      batch_losses=tuple(_batch_losses(r, where) for r in evals),
      train_tokens=np.array([r["tokens"] for r in train], np.float64),
      train_loss=np.array([r["loss"] for r in train], np.float64),
      validation=_validation(workdir))


def eval_curve(workdir):
  """(tokens, eval_loss) lists of a run, in step order (read_curve)."""
  curve = read_curve(workdir)
  return [int(t) for t in curve.tokens], list(curve.loss)


def difference(curve, base):
  """(tokens [D], curve's loss - base's [D], standard error [D], batches [D])
  at the token counts both evaluated. When both runs evaluated the same
  batches with a standard error logged: the standard error of the mean of the
  batch-loss differences, over that many batches; else sqrt(se^2 + se_base^2)
  (NaN where one is unknown) over the smaller batch count (conservative)."""
  at = {t: i for i, t in enumerate(base.tokens)}
  pairs = [(i, at[t]) for i, t in enumerate(curve.tokens) if t in at]
  i, j = (np.array(x, int) for x in zip(*pairs)) if pairs else (np.zeros(0, int),) * 2
  se = np.sqrt(curve.se[i] ** 2 + base.se[j] ** 2)
  batches = np.minimum(curve.batches[i], base.batches[j])
  if curve.validation is not None and curve.validation == base.validation:
    for k, (a, b) in enumerate(zip(i, j)):
      da, db = curve.batch_losses[a], base.batch_losses[b]
      if len(da) == len(db) > 1 and math.isfinite(se[k]):
        d = np.subtract(da, db)
        se[k] = d.std(ddof=1) / math.sqrt(d.size)
  return curve.tokens[i], curve.loss[i] - base.loss[j], se, batches


def first_shown(curves, from_tokens=None):
  """The fewest tokens an evaluation is drawn at: `from_tokens` when given,
  else FROM_FRACTION of the longest run's last evaluated tokens."""
  if from_tokens is not None:
    return from_tokens
  return FROM_FRACTION * max(c.tokens[-1] for c in curves)


def _label(workdir):
  name = os.path.basename(os.path.normpath(workdir))
  try:
    recipe = run_layout.recipe_name(workdir)
  except records.RecordError:
    return name
  return name if recipe in (None, name) else f"{name} ({recipe})"


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


def _baseline_index(workdirs, baseline):
  """The position of `baseline` among `workdirs` (the same directory), or UserError."""
  same = [i for i, w in enumerate(workdirs)
          if os.path.realpath(w) == os.path.realpath(baseline)]
  if not same:
    raise errors.UserError(f"--baseline {baseline!r} is not among the runs given "
                           f"({', '.join(workdirs)}); name one of them")
  return same[0]


def _band(ax, x, y, half, color):
  known = np.isfinite(half)
  if known.any():
    ax.fill_between(x, np.where(known, y - half, np.nan), np.where(known, y + half, np.nan),
                    color=color, alpha=0.18, lw=0)


def _y_range(curves, shown, train_shown=None):
  """(low, high) of the bands (and the training losses in train_shown) of the
  runs whose shown evaluations are all finite."""
  lows, highs = [], []
  for k, (c, keep) in enumerate(zip(curves, shown)):
    y, half = c.loss[keep], np.nan_to_num(half_width(c.se[keep], c.batches[keep]))
    if y.size and np.all(np.isfinite(y)):
      train = c.train_loss[train_shown[k]] if train_shown else np.zeros(0)
      train = train[np.isfinite(train)]
      lows.append(min((y - half).min(), train.min(initial=np.inf)))
      highs.append(max((y + half).max(), train.max(initial=-np.inf)))
  if not lows:
    return None
  low, high = min(lows), max(highs)
  pad = 0.06 * (high - low) + 1e-3
  return low - pad, high + pad


def figure(curves, labels, baseline=None, from_tokens=0.0, train_loss=False, title=None):
  """The matplotlib Figure: validation loss (top) and, with `baseline` (an
  index into curves), each other run's difference from it (below)."""
  rows = 1 if baseline is None else 2
  fig, axes = plt.subplots(rows, 1, figsize=(7.5, 4.2 + 2.8 * (rows - 1)), sharex=True,
                           squeeze=False, gridspec_kw=dict(height_ratios=[3, 2][:rows]))
  top = axes[0, 0]
  colors = plt.get_cmap("tab10")
  shown = [(c.tokens >= from_tokens) & ((c.tokens > 0) | (from_tokens <= 0)) for c in curves]
  train_shown = [c.train_tokens >= from_tokens for c in curves] if train_loss else None
  for k, (c, label, keep) in enumerate(zip(curves, labels, shown)):
    color = colors(k % 10)
    if train_loss:
      t = train_shown[k]
      top.plot(c.train_tokens[t], c.train_loss[t], color=color, lw=0.7, alpha=0.45)
    top.plot(c.tokens[keep], np.where(np.isfinite(c.loss[keep]), c.loss[keep], np.nan),
             color=color, marker="o", ms=3, lw=1.4, label=label)
    _band(top, c.tokens[keep], c.loss[keep], half_width(c.se[keep], c.batches[keep]), color)
  y_range = _y_range(curves, shown, train_shown)
  if y_range:
    top.set_ylim(*y_range)
  top.set_ylabel("validation loss" + (" (thin: training)" if train_loss else ""))
  top.legend(fontsize=8)
  top.set_title(title or "validation loss, 95% bands from eval_loss_se", fontsize=10)
  if baseline is not None:
    ax = axes[1, 0]
    ax.axhline(0.0, color=colors(baseline % 10), lw=1.2, label=f"{labels[baseline]} (baseline)")
    for k, (c, label) in enumerate(zip(curves, labels)):
      if k == baseline:
        continue
      x, d, se, batches = difference(c, curves[baseline])
      keep = (x >= from_tokens) & ((x > 0) | (from_tokens <= 0))
      ax.plot(x[keep], d[keep], color=colors(k % 10), marker="o", ms=3, lw=1.4, label=label)
      _band(ax, x[keep], d[keep], half_width(se[keep], batches[keep]), colors(k % 10))
    ax.set_ylabel(f"validation loss minus {labels[baseline]}")
    ax.set_title("difference from the baseline, 95% bands (paired over the validation batches)",
                 fontsize=9)
    ax.legend(fontsize=8)
  bottom = axes[-1, 0]
  xs = np.concatenate([c.tokens[keep] for c, keep in zip(curves, shown)])
  if from_tokens <= 0 and (xs == 0).any():
    linear = float(xs[xs > 0].min()) if (xs > 0).any() else 1.0
    bottom.set_xscale("symlog", linthresh=linear)
    bottom.set_xlabel(f"tokens (log scale; linear below {linear:,.0f})")
  else:
    bottom.set_xscale("log")
    decades = math.log10(xs.max() / xs.min()) if xs.size and xs.min() > 0 else 0.0
    subs = (1.0, 2.0, 3.0, 5.0, 7.0) if decades < 1.5 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
    bottom.xaxis.set_major_locator(ticker.LogLocator(subs=subs))
  bottom.xaxis.set_major_formatter(ticker.FuncFormatter(
      lambda x, _: f"{x / 1e9:g}B" if x >= 1e9 else f"{x / 1e6:g}M" if x >= 1e6
      else f"{x / 1e3:g}k" if x >= 1e3 else f"{x:g}"))
  bottom.xaxis.set_minor_formatter(ticker.NullFormatter())
  if not bottom.get_xlabel():
    bottom.set_xlabel("tokens (log scale)")
  for ax in axes[:, 0]:
    ax.grid(True, which="both", alpha=0.25)
  fig.tight_layout()
  return fig


def table(curves, labels, baseline=None):
  """Lines: each run's last evaluation (tokens, loss +- 95%) and, with
  `baseline`, its last difference from it at tokens both evaluated."""
  width = max(len(l) for l in labels)
  head = f"{'run':<{width}}  {'tokens':>12}  {'eval loss +- 95%':>18}"
  if baseline is not None:
    head += f"  {'minus ' + labels[baseline] + ' +- 95%':>22}"
  lines = [head]
  for k, (c, label) in enumerate(zip(curves, labels)):
    line = (f"{label:<{width}}  {int(c.tokens[-1]):>12,}  "
            f"{_pm(c.loss[-1], c.se[-1], c.batches[-1]):>18}")
    if baseline is not None and k != baseline:
      x, d, se, batches = difference(c, curves[baseline])
      line += f"  {_pm(d[-1], se[-1], batches[-1], '+.4f') if x.size else 'no common tokens':>22}"
    lines.append(line)
  return lines


def _pm(value, se, batches, fmt=".4f"):
  half = float(half_width(se, batches))
  return f"{value:{fmt}}" + (f" +- {half:.4f}" if math.isfinite(half) else "")


def plot_runs(workdirs, out, labels=None, title=None, baseline=None, from_tokens=None,
              train_loss=False):
  """Draws the runs into `out` (an image, `check_out`); returns (out, the table's lines)."""
  out = check_out(out)
  labels = labels or [_label(w) for w in workdirs]
  if len(labels) != len(workdirs):
    raise errors.UserError(f"{len(labels)} labels for {len(workdirs)} runs")
  if from_tokens is not None and from_tokens < 0:
    raise errors.UserError(f"--from_tokens {from_tokens} is negative; give 0 or more")
  index = None if baseline is None else _baseline_index(workdirs, baseline)
  curves = [read_curve(w) for w in workdirs]
  last = max(c.tokens[-1] for c in curves)
  if from_tokens is not None and from_tokens > last:
    raise errors.UserError(f"--from_tokens {from_tokens:g} leaves no evaluation to draw: the "
                           f"runs' last is at {last:,.0f} tokens")
  fig = figure(curves, labels, index, first_shown(curves, from_tokens), train_loss, title)
  image = io.BytesIO()
  fig.savefig(image, dpi=120, format=os.path.splitext(out)[1][1:].lower())
  plt.close(fig)
  atomic.write_text(out, image.getvalue())
  return out, table(curves, labels, index)


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m fp4jax.plot", description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", help="run directories")
  parser.add_argument("-o", "--out", default="eval_loss.png",
                      help="output image (its extension names the format: png, pdf, svg, ...)")
  parser.add_argument("--baseline", metavar="RUN",
                      help="one of the runs: a panel of every other run's difference from it")
  cut = parser.add_mutually_exclusive_group()
  cut.add_argument("--all", action="store_true",
                   help="draw every evaluation, step 0 included")
  cut.add_argument("--from_tokens", type=float, metavar="N",
                   help=f"draw the evaluations from N tokens on (default: {FROM_FRACTION:g} "
                        "of the longest run's tokens)")
  parser.add_argument("--train_loss", action="store_true", help="add the training loss")
  parser.add_argument("--labels", nargs="+", help="one label per run")
  parser.add_argument("--title")
  args = parser.parse_args(argv)
  try:
    out, lines = plot_runs(args.workdirs, args.out, args.labels, args.title, args.baseline,
                      0.0 if args.all else args.from_tokens, args.train_loss)
  except errors.UserError as e:
    return errors.report(parser.prog, e)
  except OSError as e:  # the output image cannot be written
    return errors.report(parser.prog, f"cannot write {args.out!r}: {e}")
  print("\n".join(lines + [f"wrote {out}"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
