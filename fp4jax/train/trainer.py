"""The training program: config -> sharded state -> steps, evals, checkpoints.

`train(config, workdir, callbacks=())` runs (or resumes) one run and returns
its closing summary. The config keys are listed in fp4jax.train.config
(`base_config()`, re-exported here, is what configs/ start from).

Randomness: one seed. seed_key = jax.random.key(seed); the parameters come
from split(seed_key)[0], evaluation of random recipes from split(seed_key)[1],
step s of the recipe from fold_in(seed_key, s) (micro-batch i: fold_in of that
with i), per-layer Hadamard signs from train_step.layer_key(seed_key) (the
same every step and evaluation), and the data order from `seed` through
fp4jax.data. Nothing else is
random, so a run (and a resumed run) is bitwise reproducible on CPU.

Workdir: config.json (the resolved config), metrics.jsonl, tensorboard/,
checkpoints/<step>/, summary.json, lock (while a run holds it), history/
(records a restart set aside). A workdir that holds a checkpoint resumes from
its newest readable one, with the config it was started with: see
fp4jax.train.workdir for the keys that may change and the lock.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from fp4jax.train import adaptive
from fp4jax.data import pipeline
from fp4jax.data import tokenizers
from fp4jax.train import init_from
from fp4jax.llama import model as model_lib
from fp4jax import schedule
from fp4jax import sharding
from fp4jax.train import step as train_step
from fp4jax.train import workdir as workdir_lib
from fp4jax.checkpointing import Checkpoints
from fp4jax.train.metrics_log import MetricsLog
from fp4jax.train.config import ConfigError
from fp4jax.train.config import check
from fp4jax.train.config import micro_batch as _micro_batch
from fp4jax.train.config import resolve
from fp4jax.train.config import resolve_recipe

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
    segs = schedule.segments(recipe, config.get("quant_schedule"), config.steps,
                             lambda quant: resolve_recipe(quant, config.dtype))
    adaptive.check(config.adaptive_wgrad, model_cfg, [seg.recipe for seg in segs],
                   config.batch_size)
    mesh = sharding.make_mesh(config.mesh)
    micro_batch = _micro_batch(config)
    for seg in segs:
      sharding.check_blocks(model_cfg, seg.recipe, mesh, micro_batch=micro_batch,
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
  """SIGTERM/SIGINT set a flag (a second one interrupts at once)."""

  def __init__(self):
    self.received = None
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
      raise KeyboardInterrupt
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
    if not isinstance(error, Exception) or self._state is None:
      return False
    if jax.process_count() > 1:  # saving needs every process: not on one's error
      return False
    step = int(self._state.step)
    self._ckpts.save(step, self._state, self._checkpoint_data())
    self._ckpts.wait()
    print(f"fp4jax: stopping at step {step} on {type(error).__name__}; saved "
          f"a checkpoint at step {step} first.", file=sys.stderr, flush=True)
    return False


_OPTIMIZER_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio",
                   "weight_decay", "b1", "b2", "eps", "clip")


@dataclasses.dataclass(frozen=True)
class _Programs:
  """The jitted functions of one run and the shardings they use."""
  init: Any             # params_key -> TrainState
  step: Any             # (state, tokens_BxL1[, wgrad_switched_L]) -> (state, metrics)
  eval: Any             # (params, tokens_BxL1, index) -> loss
  abstract: Any         # TrainState of ShapeDtypeStruct (with shardings)
  params_key: Any
  switchable: bool      # step takes wgrad_switched_L (fp4jax.train.adaptive)


@functools.lru_cache(maxsize=4)
def _programs(model_cfg, recipe, optimizer_items, seed, n_micro, nan_steps,
              seq_len, mesh, switch_wgrad_to=None):
  """Builds (and caches) the jitted init, step and eval of a run.

  switch_wgrad_to: the Gemm of switched blocks' Wgrad (fp4jax.train.adaptive); the
  step then takes the bool [n_layers] wgrad_switched_L as a third argument.

  Runs in one process that differ only in data, evaluation, checkpointing or
  stopping share these, so they compile once (tests and sweeps rely on it).
  Parameters and optimizer state are created directly sharded: init is
  jitted with out_shardings from the model's logical axis names.
  """
  model = model_lib.Llama(model_cfg, recipe, switch_wgrad_to)
  tx, schedule = train_step.optimizer(
      ml_collections.ConfigDict(dict(optimizer_items)))
  seed_key = jax.random.key(seed)
  params_key, eval_key = jax.random.split(seed_key)
  init = lambda key: train_step.init_state(model, tx, key, seq_len)
  boxed = jax.eval_shape(init, params_key)
  state_shardings = sharding.logical_to_sharding(boxed, mesh)
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.unbox(boxed), state_shardings)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_sharding = sharding.batch_sharding(mesh)
  step = train_step.make_train_step(
      model, tx, schedule, seed_key=seed_key, n_micro=n_micro,
      nan_steps=nan_steps)
  return _Programs(
      init=jax.jit(lambda key: nn.unbox(init(key)),
                   out_shardings=state_shardings),
      step=jax.jit(step, in_shardings=(state_shardings, batch_sharding)
                   + ((replicated,) if switch_wgrad_to is not None else ()),
                   out_shardings=(state_shardings, replicated),
                   donate_argnums=0),
      eval=jax.jit(train_step.make_eval_step(model, eval_key, train_step.layer_key(seed_key)),
                   in_shardings=(state_shardings.params, batch_sharding, None),
                   out_shardings=replicated),
      abstract=abstract, params_key=params_key,
      switchable=switch_wgrad_to is not None)


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


def _restore_data_state(batches, saved):
  states = saved["processes"]
  if len(states) != jax.process_count():
    raise ConfigError(
        f"the checkpoint's data iterator was saved by {len(states)} "
        f"processes; resuming it with {jax.process_count()} is not supported")
  try:
    batches.set_state(states[jax.process_index()])
  except ValueError as e:
    raise ConfigError(f"cannot resume the checkpoint's data position: {e}"
                      " (was batch_size or the data changed?)") from None


def _evaluate(eval_fn, params, val_batches):
  """{eval_loss: mean over the batches, eval_loss_se: its standard error,
  eval_batch_losses: the batch means}.

  The batches are equal-sized and each spans the whole validation stream
  (pipeline.validation_windows), so the standard error is std(batch means) /
  sqrt(batches) (None with one batch). Every run evaluates the same batches,
  so two runs' batch means give the standard error of their difference.
  """
  losses = np.asarray(jax.device_get(
      [eval_fn(params, b, i) for i, b in enumerate(val_batches)]), np.float64)
  se = (float(losses.std(ddof=1) / math.sqrt(losses.size))
        if losses.size > 1 else None)
  return dict(eval_loss=float(losses.mean()), eval_loss_se=se,
              eval_batch_losses=[round(float(x), 6) for x in losses])


def train(config, workdir, callbacks=(), *, override_resume=False):
  """Trains (or resumes) the run `config` in `workdir`; returns the summary.

  callbacks: each is called as cb(step, state, batch) after every step
  (state: the TrainState after it, donated to the next step, so copy what you
  keep; batch: the global token array [batch_size, seq_len + 1]); a returned
  dict is merged into that step's metrics.jsonl row, which is then written.

  summary["status"]: "completed", "target_reached", "interrupted" (a signal;
  a checkpoint was saved) or "diverged" (max_bad_steps non-finite steps in a
  row; the last good checkpoint is kept).

  The workdir is locked for the run. A workdir that holds a run of a config
  differing in a key outside workdir.RESUMABLE_KEYS is refused (WorkdirError)
  unless `override_resume`, which continues it with the new values. User
  errors (config, data, workdir, a checkpoint that does not fit) raise
  fp4jax.errors.UserError subclasses with a one-line message.
  """
  t_start = time.time()
  model_cfg, segs, mesh, batches, val_local = _start(config)
  workdir_lib.prepare(workdir)
  lock = workdir_lib.WorkdirLock(workdir).acquire()
  try:
    workdir_lib.check_resume_config(workdir, config, override=override_resume)
    return _run(config, workdir, callbacks, t_start, model_cfg, segs, mesh,
                batches, val_local)
  finally:
    lock.release()


def _run(config, workdir, callbacks, t_start, model_cfg, segs, mesh,
         batches, val_local):
  """train() once the config is checked and the workdir locked."""
  recipe = segs[0].recipe
  init_source = init_from.open_source(config.init_from, model_cfg)
  micro_batch = _micro_batch(config)
  main = sharding.is_main_process()
  segment_programs = [_programs(
      model_cfg, seg.recipe,
      tuple((k, config[k]) for k in _OPTIMIZER_KEYS), config.seed,
      config.batch_size // micro_batch, tuple(config.nan_steps),
      config.seq_len, mesh, adaptive.switch_target(config.adaptive_wgrad, seg.recipe))
      for seg in segs]
  programs = segment_programs[0]
  abstract = programs.abstract

  ckpts = Checkpoints(os.path.join(workdir, "checkpoints"),
                      keep=config.keep_checkpoints,
                      async_save=config.async_checkpointing)
  restored = ckpts.restore_latest(abstract)
  if restored is None:
    state = programs.init(programs.params_key)
    if init_source is not None:
      state = state.replace(params=init_source.load(abstract.params))
  else:
    _, state, data_state = restored
    _restore_data_state(batches, data_state)
  controller = None
  if config.adaptive_wgrad.enabled:
    controller = adaptive.Controller(config.adaptive_wgrad, model_cfg, config.seed)
    if restored is not None and "adaptive_wgrad" in data_state:
      controller.decisions.load_state_dict(data_state["adaptive_wgrad"])

  def checkpoint_data():
    """The checkpoint's JSON item: data positions and the adaptive switch's decisions."""
    out = _data_states(batches)
    if controller is not None:
      out["adaptive_wgrad"] = controller.decisions.state_dict()
    return out

  start = int(state.step)
  if main:
    workdir_lib.set_aside_history(workdir, start)
  n_params = sum(math.prod(x.shape) for x in
                 jax.tree.leaves(abstract.params))
  if main:
    resolved = config.to_dict()
    resolved["resolved"] = dict(
        model=dataclasses.asdict(model_cfg), recipe=recipe.to_config().to_dict(),
        n_params=n_params, mesh=dict(mesh.shape), devices=jax.device_count(),
        resumed_from_step=start,
        quant_schedule=[(seg.start, seg.recipe.name) for seg in segs])
    workdir_lib.write_json(os.path.join(workdir, "config.json"), resolved)
  print(f"fp4jax: model {config.model.name} ({n_params:,} params), recipe "
        f"{recipe.name}, mesh {dict(mesh.shape)}, "
        + (f"resuming at step {start}" if start else "starting at step 0"),
        flush=True)

  val_batches = [sharding.global_batch(b, mesh) for b in val_local]
  tokens_per_step = config.batch_size * config.seq_len
  log = MetricsLog(workdir, total_steps=config.steps, start_step=start,
                   enabled=main)
  status, message = "completed", ""
  eval_loss = eval_step = target_tokens = last_loss = None
  train_time, train_steps, steady_time = 0.0, 0, 0.0
  pending_time, pending_steps = 0.0, 0
  step = start
  with (sharding.use_mesh(mesh), _StopSignals() as signals,
        _SaveOnError(ckpts, checkpoint_data) as on_error):
    segment_programs = [dataclasses.replace(p, step=on_error.track(p.step))
                        for p in segment_programs]
    programs = segment_programs[schedule.segment_index(segs, start)]
    if start == 0:
      evaluation, eval_step = _evaluate(programs.eval, state.params, val_batches), 0
      eval_loss = evaluation["eval_loss"]
      log.write(dict(step=0, tokens=0, **evaluation,
                     eval_perplexity=math.exp(min(eval_loss, 700))))
    while step < config.steps:
      if signals.received:
        status = "interrupted"
        message = f"stopped by {signals.received} at step {step}"
        break
      seg = schedule.segment_index(segs, step)
      programs = segment_programs[seg]
      switched = seg > 0 and segs[seg].start == step
      t0 = time.time()
      batch = sharding.global_batch(next(batches), mesh)
      flags = (_replicated(controller.flags(), mesh),) if programs.switchable else ()
      state, metrics = programs.step(state, batch, *flags)
      metrics = jax.device_get(metrics)
      dt = time.time() - t0
      step += 1
      train_time += dt
      train_steps += 1
      if train_steps > 1:
        steady_time += dt
      pending_time += dt
      pending_steps += 1
      last_loss = float(metrics["loss"])
      row = dict(step=step, tokens=step * tokens_per_step, loss=last_loss,
                 lr=float(metrics["lr"]), grad_norm=float(metrics["grad_norm"]),
                 step_time_s=pending_time / pending_steps,
                 tokens_per_s=pending_steps * tokens_per_step / pending_time,
                 skipped_steps=int(metrics["skipped"]))
      extra = {"recipe": segs[seg].recipe.name} if switched else {}
      if controller is not None:
        extra.update(controller.after_step(step, segs[seg].recipe, state.params, batch,
                                           log=functools.partial(print, flush=True) if main
                                           else lambda _: None))
      for cb in callbacks:
        extra.update(cb(step, state, batch) or {})
      row.update(extra)
      evaluated = step % config.eval_every == 0 or step == config.steps
      if evaluated:
        evaluation, eval_step = _evaluate(programs.eval, state.params, val_batches), step
        eval_loss = evaluation["eval_loss"]
        row.update(**evaluation,
                   eval_perplexity=math.exp(min(eval_loss, 700)))
      bad_in_row = int(metrics["bad_in_row"])
      if bad_in_row >= config.max_bad_steps:
        status = "diverged"
        ckpts.wait()
        kept = ckpts.steps()
        message = (f"stopped at step {step}: {bad_in_row} steps in a row had "
                   f"a non-finite loss or gradient (max_bad_steps="
                   f"{config.max_bad_steps}); none of them was applied. "
                   + (f"The last good checkpoint (step {kept[-1]}) is kept."
                      if kept else "No checkpoint had been saved yet."))
      elif (evaluated and config.target_eval_loss is not None
            and eval_loss <= config.target_eval_loss):
        status, target_tokens = "target_reached", step * tokens_per_step
        message = (f"eval_loss {eval_loss:.4f} <= target "
                   f"{config.target_eval_loss} at step {step} after "
                   f"{target_tokens:,} tokens")
        row["target_reached"] = True
      if (evaluated or extra or step % config.log_every == 0
          or status != "completed"):
        log.write(row)
        pending_time, pending_steps = 0.0, 0
      if status != "completed":
        break
      if step % config.checkpoint_every == 0 and bad_in_row == 0:
        ckpts.save(step, state, checkpoint_data())
    if eval_loss is None and status != "diverged":  # resumed a finished run
      eval_loss = _evaluate(programs.eval, state.params, val_batches)["eval_loss"]
      eval_step = step
    if status != "diverged" and step > 0:
      ckpts.save(step, state, checkpoint_data())
    ckpts.wait()
  ckpts.close()
  log.close()
  summary = dict(
      status=status, message=message, step=step,
      tokens=step * tokens_per_step, final_loss=last_loss,
      final_eval_loss=eval_loss, final_eval_step=eval_step,
      final_eval_perplexity=(math.exp(min(eval_loss, 700))
                             if eval_loss is not None else None),
      target_eval_loss=config.target_eval_loss, target_tokens=target_tokens,
      skipped_steps=int(state.skipped), recipe=recipe.name,
      model=config.model.name, n_params=n_params, resumed_from_step=start,
      wall_time_s=time.time() - t_start, train_time_s=train_time,
      tokens_per_s=((train_steps - 1) * tokens_per_step / steady_time
                    if steady_time > 0 else None))
  if controller is not None:
    summary["wgrad_switches"] = controller.switches()
  if main:
    workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
    _print_summary(summary)
  return summary


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
            ("wall time (s)", s["wall_time_s"], ".1f"))
  for name, value, fmt in fields:
    if value is not None:
      lines.append(f"  {name:<26} {value:{fmt}}")
  print("\n".join(lines), flush=True)
