"""fp4jax.train.curves: validation loss against tokens for several runs."""

import json
import os

import pytest

from fp4jax.train import curves


def _fake_run(workdir, losses, recipe):
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for i, loss in enumerate(losses):
      f.write(json.dumps(dict(step=10 * i, tokens=1000 * i, loss=loss)) + "\n")
      f.write(json.dumps(dict(step=10 * i, tokens=1000 * i, eval_loss=loss))
              + "\n")
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"resolved": {"recipe": {"name": recipe}}}, f)


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
