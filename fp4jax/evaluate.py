"""`python -m fp4jax.evaluate RUN`: the validation loss of a run, a checkpoint or an export.

  python -m fp4jax.evaluate RUN [--step N] [--data GLOB] [--quant recipe|bf16|PRESET]
      [--batches N] [--batch_size N] [--seq_len N] [--json]

RUN: a run directory (its newest checkpoint), RUN/checkpoints/<step> or
--step, or an export (fp4jax.trained). Prints the mean validation loss,
its standard error and the perplexity, computed by the trainer's own
evaluation (fp4jax.train.step's eval program, fp4jax.train.trainer's mean
and standard error) on the run's validation windows (its data, seq_len,
eval_batches and eval batch size; --data: the .txt / .jsonl files of a glob,
all of them held out), in the recipe that trained the checkpoint (--quant
recipe, the default; bf16: unquantized). A run is evaluated on its own mesh
when this machine has its devices, and then the loss of a step the run
evaluated is the one metrics.jsonl logged, bit for bit (printed beside it).
An export records no recipe (its forward is bf16 unless --quant names a
preset) and no data (--data is needed). Bad input: one line, exit status 2.
"""

import sys

from fp4jax import errors

PROG = "python -m fp4jax.evaluate"

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals(PROG, "received: stopped.")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import json
import math

import jax
import ml_collections

from fp4jax import sharding
from fp4jax import trained as trained_lib
from fp4jax.data import fingerprint
from fp4jax.data import pipeline
from fp4jax.llama import hf as hf_llama
from fp4jax.train import config as train_config
from fp4jax.train import export_fp4
from fp4jax.train import metrics_log
from fp4jax.train import step as train_step
from fp4jax.train import trainer
# pylint: enable=g-import-not-at-top,wrong-import-position

# The keys of a run's config.json its evaluation program is built from
# (train_step.make_programs), the rest from train_config.base_config().
_RUN_KEYS = ("steps", "seed", "batch_size", "micro_batch", "seq_len", "dtype", "lr",
             "warmup_steps", "min_lr_ratio", "weight_decay", "b1", "b2", "eps", "clip",
             "eval_batches", "eval_batch_size")


def _parser():
  parser = argparse.ArgumentParser(prog=PROG, description=(
      "Validation loss, its standard error and perplexity of a trained fp4jax model."))
  trained_lib.add_arguments(parser)
  parser.add_argument("--data", default=None,
                      help="a glob of .txt or .jsonl files to evaluate on, all held out "
                      "(default: the run's validation data)")
  parser.add_argument("--batches", type=int, default=None,
                      help="evaluation batches (default: the run's eval_batches)")
  parser.add_argument("--batch_size", type=int, default=None,
                      help="sequences per batch (default: the run's eval batch size)")
  parser.add_argument("--seq_len", type=int, default=None,
                      help="tokens per sequence (default: the run's seq_len)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object instead of lines")
  return parser


def settings(model, args):
  """The ConfigDict the evaluation program is built from: base_config() with
  the run's keys (an export: the defaults), then the options given."""
  config = train_config.base_config()
  for key in _RUN_KEYS:
    if model.config is not None and key in model.config:
      config[key] = model.config[key]
  config.dtype = model.model_cfg.dtype
  config.eval_batch_size = config.eval_batch_size or train_step.micro_batch(config)
  for key, option in (("eval_batches", "batches"), ("eval_batch_size", "batch_size"),
                      ("seq_len", "seq_len")):
    value = getattr(args, option)
    if value is not None:
      if value < 1:
        raise errors.UserError(f"--{option} {value}; allowed: >= 1")
      config[key] = value
  return config


def data_config(model, glob, tokenizer_name):
  """(data config, the run's recorded validation fingerprint or None): --data's
  files (all held out), else the run's validation data."""
  if glob is not None:
    data_cfg = pipeline.data_config()
    data_cfg.update(dict(source="files", path=glob, val_path=glob, tokenizer=tokenizer_name))
    return data_cfg, None
  if model.config is None:
    raise errors.UserError(f"the export {model.path!r} records no validation data; give "
                           "--data GLOB (.txt or .jsonl files)")
  data_cfg, recorded = export_fp4.run_data_config(model.config)
  return data_cfg, (recorded or {}).get("validation")


def mesh_of(model):
  """(mesh, note): the run's mesh on its number of devices when this machine
  has them (the run's program, so its bits), else one device, with a note."""
  shape = (model.config or {}).get("resolved", {}).get("mesh")
  wanted = math.prod(shape.values()) if isinstance(shape, dict) and shape else None
  if wanted is not None and wanted <= jax.device_count():
    try:
      return sharding.make_mesh(ml_collections.ConfigDict(shape), jax.devices()[:wanted]), ""
    except (ValueError, TypeError):
      pass
  used = ("recorded no mesh" if wanted is None else
          f"used {wanted} device(s) and this machine has {jax.device_count()}")
  note = "" if model.config is None else (
      f"the run {used}: evaluated on one device, whose sums run in another order, so the "
      "loss may differ from the run's")
  return sharding.make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)),
                            jax.devices()[:1]), note


def logged_eval_loss(run_dir, step):
  """The eval_loss metrics.jsonl logged at `step` (the last such row), or None."""
  try:
    rows = metrics_log.read_metrics(run_dir)
  except (errors.UserError, OSError):
    return None
  losses = [r["eval_loss"] for r in rows if r.get("step") == step
            and isinstance(r.get("eval_loss"), float)]
  return losses[-1] if losses else None


def evaluate(model, args):
  """The result as a dict: what was evaluated, eval_loss, eval_loss_se,
  eval_batch_losses, perplexity, logged_eval_loss (the run's own, when this
  is the run's evaluation of a step it evaluated), notes."""
  config = settings(model, args)
  tokenizer_name = (model.config or {}).get("data", {}).get("tokenizer", "bytes")
  data_cfg, recorded = data_config(model, args.data, tokenizer_name)
  mesh, note = mesh_of(model)
  notes = [note] if note else []
  step, params = model.load(hf_llama.abstract_params(model.model_cfg, mesh))
  recipe = model.recipe(args.quant, step)
  if config.eval_batch_size % sharding.batch_shards(mesh):
    raise errors.UserError(f"--batch_size {config.eval_batch_size} is not divisible by the "
                           f"{sharding.batch_shards(mesh)} batch shards of the run's mesh")
  try:
    windows = pipeline.validation_windows(
        data_cfg, model.tokenizer, seq_len=config.seq_len, batch_size=config.eval_batch_size,
        num_batches=config.eval_batches)
  except (ValueError, OSError, ImportError) as e:
    raise errors.UserError(f"the validation data: {e}") from None
  changed = recorded is not None and fingerprint.changes(recorded, windows.fingerprint)
  if changed:
    notes.append(f"the validation files changed since the run evaluated on them ({changed})")
  programs = train_step.make_programs(config, model.model_cfg, recipe, mesh)
  batches = pipeline.Windows(sharding.global_batch(b, mesh) for b in windows)
  batches.overlap = windows.overlap
  if windows.overlap:
    notes.append(f"{windows.overlap}; no standard error")
  with sharding.use_mesh(mesh):
    result = trainer._evaluate(programs.eval, params, batches)  # pylint: disable=protected-access
  same_as_run = (model.config is not None and args.quant == trained_lib.RECIPE
                 and args.data is None and not changed and all(
                     getattr(args, k) is None for k in ("batches", "batch_size", "seq_len")))
  return dict(
      evaluated=model.describe(step), step=step, recipe=recipe.name,
      windows=dict(batches=config.eval_batches, batch_size=config.eval_batch_size,
                   seq_len=config.seq_len),
      **result, perplexity=trainer._perplexity(result["eval_loss"]),  # pylint: disable=protected-access
      logged_eval_loss=logged_eval_loss(model.run_dir, step) if same_as_run else None,
      notes=notes)


def _lines(r):
  w = r["windows"]
  se = ("unknown (one batch)" if w["batches"] == 1 else "unknown (overlapping windows)"
        if r["eval_loss_se"] is None else
        f"{r['eval_loss_se']:.6f} (standard error over {w['batches']} batches)")
  lines = [f"{r['evaluated']}, forward {r['recipe']}, {w['batches']} batch(es) of "
           f"{w['batch_size']} x {w['seq_len']} tokens",
           f"  eval_loss     {r['eval_loss']:.6f}",
           f"  standard err  {se}",
           f"  perplexity    {r['perplexity']:.4f}"]
  logged = r["logged_eval_loss"]
  if logged is not None:
    same = "the same bits" if logged == r["eval_loss"] else (
        f"differs by {r['eval_loss'] - logged:.3g}")
    lines.append(f"  logged        {logged:.6f} at step {r['step']} in metrics.jsonl ({same})")
  return lines + [f"  note: {n}" for n in r["notes"]]


def main(argv=None):
  args = _parser().parse_args(argv)
  try:
    if args.data is not None and not args.data:
      raise errors.UserError("--data is empty; give a glob of .txt or .jsonl files")
    result = evaluate(trained_lib.locate(args.run, args.step), args)
  except errors.UserError as e:
    return errors.report(PROG, e)
  print(json.dumps(result) if args.json else "\n".join(_lines(result)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
