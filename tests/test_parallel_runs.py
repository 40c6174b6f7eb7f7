"""The ablation runner's runs side by side (fp4jax.experiments.parallel): the
cores of each slot, the bits of a run independent of how many run at once,
signals passed on and a study resumed, a run made by one code version on
one core count, and the environments that made it recorded and reported
(fp4jax.experiments.code_version)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from fp4jax import errors
from fp4jax.experiments import ablation
from fp4jax.experiments import code_version
from fp4jax.experiments import committed
from fp4jax.experiments import parallel
from fp4jax.experiments import report
from fp4jax.train import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="runs side by side need 2 cores")


@pytest.mark.parametrize("parallel_, cpus, cores, want", [
    (0, 1, [0, 1], [(0,), (1,)]),
    (1, 1, [0, 1], [(0,)]),
    (0, 2, [0, 1], [(0, 1)]),
    (0, 4, list(range(5, 15)), [(5, 6, 7, 8), (9, 10, 11, 12)]),
    (0, 0, [0, 1], [None]),
    (1, 0, [0, 1], [None]),
])
def test_slots(parallel_, cpus, cores, want):
  assert parallel.slots(parallel_, cpus, cores) == want


@pytest.mark.parametrize("parallel_, cpus, match", [
    (0, 3, r"cpus_per_run=3 needs 3 cores; this process has 2 \(\[0, 1\]\)"),
    (3, 1, r"parallel=3 x cpus_per_run=1 needs 3 cores"),
    (2, 0, r"parallel=2 needs cpus_per_run >= 1"),
    (-1, 1, r"must be >= 0"),
])
def test_slots_beyond_the_cores_are_refused(parallel_, cpus, match):
  with pytest.raises(errors.UserError, match=match):
    parallel.slots(parallel_, cpus, [0, 1])


def test_mismatch_names_code_and_cores():
  now = {"code": "a" * 64, "commit": "c1", "cpus": 1}
  assert code_version.mismatch({"wall_s": 1.0}, now) == ""  # a run before the record
  assert code_version.mismatch(dict(now, wall_s=1.0, commit="other"), now) == ""
  assert code_version.mismatch(dict(now, cpus=2), now) == "cores 2 -> 1"
  assert code_version.mismatch(dict(now, code="b" * 64, commit="c0"), now) == (
      "code bbbbbbbbbbbb (commit c0) -> aaaaaaaaaaaa (commit c1)")


def test_the_source_hash_follows_every_python_file(tmp_path, monkeypatch):
  package = tmp_path / "fp4jax"
  (package / "sub").mkdir(parents=True)
  (package / "a.py").write_text("x = 1\n")
  (package / "sub" / "b.py").write_text("y = 2\n")
  monkeypatch.setattr(code_version, "_PACKAGE", str(package))

  def digest():
    code_version.source_hash.cache_clear()
    return code_version.source_hash()

  first = digest()
  (package / "notes.txt").write_text("not code")
  assert digest() == first
  (package / "sub" / "b.py").write_text("y = 3\n")
  changed = digest()
  assert changed != first
  (package / "sub" / "b.py").rename(package / "b.py")  # the same bytes elsewhere
  assert digest() not in (first, changed)
  code_version.source_hash.cache_clear()


def _study(steps=4, recipes="bf16", seeds=2):
  """A tiny study; its model and batches are those of the SIGTERM test's
  command, so that its runs find the initialisation and evaluation programs
  compiled (the JAX compilation cache of tests/conftest.py)."""
  config = cli.load_config_file(os.path.join(ROOT, "configs", "ablation_tiny.py"))
  config.model.n_layers = 1
  config.update(dict(steps=steps, batch_size=4, seq_len=16, warmup_steps=1,
                     eval_every=steps, eval_batches=1, eval_batch_size=4,
                     log_every=1, checkpoint_every=1000, async_checkpointing=False))
  config.ablation.update(dict(recipes=recipes, baseline=recipes.split(",")[0],
                              seeds=seeds, recipe_seeds="", compilation_cache=""))
  config.diagnostics.enabled = False
  return config


def test_a_run_of_other_code_or_cores_is_not_reused_or_resumed(tmp_path, monkeypatch):
  config = _study()
  config.ablation.cpus_per_run = 0
  made = dict(code_version.current(len(os.sched_getaffinity(0))), cpus=7)

  def fake_train(config, arm, seed, path):
    os.makedirs(path, exist_ok=True)
    rows = [dict(step=s, tokens=s, eval_loss=5.0 - s) for s in (0, 4)]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in rows))
    for name, obj in (("summary.json", dict(status="completed", step=4)),
                      ("config.json", dict(json.loads(
                          ablation.run_config(config, arm, seed).to_json()), resolved={}))):
      with open(os.path.join(path, name), "w") as f:
        json.dump(obj, f)
    ablation._add_wall(path, 1.0, made)  # pylint: disable=protected-access
    return dict(status="completed")

  monkeypatch.setattr(ablation, "_train", fake_train)
  monkeypatch.setattr(ablation, "_report", lambda *args: [])
  work = str(tmp_path / "work")
  ablation.run_ablation(config, work)
  with pytest.raises(errors.UserError, match=r"bf16_seed0 was made by other code or "
                     rf"cores: cores 7 -> {len(os.sched_getaffinity(0))}"):
    ablation.run_ablation(config, work)
  monkeypatch.undo()
  # An interrupted run begun by other code is not resumed by this code.
  run = os.path.join(work, "bf16_seed0")
  with open(os.path.join(run, "summary.json"), "w") as f:
    json.dump(dict(status="interrupted", step=2), f)
  ablation._add_wall(run, 1.0, dict(made, code="0" * 64))  # pylint: disable=protected-access
  with pytest.raises(errors.UserError, match=r"interrupted run .*bf16_seed0 was begun with "
                     r"other code or cores \(code 000000000000"):
    ablation._train(config, ablation.arm_list(config)[0], 0, run)  # pylint: disable=protected-access


def test_environment_changes_name_what_moved():
  now = code_version.current(1)
  env = now["environment"]
  assert set(env["packages"]) == set(code_version.PACKAGES) and env["packages"]["jax"]
  assert env["cpu"] and env["python"].count(".") == 2
  assert code_version.environment_changes({"wall_s": 1.0}, now) == ""  # none recorded
  assert code_version.environment_changes({"environments": [env]}, now) == ""
  other = dict(env, cpu="Other CPU", packages=dict(env["packages"], numpy="0.1"))
  assert code_version.environment_changes({"environments": [env, other]}, now) == (
      f"cpu 'Other CPU' -> {env['cpu']!r}, numpy 0.1 -> {env['packages']['numpy']}")


def test_a_run_resumed_in_another_environment_keeps_both(tmp_path, monkeypatch, capsys):
  config = _study()
  run = str(tmp_path / "bf16_seed0")
  made = code_version.current(len(os.sched_getaffinity(0)))
  elsewhere = dict(made, environment=dict(made["environment"], cpu="Other CPU"))
  ablation._add_wall(run, 2.0, elsewhere)  # pylint: disable=protected-access
  ablation._add_wall(run, 3.0, elsewhere)  # pylint: disable=protected-access
  monkeypatch.setattr(ablation.trainer, "train", lambda *a, **k: dict(status="completed"))
  ablation._train(config, ablation.arm_list(config)[0], 0, run)  # pylint: disable=protected-access
  assert (f"{run} was begun in another environment (cpu 'Other CPU' -> "
          f"{made['environment']['cpu']!r}); resumed here") in capsys.readouterr().out
  wall = json.loads((tmp_path / "bf16_seed0" / "wall.json").read_text())
  assert wall["environments"] == [elsewhere["environment"], made["environment"]]
  assert wall["wall_s"] >= 5.0 and wall["code"] == made["code"] and "environment" not in wall


def test_the_report_says_which_environment_made_which_runs():
  env = code_version.environment()
  other = dict(env, packages=dict(env["packages"], jaxlib="0.0.1"))

  def run(recipe, seed, environments):
    return report.Run(recipe, seed, "", [], None, None, "completed", 0, 1.0, environments)

  runs = {"R0": [run("R0", 0, [env]), run("R0", 1, [other])],
          "S1": [run("S1", 0, [env]), run("S1", 1, [env, other]), run("S1", 2, None)]}
  lines = report.environments_section(runs)
  assert lines[1].startswith("Made in 3 environment(s)")
  assert lines[2].startswith("- E1: Python ") and lines[2].endswith(
      ": R0 seed 0, S1 seed 0, S1 seed 1")
  assert "jaxlib 0.0.1" in lines[3] and lines[3].endswith(": R0 seed 1, S1 seed 1")
  assert lines[4] == "- E3: not recorded (runs before fp4jax recorded it): S1 seed 2"
  assert lines[5] == "- Resumed in another environment (one run, two or more): S1 seed 1"
  assert lines[6] == "- Seeds whose arms were made in more than one: 1"
  assert report.environments_section({"R0": [run("R0", 0, [env])]})[1:] == [
      "Made in 1 environment(s) (a run's bits depend on the CPU and the jax, jaxlib, numpy "
      "and ml_dtypes releases, not only on the code; arms compared within a seed are "
      "treated alike where its runs share one):", f"- E1: {report._environment_text(env)}: R0 seed 0"]


def _losses(path):
  with open(os.path.join(path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows]


@TWO_CORES
@pytest.mark.slow
def test_runs_side_by_side_have_the_bits_of_runs_one_at_a_time(tmp_path, monkeypatch):
  """Two runs on one core each, one after the other and at once: the same
  bits, each published as it ends, its code and core count recorded. (The
  first run compiles; the others load its programs from the compilation cache.)"""
  monkeypatch.delenv("XLA_FLAGS")  # one CPU device per run, as a user's machine
  made_in = dict(code_version.environment(), xla_flags="")  # the runs' environment
  config = _study()
  runs = ("bf16_seed0", "bf16_seed1")
  for name, parallel_ in (("apart", 1), ("together", 2)):
    config.ablation.parallel = parallel_
    ablation.run_ablation(config, str(tmp_path / name), str(tmp_path / f"{name}_results"))
    for run in runs:
      assert committed.is_complete(str(tmp_path / f"{name}_results" / run)), (name, run)
      wall = json.loads((tmp_path / name / run / "wall.json").read_text())
      assert wall["cpus"] == 1 and wall["code"] == code_version.source_hash()
      assert wall["environments"] == [made_in]
  for run in runs:
    together, apart = (_losses(str(tmp_path / n / run)) for n in ("together", "apart"))
    assert together == apart and len(together) >= 5 and together[-1][2] is not None
  assert _losses(str(tmp_path / "apart" / runs[0])) != _losses(str(tmp_path / "apart" / runs[1]))


@TWO_CORES
@pytest.mark.slow
def test_sigterm_reaches_the_runs_side_by_side_and_the_study_resumes(tmp_path):
  work = tmp_path / "study"
  command = [sys.executable, "-m", "fp4jax.experiments.ablation",
             "--config=configs/ablation_tiny.py", f"--workdir={work}",
             "--config.model.n_layers=1", "--config.steps=800", "--config.seq_len=16",
             "--config.batch_size=4", "--config.eval_batches=1", "--config.eval_batch_size=4",
             "--config.eval_every=800", "--config.checkpoint_every=800",
             "--config.ablation.recipes=bf16", "--config.ablation.baseline=bf16",
             "--config.ablation.seeds=2", "--config.ablation.recipe_seeds=",
             "--config.ablation.compilation_cache=",
             "--config.diagnostics.enabled=False"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")  # lines as printed
  env.pop("XLA_FLAGS", None)  # one CPU device per run, as a user's machine
  process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  metrics = [work / f"bf16_seed{s}" / "metrics.jsonl" for s in (0, 1)]
  seen = []  # both runs past their compilation: step 200 printed twice
  while sum("] 200/800" in line for line in seen) < 2:
    seen.append(process.stdout.readline())
    assert seen[-1], "".join(seen)[-3000:]
  process.send_signal(signal.SIGTERM)
  out = "".join(seen) + process.communicate(timeout=600)[0]
  assert process.returncode == 0, out[-3000:]
  assert "SIGTERM received: passed on to the 2 runs in progress" in out, out[-3000:]
  assert out.strip().splitlines()[-1] == (
      "ablation: interrupted (SIGTERM; 2 runs saved a checkpoint); run the same command "
      "again to resume"), out[-3000:]
  stopped = [json.loads((m.parent / "summary.json").read_text()) for m in metrics]
  assert all(s["status"] == "interrupted" and 0 < s["step"] < 800 for s in stopped)
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900, check=False)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  for m, before in zip(metrics, stopped):
    summary = json.loads((m.parent / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 800
    assert f"resuming at step {before['step']}" in out.stdout, out.stdout[-3000:]
    steps = [json.loads(line)["step"] for line in m.read_text().splitlines()]
    assert steps == sorted(set(steps))


def _killed(*args):
  """A run's child process killed from outside (as by the out-of-memory killer)."""
  del args
  os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_run_killed_by_a_signal_is_named(tmp_path, monkeypatch):
  """A child killed by SIGKILL prints nothing: the runner names the signal
  and does not point at errors printed above."""
  config = _study(seeds=1)
  config.ablation.update(dict(cpus_per_run=1, parallel=1))
  monkeypatch.setattr(ablation, "_train_in_child", _killed)
  with pytest.raises(errors.UserError) as failure:
    ablation.run_ablation(config, str(tmp_path / "work"))
  assert str(failure.value) == (
      f"1 runs failed: {tmp_path / 'work' / 'bf16'} (killed by SIGKILL, so it printed no error; the "
      "kernel's out-of-memory killer sends SIGKILL); the finished runs are kept")
