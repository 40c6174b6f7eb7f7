"""The adaptive per-layer Wgrad switch: `config.adaptive_wgrad`.

Chmiel et al. ("FP4 All the Way", 2025) find that FP4 training stops making
progress once the weight gradient's norm falls below about sqrt(3) times the
norm of its quantization noise, and propose moving to higher precision then.
This module does that per transformer block, during the run:

  every `every` steps the trainer measures, on the training batch just used
  and the parameters after the step, each block's true-gradient Wgrad
  signal-to-noise ratio over its seven linears together (q, k, v, o, gate,
  up, down: their weight gradients as one vector):
    snr_true = sqrt(max(sum <dW_a, dW_b>, 0)) / ||quantized dW - exact dW||,
  dW_a, dW_b the exact weight gradients of the two halves of the batch
  (fp4jax.diagnostics.true_snr: the numerator estimates the expected
  gradient's norm) and the error that of the recipe's own Wgrad on the whole
  batch (fp4jax.diagnostics.gemm_stats; attention products and the head are
  not weights of a block and are not measured or switched). The batch SNR
  ||exact dW|| / ||error|| is not offered: once per-token terms are
  incoherent it is a constant of the format (fp4jax.diagnostics), so a
  switch on it reacts to the format, not to training. A block whose
  snr_true is below `threshold` on `window`
  measurements in a row (a NaN or a value >= threshold starts the count
  again) computes its Wgrad with `to` from the next step on, for the rest of
  the run.

  to = "fp8": per-tensor FP8 (E4M3 X, E5M2 dY, as the `fp8` preset's Wgrad);
  to = "bf16": the unquantized GEMM in the compute dtype (the `bf16` preset).

The switch is runtime data, not a new program: the train step takes a bool
[n_layers] argument, and each quantized linear's backward picks its Wgrad
with one lax.cond (fp4jax.dot; both GEMMs are compiled, one runs). A run
with the switch disabled takes exactly the code of a run without it.

Logged: one line per switch, a metrics.jsonl row at every measurement with
`adaptive_wgrad/block_<i>/snr_true` and, when blocks switch, `wgrad_switch`
({"block_<i>": to}); summary.json lists `wgrad_switches` ({"block_<i>":
step}). The decision state (which blocks switched at which step, the current
runs of low measurements) is saved in every checkpoint, so a resumed run
decides exactly as an uninterrupted one (the measurements themselves are
deterministic: fixed keys per step).

Config keys (config.adaptive_wgrad): enabled (False), threshold (sqrt(3)),
window (3), every (50), to ("fp8"). Needs model.scan_layers=False, an even
batch_size (two halves of whole sequences) and a recipe whose Wgrad is
quantized, with residuals="original".
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fp4jax import diagnostics
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax import recipes
from fp4jax.train import step as train_step

TARGETS = ("fp8", "bf16")
_KEY_DATA = 2  # fold_in(fold_in(key(seed), step), 2): the diagnostics use 0 and 1


def adaptive_config() -> ml_collections.ConfigDict:
  """Defaults of config.adaptive_wgrad (see the module docstring)."""
  return ml_collections.ConfigDict(dict(
      enabled=False, threshold=diagnostics.SNR_THRESHOLD, window=3, every=50, to="fp8"))


def check(cfg, model_cfg, segment_recipes, batch_size):
  """ValueError (one line, naming the key) on a bad config.adaptive_wgrad value.

  segment_recipes: the recipe from step 0, then those of config.quant_schedule;
  batch_size: config.batch_size.
  The values are checked even when disabled; the model and recipes only when
  enabled.
  """
  where = "config.adaptive_wgrad"  # (the ConfigDict enforces each key's type)
  if not cfg.threshold > 0:
    raise ValueError(f"{where}.threshold must be > 0 (a Wgrad snr_true, default sqrt(3)), "
                     f"got {cfg.threshold!r}")
  for key in ("window", "every"):
    if cfg[key] < 1:
      raise ValueError(f"{where}.{key} must be >= 1, got {cfg[key]!r}")
  if cfg.to not in TARGETS:
    raise ValueError(f"{where}.to must be one of {', '.join(TARGETS)}, got {cfg.to!r}")
  if not cfg.enabled:
    return
  if batch_size % 2:
    raise ValueError(f"{where} needs an even batch_size (snr_true compares the gradients of "
                     f"its two halves), got {batch_size}")
  if model_cfg.scan_layers:
    raise ValueError(f"{where} needs model.scan_layers=False (the switch and its monitor "
                     "address each block by its module path)")
  first = segment_recipes[0]
  if first.wgrad.is_plain:
    raise ValueError(f"{where}: recipe {first.name!r} does not quantize Wgrad; "
                     "there is nothing to switch")
  for recipe in segment_recipes:
    if recipe.residuals == "quantized":
      raise ValueError(f"{where} needs quant.residuals='original': recipe {recipe.name!r} "
                       "saves X only in its FP4 Wgrad form, and a switched Wgrad needs X")
  if not eligible_blocks(model_cfg):
    raise ValueError(f"{where}: every block is in model.bf16_layers "
                     f"{model_cfg.bf16_layers}; there is nothing to switch")


def target_gemm(to: str) -> recipes.Gemm:
  """The Wgrad Gemm a switched block uses: the `fp8` or `bf16` preset's."""
  return recipes.recipe(to).wgrad


def switch_target(cfg, recipe):
  """The Gemm for Llama(switch_wgrad_to=...) under `recipe`: None when the switch
  is disabled or the recipe's Wgrad is unquantized (a quant_schedule segment)."""
  if not cfg.enabled or recipe.wgrad.is_plain:
    return None
  return target_gemm(cfg.to)


def eligible_blocks(model_cfg) -> list[int]:
  """Blocks on the recipe (not in bf16_layers)."""
  return [i for i in range(model_cfg.n_layers) if not model_cfg.is_bf16(i)]


class WgradSwitch:
  """The decisions: which blocks switched at which step (host-side, JSON-able).

  n_layers: blocks of the model; blocks: those that may switch; threshold,
  window: see the module docstring.
  """

  def __init__(self, n_layers, blocks, threshold, window):
    self.n_layers, self.blocks = n_layers, list(blocks)
    self.threshold, self.window = threshold, window
    self.switched = {}  # block -> step of the measurement that decided it
    self.low = {b: [] for b in self.blocks}  # block -> [(step, snr)] of the current run

  def update(self, step, snr_by_block) -> list[int]:
    """Adds the measurement of `step` ({block: SNR}); returns the blocks it switches."""
    new = []
    for block in self.blocks:
      if block in self.switched or block not in snr_by_block:
        continue
      snr = float(snr_by_block[block])
      if snr < self.threshold:
        self.low[block] = (self.low[block] + [(step, snr)])[-self.window:]
      else:
        self.low[block] = []
      if len(self.low[block]) == self.window:
        self.switched[block] = step
        new.append(block)
    return new

  def flags(self) -> np.ndarray:
    """bool [n_layers]: True for the switched blocks."""
    out = np.zeros(self.n_layers, np.bool_)
    out[list(self.switched)] = True
    return out

  def state_dict(self) -> dict:
    return {"switched": {str(b): s for b, s in self.switched.items()},
            "low": {str(b): [list(e) for e in run] for b, run in self.low.items()}}

  def load_state_dict(self, saved: dict):
    self.switched = {int(b): int(s) for b, s in saved["switched"].items()}
    self.low = {b: [(int(s), float(v)) for s, v in saved["low"].get(str(b), [])]
                for b in self.blocks}


@functools.lru_cache(maxsize=8)
def make_monitor(model_cfg, recipe, blocks: tuple, seed: int):
  """measure(params, tokens_BxL1, key) -> float32 [len(blocks)]: each block's Wgrad snr_true.

  model_cfg, recipe: the model being trained (the recipe is measured);
  seed: the run's seed (its layer key gives per-layer Hadamard signs). Jitted
  (and cached, so runs of one process share it): one capture of every
  linear's operands and output gradient (fp4jax.diagnostics.capture), then
  the recipe's Wgrad against the exact one, and the exact Wgrads of the two
  halves of the batch (B even).
  """
  cap_model = model_lib.Llama(dataclasses.replace(model_cfg, capture_dots=True), recipe)
  layer_key = train_step.layer_key(jax.random.key(seed))
  layers = [f"block_{b}/{layer.path}" for b in blocks for layer in linears.BLOCK]

  def measure(params, tokens_BxL1, key):
    ops = diagnostics.capture(cap_model, layers, params, tokens_BxL1, jax.random.fold_in(key, 0),
                              layer_key)
    signal2, noise2 = [], []
    for i, layer in enumerate(layers):
      lhs, rhs, dy, own_key = ops[layer]
      x_MxK, w_KxN, dy_MxN = diagnostics.as_matrices(lhs, rhs, dy)
      _, errors = diagnostics.gemm_stats(recipe, x_MxK, w_KxN, dy_MxN,
                                         jax.random.fold_in(key, i + 1), own_key)
      g_a, g_b = diagnostics.half_gradients(x_MxK, dy_MxN)
      signal2.append(jnp.vdot(g_a.ravel(), g_b.ravel()))
      noise2.append(jnp.sum(errors["wgrad"] ** 2))
    per_block = lambda v: jnp.stack(v).reshape(len(blocks), len(linears.BLOCK)).sum(axis=1)
    return diagnostics.signal_to_noise_from_norms(jnp.sqrt(jnp.maximum(per_block(signal2), 0.0)),
                                                  jnp.sqrt(per_block(noise2)))

  return jax.jit(measure)


class Controller:
  """The switch of one run: measures every `every` steps, decides, logs.

  cfg: config.adaptive_wgrad (checked); model_cfg: the LlamaConfig; seed:
  the run's seed.
  """

  def __init__(self, cfg, model_cfg, seed):
    self.cfg, self.model_cfg, self.seed = cfg, model_cfg, seed
    self.decisions = WgradSwitch(model_cfg.n_layers, eligible_blocks(model_cfg),
                                 cfg.threshold, cfg.window)

  def after_step(self, step, recipe, params, tokens_BxL1, log=print) -> dict:
    """Measures and decides at the steps with step % every == 0 (after the step,
    on its batch, with the step's `recipe`); returns the metrics.jsonl entries
    ({} on other steps or when the recipe's Wgrad is unquantized)."""
    if step % self.cfg.every or recipe.wgrad.is_plain:
      return {}
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), _KEY_DATA)
    measure = make_monitor(self.model_cfg, recipe, tuple(self.decisions.blocks), self.seed)
    snr = np.asarray(jax.device_get(measure(params, tokens_BxL1, key)))
    by_block = dict(zip(self.decisions.blocks, snr.tolist()))
    row = {f"adaptive_wgrad/block_{b}/snr_true": v for b, v in by_block.items()}
    switched = self.decisions.update(step, by_block)
    for b in switched:
      run = self.decisions.low[b]
      log(f"fp4jax: adaptive_wgrad: block_{b} Wgrad -> {self.cfg.to} from step {step + 1}: "
          f"its Wgrad snr_true was below {self.cfg.threshold:.4g} on {self.cfg.window} measurements "
          "in a row (" + ", ".join(f"step {s}: {v:.3f}" for s, v in run) + ")")
    if switched:
      row["wgrad_switch"] = {f"block_{b}": self.cfg.to for b in switched}
    return row

  def flags(self) -> np.ndarray:
    return self.decisions.flags()

  def switches(self) -> dict:
    """{"block_<i>": step of the decision} (summary.json's wgrad_switches)."""
    return {f"block_{b}": s for b, s in sorted(self.decisions.switched.items())}
