"""Llama 3.1 in Flax linen; every linear layer takes its dot_general from a recipe.

Architecture (exactly Llama 3.1): token embedding -> n_layers x [RMSNorm ->
causal grouped-query attention with Llama-3-scaled rotary embeddings ->
residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output head. No
biases; the embedding and the output head are separate (untied) matrices.

Parameters are float32 master weights; activations and matmuls run in
`config.dtype`. RMSNorm, RoPE and softmax are computed in float32.

Kernel layouts (Flax: y = x W, contraction axes first; the linears' names and
axes are the table of fp4jax.llama.linears):
  q    [embed, heads, head_dim]      k, v [embed, kv_heads, head_dim]
  o    [heads, head_dim, embed]      (contracts over two axes: heads, head_dim)
  gate [embed, mlp]  up [embed, mlp]  down [mlp, embed]
  embedding [vocab, embed]            head [embed, vocab]
Keeping heads and head_dim as separate axes lets the tensor axis shard heads
while MX blocks (which run along a GEMM's contraction axis) stay inside
head_dim. For real presets every contraction length (embed, mlp, head_dim,
and the token axes of Wgrad) is a multiple of 32.

Quantized layers: q, k, v, o, gate, up, down, and the head when
`quantize_head=True`. Each gets `fp4jax.flax.DotGeneral(recipe=...)` as its
`dot_general_cls`. Layers named in `bf16_layers` use `fp4jax.recipe("bf16")`:
  "block_<i>"   all seven linears of block i (i in [0, n_layers); negative i
                counts from the end, so "block_-1" is the last block),
  "first:<n>"   the first n blocks, "last:<n>" the last n (NVIDIA's NVFP4
                12B recipe, arXiv 2509.25149: "first:2,last:8"),
  "head"        the output head (only meaningful with quantize_head=True).
The attention products QK^T and PV run in the compute dtype through
lax.dot_general, unless `quantize_attention=True`, in which case they go
through the layer's recipe `DotGeneral` module (batch dims: batch and kv heads;
contraction: head_dim for QK^T, the key positions for PV). Caution: that mode
is not strictly causal. PV's blocks (and Hadamard rotations) run along the
key axis, so V's shared block scale at position j depends on later positions
of the same 32-token block, and a future token can change earlier logits
(docs/training.md). Use it for numerics studies, not to train models meant
to be causal. The default (linears only) is strictly
causal: linears quantize along features, never across tokens, in the forward.

Cached decoding (fp4jax.generate): `init_cache(config, start_B, max_length)`
makes a "cache" collection; `Llama.apply({"params": ..., "cache": cache},
tokens_BxL, mutable=["cache"])` then runs the same layers on L new tokens per
row (a prompt, then one token at a time), writes their keys and values into
the cache and attends over the cached ones. Row b's tokens sit in slots
start_B[b].. of the cache (left padding before it is never attended to) and
have RoPE positions counted from there. The attention products run in the
compute dtype (quantize_attention is refused: its blocks run along the key
axis, which decoding never holds whole); per-tensor scales (NVFP4, FP8) are
taken over the tokens of each call, as the forward takes them over its input.
Without a "cache" collection (training, evaluation) none of this runs.
"""

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import fp4jax.flax as fp4flax
from fp4jax import recipes, sharding
from fp4jax.llama import linears

DTYPES = ("bfloat16", "float32")
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ATTENTION_IMPLS = ("dot_general", "xla", "cudnn")
_BLOCK_NAME = re.compile(r"block_(-?\d+)")
_BLOCK_RANGE = re.compile(r"(first|last):(\d+)")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama 3.1 hyper-parameters and the knobs of the fp4jax model.

  Attributes:
    vocab_size, dim, n_layers, n_heads, n_kv_heads, mlp_dim: model shape;
      head_dim = dim // n_heads.
    rope_theta, rope_factor, rope_low_freq_factor, rope_high_freq_factor,
      rope_original_context: Llama 3 rotary frequencies; rope_factor=1 turns
      the frequency scaling off.
    norm_eps: RMSNorm epsilon.
    dtype: compute dtype, "bfloat16" or "float32" (parameters are float32).
    bf16_layers: layers kept on the unquantized recipe ("block_0", "block_-1",
      "first:2", "last:8", "head"; see the module docstring); a comma-separated
      string is accepted.
    quantize_head: the output head uses the recipe (default: plain dot).
    quantize_attention: QK^T and PV use the recipe (default: compute dtype).
    capture_dots: recipe DotGeneral modules sow operands and perturb outputs
      (for fp4jax.diagnostics).
    remat: one of REMAT_POLICIES, applied per block.
    scan_layers: nn.scan over the blocks (params get a leading "layers" axis).
    attention_impl: "dot_general" (explicit softmax(QK^T)V, quantizable),
      or "xla" / "cudnn": jax.nn.dot_product_attention with that
      implementation ("cudnn" is the fused flash kernel on NVIDIA GPUs and
      needs dtype="bfloat16"); these two cannot be quantized.
    init_std: std of the embedding init (linears: truncated normal, fan-in).
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  mlp_dim: int
  rope_theta: float = 500_000.0
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_context: int = 8192
  norm_eps: float = 1e-5
  dtype: str = "bfloat16"
  bf16_layers: tuple[str, ...] = ()
  quantize_head: bool = False
  quantize_attention: bool = False
  capture_dots: bool = False
  remat: str = "none"
  scan_layers: bool = False
  attention_impl: str = "dot_general"
  init_std: float = 1.0

  def __post_init__(self):
    layers = self.bf16_layers
    if isinstance(layers, str):
      layers = (layers,)
    # "block_0,block_-1" from a command line may arrive as a string or, through
    # a tuple-typed config field, as a 1-tuple holding that string.
    layers = [name.strip() for entry in layers for name in str(entry).split(",") if name.strip()]
    object.__setattr__(self, "bf16_layers", tuple(layers))
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                 "mlp_dim", "rope_original_context"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
    for name in ("rope_theta", "rope_factor", "norm_eps", "init_std"):
      if not getattr(self, name) > 0:
        raise ValueError(f"LlamaConfig.{name} must be > 0, got {getattr(self, name)!r}")
    if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
      raise ValueError(
          "LlamaConfig needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
          f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}")
    if self.dim % self.n_heads:
      raise ValueError(f"LlamaConfig.dim={self.dim} is not a multiple of n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig head_dim={self.head_dim} must be even (rotary pairs)")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"LlamaConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    _check_choice("dtype", self.dtype, DTYPES)
    _check_choice("remat", self.remat, tuple(REMAT_POLICIES))
    _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
    if self.attention_impl == "cudnn" and self.dtype != "bfloat16":
      raise ValueError(
          f"LlamaConfig.attention_impl='cudnn' needs dtype='bfloat16', got {self.dtype!r}")
    if self.quantize_attention and self.attention_impl != "dot_general":
      raise ValueError("LlamaConfig.quantize_attention=True needs attention_impl='dot_general', "
                       f"got {self.attention_impl!r}")
    for name in self.bf16_layers:
      self.named_blocks(name)  # raises on a bad name
    if self.scan_layers and any(n != "head" for n in self.bf16_layers):
      raise ValueError(
          f"LlamaConfig.scan_layers=True cannot keep individual blocks in bf16 "
          f"(bf16_layers={self.bf16_layers}); scanned blocks share one recipe. "
          "Set scan_layers=False or list only 'head'.")

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  def block_index(self, name: str) -> int | None:
    """Block index named by a bf16_layers entry ("block_3", "block_-1"); None for "head"."""
    if name == "head":
      return None
    match = _BLOCK_NAME.fullmatch(name)
    if match is None or not -self.n_layers <= int(match.group(1)) < self.n_layers:
      raise ValueError(
          f"LlamaConfig.bf16_layers entry {name!r} is not a layer name; use 'head', "
          f"'first:<n>', 'last:<n>' or 'block_<i>' with -{self.n_layers} <= i < "
          f"{self.n_layers} (negative counts from the end)")
    return int(match.group(1)) % self.n_layers

  def named_blocks(self, name: str) -> set[int]:
    """Block indices a bf16_layers entry names: "block_<i>", "first:<n>",
    "last:<n>"; the empty set for "head"."""
    match = _BLOCK_RANGE.fullmatch(name)
    if match is None:
      index = self.block_index(name)
      return set() if index is None else {index}
    n = int(match.group(2))
    if not 1 <= n <= self.n_layers:
      raise ValueError(f"LlamaConfig.bf16_layers entry {name!r} needs 1 <= n <= "
                       f"n_layers={self.n_layers}")
    return set(range(n)) if match.group(1) == "first" else set(
        range(self.n_layers - n, self.n_layers))

  def is_bf16(self, block: int | None) -> bool:
    """Whether block `block` (None: the head) is kept on the unquantized recipe."""
    if block is None:
      return "head" in self.bf16_layers
    return any(block in self.named_blocks(name) for name in self.bf16_layers)


def _check_choice(field, value, choices):
  if value not in choices:
    raise ValueError(f"LlamaConfig.{field}={value!r} is not one of {list(choices)}")


MODEL_PRESETS = {
    "llama3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                        n_kv_heads=8, mlp_dim=14336),
    "llama-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32,
                     n_kv_heads=8, mlp_dim=8192),
    "llama-125m": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12,
                       n_kv_heads=4, mlp_dim=2048),
    # vocab 288: the byte tokenizer's (the trainer sets vocab_size from the tokenizer).
    "tiny": dict(vocab_size=288, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                 mlp_dim=384, dtype="float32"),
}


def model_config(name: str, **overrides) -> LlamaConfig:
  """The preset `name` with fields replaced by `overrides` (validated)."""
  if name not in MODEL_PRESETS:
    raise ValueError(f"unknown model preset {name!r}; valid: {sorted(MODEL_PRESETS)}")
  fields = [f.name for f in dataclasses.fields(LlamaConfig)]
  unknown = sorted(set(overrides) - set(fields))
  if unknown:
    raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid: {fields}")
  return LlamaConfig(**{**MODEL_PRESETS[name], **overrides})


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
  """Llama 3 rotary inverse frequencies, float32 [head_dim // 2].

  Wavelengths shorter than original_context / high_freq_factor keep their
  frequency, longer than original_context / low_freq_factor are divided by
  `rope_factor`, and those in between are interpolated smoothly.
  """
  d = config.head_dim
  freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  wavelen = 2 * np.pi / freq
  smooth = ((config.rope_original_context / wavelen - config.rope_low_freq_factor)
            / (config.rope_high_freq_factor - config.rope_low_freq_factor))
  smooth = np.clip(smooth, 0.0, 1.0)
  scaled = (1 - smooth) * freq / config.rope_factor + smooth * freq
  return scaled.astype(np.float32)


def apply_rope(x_BxLxHxD, positions_L, inv_freq_K):
  """Rotates pairs (x[..., i], x[..., i + D/2]) by angle position * inv_freq[i].

  The half-split pairing (as in Hugging Face / MaxText Llama) equals Meta's
  interleaved pairing up to a fixed permutation of the q and k kernels.
  positions_L: int [L], or [B, L] (each row its own, as in cached decoding).
  Computed in float32; returns x's dtype.
  """
  angle_LxK = positions_L[..., None].astype(jnp.float32) * inv_freq_K
  sin, cos = jnp.sin(angle_LxK)[..., None, :], jnp.cos(angle_LxK)[..., None, :]
  x1, x2 = jnp.split(x_BxLxHxD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxD.dtype)


def recomputed(fn):
  """fn under jax.checkpoint saving only its inputs: the backward recomputes its
  intermediates (the same operations) instead of keeping them.

  Used for SwiGLU's silu(gate) * up and the causal softmax, whose
  intermediates would otherwise be saved. The gradients keep their bits on a
  single model call (tests/test_model.py), but inside the whole jitted train
  step XLA:CPU may fuse differently: the default run's losses moved in the
  last bits (docs/performance-log.md, "Saved residuals"). Not used for
  RMSNorm, whose gradients change in the last bits even on a single call.
  """
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


class RMSNorm(nn.Module):
  """x / rms(x) * scale, in float32; returns `dtype`."""
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x_BxLxD):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                       (x_BxLxD.shape[-1],), jnp.float32)
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale).astype(self.dtype)


def _dense(features, axis, kernel_axes, dot_cls, dtype, name):
  """Bias-free DenseGeneral with logically named float32 kernel."""
  init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
  return nn.DenseGeneral(
      features=features, axis=axis, use_bias=False, dtype=dtype,
      param_dtype=jnp.float32, dot_general_cls=dot_cls, name=name,
      # rules=(): DenseGeneral boxes the kernel while it is still flat
      # (google/flax#3676), so the box must not constrain it under a mesh;
      # the trainer's jit shardings place the kernel instead.
      kernel_init=nn.with_logical_partitioning(init, kernel_axes, rules=()))


def _linear(path, cfg, dot_cls, dtype):
  """The linear layer `path` ("attn/q", ..., "head": fp4jax.llama.linears) of LlamaConfig cfg."""
  layer = linears.linear(path)
  features = tuple(size for _, size in layer.fan_out(cfg))
  # The operands' logical names: the kernel's, and the activations' (as _constrain
  # lays them out), so a kernel backend runs per shard (fp4jax.shard_local).
  x_axes = ("activation_batch", "activation_length") + tuple(
      sharding.activation_name(name) for name, _ in layer.fan_in(cfg))
  if dot_cls is not None:
    dot_cls = functools.partial(dot_cls, lhs_axes=x_axes, rhs_axes=layer.kernel_axes)
  return _dense(features, tuple(range(-layer.n_in, 0)), layer.kernel_axes, dot_cls, dtype,
                layer.name)


def _dot_cls(recipe, cfg, switch_wgrad_to=None, wgrad_switched=None):
  """The `dot_general_cls` of a linear layer on `recipe` (capturing when cfg.capture_dots),
  whose Wgrad is `switch_wgrad_to` where `wgrad_switched` (fp4jax.train.adaptive)."""
  return functools.partial(fp4flax.DotGeneral, recipe=recipe, capture=cfg.capture_dots,
                           switch_wgrad_to=switch_wgrad_to, wgrad_switched=wgrad_switched)


def _linear_maker(module, wgrad_switched):
  """name -> the linear layer `name` of an Attention or Mlp `module` (its config,
  recipe and switch_wgrad_to), created in that module."""
  cfg = module.config
  dot_cls = _dot_cls(module.recipe, cfg, module.switch_wgrad_to, wgrad_switched)
  return lambda name: _linear(name, cfg, dot_cls, jnp.dtype(cfg.dtype))


def _constrain(x, *names):
  """Logical sharding constraint; batch and length axes are always the first two."""
  return nn.with_logical_constraint(x, ("activation_batch", "activation_length") + names)


class Attention(nn.Module):
  """Causal grouped-query self-attention with Llama 3 RoPE (see Block for the Wgrad switch)."""
  config: LlamaConfig
  recipe: recipes.Recipe
  switch_wgrad_to: recipes.Gemm | None = None

  @nn.compact
  def __call__(self, x_BxLxD, wgrad_switched=None):
    cfg = self.config
    linear = _linear_maker(self, wgrad_switched)
    q_BxLxHxD = linear("attn/q")(x_BxLxD)
    k_BxLxKxD = linear("attn/k")(x_BxLxD)
    v_BxLxKxD = linear("attn/v")(x_BxLxD)
    q_BxLxHxD = _constrain(q_BxLxHxD, "activation_heads", None)
    k_BxLxKxD = _constrain(k_BxLxKxD, "activation_kv_heads", None)
    v_BxLxKxD = _constrain(v_BxLxKxD, "activation_kv_heads", None)

    length = x_BxLxD.shape[1]
    inv_freq = jnp.asarray(rope_frequencies(cfg))
    if self.has_variable("cache", "keys"):
      y_BxLxHxD = self._cached(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, inv_freq)
      return linear("attn/o")(_constrain(y_BxLxHxD, "activation_heads", None))
    positions = jnp.arange(length)
    q_BxLxHxD = apply_rope(q_BxLxHxD, positions, inv_freq)
    k_BxLxKxD = apply_rope(k_BxLxKxD, positions, inv_freq)

    if cfg.attention_impl != "dot_general":
      y_BxLxHxD = jax.nn.dot_product_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, is_causal=True,
                                               implementation=cfg.attention_impl)
    else:
      qk_dot = pv_dot = jax.lax.dot_general
      if cfg.quantize_attention:
        # No weights, so no Wgrad to switch.
        # Operands' logical names (shard_local): q [B, L, K, G, D] . k [B, S, K, D],
        # then p [B, K, L, G, S] . v [B, S, K, D].
        kv = ("activation_batch", "activation_length", "activation_kv_heads", None)
        qk_dot = _dot_cls(self.recipe, cfg)(name="qk", lhs_axes=kv + (None,), rhs_axes=kv)
        pv_dot = _dot_cls(self.recipe, cfg)(
            name="pv", lhs_axes=("activation_batch", "activation_kv_heads",
                                 "activation_length", None, None), rhs_axes=kv)
      y_BxLxHxD = _causal_gqa(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, qk_dot, pv_dot)
    y_BxLxHxD = _constrain(y_BxLxHxD, "activation_heads", None)
    return linear("attn/o")(y_BxLxHxD)

  def _cached(self, q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, inv_freq):
    """Attention of L new tokens per row over the cache (init_cache), which
    they are written into first: slots next..next+L-1, RoPE positions
    slot - start[b]; a query sees the keys of its row from start[b] to its own."""
    if self.config.quantize_attention:
      raise ValueError("cached decoding cannot run quantize_attention=True: PV's blocks "
                       "run along the key axis, which a decoding step never holds whole")
    k_cache = self.variable("cache", "keys", lambda: None)
    v_cache = self.variable("cache", "values", lambda: None)
    next_slot = self.variable("cache", "next", lambda: None)
    start_B = self.variable("cache", "start", lambda: None).value
    length = q_BxLxHxD.shape[1]
    slots_L = next_slot.value + jnp.arange(length)
    positions_BxL = slots_L[None, :] - start_B[:, None]
    q_BxLxHxD = apply_rope(q_BxLxHxD, positions_BxL, inv_freq)
    k_BxLxKxD = apply_rope(k_BxLxKxD, positions_BxL, inv_freq)
    at = (0, next_slot.value, 0, 0)
    k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, k_BxLxKxD, at)
    v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, v_BxLxKxD, at)
    next_slot.value = next_slot.value + length
    keys_S, slots_1xLx1 = jnp.arange(k_cache.value.shape[1]), slots_L[None, :, None]
    # A padding query (slot < start) sees itself alone: finite, and seen by no other.
    visible_BxLxS = (keys_S <= slots_1xLx1) & (
        (keys_S >= start_B[:, None, None]) | (keys_S == slots_1xLx1))
    return _causal_gqa(q_BxLxHxD, k_cache.value, v_cache.value, jax.lax.dot_general,
                       jax.lax.dot_general, visible_BxLxS)


def init_cache(config: LlamaConfig, start_B, max_length: int):
  """An empty "cache" collection for cached decoding of len(start_B) rows of
  at most `max_length` tokens; row b's first token goes to slot start_B[b]
  (the slots before it hold left padding, never attended to).

  Per attention layer: keys, values [B, max_length, kv_heads, head_dim] in the
  compute dtype (zeros), next (int32: the next slot to fill, 0) and start
  (int32 [B]); under scan_layers each with a leading layers axis.
  """
  start_B = np.asarray(start_B, np.int32)
  kv = (start_B.shape[0], max_length, config.n_kv_heads, config.head_dim)

  def layer(*layers):  # new arrays for each: a step donates (reuses) their buffers
    return dict(keys=jnp.zeros(layers + kv, config.dtype),
                values=jnp.zeros(layers + kv, config.dtype),
                next=jnp.zeros(layers, jnp.int32),
                start=jnp.asarray(np.broadcast_to(start_B, layers + start_B.shape)))
  if config.scan_layers:
    return {"blocks": {"attn": layer(config.n_layers)}}
  return {f"block_{i}": {"attn": layer()} for i in range(config.n_layers)}


def _causal_gqa(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, qk_dot, pv_dot, visible_BxLxS=None):
  """softmax(q k^T / sqrt(D) + causal mask) v; query head h uses kv head h // (H/K).

  visible_BxLxS (cached decoding): which keys each query sees, in place of
  the causal mask of L = S."""
  b, length, h, d = q_BxLxHxD.shape
  kv = k_BxSxKxD.shape[2]
  q_BxLxKxGxD = q_BxLxHxD.reshape(b, length, kv, h // kv, d)
  # Batch dims (B, K); contract D.  -> [B, K, L, G, S]
  s_BxKxLxGxS = qk_dot(q_BxLxKxGxD, k_BxSxKxD, (((4,), (3,)), ((0, 2), (0, 2))),
                       preferred_element_type=jnp.float32)
  p_BxKxLxGxS = recomputed(functools.partial(_causal_softmax, head_dim=d,
                                             dtype=q_BxLxHxD.dtype))(s_BxKxLxGxS,
                                                                     visible_BxLxS)
  # Batch dims (B, K); contract S.  -> [B, K, L, G, D]
  y_BxKxLxGxD = pv_dot(p_BxKxLxGxS, v_BxSxKxD, (((4,), (1,)), ((0, 1), (0, 2))))
  y_BxKxLxGxD = y_BxKxLxGxD.astype(q_BxLxHxD.dtype)
  return y_BxKxLxGxD.transpose(0, 2, 1, 3, 4).reshape(b, length, h, d)


def _causal_softmax(s_BxKxLxGxS, visible_BxLxS, head_dim, dtype):
  """softmax(s / sqrt(head_dim) + causal mask) over the keys, in float32; returns `dtype`.

  visible_BxLxS: the keys each query sees instead of the causal mask (None: causal)."""
  length = s_BxKxLxGxS.shape[2]
  s_BxKxLxGxS = s_BxKxLxGxS.astype(jnp.float32) / math.sqrt(head_dim)
  if visible_BxLxS is None:
    visible = (jnp.arange(length)[:, None] >= jnp.arange(length)[None, :])[:, None, :]
  else:
    visible = visible_BxLxS[:, None, :, None, :]
  s_BxKxLxGxS = jnp.where(visible, s_BxKxLxGxS, -jnp.inf)
  return jax.nn.softmax(s_BxKxLxGxS, axis=-1).astype(dtype)


def _swiglu(gate_BxLxF, up_BxLxF):
  return nn.silu(gate_BxLxF) * up_BxLxF


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)) (see Block for the Wgrad switch)."""
  config: LlamaConfig
  recipe: recipes.Recipe
  switch_wgrad_to: recipes.Gemm | None = None

  @nn.compact
  def __call__(self, x_BxLxD, wgrad_switched=None):
    linear = _linear_maker(self, wgrad_switched)
    gate_BxLxF = linear("mlp/gate")(x_BxLxD)
    up_BxLxF = linear("mlp/up")(x_BxLxD)
    h_BxLxF = recomputed(_swiglu)(gate_BxLxF, up_BxLxF)
    h_BxLxF = _constrain(h_BxLxF, "activation_mlp")
    return linear("mlp/down")(h_BxLxF)


class Block(nn.Module):
  """One pre-norm transformer block; returns (x, None) so nn.scan can carry x.

  wgrad_switched: None, or a boolean scalar (may be traced): where true, the
  Wgrad of the block's seven linears is `switch_wgrad_to` instead of the
  recipe's (fp4jax.train.adaptive).
  """
  config: LlamaConfig
  recipe: recipes.Recipe
  switch_wgrad_to: recipes.Gemm | None = None

  @nn.compact
  def __call__(self, x_BxLxD, wgrad_switched=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    to = self.switch_wgrad_to
    x_BxLxD = _constrain(x_BxLxD, "activation_embed")
    h_BxLxD = RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x_BxLxD)
    x_BxLxD = x_BxLxD + Attention(cfg, self.recipe, to, name="attn")(h_BxLxD, wgrad_switched)
    h_BxLxD = RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x_BxLxD)
    x_BxLxD = x_BxLxD + Mlp(cfg, self.recipe, to, name="mlp")(h_BxLxD, wgrad_switched)
    return _constrain(x_BxLxD, "activation_embed"), None


class Llama(nn.Module):
  """Llama 3.1 decoder: tokens_BxL int32 -> logits_BxLxV float32.

  Parameter tree: embed/embedding, block_<i>/{attn_norm, attn/{q,k,v,o},
  mlp_norm, mlp/{gate,up,down}} (or blocks/... with a leading layers axis when
  scan_layers), final_norm/scale, head/kernel. Random recipes draw from the
  "quant" rng stream, per-layer Hadamard signs from the "hadamard" stream (both
  split across the layers under scan_layers).

  switch_wgrad_to, wgrad_switched_L: the adaptive Wgrad switch
  (fp4jax.train.adaptive): wgrad_switched_L, bool [n_layers] (may be traced) or
  None, says which blocks compute their linears' Wgrad with the Gemm
  `switch_wgrad_to` (needs scan_layers=False).
  """
  config: LlamaConfig
  recipe: recipes.Recipe
  switch_wgrad_to: recipes.Gemm | None = None

  @nn.compact
  def __call__(self, tokens_BxL, wgrad_switched_L=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    embed = nn.Embed(
        cfg.vocab_size, cfg.dim, dtype=dtype, param_dtype=jnp.float32, name="embed",
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(cfg.init_std), ("vocab", "embed")))
    x_BxLxD = embed(tokens_BxL)

    block_cls = Block
    if cfg.remat != "none":
      block_cls = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      if wgrad_switched_L is not None:
        raise ValueError("the per-block Wgrad switch needs scan_layers=False")
      blocks = nn.scan(
          block_cls,
          variable_axes={"params": 0, "intermediates": 0, "perturbations": 0, "cache": 0},
          split_rngs={"params": True, "quant": True, "hadamard": True},
          length=cfg.n_layers,
          metadata_params={nn.PARTITION_NAME: "layers"})(cfg, self.recipe, name="blocks")
      x_BxLxD, _ = blocks(x_BxLxD, None)
    else:
      plain = recipes.recipe("bf16")
      for i in range(cfg.n_layers):
        recipe = plain if cfg.is_bf16(i) else self.recipe
        switched = None if wgrad_switched_L is None else wgrad_switched_L[i]
        x_BxLxD, _ = block_cls(cfg, recipe, self.switch_wgrad_to, name=f"block_{i}")(
            x_BxLxD, switched)

    x_BxLxD = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x_BxLxD)
    head_dot = None
    if cfg.quantize_head:
      head_recipe = recipes.recipe("bf16") if cfg.is_bf16(None) else self.recipe
      head_dot = _dot_cls(head_recipe, cfg)
    logits_BxLxV = _linear("head", cfg, head_dot, dtype)(x_BxLxD)
    logits_BxLxV = _constrain(logits_BxLxV, "activation_vocab")
    return logits_BxLxV.astype(jnp.float32)
