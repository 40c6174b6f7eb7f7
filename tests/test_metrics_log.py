"""metrics.jsonl keeps one history across kills, resumes and restarts."""

from fp4jax.train.metrics_log import MetricsLog, read_metrics


def _log(workdir, start, steps):
  log = MetricsLog(str(workdir), total_steps=4, start_step=start)
  for step in steps:
    log.write(dict(step=step, loss=float(step)))
  log.close()


def test_resume_drops_later_rows_and_a_fresh_start_drops_all(tmp_path):
  _log(tmp_path, 0, range(4))               # a run killed after writing step 3
  _log(tmp_path, 2, [3])                    # resumed from its step-2 checkpoint
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
  _log(tmp_path, 0, [0, 1])                 # no checkpoint: starts over at step 0
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1]
