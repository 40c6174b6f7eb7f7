"""The pieces of one optimisation step: state, optimizer, loss, step, eval.

Everything here is a pure function of its arguments; `make_programs` jits
them for one run (the trainer's, and the benchmarks' that time a run's step).
The step accumulates gradients over micro-batches (lax.scan), clips by global
norm, applies AdamW with a warm-up + cosine schedule, and refuses a step whose
loss or gradient is not finite: parameters and optimizer state stay as they
were, and the step is counted in `skipped` and `bad_in_row`.

Rng streams of the model: "quant" gets a fresh key per step (micro-batch,
evaluation batch); "hadamard" (per-layer Hadamard signs) gets layer_key(seed_key)
on every step and evaluation, so each layer's signs stay fixed for the run.
"""

import dataclasses
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from fp4jax import sharding
from fp4jax.llama import model as model_lib


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint needs besides the data iterator.

  step: int32, steps taken (applied or skipped); the next step's key is
    fold_in(seed_key, step). params: float32 master weights. opt_state: optax
    state. skipped: int32, non-finite steps not applied so far. bad_in_row:
    int32, the current run of consecutive non-finite steps.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array
  bad_in_row: jax.Array


def lr_schedule(config):
  """Linear warm-up from 0 to config.lr, cosine to lr * min_lr_ratio at `steps`.

  min_lr_ratio=1.0 is a constant lr after warm-up whose values do not depend
  on `steps` (bitwise: the cosine term is multiplied by 1 - 1.0 = 0), so a run
  resumed with more steps takes the steps already run exactly as before.
  """
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.lr,
      warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1),
      end_value=config.lr * config.min_lr_ratio)


def optimizer(config):
  """Global-norm clipping then AdamW on the schedule (returns tx, schedule)."""
  schedule = lr_schedule(config)
  tx = optax.chain(
      optax.clip_by_global_norm(config.clip),
      optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                  weight_decay=config.weight_decay))
  return tx, schedule


LAYER_KEY_DATA = 0xFFFFFFFF  # fold_in data of the run's layer key; no step number reaches it


def layer_key(seed_key):
  """The run's key of the "hadamard" rng stream: fold_in(seed_key, 2^32 - 1).

  The same on every step, so per-layer Hadamard signs (drawn from it and the
  layer's module path) stay fixed for the run.
  """
  return jax.random.fold_in(seed_key, LAYER_KEY_DATA)


def init_state(model, tx, key, seq_len):
  """A fresh TrainState whose params keep their logical-partitioning boxes."""
  tokens_1xL = jnp.zeros((1, seq_len), jnp.int32)
  params = model.init({"params": key, "quant": key, "hadamard": key},
                      tokens_1xL)["params"]
  zero = jnp.zeros((), jnp.int32)
  return TrainState(step=zero, params=params, opt_state=tx.init(params),
                    skipped=zero, bad_in_row=zero)


def loss_fn(model, params, tokens_BxL1, key, layer_key=None, wgrad_switched_L=None):
  """Mean next-token cross-entropy of tokens[:, 1:] given tokens[:, :-1].

  key feeds the "quant" rng stream, layer_key (when given) the "hadamard" one;
  wgrad_switched_L (bool [n_layers] or None): the blocks whose Wgrad uses
  model.switch_wgrad_to (fp4jax.train.adaptive).
  """
  rngs = {"quant": key} if layer_key is None else {"quant": key, "hadamard": layer_key}
  inputs_BxL = tokens_BxL1[:, :-1]
  args = (inputs_BxL,) if wgrad_switched_L is None else (inputs_BxL, wgrad_switched_L)
  logits_BxLxV = model.apply({"params": params}, *args, rngs=rngs)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits_BxLxV, tokens_BxL1[:, 1:]).mean()


def _micro_batches(tokens_BxL1, n):
  """[B, L+1] -> [n, B/n, L+1], micro-batch i = rows i, i+n, i+2n, ...

  Taking every n-th row keeps each micro-batch spread over all the devices
  that hold the batch, so accumulation needs no resharding.
  """
  b, length = tokens_BxL1.shape
  x_NxMxL1 = tokens_BxL1.reshape(b // n, n, length).swapaxes(0, 1)
  return nn.with_logical_constraint(
      x_NxMxL1, (None, "activation_batch", "activation_length"))


def make_train_step(model, tx, schedule, *, seed_key, n_micro,
                    nan_steps=()):
  """Returns step(state, tokens_BxL1, wgrad_switched_L=None) -> (state, metrics).

  wgrad_switched_L: see loss_fn (None: the recipe's Wgrad everywhere).

  metrics: loss, grad_norm, lr (the rate this step's update used), skipped,
  bad_in_row. nan_steps: a test hook; the loss of these steps
  (numbered from 1, as in metrics.jsonl) is multiplied by NaN (empty in real
  runs, and then not traced at all).
  """
  nan_steps = jnp.asarray(tuple(nan_steps), jnp.int32)
  run_layer_key = layer_key(seed_key)

  def step_loss(params, tokens_BxL1, key, step, wgrad_switched_L):
    loss = loss_fn(model, params, tokens_BxL1, key, run_layer_key, wgrad_switched_L)
    if nan_steps.size:
      loss = loss * jnp.where(jnp.isin(step + 1, nan_steps), jnp.nan, 1.0)
    return loss

  grad_fn = jax.value_and_grad(step_loss)

  def step(state, tokens_BxL1, wgrad_switched_L=None):
    step_key = jax.random.fold_in(seed_key, state.step)
    if n_micro == 1:
      loss, grads = grad_fn(state.params, tokens_BxL1, step_key, state.step, wgrad_switched_L)
    else:
      def accumulate(carry, xs):
        i, tokens = xs
        out = grad_fn(state.params, tokens, jax.random.fold_in(step_key, i),
                      state.step, wgrad_switched_L)
        return jax.tree.map(jnp.add, carry, out), None

      zero = (jnp.zeros((), jnp.float32),
              jax.tree.map(jnp.zeros_like, state.params))
      xs = (jnp.arange(n_micro), _micro_batches(tokens_BxL1, n_micro))
      (loss, grads), _ = jax.lax.scan(accumulate, zero, xs)
      loss, grads = jax.tree.map(lambda x: x / n_micro, (loss, grads))

    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(ok, new, old)
    bad_in_row = jnp.where(ok, 0, state.bad_in_row + 1)
    new_state = TrainState(
        step=state.step + 1,
        params=jax.tree.map(keep, params, state.params),
        opt_state=jax.tree.map(keep, opt_state, state.opt_state),
        skipped=state.skipped + (~ok).astype(jnp.int32),
        bad_in_row=bad_in_row)
    metrics = dict(loss=loss, grad_norm=grad_norm,
                   lr=schedule(state.step - state.skipped),
                   skipped=new_state.skipped, bad_in_row=bad_in_row)
    return new_state, metrics

  return step


def make_eval_step(model, eval_key, run_layer_key=None):
  """Returns eval_loss(params, tokens_BxL1, index) -> mean cross-entropy.

  Random recipes draw fold_in(eval_key, index): the same keys every eval.
  run_layer_key: the training run's layer_key(seed_key), so that per-layer
  Hadamard signs are the ones training uses (needed by such recipes only).
  """
  def eval_loss(params, tokens_BxL1, index):
    return loss_fn(model, params, tokens_BxL1,
                   jax.random.fold_in(eval_key, index), run_layer_key)
  return eval_loss


def micro_batch(config):
  """Global sequences per accumulation step (config.micro_batch, 0: the batch)."""
  return config.micro_batch or config.batch_size


_OPTIMIZER_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio",
                   "weight_decay", "b1", "b2", "eps", "clip")


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted functions of one run and the shardings they use."""
  init: Any             # params_key -> TrainState
  step: Any             # (state, tokens_BxL1[, wgrad_switched_L]) -> (state, metrics)
  eval: Any             # (params, tokens_BxL1, index) -> loss
  abstract: Any         # TrainState of ShapeDtypeStruct (with shardings)
  params_key: Any
  switchable: bool      # step takes wgrad_switched_L (fp4jax.train.adaptive)


def make_programs(config, model_cfg, recipe, mesh, *, switch_wgrad_to=None,
                  nan_steps=()):
  """The jitted init, step and eval of `config` with `recipe` on `mesh`.

  The trainer's own: its optimizer, seed, micro-batches and sequence length
  from `config` (a benchmark gets the step a run trains with).
  switch_wgrad_to: the Gemm of switched blocks' Wgrad (fp4jax.train.adaptive); the
  step then takes the bool [n_layers] wgrad_switched_L as a third argument.
  nan_steps: test hook, see fp4jax.train.trainer.train().
  """
  return _programs(
      model_cfg, recipe, tuple((k, config[k]) for k in _OPTIMIZER_KEYS),
      config.seed, config.batch_size // micro_batch(config), tuple(nan_steps),
      config.seq_len, mesh, switch_wgrad_to)


@functools.lru_cache(maxsize=4)
def _programs(model_cfg, recipe, optimizer_items, seed, n_micro, nan_steps,
              seq_len, mesh, switch_wgrad_to):
  """Builds (and caches) the Programs of make_programs.

  Runs in one process that differ only in data, evaluation, checkpointing or
  stopping share these, so they compile once (tests and sweeps rely on it).
  Parameters and optimizer state are created directly sharded: init is
  jitted with out_shardings from the model's logical axis names.
  """
  model = model_lib.Llama(model_cfg, recipe, switch_wgrad_to)
  tx, schedule = optimizer(
      ml_collections.ConfigDict(dict(optimizer_items)))
  seed_key = jax.random.key(seed)
  params_key, eval_key = jax.random.split(seed_key)
  init = lambda key: init_state(model, tx, key, seq_len)
  boxed = jax.eval_shape(init, params_key)
  state_shardings = sharding.logical_to_sharding(boxed, mesh)
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.unbox(boxed), state_shardings)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_sharding = sharding.batch_sharding(mesh)
  step = make_train_step(
      model, tx, schedule, seed_key=seed_key, n_micro=n_micro,
      nan_steps=nan_steps)
  return Programs(
      init=jax.jit(lambda key: nn.unbox(init(key)),
                   out_shardings=state_shardings),
      step=jax.jit(step, in_shardings=(state_shardings, batch_sharding)
                   + ((replicated,) if switch_wgrad_to is not None else ()),
                   out_shardings=(state_shardings, replicated),
                   donate_argnums=0),
      eval=jax.jit(make_eval_step(model, eval_key, layer_key(seed_key)),
                   in_shardings=(state_shardings.params, batch_sharding, None),
                   out_shardings=replicated),
      abstract=abstract, params_key=params_key,
      switchable=switch_wgrad_to is not None)
