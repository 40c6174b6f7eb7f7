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


class _Clock:
  """A clock the test moves: 60 s for the first step (compiling it), 1 s a step after."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _progress_lines(tmp_path, capsys, start, steps):
  """The progress lines of a 300-step run logging every 10 steps from `start`."""
  clock = _Clock()
  log = MetricsLog(str(tmp_path), total_steps=300, start_step=start, clock=clock)
  if start == 0:
    log.write(dict(step=0, eval_loss=5.0))
  for step in range(start + 1, start + steps + 1):
    clock.now += 60.0 if step == start + 1 else 1.0
    if step % 10 == 0:
      log.write(dict(step=step, loss=1.0))
  log.close()
  return capsys.readouterr().out.splitlines()


def test_eta_leaves_out_the_compiling_first_step(tmp_path, capsys):
  lines = _progress_lines(tmp_path, capsys, 0, 30)
  assert [line.split("ETA ")[1] for line in lines] == ["?", "?", "4:40", "4:30"]
  # 280 steps left at 1 s each; counting the first step's 60 s would say 18:26
  assert lines[2].startswith("[#") and "20/300" in lines[2]


def test_eta_of_a_resumed_run_starts_at_its_first_step(tmp_path, capsys):
  _progress_lines(tmp_path, capsys, 0, 100)
  lines = _progress_lines(tmp_path, capsys, 100, 30)
  assert [line.split("ETA ")[1] for line in lines] == ["?", "3:00", "2:50"]
