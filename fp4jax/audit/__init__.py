"""The precision each GEMM of a train step really runs in, read from its trace.

  python -m fp4jax.audit CONFIG-or-RUN [--config.KEY=VALUE ...]

`audit_step(config, model_cfg, recipe, programs)` traces the step the trainer
jits (its jit's .trace() with abstract arguments: nothing is compiled or run),
finds every GEMM in it (fp4jax.audit.trace) and sets it beside what the
recipe asks of its layer and role (fp4jax.audit.report). `audit_config`
does it for a config as the trainer would build it; `startup_lines` is the
trainer's summary at the start of a run. docs/audit.md.
"""

import jax
import jax.numpy as jnp

from fp4jax import errors
from fp4jax import sharding
from fp4jax.audit import report
from fp4jax.audit import trace
from fp4jax.data import tokenizers
from fp4jax.train import adaptive
from fp4jax.train import config as train_config
from fp4jax.train import step as train_step

STEP_INPUT = "[0].step"  # the TrainState's step counter: per-step keys come from it
MISMATCHES_SHOWN = 5     # at the start of a run


def step_gemms(config, programs, model_cfg, mesh):
  """The trace.Gemms of the jitted train step of `programs` (fp4jax.train.step) on
  `mesh`. Its arguments are laid out as the trainer's, so the trace is the one
  the trainer's first step compiles (jit keeps it: no second trace)."""
  batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                               sharding=sharding.batch_sharding(mesh))
  args = (programs.abstract, batch)
  if programs.switchable:
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args += (jax.ShapeDtypeStruct((model_cfg.n_layers,), jnp.bool_, sharding=replicated),)
  with sharding.use_mesh(mesh):  # as the trainer runs it: its constraints, per-shard kernels
    closed = programs.step.trace(*args).jaxpr
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
  return trace.gemms(closed, names, step_inputs=(STEP_INPUT,))


def audit_step(config, model_cfg, recipe, programs, mesh):
  """report.Rows of the train step of `programs` for `recipe` under `config` on `mesh`."""
  switch = adaptive.switch_target(config.adaptive_wgrad, recipe)
  return report.audit(step_gemms(config, programs, model_cfg, mesh), model_cfg, recipe, switch)


def audit_config(config):
  """[(heading, report.Rows)] per recipe segment of the run `config` (a ConfigDict as
  train.py takes it); errors.UserError (one line) for a config that cannot train."""
  try:
    train_config.check(config)
    tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
    model_cfg, recipe = train_config.resolve(config, tokenizer)
    segs = train_config.recipe_segments(recipe, config)
    mesh = sharding.make_mesh(config.mesh)
  except (ValueError, FileNotFoundError, ImportError) as e:
    raise errors.UserError(f"bad config: {e}") from e
  out = []
  for seg in segs:
    programs = train_step.make_programs(
        config, model_cfg, seg.recipe, mesh,
        switch_wgrad_to=adaptive.switch_target(config.adaptive_wgrad, seg.recipe))
    heading = (f"recipe {seg.recipe.name} from step {seg.start}, model "
               f"{config.model.name} ({model_cfg.n_layers} blocks), {jax.default_backend()}")
    out.append((heading, audit_step(config, model_cfg, seg.recipe, programs, mesh)))
  return out


def startup_lines(config, model_cfg, recipe, programs, mesh):
  """The trainer's lines at the start of a run: "audit: <report.summary>" and the
  first MISMATCHES_SHOWN mismatches; one line saying why when the step cannot
  be audited (the run goes on)."""
  try:
    rows = audit_step(config, model_cfg, recipe, programs, mesh)
  except Exception as e:  # pylint: disable=broad-except
    return [f"audit: not available ({type(e).__name__}: {e})"]
  lines = [f"audit: {report.summary(rows)} (python -m fp4jax.audit for the table)"]
  bad = [r for r in rows if r.mismatch]
  lines += [f"audit: MISMATCH {r.layer} {r.role}: {'; '.join(r.mismatch)}"
            for r in bad[:MISMATCHES_SHOWN]]
  return lines
