"""The closing lines of a run: where its files are, the commands to use it,
spelled so that each works as printed."""

import os
import shlex
import stat

import pytest

from fp4jax.train import curves
from fp4jax.train import next_steps
from fp4jax.train import trainer
from tests.helpers import tiny_config


def _executable(path):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("#!/bin/sh\n")
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def test_python_is_named_as_a_shell_finds_it(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  venv_python = _executable(tmp_path / ".venv" / "bin" / "python")
  other = str(tmp_path / "usr" / "bin")
  _executable(tmp_path / "usr" / "bin" / "python")
  assert next_steps.python_command(venv_python, path=os.path.dirname(venv_python)) == "python"
  assert next_steps.python_command(venv_python, path=other) == ".venv/bin/python"
  monkeypatch.chdir(tmp_path / "usr")  # not below the current folder: the whole path
  assert next_steps.python_command(venv_python, path=other) == venv_python


def test_outputs_are_listed_and_commands_given_once_a_checkpoint_exists(tmp_path):
  run = str(tmp_path / "my run")
  os.makedirs(os.path.join(run, "tensorboard"))
  text = next_steps.outputs_and_next(run, [4, 8], ".venv/bin/python")
  lines = text.splitlines()
  assert lines[0] == f"outputs in {run}"
  for name, path in (("metrics", "metrics.jsonl"), ("checkpoints", "checkpoints/"),
                     ("summary", "summary.json"), ("config", "config.json"),
                     ("tensorboard", "tensorboard/")):
    assert f"\n  {name:<12} {run}/{path}  (" in text, (name, text)
  assert "(steps 4, 8)" in text
  commands = [l.split(None, 1) for l in lines[lines.index("next:") + 1:]]
  assert [name for name, _ in commands] == ["plot", "sample", "evaluate", "export"]
  commands = [c for _, c in commands]
  quoted = shlex.quote(run)
  assert [c.split()[:3] for c in commands] == [[".venv/bin/python", "-m", m] for m in
                                               ("fp4jax.plot", "fp4jax.generate",
                                                "fp4jax.evaluate", "fp4jax.convert")]
  assert all(quoted in c for c in commands)
  assert "next:" not in next_steps.outputs_and_next(run, [], "python")
  assert "(none saved)" in next_steps.outputs_and_next(run, [], "python")


@pytest.mark.slow
def test_a_run_ends_by_naming_its_outputs_and_the_plot_it_prints_works(tmp_path, capsys,
                                                                      monkeypatch):
  monkeypatch.chdir(tmp_path)
  trainer.train(tiny_config(steps=2, eval_every=2, checkpoint_every=2), "runs/t")
  out = capsys.readouterr().out
  assert "outputs in runs/t\n" in out and "  checkpoints  runs/t/checkpoints/  (steps 2)" in out
  plot = next(l for l in out.splitlines() if " -m fp4jax.plot " in l)
  argv = shlex.split(plot)[1:]
  assert argv[:3] == [next_steps.python_command(), "-m", "fp4jax.plot"]
  assert curves.main(argv[3:]) == 0
  assert os.path.isfile("runs/t.png")
