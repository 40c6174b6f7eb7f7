"""The ablation's figures: validation curves and quantization-error diagnostics.

`plot_curves` (curves.png), `plot_diagnostics` (one run's per-layer error
statistics over training) and `plot_diagnostics_summary` (Wgrad error size,
bias and step-to-step cosine per recipe). Runs are fp4jax.experiments.report
Run objects; diagnostics rows are metrics.jsonl rows with "diag/" keys.
"""

import math

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position


def _colors(recipes):
  cmap = plt.get_cmap("tab10")
  return {r: cmap(i % 10) for i, r in enumerate(recipes)}


def _paired_difference(rs, base):
  """[runs, evals] loss minus the same seed's baseline loss (None without a pair)."""
  by_seed = {r.seed: r for r in base}
  pairs = [(r, by_seed[r.seed]) for r in rs if r.seed in by_seed]
  if not pairs:
    return None, None
  n = min(min(r.tokens_T.size, b.tokens_T.size) for r, b in pairs)
  if n == 0 or any(not np.array_equal(r.tokens_T[:n], b.tokens_T[:n]) for r, b in pairs):
    return None, None
  return pairs[0][0].tokens_T[:n], np.stack([r.loss_T[:n] - b.loss_T[:n] for r, b in pairs])


def plot_curves(path, runs, zoom=0.5, target=None, baseline="fp8"):
  """curves.png: validation loss vs tokens for all recipes (left); the last
  `zoom` of the tokens (middle); and, when the baseline ran, each recipe's
  loss minus the same seed's baseline loss over those tokens (right).

  Several seeds: the mean line and a min-max band (seeds change the data order
  and the initialisation, so the band is wide; the paired difference is not);
  `target`: a dotted line (the mean target with per-seed targets).
  """
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=80)
  colors = _colors(runs)
  zoom_lo, zoom_hi = [], []
  t_max = max((r.tokens_T[-1] for rs in runs.values() for r in rs if r.tokens_T.size), default=1)
  t_min = (1 - zoom) * t_max
  base = [r for r in runs.get(baseline, []) if r.tokens_T.size]
  for recipe, rs in runs.items():
    rs = [r for r in rs if r.tokens_T.size]
    if not rs:
      continue
    n = min(r.tokens_T.size for r in rs)
    tokens = rs[0].tokens_T[:n]
    loss_SxT = np.stack([r.loss_T[:n] for r in rs])
    label = f"{recipe} (n={len(rs)})" if len(rs) > 1 else recipe
    for ax in axes[:2]:
      ax.plot(tokens, loss_SxT.mean(0), color=colors[recipe], label=label, lw=1.4)
      if len(rs) > 1:
        ax.fill_between(tokens, loss_SxT.min(0), loss_SxT.max(0), color=colors[recipe],
                        alpha=0.08, lw=0)
    tail = (tokens >= t_min) & np.all(np.isfinite(loss_SxT), 0)
    if tail.any():
      zoom_lo.append(loss_SxT[:, tail].min())
      zoom_hi.append(loss_SxT[:, tail].max())
    d_tokens, diff_SxT = _paired_difference(rs, base)
    if diff_SxT is not None:
      keep = d_tokens >= t_min
      axes[2].plot(d_tokens[keep], diff_SxT.mean(0)[keep], color=colors[recipe], label=label,
                   lw=1.4, marker=".", ms=3)
      if len(diff_SxT) > 1:
        axes[2].fill_between(d_tokens[keep], diff_SxT.min(0)[keep], diff_SxT.max(0)[keep],
                             color=colors[recipe], alpha=0.12, lw=0)
  for ax in axes:
    ax.set_xlabel("tokens")
    ax.xaxis.set_major_formatter(
        matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1e6:g}M" if x >= 1e6 else
                                        f"{x / 1e3:g}k"))
    ax.grid(alpha=0.3)
  for ax in axes[:2]:
    if target is not None:
      ax.axhline(target, color="k", ls=":", lw=1, label="target")
    ax.set_ylabel("validation loss")
  axes[0].set_title("validation loss")
  axes[1].set_title(f"last {zoom:.0%} of tokens")
  axes[2].set_title(f"minus {baseline} of the same seed (last {zoom:.0%})")
  axes[2].set_ylabel(f"validation loss - {baseline}")
  for ax in axes[1:]:
    ax.set_xlim(t_min, t_max * 1.01)
  if zoom_lo:  # the median recipe's range sets the top: diverged curves run off it
    lo, hi = min(zoom_lo), float(np.median(zoom_hi))
    pad = 0.08 * (hi - lo + 1e-6)
    axes[1].set_ylim(lo - pad, hi + pad)
  axes[1].legend(fontsize=7, loc="lower left")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def diag_series(rows):
  """{metric key: (steps, values)} for the diag/ entries of metrics rows."""
  series = {}
  for row in rows:
    for key, value in row.items():
      if key.startswith("diag/") and value is not None:
        steps, values = series.setdefault(key, ([], []))
        steps.append(row["step"])
        values.append(value)
  return {k: (np.array(s), np.array(v)) for k, (s, v) in series.items()}


def parse_key(key):
  """'diag/<source>/<layer...>/<role>/<stat>' -> (source, layer, role, stat)."""
  parts = key.split("/")
  return parts[1], "/".join(parts[2:-2]), parts[-2], parts[-1]


def plot_diagnostics(path, run):
  """<run>/diagnostics.png: per layer (columns), the per-role error statistics over steps."""
  series = diag_series(run.rows)
  if not series:
    return False
  layers = sorted({parse_key(k)[1] for k in series})
  panels = [("out_err", "GEMM output rel. error (ref)"),
            ("operands", "operand rel. error (ref): lhs -, rhs --"),
            ("bias", "error bias over window"),
            ("step_cos", "step-to-step cosine of error")]
  fig, axes = plt.subplots(len(panels), len(layers), figsize=(5 * len(layers), 10), dpi=75,
                           squeeze=False, sharex=True)
  role_colors = {"fprop": "tab:blue", "dgrad": "tab:orange", "wgrad": "tab:red"}
  rows_of = {"out_err": 0, "lhs_err": 1, "rhs_err": 1, "bias": 2, "step_cos": 3}
  for key, (steps, values) in sorted(series.items()):
    source, layer, role, stat = parse_key(key)
    row = rows_of.get(stat)
    if row is None or (row < 2 and source != "ref"):
      continue
    ls = "--" if stat == "rhs_err" else ":" if source == "train" else "-"
    color = role_colors.get(role, "k") if source == "ref" else "k"
    axes[row, layers.index(layer)].plot(steps, values, color=color, ls=ls, marker=".", ms=3,
                                        lw=0.8, label=f"{role} ({source})")
  for col, layer in enumerate(layers):
    for row, (_, title) in enumerate(panels):
      ax = axes[row, col]
      ax.set_title(f"{layer}: {title}", fontsize=8)
      ax.grid(alpha=0.3)
      ax.tick_params(labelsize=7)
      lines = ax.get_lines()
      if row in (0, 1) and lines and all(np.all(l.get_ydata() > 0) for l in lines):
        ax.set_yscale("log")
      if row in (0, 2, 3) and lines:
        ax.legend(fontsize=6)
    axes[-1, col].set_xlabel("step")
  fig.suptitle(f"{run.recipe}: quantization error diagnostics", fontsize=10)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def plot_diagnostics_summary(path, summary, window=None):
  """diagnostics.png: per recipe, Wgrad error size, bias and step cosine (bars)."""
  if not summary:
    return False
  recipes = list(summary)
  panels = [("wgrad output rel. error (ref batch)", ["wgrad out err (ref)"]),
            ("wgrad error bias (1 = same every step)", ["wgrad bias (train)", "wgrad bias (ref)"]),
            ("wgrad error step-to-step cosine", ["wgrad step cos (train)",
                                                 "wgrad step cos (ref)"])]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=80)
  x = np.arange(len(recipes))
  for ax, (title, cols) in zip(axes, panels):
    width = 0.8 / len(cols)
    for i, col in enumerate(cols):
      vals = [summary[r][col] if summary[r][col] is not None else np.nan for r in recipes]
      source = "training batch" if "(train)" in col else "reference batch"
      ax.bar(x + (i - (len(cols) - 1) / 2) * width, vals, width, label=source,
             color={"training batch": "tab:blue", "reference batch": "tab:gray"}[source])
    if "bias" in title and window:
      ax.axhline(1 / math.sqrt(window), color="k", ls=":", lw=1,
                 label=f"1/sqrt({window}) (independent)")
    ax.set_xticks(x, recipes, rotation=45, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def plot_snr(path, series, threshold):
  """snr.png: per recipe (panels), the training-batch SNRs of each (layer, role) over steps.

  series: {recipe: {(layer, role, stat): (steps, values)}}, stat "snr" (the
  batch SNR, thin) or "snr_true" (the expected gradient's, thick); a dotted
  line at `threshold`.
  """
  if not series:
    return False
  recipes = list(series)
  cols = min(4, len(recipes))
  rows = math.ceil(len(recipes) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=75,
                           squeeze=False, sharey=True)
  role_colors = {"fprop": "tab:blue", "dgrad": "tab:orange", "wgrad": "tab:red"}
  styles = ["-", "--", ":", "-."]
  for ax, recipe in zip(axes.ravel(), recipes):
    layers = sorted({layer for layer, _, _ in series[recipe]})
    for (layer, role, stat), (steps, values) in sorted(series[recipe].items()):
      ax.plot(steps, values, color=role_colors.get(role, "k"),
              ls=styles[layers.index(layer) % len(styles)], lw=2 if stat == "snr_true" else 0.8,
              marker=".", ms=3, label=f"{stat} {role} {layer}")
    ax.axhline(threshold, color="k", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_title(recipe, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)
  for ax in axes.ravel()[len(recipes):]:
    ax.axis("off")
  axes[0, 0].set_ylabel("signal / ||quant. error||", fontsize=8)
  axes[0, 0].legend(fontsize=5.5, loc="upper right")
  fig.suptitle("Training-batch SNR (thin) and expected-gradient snr_true (thick); dotted: "
               f"{threshold:.3g}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return True


def plot_contrasts(path, curves, threshold_steps=None):
  """One panel per contrast: its per-seed paired difference (nats) against
  steps (log axis), one thin line per seed, the mean over seeds thick with a
  min-max band. curves: {label: (steps_T, diff_SxT)}; threshold_steps: {label:
  step} marks (e.g. where an SNR falls below its threshold), optional."""
  if not curves:
    return
  fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.6), squeeze=False)
  for ax, (label, (steps, diff)) in zip(axes[0], curves.items()):
    keep = steps > 0
    for row in diff:
      ax.plot(steps[keep], row[keep], color="0.6", lw=0.8)
    ax.fill_between(steps[keep], diff[:, keep].min(0), diff[:, keep].max(0), color="C0", alpha=0.2)
    ax.plot(steps[keep], diff[:, keep].mean(0), color="C0", lw=2, label=f"mean of {len(diff)}")
    ax.axhline(0, color="k", lw=0.6)
    if threshold_steps and threshold_steps.get(label) is not None:
      ax.axvline(threshold_steps[label], color="C3", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set(title=label, xlabel="step", ylabel="paired difference of val loss (nats)")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
