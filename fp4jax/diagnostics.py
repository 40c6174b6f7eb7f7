"""Per-role quantization-error statistics: the "structural error" of a recipe.

For a linear layer with input X[M, K], kernel W[K, N] and output gradient
dY[M, N], each role's quantized GEMM (fprop X W, dgrad dY W^T, wgrad X^T dY,
computed by `fp4jax.dot.dot_general(recipe)` itself, forward and VJP) is
compared with the exact float32 GEMM:

  lhs_err, rhs_err  relative error eps = ||q(a) - a|| / ||a|| of each operand
                    as the role quantizes it (after its rotation, if any);
  out_err, out_cos  relative error and cosine similarity of the GEMM output;
  snr               ||exact|| / ||quantized - exact|| of the output (=
                    1 / out_err) on this batch. For Wgrad, dW = sum_m x_m dy_m^T:
                    once the per-token terms are incoherent, ||dW||^2 and
                    ||error||^2 both scale with sum_m ||x_m||^2 ||dy_m||^2 and
                    snr ~ 1 / sqrt(eps_lhs^2 + eps_rhs^2), a constant of the
                    format, whatever the state of training;
  kappa             snr * sqrt(eps_lhs^2 + eps_rhs^2): ~1 when snr is that
                    constant, > 1 when the output's terms add more coherently
                    than their errors (`coherence`);
  snr_true          Wgrad only (the one role whose output has the same
                    coordinates for every batch): sqrt(max(<G_a, G_b>, 0)) /
                    ||quantized - exact|| with G_a, G_b the exact weight
                    gradients of the two halves of the batch (`true_snr`);
                    estimates ||E G|| / ||quantization error||, E over batches
                    at these weights;
  lhs_signed, rhs_signed, out_signed
                    <q(a) - a, a> / ||a||^2 of each operand and of the output
                    (`signed_error`): the error's projection on the value;
                    negative = shrinkage toward zero (UFP4, arXiv 2606.20381,
                    argues E2M1 rounding shrinks and a random Hadamard
                    amplifies it);
  bias              ||mean of the last k output errors|| / mean of their norms
                    (1: the same error every step; ~1/sqrt(k): independent);
  step_cos          cosine between the output errors at steps t-1 and t.

Chmiel et al. ("FP4 All the Way", arXiv 2505.19115) write in their abstract
that quantized training becomes less effective "when the gradient norm falls
below approximately sqrt(3) times the quantization noise"; the abstract does
not say whether that gradient is the expected (full-data) one or a
minibatch's. `snr_true` takes the expected gradient, the signal
that quantization noise can drown; the batch `snr` above cannot make that
comparison, because its numerator carries the batch's own sampling noise,
incoherent over tokens like the quantization error.

The paper (arXiv 2605.09825; docs/ablation.md) claims deterministic rotations help because their
Wgrad error is the same every step while random methods' errors accumulate;
bias and step_cos of the wgrad error measure exactly that. They are computed
on the training batch (wgrad only: its error lives in weight space, the same
coordinates every step) and on a fixed reference batch (all roles: identical
inputs for every recipe and step, only the weights move). On the training
batch every role also logs TRAIN_STATS: that is the gradient training uses.

`make_callback` returns a trainer callback `cb(step, state, batch)` that
measures chosen layers on `window` consecutive steps every `every` steps and
returns rows such as {"diag/ref/block_0/attn/q/wgrad/bias": 0.93, ...}.
"""

import collections
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from fp4jax import dot as fp4dot
from fp4jax.numerics import operand
from fp4jax.recipes import ROLES

SOURCES = ("train", "ref")
GEMM_STATS = ("lhs_err", "rhs_err", "out_err", "out_cos", "snr", "kappa", "lhs_signed",
              "rhs_signed", "out_signed")
TRAIN_STATS = ("snr", "kappa", "lhs_signed", "rhs_signed", "out_signed")
WINDOW_STATS = ("bias", "step_cos")
# The Wgrad snr below which FP4 training stops making progress (Chmiel et al.).
SNR_THRESHOLD = math.sqrt(3)
_DN = (((1,), (0,)), ((), ()))  # x_MxK . w_KxN


# ---------------------------------------------------------------- statistics

def _ratio(num, den):
  """num / den, NaN where den is 0 (the statistic is undefined)."""
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


def relative_error(approx, exact):
  """||approx - exact|| / ||exact|| over all elements (NaN when exact is zero)."""
  diff = jnp.asarray(approx, jnp.float32) - jnp.asarray(exact, jnp.float32)
  return _ratio(jnp.linalg.norm(diff.ravel()),
                jnp.linalg.norm(jnp.asarray(exact, jnp.float32).ravel()))


def cosine(a, b):
  """<a, b> / (||a|| ||b||) over all elements (NaN when either is zero)."""
  a = jnp.asarray(a, jnp.float32).ravel()
  b = jnp.asarray(b, jnp.float32).ravel()
  return _ratio(jnp.dot(a, b), jnp.linalg.norm(a) * jnp.linalg.norm(b))


def signal_to_noise(approx, exact):
  """||exact|| / ||approx - exact|| over all elements (inf when they are equal, NaN when both are zero)."""
  exact = jnp.asarray(exact, jnp.float32)
  noise = jnp.linalg.norm((jnp.asarray(approx, jnp.float32) - exact).ravel())
  return signal_to_noise_from_norms(jnp.linalg.norm(exact.ravel()), noise)


def signal_to_noise_from_norms(signal, noise):
  """signal / noise (arrays of norms): inf where only noise is 0, NaN where both are."""
  return jnp.where(noise > 0, signal / jnp.where(noise > 0, noise, 1.0),
                   jnp.where(signal > 0, jnp.inf, jnp.nan))


def signed_error(approx, exact):
  """<approx - exact, exact> / ||exact||^2 over all elements (NaN when exact is zero).

  The part of the relative error along the value: -0.01 = a 1% shrinkage
  toward zero. Its expectation over a distribution of values is the bias a
  rounding rule has on that distribution; sampled once it carries the
  rounding's variance too (small for large tensors).
  """
  exact = jnp.asarray(exact, jnp.float32).ravel()
  diff = jnp.asarray(approx, jnp.float32).ravel() - exact
  return _ratio(jnp.dot(diff, exact), jnp.dot(exact, exact))


def coherence(snr, lhs_err, rhs_err):
  """kappa = snr * sqrt(lhs_err^2 + rhs_err^2).

  For a GEMM output that sums M per-term products whose errors are
  incoherent, ||error|| ~ sqrt(lhs^2 + rhs^2) * sqrt(sum_m ||term_m||^2): kappa
  is then ||output|| / sqrt(sum_m ||term_m||^2), 1 when the terms themselves
  add incoherently (snr is the format's constant) and up to sqrt(M) when they
  all point the same way. Biased where the operand errors are correlated with
  each other (then the error is not their root-sum-square).
  """
  return snr * jnp.sqrt(lhs_err ** 2 + rhs_err ** 2)


def half_gradients(x_MxK, dy_MxN):
  """The exact Wgrads G_a, G_b [K, N] of the two halves of the M rows.

  dy is the gradient of a mean over the M rows, so each half's own mean-loss
  gradient is 2 x_h^T dy_h and G = (G_a + G_b) / 2 is the batch's. M even;
  the halves are independent samples only if they hold different sequences
  (rows ordered sequence by sequence, an even number of sequences).
  """
  x, dy = jnp.asarray(x_MxK, jnp.float32), jnp.asarray(dy_MxN, jnp.float32)
  h = x.shape[0] // 2
  hi = jax.lax.Precision.HIGHEST
  return (2 * jnp.dot(x[:h].T, dy[:h], precision=hi), 2 * jnp.dot(x[h:].T, dy[h:], precision=hi))


def true_snr(g_a, g_b, error):
  """sqrt(max(<g_a, g_b>, 0)) / ||error||: the expected gradient's norm over the noise.

  g_a, g_b: exact gradients of two independent batches at the same weights;
  error: the quantization error of the gradient training uses.
  <g_a, g_b> is an unbiased estimate of ||E g||^2 when the batches are
  independent and equally distributed (E<g_a, g_b> = <E g_a, E g_b>); it is
  biased up when they are positively correlated (e.g. neighbouring windows of
  one document). Its square root is biased low (Jensen), and where ||E g||^2
  is small against the spread of <g_a, g_b> (sampling noise of the halves,
  late in training) the max(., 0) clip biases it up and single measurements
  are noisy: average several. Identical batches give the batch snr exactly.
  """
  dot = jnp.vdot(jnp.asarray(g_a, jnp.float32).ravel(), jnp.asarray(g_b, jnp.float32).ravel())
  noise = jnp.linalg.norm(jnp.asarray(error, jnp.float32).ravel())
  return signal_to_noise_from_norms(jnp.sqrt(jnp.maximum(dot, 0.0)), noise)


def error_bias(errors):
  """||mean_t e_t|| / mean_t ||e_t|| for k same-shaped errors e_t (a sequence or [k, ...]).

  1 when every e_t is the same; about 1/sqrt(k) for independent zero-mean
  errors; NaN when all are zero.
  """
  e_KxS = jnp.stack([jnp.asarray(e, jnp.float32).ravel() for e in errors])
  return _ratio(jnp.linalg.norm(jnp.mean(e_KxS, axis=0)),
                jnp.mean(jnp.linalg.norm(e_KxS, axis=1)))


class ErrorWindow:
  """The last k errors of one (source, layer, role), kept on the host.

  `add(step, error)` returns {"step_cos": ...} when step - 1 was the previous
  entry, and {"bias": ...} once the last k entries are k consecutive steps;
  statistics that are undefined (all errors zero, e.g. an unquantized role)
  are left out.
  """

  def __init__(self, k: int):
    if k < 2:
      raise ValueError(f"the error window needs k >= 2 steps, got {k}")
    self.k = k
    self._steps = collections.deque(maxlen=k)
    self._errors = collections.deque(maxlen=k)

  def add(self, step: int, error) -> dict:
    out = {}
    if self._steps and self._steps[-1] == step - 1:
      out["step_cos"] = float(cosine(self._errors[-1], error))
    self._steps.append(step)
    self._errors.append(np.asarray(error, np.float32))
    if len(self._steps) == self.k and self._steps[-1] - self._steps[0] == self.k - 1:
      out["bias"] = float(error_bias(self._errors))
    return {k: v for k, v in out.items() if np.isfinite(v)}


# ---------------------------------------------------------------- one layer

def as_matrices(lhs, rhs, dy):
  """A linear layer's captured operands as x_MxK, w_KxN, dy_MxN.

  lhs [*M, *K] (activations), rhs [*K, *N] (kernel), dy [*M, *N] (output
  gradient); the number of contraction axes is the one that makes the shapes
  agree (as for flax DenseGeneral, whose contraction axes lead the kernel).
  """
  for c in range(min(lhs.ndim, rhs.ndim), 0, -1):
    m_shape, k_shape = lhs.shape[:lhs.ndim - c], lhs.shape[lhs.ndim - c:]
    if k_shape == rhs.shape[:c] and m_shape + rhs.shape[c:] == dy.shape:
      m, k = math.prod(m_shape), math.prod(k_shape)
      return lhs.reshape(m, k), rhs.reshape(k, -1), dy.reshape(m, -1)
  raise ValueError(f"cannot read lhs {lhs.shape}, rhs {rhs.shape}, dy {dy.shape} "
                   "as a linear layer [*M, *K] x [*K, *N] -> [*M, *N]")


def role_operands(recipe, role, a, b, a_axis, b_axis, key=None, layer_key=None):
  """Both operands of one role as its GEMM consumes them, and their references.

  Returns ((a_q, a_ref), (b_q, b_ref)): q = rotated, quantized and cast to the
  compute dtype by `fp4jax.numerics.operand.fake_quantize_operand` with the keys and signs
  dot.py derives from the role key `key` (and the role's layer key
  `layer_key`, for per-layer signs); ref = rotated only (float32), so
  the relative error is the quantization error in the rotated basis (an
  orthonormal rotation keeps norms). A plain role returns its operands.
  Always the XLA path (tests/test_dot.py: bitwise equal to the Pallas one).
  """
  gemm = getattr(recipe, role)
  if gemm.is_plain:
    return (a, a), (b, b)
  keys = [None] * 3 if key is None else [jax.random.fold_in(key, i) for i in range(3)]
  signs = fp4dot.rotation_signs(gemm.hadamard, keys[2], layer_key)
  out = []
  for x, spec, axis, k in ((a, gemm.lhs, a_axis, keys[0]), (b, gemm.rhs, b_axis, keys[1])):
    ref = operand.fake_quantize_operand(x, None, gemm.hadamard, signs, axis, None)
    q = operand.fake_quantize_operand(x, spec, gemm.hadamard, signs, axis, k)
    out.append((q.astype(recipe.compute_dtype), ref))
  return tuple(out)


def gemm_stats(recipe, x_MxK, w_KxN, dy_MxN, key=None, layer_key=None, halves=False):
  """Statistics of the three quantized GEMMs of one layer against the exact ones.

  Returns ({role: {stat: scalar}} for GEMM_STATS, plus wgrad's snr_true when
  `halves` (`half_gradients`: M even, the halves independent), {role: output
  error array}): errors are quantized minus exact, shapes fprop [M, N], dgrad
  [M, K], wgrad [K, N]. `key` is used by random recipes only; `layer_key`
  (the key the layer passed to dot_general, see `capture`) by per-layer signs only.
  """
  key = key if recipe.is_random else None
  layer_key = layer_key if recipe.needs_layer_key else None
  x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x_MxK, w_KxN, dy_MxN))
  dot = fp4dot.dot_general(recipe)
  y_q, vjp = jax.vjp(
      lambda a, b: dot(a, b, _DN, preferred_element_type=jnp.float32, key=key,
                       layer_key=layer_key), x, w)
  dx_q, dw_q = vjp(dy.astype(y_q.dtype))
  hi = jax.lax.Precision.HIGHEST
  exact = {"fprop": jnp.dot(x, w, precision=hi), "dgrad": jnp.dot(dy, w.T, precision=hi),
           "wgrad": jnp.dot(x.T, dy, precision=hi)}
  quant = {"fprop": y_q, "dgrad": dx_q, "wgrad": dw_q}
  # Operands and contraction axes in dot.py's layout (lhs contracts its last
  # axis, rhs in place), so stochastic rounding draws the GEMM's own bits.
  operands = {"fprop": (x, w, 1, 0), "dgrad": (dy, w, 1, 1), "wgrad": (x.T, dy, 1, 0)}
  stats, errors = {}, {}
  for i, role in enumerate(ROLES):
    a, b, a_axis, b_axis = operands[role]
    role_key = None if key is None else jax.random.fold_in(key, i)
    role_layer_key = None if layer_key is None else jax.random.fold_in(layer_key, i)
    (a_q, a_ref), (b_q, b_ref) = role_operands(recipe, role, a, b, a_axis, b_axis, role_key,
                                               role_layer_key)
    out_q, out = quant[role].astype(jnp.float32), exact[role]
    lhs_err, rhs_err = relative_error(a_q, a_ref), relative_error(b_q, b_ref)
    snr = signal_to_noise(out_q, out)
    stats[role] = {"lhs_err": lhs_err, "rhs_err": rhs_err,
                   "out_err": relative_error(out_q, out), "out_cos": cosine(out_q, out),
                   "snr": snr, "kappa": coherence(snr, lhs_err, rhs_err),
                   "lhs_signed": signed_error(a_q, a_ref), "rhs_signed": signed_error(b_q, b_ref),
                   "out_signed": signed_error(out_q, out)}
    errors[role] = out_q - out
  if halves:
    stats["wgrad"]["snr_true"] = true_snr(*half_gradients(x, dy), errors["wgrad"])
  return stats, errors


# ---------------------------------------------------------------- the model

def capture(model, layers, params, tokens_BxL1, key=None, layer_key=None):
  """Runs `model` (built with capture_dots=True) on one batch and returns the
  operands of the named layers: {layer: (lhs, rhs, dy, layer's key or None)}.

  tokens_BxL1: int32 [B, L + 1] (inputs and next-token targets); dy is the
  gradient of the mean next-token cross-entropy w.r.t. the layer's output.
  `layers` are module paths such as "block_0/attn/q"; `key` feeds the "quant"
  rng stream of random recipes, `layer_key` (the run's, as in training) the
  "hadamard" stream of per-layer signs; each such layer sows the key it
  passed to dot_general, which is returned with its operands.
  """
  inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
  rngs = {"quant": key} if model.recipe.is_random else {}
  if model.recipe.needs_layer_key:
    rngs["hadamard"] = layer_key
  _, zeros = model.apply({"params": params}, inputs, rngs=rngs, mutable=["perturbations"])

  def loss(perturbations):
    logits, inter = model.apply({"params": params, **perturbations}, inputs, rngs=rngs,
                                mutable=["intermediates"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return ce, inter["intermediates"]

  grads, inter = jax.grad(loss, has_aux=True)(zeros)
  sown = traverse_util.flatten_dict(inter, sep="/")
  outs = traverse_util.flatten_dict(grads["perturbations"], sep="/")
  found = {}
  for path, dy in outs.items():
    module = path.rsplit("/", 1)[0]
    match = [name for name in layers if module == name or module.startswith(name + "/")]
    if match:
      own_key = sown.get(f"{module}/layer_key")
      found[match[0]] = (sown[f"{module}/lhs"][0], sown[f"{module}/rhs"][0], dy,
                         None if own_key is None else own_key[0])
  missing = [name for name in layers if name not in found]
  if missing:
    known = sorted({p.rsplit("/", 2)[0] for p in outs})
    raise ValueError(f"diagnostics layers {missing} not found; captured layers: {known}")
  return found


@dataclasses.dataclass
class _Callback:
  """State of `make_callback`'s callback (see there)."""
  capture_fn: object
  stats_fn: object
  ref_batch: object
  every: int
  window: int
  seed: int
  layer_key: object = None
  windows: dict = dataclasses.field(default_factory=dict)

  def __call__(self, step, state, batch):
    if step % self.every >= self.window:
      return None
    row = {}
    sources = {"train": batch, "ref": self.ref_batch}
    for s, source in enumerate(SOURCES):
      tokens = sources[source]
      if tokens is None:
        continue
      tokens = jnp.asarray(np.asarray(tokens).reshape(-1, np.shape(tokens)[-1]), jnp.int32)
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), s)
      ops = self.capture_fn(state.params, tokens, jax.random.fold_in(key, 0), self.layer_key)
      halves = tokens.shape[0] % 2 == 0  # whole sequences in each half
      for li, (layer, (lhs, rhs, dy, own_key)) in enumerate(ops.items()):
        stats, errors = jax.device_get(self.stats_fn(
            *as_matrices(lhs, rhs, dy), jax.random.fold_in(key, li + 1), own_key, halves))
        for role in ROLES:
          prefix = f"diag/{source}/{layer}/{role}"
          if source == "train" and role != "wgrad":
            row.update({f"{prefix}/{k}": float(stats[role][k]) for k in TRAIN_STATS})
            continue
          row.update({f"{prefix}/{k}": float(v) for k, v in stats[role].items()})
          win = self.windows.setdefault(prefix, ErrorWindow(self.window))
          row.update({f"{prefix}/{k}": v for k, v in win.add(step, errors[role]).items()})
    return row


def make_callback(model, ref_batch=None, *, layers, every=50, window=4, seed=0,
                  layer_key=None):
  """A trainer callback `cb(step, state, batch) -> dict | None` for fp4jax.train.trainer.

  model: the fp4jax.llama.model.Llama being trained (rebuilt here with
    capture_dots=True); its recipe is the one measured.
  ref_batch: int32 [B, L + 1] fixed reference tokens (None: training batch only).
  layers: module paths, e.g. fp4jax.llama.linears.diagnostics_layers(). Measures the steps with
    step % every < window, so each window holds `window` consecutive steps;
    bias is reported on its last step, step_cos on all but its first.
  seed: keys for random recipes (fold_in(seed, step)).
  layer_key: the run's "hadamard" key (fp4jax.train.step.layer_key), needed
    by recipes with per-layer signs: the diagnostics then see the signs that
    training uses.
  The per-(source, layer, role) error windows are Python state of the callback.
  """
  recipe = model.recipe
  if model.config.scan_layers:
    raise ValueError("diagnostics need scan_layers=False (per-block module paths)")
  if window < 2 or every < window:
    raise ValueError(f"diagnostics need 2 <= window <= every, got window={window}, every={every}")
  layers = tuple(layers)
  for name in layers:
    block = re.match(r"block_(\d+)/", name)
    if block and model.config.is_bf16(int(block.group(1))):
      raise ValueError(f"diagnostics layer {name!r} is in bf16_layers, not on recipe "
                       f"{recipe.name!r}; choose another layer")
  cap_model = model.clone(config=dataclasses.replace(model.config, capture_dots=True))
  capture_fn = jax.jit(functools.partial(capture, cap_model, layers))
  stats_fn = jax.jit(functools.partial(gemm_stats, recipe), static_argnums=(5,))
  if recipe.needs_layer_key and layer_key is None:
    raise ValueError(f"recipe {recipe.name!r} uses per-layer Hadamard signs: diagnostics "
                     "need the run's layer_key (fp4jax.train.step.layer_key)")
  return _Callback(capture_fn, stats_fn, ref_batch, every, window, seed, layer_key)
