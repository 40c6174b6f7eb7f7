"""fp4jax.plot (fp4jax.train.curves): validation loss against log tokens for
several runs, 95% bands from the logged standard errors, and each run's
difference from a baseline run."""

import json
import math
import os

import numpy as np
import pytest

from fp4jax.train import curves
from tests.helpers import exit_2_line

Z = 1.959964  # a normal distribution's two-sided 95% quantile
T7 = 2.364624  # Student's t with 7 degrees of freedom (8 validation batches), two-sided 95%


def _fake_run(workdir, losses, recipe, *, batch_losses=None, se=None, tokens_per_eval=1000,
              validation="stdlib"):
  """A run of eval rows at i * tokens_per_eval tokens (training rows between),
  with eval_loss_se and eval_batch_losses when given (one list per eval)."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for i, loss in enumerate(losses):
      row = dict(step=10 * i, tokens=tokens_per_eval * i, eval_loss=loss)
      if se is not None:
        row["eval_loss_se"] = se[i]
      if batch_losses is not None:
        row["eval_batch_losses"] = batch_losses[i]
      if i:
        row["loss"] = loss + 0.5
        f.write(json.dumps(dict(step=10 * i - 5, tokens=tokens_per_eval * i - 500,
                                loss=loss + 0.7)) + "\n")
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"model": {}, "quant": {}, "seq_len": 128, "data": {"source": validation},
               "resolved": {"recipe": {"name": recipe}}}, f)


def _batched_run(workdir, recipe, means, spread, seed, validation="stdlib"):
  """A run whose evaluations are the means of 8 batch losses (around `means`)."""
  rng = np.random.default_rng(seed)
  batches = [list(m + spread * rng.standard_normal(8)) for m in means]
  _fake_run(workdir, [float(np.mean(b)) for b in batches], recipe, batch_losses=batches,
            se=[float(np.std(b, ddof=1) / math.sqrt(8)) for b in batches],
            validation=validation)
  return batches


def _band_halfwidths(ax, index):
  """{x: half the band's height} of the index-th fill_between of `ax`."""
  vertices = ax.collections[index].get_paths()[0].vertices
  ys = {}
  for x, y in vertices:
    ys.setdefault(round(float(x), 6), []).append(float(y))
  return {x: (max(y) - min(y)) / 2 for x, y in ys.items()}


def test_eval_curve_reads_only_eval_rows(tmp_path):
  run = str(tmp_path / "a")
  _fake_run(run, [5.0, 4.0, float("nan")], "bf16")
  tokens, losses = curves.eval_curve(run)
  assert tokens == [0, 1000, 2000]
  assert losses[:2] == [5.0, 4.0]


def test_main_draws_several_runs_into_one_png(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _fake_run(a, [5.0, 4.0, 3.5], "bf16")
  _fake_run(b, [5.0, 4.2, 3.8], "mxfp4-dh16")
  out = str(tmp_path / "curves.png")
  curves.main([a, b, "-o", out, "--title", "t"])
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(out) > 5000
  assert curves._label(b) == "b (mxfp4-dh16)"


def test_a_run_without_evaluations_is_an_error(tmp_path):
  run = str(tmp_path / "empty")
  os.makedirs(run)
  with pytest.raises(ValueError, match="no metrics.jsonl rows with an eval_loss"):
    curves.plot_runs([run], str(tmp_path / "x.png"))


def test_an_out_that_is_not_an_image_name_is_refused_before_drawing(tmp_path, capsys):
  run = str(tmp_path / "a")
  _fake_run(run, [5.0, 4.0], "bf16")
  os.makedirs(os.path.join(run, "checkpoints", "4"))
  before = {n: open(os.path.join(run, n), "rb").read() for n in ("config.json", "metrics.jsonl")}
  for out in ("config.json", "metrics.jsonl", "checkpoints", os.path.join("checkpoints", "4"),
              "wandb_id"):
    assert curves.main([run, "-o", os.path.join(run, out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not the name of an image file" in err, err
    assert ".png" in err and ".pdf" in err
  assert sorted(os.listdir(run)) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert os.listdir(os.path.join(run, "checkpoints")) == ["4"]
  assert {n: open(os.path.join(run, n), "rb").read() for n in before} == before
  assert curves.main([run, "-o", str(tmp_path / "curves.PDF")]) == 0


def test_an_out_that_is_a_link_or_inside_a_run_is_refused(tmp_path, capsys):
  run = str(tmp_path / "a")
  _fake_run(run, [5.0, 4.0], "bf16")
  os.makedirs(os.path.join(run, "checkpoints", "4", "state"))  # a checkpoint
  (tmp_path / "fig.png").symlink_to(os.path.join(run, "metrics.jsonl"))
  (tmp_path / "fig.svg").symlink_to(os.path.join(run, "config.json"))
  before = {n: open(os.path.join(run, n), "rb").read() for n in ("config.json", "metrics.jsonl")}
  for out, message in (
      (tmp_path / "fig.png", f"is a symbolic link to '{run}/metrics.jsonl'"),
      (tmp_path / "fig.svg", f"is a symbolic link to '{run}/config.json'"),
      (tmp_path / "a" / "checkpoints" / "4" / "loss.png", "lies inside the run or checkpoint"),
      (tmp_path / "a" / "checkpoints" / "loss.png", f"lies inside the run or checkpoint '{run}'"),
      (tmp_path / "a" / "curves.png", f"lies inside the run or checkpoint '{run}'")):
    assert curves.main([run, "-o", str(out)]) == 2, out
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"-o '{out}' {message}" in err, err
  assert {n: open(os.path.join(run, n), "rb").read() for n in before} == before
  assert sorted(os.listdir(run)) == ["checkpoints", "config.json", "metrics.jsonl"]
  assert os.listdir(os.path.join(run, "checkpoints", "4")) == ["state"]
  assert sorted(os.listdir(tmp_path)) == ["a", "fig.png", "fig.svg"]
  (tmp_path / "out").mkdir()  # beside the run, through a link and `..`: where the OS goes
  (tmp_path / "out" / "inner").mkdir()
  (tmp_path / "alink").symlink_to(tmp_path / "out" / "inner")
  assert curves.main([run, "-o", str(tmp_path / "alink" / ".." / "c.png")]) == 0
  assert sorted(os.listdir(tmp_path / "out")) == ["c.png", "inner"]


def test_the_difference_panel_is_each_run_minus_the_baseline(tmp_path):
  base, a, b = (str(tmp_path / n) for n in ("bf16", "mxfp4", "fp8"))
  _fake_run(base, [6.0, 3.0, 2.5, 2.2, 2.0], "bf16")
  _fake_run(a, [6.0, 3.1, 2.55, 2.26, 2.03], "mxfp4")
  _fake_run(b, [6.0, 2.9, 2.45], "fp8", tokens_per_eval=2000)  # evaluated at 0, 2k, 4k
  runs = [curves.read_curve(w) for w in (base, a, b)]
  fig = curves.figure(runs, ["bf16", "mxfp4", "fp8"], baseline=0, from_tokens=1000)
  diff_ax = fig.axes[1]
  lines = {l.get_label(): l for l in diff_ax.get_lines()}
  assert list(lines["bf16 (baseline)"].get_ydata()) == [0.0, 0.0]
  np.testing.assert_allclose(lines["mxfp4"].get_xdata(), [1000, 2000, 3000, 4000])
  np.testing.assert_allclose(lines["mxfp4"].get_ydata(), [0.1, 0.05, 0.06, 0.03], atol=1e-12)
  np.testing.assert_allclose(lines["fp8"].get_xdata(), [2000, 4000])  # tokens both evaluated
  np.testing.assert_allclose(lines["fp8"].get_ydata(), [2.9 - 2.5, 2.45 - 2.0], atol=1e-12)
  assert diff_ax.get_ylabel() == "validation loss minus bf16"


def test_bands_come_from_the_logged_standard_errors(tmp_path):
  """Without eval_batch_losses the batch count is unknown: the normal's quantile."""
  run = str(tmp_path / "a")
  se = [0.5, 0.04, 0.02, 0.03]
  _fake_run(run, [6.0, 3.0, 2.5, 2.2], "bf16", se=se)
  fig = curves.figure([curves.read_curve(run)], ["a"], from_tokens=1000)
  assert _band_halfwidths(fig.axes[0], 0) == pytest.approx(
      {1000.0: Z * 0.04, 2000.0: Z * 0.02, 3000.0: Z * 0.03})
  assert len(fig.axes) == 1  # no baseline: no difference panel


def _se(batches):
  return [float(np.std(b, ddof=1) / math.sqrt(len(b))) for b in batches]


def test_a_difference_band_is_paired_over_the_shared_validation_batches(tmp_path):
  base, same, other = (str(tmp_path / n) for n in ("base", "same", "other"))
  rng = np.random.default_rng(0)
  b0 = [list(m + 0.3 * rng.standard_normal(8)) for m in (5.0, 3.0, 2.5)]
  b1 = [[x + 0.01 * (i + 1) + 0.002 * k for k, x in enumerate(row)]  # the same batches, shifted
        for i, row in enumerate(b0)]
  b2 = [list(m + 0.3 * rng.standard_normal(8)) for m in (5.0, 3.0, 2.5)]
  for run, batches, validation in ((base, b0, "stdlib"), (same, b1, "stdlib"), (other, b2, "c4")):
    _fake_run(run, [float(np.mean(b)) for b in batches], "r", batch_losses=batches,
              se=_se(batches), validation=validation)
  runs = [curves.read_curve(w) for w in (base, same, other)]
  _, d, se, batches = curves.difference(runs[1], runs[0])
  paired = [np.std(np.subtract(p, q), ddof=1) / math.sqrt(8) for p, q in zip(b1, b0)]
  np.testing.assert_allclose(d, [0.017, 0.027, 0.037], atol=1e-12)
  np.testing.assert_allclose(se, paired, rtol=1e-9)
  assert list(batches) == [8, 8, 8]
  assert max(se) < 0.01 < min(runs[0].se)  # pairing removes the batches' own spread
  _, _, se_other, _ = curves.difference(runs[2], runs[0])  # other validation data: unpaired
  np.testing.assert_allclose(se_other, np.hypot(runs[2].se, runs[0].se), rtol=1e-12)
  fig = curves.figure(runs, ["base", "same", "other"], baseline=0, from_tokens=1000)
  assert _band_halfwidths(fig.axes[1], 0) == pytest.approx(  # Student's t, 7 degrees of freedom
      {1000.0: T7 * paired[1], 2000.0: T7 * paired[2]})
  assert _band_halfwidths(fig.axes[0], 0) == pytest.approx(
      {1000.0: T7 * runs[0].se[1], 2000.0: T7 * runs[0].se[2]})


def test_early_evaluations_are_left_out_unless_all_is_asked(tmp_path):
  run = str(tmp_path / "a")
  _fake_run(run, [6.0, 5.0, 3.0, 2.5, 2.2, 2.1, 2.0, 1.95, 1.9, 1.87, 1.85, 1.84], "bf16")
  curve = curves.read_curve(run)
  cut = curves.first_shown([curve])
  assert cut == curves.FROM_FRACTION * 11000 and 1000 < cut < 11000
  assert curves.first_shown([curve], 5000) == 5000
  fig = curves.figure([curve], ["a"], from_tokens=cut)
  (line,) = fig.axes[0].get_lines()
  shown = [t for t in range(0, 12000, 1000) if t >= cut]
  assert list(line.get_xdata()) == shown
  np.testing.assert_allclose(line.get_ydata(), curve.loss[-len(shown):])
  assert fig.axes[0].get_xscale() == "log"
  assert fig.axes[0].get_ylim()[1] < 3.0  # the range drawn is the range shown
  fig = curves.figure([curve], ["a"], from_tokens=0.0)  # --all: step 0 too
  assert list(fig.axes[0].get_lines()[0].get_xdata())[:2] == [0.0, 1000.0]
  assert fig.axes[0].get_xscale() == "symlog" and fig.axes[0].get_ylim()[1] > 6.0


def test_training_loss_is_drawn_only_when_asked(tmp_path):
  run = str(tmp_path / "a")
  _fake_run(run, [6.0, 3.0, 2.5, 2.2], "bf16")
  curve = curves.read_curve(run)
  assert len(curves.figure([curve], ["a"], from_tokens=1000).axes[0].get_lines()) == 1
  lines = curves.figure([curve], ["a"], from_tokens=1000, train_loss=True).axes[0].get_lines()
  assert [list(l.get_xdata()) for l in lines] == [[1000, 1500, 2000, 2500, 3000],
                                                   [1000, 2000, 3000]]
  np.testing.assert_allclose(lines[0].get_ydata(), [3.5, 3.2, 3.0, 2.9, 2.7])


def test_main_prints_the_final_differences(tmp_path, capsys):
  base, a = str(tmp_path / "bf16"), str(tmp_path / "mxfp4")
  _fake_run(base, [6.0, 3.0, 2.5], "bf16", se=[0.1, 0.01, 0.01])
  _fake_run(a, [6.0, 3.1, 2.53], "mxfp4", se=[0.1, 0.01, 0.02])
  out = str(tmp_path / "c.png")
  assert curves.main([base, a, "--baseline", base, "-o", out, "--train_loss"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].split() == ["bf16", "2,000", "2.5000", "+-", f"{Z * 0.01:.4f}"]
  assert lines[2].split() == ["mxfp4", "2,000", "2.5300", "+-", f"{Z * 0.02:.4f}",
                              "+0.0300", "+-", f"{Z * math.hypot(0.01, 0.02):.4f}"]
  assert lines[-1] == f"wrote {out}"


@pytest.mark.parametrize("argv, message", [
    (["--baseline", "{tmp}/c"], "--baseline '{tmp}/c' is not among the runs given ({tmp}/a, "
                                "{tmp}/b); name one of them"),
    (["--from_tokens", "-5"], "--from_tokens -5.0 is negative; give 0 or more"),
    (["--all", "--from_tokens", "5"], "argument --from_tokens: not allowed with argument --all"),
    (["--from_tokens", "1e6"], "--from_tokens 1e+06 leaves no evaluation to draw: the runs' "
                               "last is at 1,000 tokens"),
    (["--labels", "x"], "1 labels for 2 runs"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  _fake_run(a, [5.0, 4.0], "bf16")
  _fake_run(b, [5.0, 4.2], "mxfp4")
  os.makedirs(tmp_path / "c")
  argv = [a, b, "-o", str(tmp_path / "x.png")] + [x.format(tmp=tmp_path) for x in argv]
  try:
    rc = curves.main(argv)
  except SystemExit as e:  # argparse's own refusals
    rc = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and message.format(tmp=tmp_path) in err[-1], err
  assert not os.path.exists(tmp_path / "x.png")


def test_a_damaged_standard_error_is_named(tmp_path, capsys):
  run = str(tmp_path / "a")
  _fake_run(run, [5.0, 4.0], "bf16", se=[0.1, "0.2"])
  assert curves.main([run, "-o", str(tmp_path / "x.png")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "step 10's eval_loss_se is '0.2', not a number" in err
