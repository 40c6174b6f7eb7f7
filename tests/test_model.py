"""Tests for fp4jax.llama.model: shapes, counts, RoPE, causality, GQA, scan, bf16 layers."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
import fp4jax.flax as fp4flax
from fp4jax.llama import model
from tests.helpers import numpy_llama, reference_llama3_freqs

# Small enough to compile in about a second; every contraction axis a multiple of 32.
MICRO = dict(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96,
             dtype="float32")
LOGICAL_NAMES = {"embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers"}


def micro(**overrides):
  return model.model_config("tiny", **{**MICRO, **overrides})


def tokens(seed=0, shape=(2, 32), vocab=64):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


@functools.cache
def _jitted(cfg, recipe, **apply_kwargs):
  return jax.jit(functools.partial(model.Llama(cfg, fp4jax.recipe(recipe)).apply, **apply_kwargs))


def run(cfg, recipe, params, toks=None, key=0, **apply_kwargs):
  """Jitted Llama.apply (one compile per config); key feeds the "quant" stream."""
  fn = _jitted(cfg, recipe, **apply_kwargs)
  return fn({"params": params}, tokens() if toks is None else toks,
            rngs={"quant": jax.random.key(key)})


@functools.cache
def init(cfg):
  """Float32 params of `cfg` (they do not depend on the recipe)."""
  m = model.Llama(cfg, fp4jax.recipe("bf16"))
  return jax.jit(lambda k: nn.unbox(m.init(k, tokens())["params"]))(jax.random.key(0))


def expected_params(c):
  """Parameter count written out from the Llama architecture."""
  d, hd = c.dim, c.head_dim
  attn = d * c.n_heads * hd * 2 + d * c.n_kv_heads * hd * 2
  block = attn + 3 * d * c.mlp_dim + 2 * d
  return 2 * c.vocab_size * d + c.n_layers * block + d


@pytest.mark.parametrize("name", sorted(model.MODEL_PRESETS))
def test_preset_param_counts_without_allocating(name):
  cfg = model.model_config(name, scan_layers=True)
  shapes = jax.eval_shape(
      lambda: model.Llama(cfg, fp4jax.recipe("bf16")).init(
          jax.random.key(0), jnp.zeros((1, 32), jnp.int32)))["params"]
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  boxed = jax.tree_util.tree_leaves(shapes, is_leaf=is_box)
  assert all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)
  for x in boxed:
    assert x.value.dtype == jnp.float32
    assert len(x.names) == x.value.ndim and set(x.names) <= LOGICAL_NAMES
    assert x.names[0] == "layers" or x.value.shape[0] != cfg.n_layers
  count = sum(x.value.size for x in boxed)
  assert count == expected_params(cfg)
  if name == "llama3.1-8b":
    assert count == 8_030_261_248


def test_unscanned_8b_count_and_layer_names():
  cfg = model.model_config("llama3.1-8b")
  shapes = nn.unbox(jax.eval_shape(
      lambda: model.Llama(cfg, fp4jax.recipe("bf16")).init(
          jax.random.key(0), jnp.zeros((1, 32), jnp.int32)))["params"])
  assert sum(x.size for x in jax.tree_util.tree_leaves(shapes)) == 8_030_261_248
  assert shapes["block_31"]["attn"]["q"]["kernel"].shape == (4096, 32, 128)
  assert shapes["block_31"]["attn"]["k"]["kernel"].shape == (4096, 8, 128)
  assert shapes["block_0"]["attn"]["o"]["kernel"].shape == (32, 128, 4096)
  assert shapes["block_0"]["mlp"]["down"]["kernel"].shape == (14336, 4096)
  assert shapes["embed"]["embedding"].shape == (128256, 4096)
  assert shapes["head"]["kernel"].shape == (4096, 128256)


@pytest.mark.parametrize("name", ["llama3.1-8b", "llama-1b", "llama-125m", "tiny"])
def test_contraction_axes_are_mx_blocks(name):
  c = model.model_config(name)
  for n in (c.dim, c.mlp_dim, c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim):
    assert n % 32 == 0, (name, n)


def test_shapes_dtypes_and_init_scale():
  cfg = micro()
  params = init(cfg)
  logits = run(cfg, "mxfp4-dh16", params)
  assert logits.shape == (2, 32, 64) and logits.dtype == jnp.float32
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  assert np.isfinite(logits).all()
  # Unit-variance logits at init: initial loss near log(vocab).
  assert 0.3 < float(jnp.std(logits)) < 3.0
  bf16 = model.Llama(micro(dtype="bfloat16"), fp4jax.recipe("mxfp4-dh16"))
  out = jax.eval_shape(lambda p: bf16.apply({"params": p}, tokens()), params)
  assert out.shape == (2, 32, 64) and out.dtype == jnp.float32


@pytest.mark.parametrize("factor", [8.0, 1.0])
def test_rope_matches_numpy(factor):
  cfg = model.model_config("tiny", rope_factor=factor)  # head_dim 32
  ref = reference_llama3_freqs(32, 500000.0, factor, 1.0, 4.0, 8192)
  plain = 1.0 / 500000.0 ** (np.arange(0, 32, 2) / 32)
  if factor == 8.0:  # all three regimes occur: kept, interpolated, divided
    assert (ref == plain).any() and (ref == plain / 8).any()
    assert ((ref != plain) & (ref != plain / 8)).any()
  np.testing.assert_allclose(model.rope_frequencies(cfg), ref, rtol=1e-6)

  x = np.random.default_rng(0).normal(size=(2, 5, 3, 32)).astype(np.float32)
  pos = np.array([0, 1, 7, 1000, 8191])
  got = model.apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(model.rope_frequencies(cfg)))
  z = (x[..., :16] + 1j * x[..., 16:]) * np.exp(1j * pos[:, None] * ref)[None, :, None, :]
  np.testing.assert_allclose(np.asarray(got), np.concatenate([z.real, z.imag], -1), atol=2e-3)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4-dh16"])
def test_causal(recipe):
  cfg = micro()
  toks = tokens()
  base = run(cfg, recipe, init(cfg), toks)
  for t in (5, 31):
    changed = run(cfg, recipe, init(cfg), toks.at[:, t].set((toks[:, t] + 1) % 64))
    np.testing.assert_array_equal(changed[:, :t], base[:, :t])
    assert not np.allclose(changed[:, t], base[:, t])


def test_forward_matches_numpy_llama():
  cfg = micro()
  np.testing.assert_allclose(run(cfg, "bf16", init(cfg)), numpy_llama(init(cfg), tokens(), cfg),
                             atol=2e-4, rtol=1e-4)


def test_gqa_equals_mha_with_repeated_kv_heads():
  cfg = micro()  # query heads (0, 1) share kv head 0, (2, 3) share kv head 1
  params = init(cfg)
  mha_params = jax.tree_util.tree_map(np.asarray, params)
  for i in range(cfg.n_layers):
    attn = mha_params[f"block_{i}"]["attn"]
    for name in ("k", "v"):
      attn[name]["kernel"] = np.repeat(attn[name]["kernel"], 2, axis=1)
  mha = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
  np.testing.assert_allclose(run(mha, "bf16", mha_params), run(cfg, "bf16", params), atol=1e-5)


def _stack_blocks(params, n_layers):
  stacked = {k: v for k, v in params.items() if not k.startswith("block_")}
  blocks = [params[f"block_{i}"] for i in range(n_layers)]
  stacked["blocks"] = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *blocks)
  return stacked


def test_scan_equals_unrolled():
  cfg = micro()
  params = init(cfg)
  stacked = _stack_blocks(params, cfg.n_layers)
  scanned = dataclasses.replace(cfg, scan_layers=True, remat="full")
  shapes = jax.eval_shape(
      lambda: model.Llama(scanned, fp4jax.recipe("bf16")).init(jax.random.key(0), tokens()))
  assert jax.tree_util.tree_structure(nn.unbox(shapes["params"])) == \
      jax.tree_util.tree_structure(stacked)
  assert nn.get_partition_spec(shapes)["params"]["blocks"]["mlp"]["up"]["kernel"] == \
      jax.sharding.PartitionSpec("layers", "embed", "mlp")
  np.testing.assert_allclose(run(scanned, "mxfp4-dh16", stacked),
                             run(cfg, "mxfp4-dh16", params), atol=1e-5)


def _loss(cfg, recipe):
  mdl = model.Llama(cfg, fp4jax.recipe(recipe))
  return lambda p: jnp.mean(mdl.apply({"params": p}, tokens(shape=(1, 32))) ** 2)


def test_scan_and_remat_keep_gradients():
  cfg = micro(n_layers=1)
  params = init(cfg)
  scanned = dataclasses.replace(cfg, scan_layers=True, remat="dots_saveable")
  expected = _stack_blocks(jax.jit(jax.grad(_loss(cfg, "bf16")))(params), 1)
  got = jax.jit(jax.grad(_loss(scanned, "bf16")))(_stack_blocks(params, 1))
  for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("remat", sorted(model.REMAT_POLICIES))
def test_remat_policies_trace_with_quantized_gradients(remat):
  def remats(remat):
    cfg = micro(n_layers=1, remat=remat)
    return str(jax.make_jaxpr(jax.grad(_loss(cfg, "mxfp4-dh16")))(init(micro(n_layers=1)))
               ).count("remat2")
  # model.recomputed puts SwiGLU and the softmax under jax.checkpoint in every
  # block; a remat policy adds the block's own.
  assert (remats(remat) > remats("none")) == (remat != "none")


def _dot_recipes(cfg, recipe="mxfp4-dh16"):
  """{module path: recipe name} of every recipe DotGeneral the model calls (traced only)."""
  seen = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, fp4flax.DotGeneral) and context.method_name == "__call__":
      seen["/".join(context.module.path)] = context.module.recipe.name
    return next_fun(*args, **kwargs)

  m = model.Llama(cfg, fp4jax.recipe(recipe))
  with nn.intercept_methods(record):
    jax.eval_shape(lambda p: m.apply({"params": p}, tokens(), rngs={"quant": jax.random.key(0)}),
                   init(dataclasses.replace(cfg, bf16_layers=())))
  return seen


LINEARS = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")


def test_every_linear_takes_the_recipe_dot_general():
  cfg = micro()
  expected = {f"block_{i}/{p}/DotGeneral_0": "mxfp4-dh16" for i in range(2) for p in LINEARS}
  assert _dot_recipes(cfg) == expected
  everything = dataclasses.replace(cfg, quantize_head=True, quantize_attention=True)
  assert _dot_recipes(everything) == {
      **expected, "head/DotGeneral_0": "mxfp4-dh16",
      **{f"block_{i}/attn/{p}": "mxfp4-dh16" for i in range(2) for p in ("qk", "pv")}}
  # capture_dots: operands sown for the diagnostics.
  capturing = model.Llama(dataclasses.replace(cfg, capture_dots=True), fp4jax.recipe("mxfp4-dh16"))
  captured = jax.eval_shape(
      lambda p: capturing.apply({"params": p}, tokens(), mutable=["intermediates"]), init(cfg))[1]
  assert captured["intermediates"]["block_1"]["mlp"]["down"]["DotGeneral_0"]["lhs"][0].shape == \
      (2, 32, cfg.mlp_dim)


def test_bf16_layers_use_the_unquantized_recipe():
  cfg = micro(quantize_head=True)
  first_last = dataclasses.replace(cfg, bf16_layers=("block_0", "block_-1", "head"))
  recipes_used = _dot_recipes(first_last)
  for i in range(2):
    for p in LINEARS:
      assert recipes_used[f"block_{i}/{p}/DotGeneral_0"] == "bf16"
  assert recipes_used["head/DotGeneral_0"] == "bf16"
  only_last = _dot_recipes(dataclasses.replace(cfg, bf16_layers=("block_-1",)))
  assert {k for k, v in only_last.items() if v == "bf16"} == \
      {f"block_1/{p}/DotGeneral_0" for p in LINEARS}
  # Numerically: all blocks in bf16 (head unquantized) is exactly the bf16 model.
  params = init(micro())
  all_bf16 = micro(bf16_layers=("block_0", "block_1"))
  np.testing.assert_array_equal(run(all_bf16, "mxfp4-dh16", params), run(micro(), "bf16", params))


def test_recipes_change_outputs_and_random_recipes_use_the_quant_stream():
  cfg = micro()
  params = init(cfg)
  plain = run(cfg, "bf16", params)
  quant = run(cfg, "mxfp4-dh16", params)
  assert np.isfinite(quant).all() and not np.allclose(quant, plain, atol=1e-3)
  # A recipe that is random in the forward pass (e.g. random Hadamard signs).
  name = next(n for n in fp4jax.recipe_names() if fp4jax.recipe(n).fprop.is_random)
  a, b, c = (run(cfg, name, params, key=k) for k in (0, 0, 1))
  assert np.isfinite(a).all()
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_quantize_attention_and_fused_attention():
  cfg = micro()
  params = init(cfg)
  fused = dataclasses.replace(cfg, attention_impl="xla")
  np.testing.assert_allclose(run(fused, "bf16", params), run(cfg, "bf16", params), atol=1e-5)
  qa_cfg = dataclasses.replace(cfg, quantize_attention=True)
  quant_attn = run(qa_cfg, "mxfp4-dh16", params)
  assert np.isfinite(quant_attn).all()
  assert not np.allclose(quant_attn, run(cfg, "mxfp4-dh16", params), atol=1e-4)
  # The documented caveat: PV blocks along the key axis, so within one 32-token
  # block a later token moves earlier logits (the default path is causal).
  toks = tokens()
  changed = run(qa_cfg, "mxfp4-dh16", params, toks.at[:, 31].set((toks[:, 31] + 1) % 64))
  assert not np.allclose(changed[:, :31], quant_attn[:, :31], atol=1e-3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="llama-7b"), "unknown model preset"),
    (dict(hidden=3), "unknown LlamaConfig field"),
    (dict(n_heads=3), "not a multiple of n_heads"),
    (dict(n_kv_heads=3), "not a multiple of n_kv_heads"),
    (dict(dim=0), "positive int"),
    (dict(dtype="float16"), "dtype"),
    (dict(remat="some"), "remat"),
    (dict(attention_impl="flash"), "attention_impl"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), "rope_low_freq_factor"),
    (dict(bf16_layers=("block_4",)), "block_4"),
    (dict(bf16_layers=("block_-5",)), "block_-5"),
    (dict(bf16_layers=("layer_0",)), "layer_0"),
    (dict(bf16_layers=("block_0",), scan_layers=True), "scan_layers"),
    (dict(bf16_layers=("last:1",), scan_layers=True), "scan_layers"),
    (dict(bf16_layers=("first:0",)), "first:0"),
    (dict(bf16_layers=("last:5",)), "last:5"),
    (dict(bf16_layers=("middle:1",)), "middle:1"),
    (dict(quantize_attention=True, attention_impl="xla"), "quantize_attention"),
    (dict(attention_impl="cudnn", dtype="float32"), "cudnn"),
])
def test_bad_config_values_raise(kwargs, match):
  name = kwargs.pop("name", "tiny")
  with pytest.raises(ValueError, match=match):
    model.model_config(name, **kwargs)


def test_config_accepts_lists_strings_and_negative_block_names():
  cfg = model.model_config("tiny", bf16_layers=["block_-1", "head"])
  assert cfg.bf16_layers == ("block_-1", "head")
  assert cfg.is_bf16(3) and cfg.is_bf16(None) and not cfg.is_bf16(0)
  assert model.model_config("tiny", bf16_layers="block_0, block_-1").bf16_layers == \
      ("block_0", "block_-1")
  # --config.model.bf16_layers=block_0,head through the tuple-typed config field:
  assert model.model_config("tiny", bf16_layers=("block_0,head",)).bf16_layers == \
      ("block_0", "head")
  assert model.model_config("tiny", bf16_layers=("head",), scan_layers=True).is_bf16(None)


def test_first_and_last_block_ranges():
  cfg = model.model_config("tiny", bf16_layers="first:1,last:2")
  assert [cfg.is_bf16(i) for i in range(cfg.n_layers)] == [True, False, True, True]
  assert not cfg.is_bf16(None)
  assert model.model_config("tiny", bf16_layers="last:4").named_blocks("last:4") == {0, 1, 2, 3}


@pytest.mark.parametrize("recipe,overrides", [("mxfp4-dh16", dict(scan_layers=True))])
def test_recomputed_parts_keep_the_gradients_bits(recipe, overrides, monkeypatch):
  """model.recomputed (SwiGLU, causal softmax) saves less and, on one model
  call, changes no bit: loss and gradients equal those of the same model
  without it. (Not a promise for a whole train step: see model.recomputed.)"""
  cfg = micro(**overrides)
  m = model.Llama(cfg, fp4jax.recipe(recipe))
  params = jax.jit(lambda k: nn.unbox(m.init(k, tokens())["params"]))(jax.random.key(0))

  def value_and_grad():
    loss = lambda p: m.apply({"params": p}, tokens(), rngs={"quant": jax.random.key(1)}).var()
    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(loss))(params))

  got = value_and_grad()
  monkeypatch.setattr(model, "recomputed", lambda fn: fn)
  want = value_and_grad()
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint32), np.atleast_1d(w).view(np.uint32))
