"""The study runner's runs as submitit jobs: submitit's local executor (each job a
process of this machine) stands in for Slurm. The runs are faked, as in
test_study_records, so what is tested is the runner's records, not training."""

import os
import signal
import sys
import threading
import time

import pytest

from fp4jax import errors
from fp4jax.experiments import ablation
from fp4jax.experiments import cluster
from fp4jax.experiments import report

import test_study_records
from test_study_records import write_finished_run

submitit = pytest.importorskip("submitit")  # the optional extra fp4jax[cluster]
cloudpickle = pytest.importorskip("cloudpickle")


def test_params_and_kinds_are_checked():
  assert cluster.parse_params(" timeout_min=240, slurm_partition=gpu,mem_gb=1.5,") == {
      "timeout_min": 240, "slurm_partition": "gpu", "mem_gb": 1.5}
  with pytest.raises(errors.UserError, match="'gpu' is not KEY=VALUE"):
    cluster.parse_params("timeout_min=5,gpu")
  with pytest.raises(errors.UserError, match="'pbs' is not one of auto, slurm, local"):
    cluster.check("pbs")


def test_a_job_is_pinned_to_its_slots_cores():
  cores = sorted(os.sched_getaffinity(0))
  try:
    for slot in range(3):
      got = cluster.pinned(slot, 1, os.sched_getaffinity, 0)
      assert got == {cores[slot % len(cores)]}
      os.sched_setaffinity(0, cores)
  finally:
    os.sched_setaffinity(0, cores)


def test_jobs_end_with_their_exit_codes(tmp_path, capsys):
  ex = cluster.executor("local", str(tmp_path / "logs"), 1, "timeout_min=5")
  ended = []
  jobs = [(1, divmod, 7, 2), (1, divmod, 1, 0), (1, os.getcwd)]
  assert cluster.run(jobs, cluster.pinned, lambda job, code: ended.append((job, code)),
                     ex, 2) is None
  assert sorted(ended, key=str) == sorted([(jobs[0], 0), (jobs[1], 1), (jobs[2], 0)], key=str)
  out = capsys.readouterr().out
  assert "failed: ZeroDivisionError: integer division or modulo by zero" in out
  assert str(tmp_path / "logs") in out


def test_a_signal_cancels_the_jobs_in_flight_and_starts_no_more(tmp_path):
  ex = cluster.executor("local", str(tmp_path / "logs"), 1, "timeout_min=5")
  ended = []
  timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
  timer.start()
  t0 = time.time()
  try:
    got = cluster.run([(1, time.sleep, 60)] * 3, cluster.pinned,
                      lambda job, code: ended.append(code), ex, 1)
  finally:
    timer.cancel()
  assert got == "SIGINT" and ended == [1]  # the one in flight cancelled, two never started
  assert time.time() - t0 < 50


RUN_CONFIGS = {}  # path: the run's trainer config, made here (the jobs need not import jax)


def _fake_train_in_child(config, arm, seed, path, verbosity):
  """In the job's process: a finished run's records, and the cores it had."""
  del config, arm, seed, verbosity
  write_finished_run(path, RUN_CONFIGS[path])
  with open(os.path.join(path, "cores"), "w") as f:
    f.write(str(len(os.sched_getaffinity(0))))


def test_the_runner_trains_its_runs_as_jobs_and_publishes_them(tmp_path, monkeypatch):
  here = sys.modules[__name__]  # the fake and its helpers travel by value: not importable there
  for module in (here, test_study_records):
    cloudpickle.register_pickle_by_value(module)
  monkeypatch.setattr(ablation, "_train_in_child", _fake_train_in_child)
  monkeypatch.setattr(ablation, "_report", lambda *args: [])
  config = test_study_records._config()  # pylint: disable=protected-access
  config.ablation.cpus_per_run = 1
  # more runs at once than this machine has cores: a scheduler's cores, not refused here
  config.ablation.parallel = len(os.sched_getaffinity(0)) + 1
  config.ablation.executor, config.ablation.executor_params = "local", "timeout_min=5"
  work, results = tmp_path / "work", tmp_path / "results"
  for arm in ablation.arm_list(config):
    RUN_CONFIGS[str(work / arm.name)] = ablation.run_config(config, arm, config.seed)
  try:
    ablation.run_ablation(config, str(work), str(results))
  finally:
    for module in (here, test_study_records):
      cloudpickle.unregister_pickle_by_value(module)
  for run in ("bf16", "fp8"):
    assert (work / run / "cores").read_text() == "1"  # pinned to cpus_per_run
    assert (results / run / "MANIFEST.json").is_file()  # published as it ended
  assert os.listdir(work / ".submitit")  # submitit's logs, hidden from the report
  assert sorted(report.load_runs(str(results))) == ["bf16", "fp8"]
  config.ablation.executor = "pbs"  # a bad kind: one line, before anything is recorded
  with pytest.raises(errors.UserError, match="executor='pbs'"):
    ablation.run_ablation(config, str(tmp_path / "w2"))
  assert not (tmp_path / "w2").exists()
