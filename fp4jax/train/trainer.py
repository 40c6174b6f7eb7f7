"""The training program: config -> sharded state -> steps, evals, checkpoints.

`train(config, workdir, callbacks=())` runs (or resumes) one run and returns
its closing summary. The config keys are listed in fp4jax.train.config
(`base_config()` there is what configs/ start from).

Randomness: one seed. seed_key = jax.random.key(seed); the parameters come
from split(seed_key)[0], evaluation of random recipes from split(seed_key)[1],
step s of the recipe from fold_in(seed_key, s) (micro-batch i: fold_in of that
with i), per-layer Hadamard signs from train_step.layer_key(seed_key) (the
same every step and evaluation), and the data order from `seed` through
fp4jax.data. Nothing else is
random, so a run (and a resumed run) is bitwise reproducible on CPU.

Workdir: config.json (the resolved config), metrics.jsonl, tensorboard/,
checkpoints/<step>/, summary.json, lock (while a run holds it), history/
(records a restart set aside): fp4jax.train.run_layout names them. A workdir that holds a checkpoint resumes from
its newest readable one, with the config it was started with: see
fp4jax.train.workdir for the keys that may change and the lock.
"""

import dataclasses
import functools
import json
import math
import signal
import sys
import time
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

from fp4jax import dot
from fp4jax.train import adaptive
from fp4jax.data import pipeline
from fp4jax.data import sources
from fp4jax.data import tokenizers
from fp4jax.train import init_from
from fp4jax.train import next_steps
from fp4jax.train import profile
from fp4jax.train import run_layout
from fp4jax.train import throughput
from fp4jax.train import wandb_log
from fp4jax.llama import block_check
from fp4jax import audit
from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import records
from fp4jax import schedule
from fp4jax import sharding
from fp4jax.data import fingerprint
from fp4jax.train import stall
from fp4jax.train import step as train_step
from fp4jax.train import workdir as workdir_lib
from fp4jax.checkpointing import Checkpoints
from fp4jax.train.metrics_log import MetricsLog
from fp4jax.train.config import ConfigError
from fp4jax.train.config import check
from fp4jax.train.config import resolve
from fp4jax.train.config import recipe_segments

def _start(config):
  """Checks the config and opens the data; any bad value -> ConfigError.

  Returns (LlamaConfig, the recipe schedule's segments, mesh, train
  iterator, local validation batches).
  """
  try:
    sharding.initialize_distributed(config.distributed)
    check(config)
    tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
    model_cfg, recipe = resolve(config, tokenizer)
    segs = recipe_segments(recipe, config)
    adaptive.check(config.adaptive_wgrad, model_cfg, [seg.recipe for seg in segs],
                   config.batch_size)
    mesh = sharding.make_mesh(config.mesh)
    micro_batch = train_step.micro_batch(config)
    for seg in segs:
      block_check.check_blocks(model_cfg, seg.recipe, mesh, micro_batch=micro_batch,
                               seq_len=config.seq_len)
    eval_batch = config.eval_batch_size or micro_batch
    if eval_batch % sharding.batch_shards(mesh):
      raise ValueError(
          f"eval batch size {eval_batch} (config.eval_batch_size; 0 = "
          f"micro_batch) is not divisible by the {sharding.batch_shards(mesh)} "
          f"batch shards (data x fsdp) of mesh {dict(mesh.shape)}")
    procs = dict(process_index=jax.process_index(),
                 process_count=jax.process_count())
    batches = pipeline.train_iterator(
        config.data, tokenizer, seq_len=config.seq_len,
        global_batch=config.batch_size, seed=config.seed, **procs)
    val_local = pipeline.validation_windows(
        config.data, tokenizer, seq_len=config.seq_len,
        batch_size=eval_batch,
        num_batches=config.eval_batches, **procs)
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise ConfigError(f"bad config: {e}") from e
  return model_cfg, segs, mesh, batches, val_local


class _StopSignals:
  """SIGTERM/SIGINT set a flag; a second one ends the process at once with
  one line naming the newest committed checkpoint under `checkpoints`
  (what a rerun resumes from; the one being saved is not kept)."""

  def __init__(self, checkpoints):
    self.received = None
    self._checkpoints = checkpoints
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    if self.received is not None:
      kept = checkpointing.committed_steps(self._checkpoints)
      errors.exit_at_once("fp4jax", signum, (
          f"again: stopped at once; the checkpoint at step {kept[-1]} is "
          "kept (rerun to resume from it)" if kept else "again: stopped at "
          "once, before any checkpoint was saved") + "; a checkpoint being "
          "saved is not.")
    self.received = signal.Signals(signum).name
    print(f"\n{self.received} received: saving a checkpoint at the end of "
          "this step, then stopping.", flush=True)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


class _SaveOnError:
  """Saves a checkpoint when the loop stops on an exception between steps.

  An error in the data, the metrics or a callback (anything but the step
  itself, whose input state is donated) leaves the state after the last
  completed step; it is saved (with the data position before the failed
  batch, see pipeline.BatchIterator) before the exception goes on, as on SIGTERM.
  `track(step_fn)` wraps the jitted step to know when that state exists.
  """

  def __init__(self, ckpts, checkpoint_data):
    self._ckpts, self._checkpoint_data = ckpts, checkpoint_data
    self._state = None  # None before the first step and while a step runs

  def track(self, step_fn):
    def tracked(state, batch, *flags):
      self._state = None
      out = step_fn(state, batch, *flags)
      self._state = out[0]
      return out
    return tracked

  def __enter__(self):
    return self

  def __exit__(self, kind, error, traceback):
    if (not isinstance(error, Exception) or self._state is None
        or isinstance(error, errors.DiskFull)):  # a save would fail again
      return False
    if jax.process_count() > 1:  # saving needs every process: not on one's error
      return False
    step = int(self._state.step)
    self._ckpts.save(step, self._state, self._checkpoint_data(step))
    self._ckpts.wait()
    print(f"fp4jax: stopping at step {step} on {type(error).__name__}; saved "
          f"a checkpoint at step {step} first.", file=sys.stderr, flush=True)
    return False


def _data_states(batches):
  """{"processes": [iterator state of process 0, 1, ...]} (JSON-ready).

  Each process reads its own rows, so each has its own state; they are
  gathered so that the checkpoint (written by process 0) holds them all.
  """
  state = batches.get_state()
  if jax.process_count() == 1:
    return {"processes": [state]}
  raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
  size = int(np.max(multihost_utils.process_allgather(np.int32(raw.size))))
  padded = np.zeros(size, np.uint8)
  padded[:raw.size] = raw
  rows = multihost_utils.process_allgather(padded)  # [processes, size]
  return {"processes": [json.loads(bytes(r).rstrip(b"\0")) for r in rows]}


def _replicated(x, mesh):
  """A small host array as a global jax.Array replicated over `mesh` (any number of hosts)."""
  x = np.asarray(x)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.make_array_from_callback(x.shape, spec, lambda index: x[index])


def _restore_data_state(batches, saved, step, override):
  """Puts the checkpoint's data position (at `step`) into `batches`.

  A position saved for other training files is refused (ConfigError naming
  what changed) unless `override`, which takes it on the files now there
  (fp4jax.data.fingerprint). Returns {"data": what changed} for history/
  when it did, else {}.
  """
  states = saved["processes"]
  if len(states) != jax.process_count():
    raise ConfigError(
        f"the checkpoint's data iterator was saved by {len(states)} "
        f"processes; resuming it with {jax.process_count()} is not supported")
  state = states[jax.process_index()]
  try:
    batches.set_state(state)
  except fingerprint.DataChanged as e:
    if not override:
      raise ConfigError(
          f"the training data changed since the checkpoint at step {step} "
          f"was saved: {e}; its data position is only meaningful for the "
          "files it was saved with. Restore them, use a new workdir, or pass "
          "--override_resume to continue from that position on these "
          "files.") from None
    batches.set_state(state, other_data=True)
    return {"data": str(e)}
  except ValueError as e:
    raise ConfigError(f"cannot resume the checkpoint's data position: {e}"
                      " (was batch_size or the data changed?)") from None
  return {}


def _check_validation_data(saved, now, step, override):
  """Refuses (ConfigError naming what changed) to evaluate a resumed run on
  other validation files than those its checkpoint at `step` recorded
  (resolved.data.validation of the config it carries: names and sizes,
  fp4jax.data.fingerprint), unless `override`, which goes on with the files
  there. A checkpoint that recorded none (from before runs did) is not
  checked. Returns {"validation_data": what changed} for history/ when it
  did, else {}."""
  config = saved.get("config") if isinstance(saved.get("config"), dict) else {}
  recorded = (config.get("resolved") or {}).get("data")
  if not isinstance(recorded, dict) or not isinstance(
      recorded.get("validation"), dict) or now is None:
    return {}
  changed = fingerprint.changes(recorded["validation"], now)
  if not changed:
    return {}
  if not override:
    raise ConfigError(
        f"the validation data changed since the checkpoint at step {step} was "
        f"saved: {changed}; the run's evaluations are only comparable on the "
        "files it evaluated on. Restore them, use a new workdir, or pass "
        "--override_resume to evaluate on these files from here on.")
  return {"validation_data": changed}


def _record_data_changes(workdir, changes):
  """Keeps what --override_resume accepted of the data ({"data": ...,
  "validation_data": ...}) in one history/<n>/resume_override.json."""
  if not changes or not sharding.is_main_process():
    return
  dst = workdir_lib.record_override(workdir, changes)
  what = "; ".join(f"{'validation' if k == 'validation_data' else 'training'} "
                   f"data: {v}" for k, v in changes.items())
  print(f"fp4jax: resuming on changed {what} (override); recorded in {dst}",
        file=sys.stderr, flush=True)


def _evaluate(eval_fn, params, val_batches):
  """{eval_loss: mean over the batches, eval_loss_se: its standard error,
  eval_batch_losses: the batch means}.

  The batches are equal-sized and each spans the whole validation stream
  (pipeline.validation_windows), so the standard error is std(batch means) /
  sqrt(batches) (None with one batch, or when the windows overlap: a
  pipeline.Windows whose `overlap` says why). Every run evaluates the same batches, so two runs'
  batch means give the standard error of their difference.
  """
  losses = np.asarray(jax.device_get(
      [eval_fn(params, b, i) for i, b in enumerate(val_batches)]), np.float64)
  se = (float(losses.std(ddof=1) / math.sqrt(losses.size))
        if losses.size > 1 and not getattr(val_batches, "overlap", "") else None)
  return dict(eval_loss=float(losses.mean()), eval_loss_se=se,
              eval_batch_losses=[round(float(x), 6) for x in losses])


def _perplexity(loss):
  return math.exp(min(loss, 700))


def train(config, workdir, callbacks=(), *, override_resume=False,
          nan_steps=()):
  """Trains (or resumes) the run `config` in `workdir`; returns the summary.

  callbacks: each is called as cb(step, state, batch) after every step
  (state: the TrainState after it, donated to the next step, so copy what you
  keep; batch: the global token array [batch_size, seq_len + 1]); a returned
  dict is merged into that step's metrics.jsonl row, which is then written.

  summary["status"]: "completed", "target_reached", "interrupted" (a signal;
  a checkpoint was saved), "diverged" (max_bad_steps non-finite steps in a
  row; the last good checkpoint is kept) or "stalled" (it ran to the end but
  stopped learning: fp4jax.train.stall; warned in the log when found). It
  is written to WORKDIR/summary.json when the run ends; a run that will
  train removes the one a previous run wrote before its first step
  (workdir.remove_summary), so a run killed meanwhile has none.

  The workdir is locked for the run. A workdir that holds a run of a config
  differing in a key outside workdir.RESUMABLE_KEYS is refused (WorkdirError)
  unless `override_resume`, which continues it with the new values; so is a
  checkpoint whose data position was saved for other training files
  (fp4jax.data.fingerprint), which `override_resume` continues on the files
  there (both recorded in history/). User errors (config, data, workdir, a
  checkpoint that does not fit, a full disk) raise fp4jax.errors.UserError
  subclasses with a one-line message.

  nan_steps: a test hook, the steps (from 1) whose loss is made NaN.
  """
  t_start = time.time()
  model_cfg, segs, mesh, batches, val_local = _start(config)
  workdir_lib.prepare(workdir)
  lock = workdir_lib.WorkdirLock(workdir).acquire()
  try:
    workdir_lib.check_resume_config(workdir, config, dict(
        model=dataclasses.asdict(model_cfg),
        recipe=segs[0].recipe.to_config().to_dict(),
        tokenizer=tokenizers.identity(config.data.tokenizer)),
                                    override=override_resume)
    return _run(config, workdir, callbacks, t_start, model_cfg, segs, mesh,
                batches, val_local, nan_steps, override_resume)
  finally:
    lock.release()


@dataclasses.dataclass
class _Outcome:
  """Where the training loop stands: its step, its status, the latest losses."""
  step: int
  status: str = "completed"
  message: str = ""
  last_loss: Any = None      # the last step's training loss
  eval_loss: Any = None      # the last evaluation's, at eval_step
  eval_step: Any = None
  target_tokens: Any = None  # tokens when target_eval_loss was reached
  stall: Any = None          # stall.StallWatch of the steps so far


@dataclasses.dataclass
class _Timer:
  """Seconds of the steps: all, after the first (the compile), since the last row."""
  total: float = 0.0
  steps: int = 0
  steady: float = 0.0
  pending: float = 0.0
  pending_steps: int = 0

  def add(self, dt):
    self.total += dt
    self.steps += 1
    if self.steps > 1:
      self.steady += dt
    self.pending += dt
    self.pending_steps += 1

  def rates(self, tokens_per_step):
    """{step_time_s, tokens_per_s} of the steps since the last row."""
    return dict(step_time_s=self.pending / self.pending_steps,
                tokens_per_s=self.pending_steps * tokens_per_step / self.pending)

  def reset_pending(self):
    self.pending, self.pending_steps = 0.0, 0


@dataclasses.dataclass(frozen=True)
class _Run:
  """What the training loop works with (fixed for the run)."""
  config: Any
  segs: Any              # the recipe schedule's segments
  programs: Any          # [train_step.Programs] of each segment
  mesh: Any
  batches: Any           # the training iterator
  val_batches: Any       # global validation batches
  controller: Any        # adaptive.Controller or None
  callbacks: Any
  ckpts: Any
  log: Any
  checkpoint_data: Any   # step -> the checkpoint's JSON item
  tokens_at: Any         # step -> tokens trained by then (_TokenCount)
  main: bool
  meter: Any             # throughput.Meter: tokens/s -> model TFLOP/s per device, MFU
  window: Any            # profile.Window

  @property
  def tokens_per_step(self):
    return self.config.batch_size * self.config.seq_len


def _run(config, workdir, callbacks, t_start, model_cfg, segs, mesh,
         batches, val_local, nan_steps, override_resume):
  """train() once the config is checked and the workdir locked."""
  init_source = init_from.open_source(config.init_from, model_cfg)
  main = sharding.is_main_process()
  segment_programs = [train_step.make_programs(
      config, model_cfg, seg.recipe, mesh, nan_steps=nan_steps,
      switch_wgrad_to=adaptive.switch_target(config.adaptive_wgrad, seg.recipe))
      for seg in segs]
  abstract = segment_programs[0].abstract
  ckpts = Checkpoints(run_layout.checkpoints(workdir),
                      keep=config.keep_checkpoints,
                      set_aside_to=run_layout.corrupt_checkpoints(workdir),
                      async_save=config.async_checkpointing,
                      data_kind=records.CheckpointData)
  state, controller, tokens_at_start = _first_state(
      config, model_cfg, segment_programs[0], ckpts, batches, init_source,
      workdir, override_resume, val_local.fingerprint)
  start = int(state.step)
  tokens_at = _TokenCount(start, tokens_at_start,
                          config.batch_size * config.seq_len)
  if main:
    workdir_lib.set_aside_history(workdir, start)
    if start < config.steps:  # it trains: until it ends, no summary claims it did
      workdir_lib.remove_summary(workdir)
  n_params = sum(math.prod(x.shape) for x in
                 jax.tree.leaves(abstract.params))
  resolved = _resolved_config(config, model_cfg, segs, mesh, n_params, start,
                              val_local.fingerprint)
  if main:
    workdir_lib.write_json(run_layout.config_file(workdir), resolved)
  checkpoint_data = functools.partial(_checkpoint_data, batches, controller,
                                      resolved, tokens_at)
  print(f"fp4jax: model {config.model.name} ({n_params:,} params), recipe "
        f"{segs[0].recipe.name}, mesh {dict(mesh.shape)}, "
        + (f"resuming at step {start}" if start else "starting at step 0"),
        flush=True)
  if main:  # the precision each GEMM runs in, from the step's trace (fp4jax.audit)
    print("\n".join(f"fp4jax: {line}" for line in audit.startup_lines(
        config, model_cfg, segs[0].recipe, segment_programs[0], mesh)), flush=True)
  val_batches = pipeline.Windows(sharding.global_batch(b, mesh) for b in val_local)
  val_batches.overlap = val_local.overlap
  if val_batches.overlap and main:
    print(f"fp4jax: warning: {val_batches.overlap}; eval_loss_se is reported as "
          "unknown (null). Ask fewer windows (eval_batches x eval_batch_size) or "
          "give more validation text.", file=sys.stderr, flush=True)
  sinks = ([wandb_log.open_run(config.wandb, workdir, config.to_dict())]
           if main and config.wandb.enabled else [])
  log = MetricsLog(workdir, total_steps=config.steps, start_step=start,
                   enabled=main, sinks=sinks)
  meter = throughput.Meter(n_params, model_cfg, config.seq_len, config.peak_tflops)
  window = profile.Window(config.profile, workdir, first_step=start + 1)
  out, timer = _Outcome(step=start, stall=stall.StallWatch(
      model_cfg.vocab_size, after_step=config.warmup_steps)), _Timer()
  with (sharding.use_mesh(mesh), _StopSignals(ckpts.directory) as signals,
        _SaveOnError(ckpts, checkpoint_data) as on_error):
    run = _Run(config=config, segs=segs, mesh=mesh, batches=batches,
               programs=[dataclasses.replace(p, step=on_error.track(p.step))
                         for p in segment_programs],
               val_batches=val_batches, controller=controller,
               callbacks=callbacks, ckpts=ckpts, log=log,
               checkpoint_data=checkpoint_data, tokens_at=tokens_at,
               main=main, meter=meter,
               window=window)
    state, seg = _loop(run, state, out, timer, signals)
    if out.eval_loss is None and out.status != "diverged":  # resumed a finished run
      out.eval_loss = _evaluate(run.programs[seg].eval, state.params,
                                val_batches)["eval_loss"]
      out.eval_step = out.step
    if out.status != "diverged" and out.step > 0:
      ckpts.save(out.step, state, checkpoint_data(out.step))
    ckpts.wait()
  window.close()
  ckpts.close()
  log.close()
  if out.status == "completed" and out.stall.found:
    out.status, out.message = "stalled", f"the run {out.stall.found}"
  summary = _summary(config, out, timer, state, segs[0].recipe, n_params,
                     start, t_start, tokens_at)
  summary.update({"model_tflops_per_device": None, "mfu": None,
                  **(meter(summary["tokens_per_s"]) if summary["tokens_per_s"] else {})})
  if controller is not None:
    summary["wgrad_switches"] = controller.switches()
  if main:
    workdir_lib.write_json(run_layout.summary_file(workdir), summary)
    _print_summary(summary)
    print(next_steps.outputs_and_next(workdir, checkpointing.committed_steps(ckpts.directory),
                                      next_steps.python_command()), flush=True)
  return summary


def _first_state(config, model_cfg, programs, ckpts, batches, init_source,
                 workdir, override_resume, validation):
  """(TrainState, adaptive.Controller or None, tokens trained) to start from.

  The newest usable checkpoint's (which also sets the data position, see
  _restore_data_state, and the controller's decisions; one that cannot be
  read, or whose parameters or optimizer state hold NaN or Inf, is set
  aside: checkpointing.Checkpoints.restore_latest), else a fresh init (with
  init_source's parameters). validation: the fingerprint of the validation
  files now (_check_validation_data).
  """
  restored = ckpts.restore_latest(programs.abstract)
  tokens = 0
  if restored is None:
    state = programs.init(programs.params_key)
    if init_source is not None:
      state = state.replace(params=init_from.load(
          init_source, programs.abstract.params, config.init_from))
  else:
    step, state, data_state = restored
    changes = _restore_data_state(batches, data_state, step, override_resume)
    changes.update(_check_validation_data(data_state, validation, step,
                                          override_resume))
    _record_data_changes(workdir, changes)
    tokens = _saved_tokens(data_state, step, config)
  controller = None
  if config.adaptive_wgrad.enabled:
    controller = adaptive.Controller(config.adaptive_wgrad, model_cfg, config.seed)
    if restored is not None and "adaptive_wgrad" in data_state:
      controller.decisions.load_state_dict(data_state["adaptive_wgrad"])
  return state, controller, tokens


def _saved_tokens(data_state, step, config):
  """Tokens trained up to the checkpoint at `step`: its "tokens", or (a
  checkpoint from before it kept them) step x the tokens per step of the
  config it was saved with."""
  if isinstance(data_state.get("tokens"), int):
    return data_state["tokens"]
  saved = data_state.get("config") if isinstance(data_state.get("config"), dict) else {}
  per_step = [saved.get(k, config[k]) for k in ("batch_size", "seq_len")]
  if not all(isinstance(n, int) for n in per_step):
    per_step = [config.batch_size, config.seq_len]
  return step * per_step[0] * per_step[1]


@dataclasses.dataclass(frozen=True)
class _TokenCount:
  """tokens_at(step): the tokens trained up to `step`, counted from those at
  the start step, so the count only grows across resumes that change
  batch_size or seq_len (--override_resume)."""
  start: int
  tokens_at_start: int
  per_step: int

  def __call__(self, step):
    return self.tokens_at_start + (step - self.start) * self.per_step


def _checkpoint_data(batches, controller, resolved, tokens_at, step):
  """The checkpoint's JSON item at `step`: data positions, the adaptive
  switch's decisions, the tokens trained and the run's resolved config (what
  the resume check reads: fp4jax.train.run_layout.checkpoint_config)."""
  out = dict(_data_states(batches), config=resolved, tokens=tokens_at(step))
  if controller is not None:
    out["adaptive_wgrad"] = controller.decisions.state_dict()
  return out


def _resolved_config(config, model_cfg, segs, mesh, n_params, start,
                     validation):
  """The config and what it resolved to (config.json; JSON-ready): data
  holds the data paths made absolute (sources.absolute_paths) and the
  `validation` files' fingerprint, what a later reader of the run's
  validation text (an export's calibration) reads and checks;
  xla_bf16_gemm the dtype the xla backend's GEMMs of bf16 values run in here,
  and why (fp4jax.dot.xla_bf16_gemm)."""
  resolved = config.to_dict()
  resolved["resolved"] = dict(
      model=dataclasses.asdict(model_cfg),
      recipe=segs[0].recipe.to_config().to_dict(),
      tokenizer=tokenizers.identity(config.data.tokenizer),
      data=dict(paths=sources.absolute_paths(config.data),
                validation=validation),
      n_params=n_params, mesh=dict(mesh.shape), devices=jax.device_count(),
      resumed_from_step=start,
      quant_schedule=[(seg.start, seg.recipe.name) for seg in segs],
      xla_bf16_gemm=dot.xla_bf16_gemm()._asdict())
  return json.loads(json.dumps(resolved, default=workdir_lib.json_default))


def _loop(run, state, out, timer, signals):
  """Trains from out.step until config.steps or a stop (out.status says which).

  Returns (state, index of the segment whose programs ran last).
  """
  config = run.config
  seg = schedule.segment_index(run.segs, out.step)
  if out.step == 0:
    evaluation = _evaluate(run.programs[seg].eval, state.params, run.val_batches)
    out.eval_loss, out.eval_step = evaluation["eval_loss"], 0
    run.log.write(dict(step=0, tokens=0, **evaluation,
                       eval_perplexity=_perplexity(out.eval_loss)))
  while out.step < config.steps:
    if signals.received:
      out.status = "interrupted"
      out.message = f"stopped by {signals.received} at step {out.step}"
      break
    run.ckpts.check()  # no step after a failed (background) save
    seg = schedule.segment_index(run.segs, out.step)
    switched = seg > 0 and run.segs[seg].start == out.step
    state, metrics, batch = _advance(run, state, seg, out, timer)
    row = dict(step=out.step, tokens=run.tokens_at(out.step),
               loss=out.last_loss, lr=float(metrics["lr"]),
               grad_norm=float(metrics["grad_norm"]),
               **timer.rates(run.tokens_per_step),
               skipped_steps=int(metrics["skipped"]))
    row.update(run.meter(row["tokens_per_s"]))
    extra = _extra(run, seg, switched, out.step, state, batch)
    row.update(extra)
    warning = out.stall.update(out.step, out.last_loss, row["grad_norm"])
    if warning and run.main:
      print(warning, file=sys.stderr, flush=True)
    evaluated = out.step % config.eval_every == 0 or out.step == config.steps
    if evaluated:
      evaluation = _evaluate(run.programs[seg].eval, state.params, run.val_batches)
      out.eval_loss, out.eval_step = evaluation["eval_loss"], out.step
      row.update(**evaluation, eval_perplexity=_perplexity(out.eval_loss))
    bad_in_row = int(metrics["bad_in_row"])
    _check_stop(run, out, bad_in_row, evaluated, row)
    if (evaluated or extra or out.step % config.log_every == 0
        or out.status != "completed"):
      run.log.write(row)
      timer.reset_pending()
    if out.status != "completed":
      break
    if out.step % config.checkpoint_every == 0 and bad_in_row == 0:
      run.ckpts.save(out.step, state, run.checkpoint_data(out.step))
  return state, seg


def _advance(run, state, seg, out, timer):
  """Runs one step with segment `seg`'s programs; returns (state, metrics, batch)."""
  programs = run.programs[seg]
  t0 = time.time()
  batch = sharding.global_batch(next(run.batches), run.mesh)
  flags = (_replicated(run.controller.flags(), run.mesh),) if programs.switchable else ()
  run.window.before(out.step + 1)
  state, metrics = programs.step(state, batch, *flags)
  metrics = jax.device_get(metrics)
  timer.add(time.time() - t0)
  out.step += 1
  run.window.after(out.step)
  out.last_loss = float(metrics["loss"])
  return state, metrics, batch


def _extra(run, seg, switched, step, state, batch):
  """The metrics row's additions: a recipe switch, the adaptive switch's, the callbacks'."""
  extra = {"recipe": run.segs[seg].recipe.name} if switched else {}
  if run.controller is not None:
    extra.update(run.controller.after_step(step, run.segs[seg].recipe, state.params, batch,
                                           log=functools.partial(print, flush=True) if run.main
                                           else lambda _: None))
  for cb in run.callbacks:
    extra.update(cb(step, state, batch) or {})
  return extra


def _check_stop(run, out, bad_in_row, evaluated, row):
  """Sets out.status to "diverged" or "target_reached" when the step calls for it."""
  config, step = run.config, out.step
  if bad_in_row >= config.max_bad_steps:
    out.status = "diverged"
    run.ckpts.wait()
    kept = run.ckpts.steps()
    out.message = (f"stopped at step {step}: {bad_in_row} steps in a row had "
                   f"a non-finite loss or gradient (max_bad_steps="
                   f"{config.max_bad_steps}); none of them was applied. "
                   + (f"The last good checkpoint (step {kept[-1]}) is kept."
                      if kept else "No checkpoint had been saved yet."))
  elif (evaluated and config.target_eval_loss is not None
        and out.eval_loss <= config.target_eval_loss):
    out.status, out.target_tokens = "target_reached", run.tokens_at(step)
    out.message = (f"eval_loss {out.eval_loss:.4f} <= target "
                   f"{config.target_eval_loss} at step {step} after "
                   f"{out.target_tokens:,} tokens")
    row["target_reached"] = True


def _summary(config, out, timer, state, recipe, n_params, start, t_start,
             tokens_at):
  """The run's summary.json (see train())."""
  tokens_per_step = config.batch_size * config.seq_len
  return dict(
      status=out.status, message=out.message, step=out.step,
      tokens=tokens_at(out.step), final_loss=out.last_loss,
      final_eval_loss=out.eval_loss, final_eval_step=out.eval_step,
      final_eval_perplexity=(_perplexity(out.eval_loss)
                             if out.eval_loss is not None else None),
      target_eval_loss=config.target_eval_loss, target_tokens=out.target_tokens,
      skipped_steps=int(state.skipped), recipe=recipe.name,
      model=config.model.name, n_params=n_params, resumed_from_step=start,
      wall_time_s=time.time() - t_start, train_time_s=timer.total,
      tokens_per_s=((timer.steps - 1) * tokens_per_step / timer.steady
                    if timer.steady > 0 else None))


def _print_summary(s):
  lines = [f"fp4jax run {s['status']}" + (f": {s['message']}"
                                          if s["message"] else "")]
  at = ("" if s["final_eval_step"] in (None, s["step"])
        else f" (step {s['final_eval_step']})")
  fields = (("steps", s["step"], ","), ("tokens", s["tokens"], ","),
            ("final train loss", s["final_loss"], ".4f"),
            (f"final eval loss{at}", s["final_eval_loss"], ".4f"),
            (f"final eval perplexity{at}", s["final_eval_perplexity"], ".2f"),
            ("skipped steps", s["skipped_steps"], ","),
            ("tokens/s (after compile)", s["tokens_per_s"], ",.0f"),
            ("model TFLOP/s per device", s["model_tflops_per_device"], ",.3f"),
            ("MFU (dense bf16 peak)", s["mfu"], ".1%"),
            ("wall time (s)", s["wall_time_s"], ".1f"))
  for name, value, fmt in fields:
    if value is not None:
      lines.append(f"  {name:<26} {value:{fmt}}")
  print("\n".join(lines), flush=True)
