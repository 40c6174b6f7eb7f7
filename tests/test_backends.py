"""fp4jax.backends: how auto picks, the fallback to xla, native's routes, and
native == xla bit for bit.

The bitwise tests need jax >= 0.11 (jax.nn.scaled_matmul's CPU lowering) and
skip, naming the installed jax, before that; CI runs them on Python 3.12.
"""

import dataclasses
import logging
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import backends, dot, recipes
from fp4jax.numerics import formats
from fp4jax.backends import mosaic, native
from fp4jax.recipes import Gemm, Recipe
from tests.helpers import NATIVE_PRESETS, NEW_JAX, native_gemms, native_recipe, needs_new_jax

MXFP4 = formats.QuantSpec("mxfp4")
DENSE = (((2,), (0,)), ((), ()))  # x[B, L, K] . w[K, N]


def _device(platform, kind, capability=None):
  fields = dict(platform=platform, device_kind=kind)
  if capability is not None:
    fields["compute_capability"] = capability
  return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("device,supported,words", [
    (_device("cpu", "cpu"), False, "not an NVIDIA GPU"),
    (_device("gpu", "NVIDIA H200", "9.0"), False, "9.0 < 10.0"),
    (_device("gpu", "AMD Instinct MI355X"), False, "no compute capability"),
    (_device("gpu", "NVIDIA B200", "10.0"), True, None),
    (_device("gpu", "NVIDIA GB300", "10.3"), True, None),
    (_device("gpu", "NVIDIA RTX PRO 6000", "12.0"), True, None),
])
def test_unsupported_device(device, supported, words):
  reason = native.unsupported_device(device)
  assert (reason is None) == supported
  if words:
    assert words in reason


@pytest.mark.parametrize("platform,capability,version,want", [
    ("cpu", None, (0, 12, 0), "xla"),
    ("gpu", "9.0", (0, 12, 0), "mosaic"),
    ("gpu", "9.0", (0, 11, 2), "pallas"),
    ("gpu", None, (0, 12, 0), "pallas"),  # ROCm: no compute capability
    ("gpu", "10.0", (0, 12, 0), "native"),
    ("gpu", "10.0", (0, 10, 2), "pallas"),
])
def test_auto_picks_by_device_and_jax(monkeypatch, caplog, platform, capability, version, want):
  backends.resolve.cache_clear()
  real = backends.resolve("auto")  # this machine's: xla on a CPU, pallas on an H200
  device = _device(platform, "some device", capability)
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  monkeypatch.setattr(backends, "jax_version", lambda: version)
  backends.resolve.cache_clear()
  try:
    with caplog.at_level(logging.INFO):
      assert backends.resolve("auto") == want
    assert f"backend auto -> {want}" in caplog.text
  finally:
    backends.resolve.cache_clear()
  monkeypatch.undo()
  assert backends.resolve("auto") == real  # the real device again


def test_recipes_name_every_backend_and_route_and_each_backend_declares_its_layout_rule():
  assert set(recipes.BACKENDS) == set(backends.NAMES) | {"auto"}
  assert tuple(recipes.NATIVE_ROUTES) == tuple(backends.NATIVE_ROUTES)
  assert {name: backends.module(name).QUANTIZES_WHOLE_TENSOR_FIRST
          for name in backends.NAMES} == {"xla": True, "pallas": True, "native": False,
                                      "mosaic": True, "mosaic_fast": True}


def test_native_is_refused_on_old_jax(monkeypatch):
  monkeypatch.setattr(backends, "jax_version", lambda: (0, 10, 2))
  native = dataclasses.replace(recipes.recipe("mxfp4"), backend="native")  # a value: fine
  with pytest.raises(ValueError, match=r"backend 'native' needs jax >= 0.11 .*installed: jax"):
    dot.dot_general(native)  # where the recipe meets the backend
  if not NEW_JAX:  # the installed jax itself
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
      dot.dot_general(Recipe("x", backend="native"))


def test_mosaic_is_refused_on_old_jax(monkeypatch):
  monkeypatch.setattr(backends, "jax_version", lambda: (0, 10, 2))
  with pytest.raises(ValueError, match=r"backend 'mosaic' needs jax >= 0.11 \(Pallas Mosaic GPU"):
    dot.dot_general(dataclasses.replace(recipes.recipe("mxfp4"), backend="mosaic"))


def test_what_mosaic_takes():
  e4m3, e5m2, nv = (formats.QuantSpec(f) for f in ("fp8_e4m3", "fp8_e5m2", "nvfp4"))
  for gemm in (Gemm(MXFP4, MXFP4), Gemm(nv, nv), Gemm(e4m3, e5m2),
               Gemm(formats.QuantSpec("mxfp8_e4m3"), formats.QuantSpec("mxfp6_e3m2"))):
    assert mosaic.unsupported(gemm) is None, gemm
  assert "rhs is not quantized" in mosaic.unsupported(Gemm(MXFP4, None))
  assert "different blocks (32, None)" in mosaic.unsupported(Gemm(MXFP4, e4m3))
  assert "block_2d=True" in mosaic.unsupported(recipes.recipe("nvfp4").fprop)
  assert "not 9.x" in mosaic.unsupported_device(_device("gpu", "NVIDIA B200", "10.0"))
  assert mosaic.unsupported_device(_device("gpu", "NVIDIA H100", "9.0")) is None


def test_what_native_takes_and_the_logged_fallback(caplog):
  nv, e4m3 = formats.QuantSpec("nvfp4"), formats.QuantSpec("fp8_e4m3")
  assert native.unsupported(Gemm(MXFP4, MXFP4)) is None
  assert native.unsupported(Gemm(nv, nv)) is None
  assert "per-tensor fp8_e4m3" in native.unsupported(Gemm(MXFP4, e4m3))
  assert "rhs is not quantized" in native.unsupported(Gemm(MXFP4, None))
  assert "block sizes (32, 16)" in native.unsupported(Gemm(MXFP4, nv))
  fp8 = recipes.recipe("fp8").fprop
  with caplog.at_level(logging.WARNING):
    assert backends.for_gemm("native", fp8) is backends.module("xla")
    assert backends.for_gemm("native", fp8) is backends.module("xla")
    assert backends.for_gemm("native", Gemm(MXFP4, MXFP4)) is native
  assert caplog.text.count("backend native runs this GEMM on xla: its lhs is per-tensor") <= 1
  with pytest.raises(ValueError, match="unknown backend 'cuda'"):
    backends.module("cuda")


# ------------------------------------------------ native's routes

def _spec(fmt, **kw):
  return formats.QuantSpec(fmt, **kw)


@pytest.mark.parametrize("lhs,rhs,want", [
    (_spec("mxfp4"), _spec("mxfp4"), "scaled_dot"),           # E2M1 + E8M0: not cuDNN's
    (_spec("mxfp8_e4m3"), _spec("mxfp8_e5m2"), "scaled_matmul"),  # MXFP8: cuDNN
    (_spec("mxfp6_e2m3"), _spec("mxfp8_e4m3"), "scaled_matmul"),  # E2M3 travels as E4M3
    (_spec("mxfp8_e4m3", block_size=16), _spec("mxfp8_e4m3", block_size=16), "scaled_dot"),
    (_spec("mxfp4"), _spec("mxfp8_e4m3"), "scaled_dot"),      # FP4 x FP8 mix
    (_spec("nvfp4"), _spec("nvfp4"), "scaled_matmul"),        # E4M3 scales: cuDNN
])
def test_auto_route_by_format(lhs, rhs, want):
  assert native.route_for(lhs, rhs) == want
  for forced in ("scaled_matmul", "scaled_dot"):
    assert native.route_for(lhs, rhs, forced) == forced


def test_native_route_is_a_recipe_and_config_key(monkeypatch):
  cfg = recipes.config_template("mxfp4")
  cfg.native_route = "scaled_matmul"
  r = recipes.from_config(cfg)
  assert r.native_route == "scaled_matmul" and "native_route=scaled_matmul" in r.name
  assert recipes.from_config(r.to_config()) == r
  with pytest.raises(ValueError, match=r"native_route 'cudnn' not in \('auto', "):
    Recipe("x", native_route="cudnn")
  monkeypatch.delattr(jax.lax, "scaled_dot")
  with pytest.raises(ValueError, match=r"'scaled_dot' needs jax.lax.scaled_dot, which the "
                     r"installed jax \S+ lacks"):
    backends.check_recipe(Recipe("x", native_route="scaled_dot"))
  assert Recipe("x", native_route="auto").native_route == "auto"


def _eqns(jaxpr, made_by=None):
  """(eqn, the primitive that made each of its inputs) for every equation of jaxpr and
  of the jaxprs nested in its params; a nested jaxpr that takes its caller's inputs
  one for one (a jit) sees the caller's producers."""
  made_by = {**(made_by or {}), **{v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}}
  for eqn in jaxpr.eqns:
    inputs = [None if isinstance(v, jax.extend.core.Literal) else made_by.get(v)
              for v in eqn.invars]
    yield eqn, inputs
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          same = len(sub.invars) == len(eqn.invars)
          yield from _eqns(sub, dict(zip(sub.invars, inputs)) if same else None)


@needs_new_jax
@pytest.mark.parametrize("name,route,op", [("mxfp4", "auto", "scaled_dot"),
                                           ("mxfp4", "scaled_matmul", "scaled_matmul_wrapper"),
                                           ("mxfp8", "auto", "scaled_matmul_wrapper"),
                                           ("mxfp8", "scaled_dot", "scaled_dot")])
def test_each_gemm_is_one_op_behind_a_barrier(name, route, op):
  """y, dX, dW: per GEMM one block-scaled op (and none of the other route) whose four
  inputs, elements and scales in their own dtypes, come out of an optimization_barrier."""
  dg = dot.dot_general(native_recipe(name, route))
  def f(x, w):
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DENSE), x, w)
    return vjp(y)
  closed = jax.make_jaxpr(f)(jnp.ones((2, 8, 64)), jnp.ones((64, 32)))
  element = jnp.float4_e2m1fn if name == "mxfp4" else jnp.float8_e4m3fn
  other = ({"scaled_dot", "scaled_matmul_wrapper"} - {op}).pop()
  calls = 0
  for eqn, made_by in _eqns(closed.jaxpr):
    assert eqn.primitive.name != other
    if eqn.primitive.name == op:
      calls += 1
      assert made_by == ["optimization_barrier"] * 4
      assert [v.aval.dtype for v in eqn.invars] == [element] * 2 + [jnp.float8_e8m0fnu] * 2
  assert calls == 3


# ------------------------------------------------ native == xla, bit for bit





def _value_and_grads(recipe, x, w, dims, key):
  dg = dot.dot_general(recipe)
  layer_key = jax.random.key(9) if recipe.needs_layer_key else None
  def f(x, w):
    y, vjp = jax.vjp(lambda a, b: dg(a, b, dims, key=key, layer_key=layer_key), x, w)
    return (y,) + vjp(jnp.cos(y))
  return jax.jit(f)(x, w), str(jax.make_jaxpr(f)(x, w))


def _assert_same_bits(got, want):
  for a, b in zip(got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint32 if a.itemsize == 4 else np.uint16),
                                  b.view(np.uint32 if b.itemsize == 4 else np.uint16))


def test_every_preset_native_takes_is_listed():
  assert "bf16" not in NATIVE_PRESETS and "fp8" not in NATIVE_PRESETS
  assert {"mxfp8", "mxfp4-dh16", "quartet", "tseng", "nvfp4"} <= set(NATIVE_PRESETS)
  assert [n for n in NATIVE_PRESETS if not _fp4_only(n)] == ["mxfp8"]


def _fp4_only(name):
  """Whether every GEMM native runs has E2M1 elements on both sides (MXFP4, NVFP4)."""
  r = recipes.recipe(name)
  gemms = [getattr(r, role) for role in recipes.ROLES]
  return all(g.lhs.element.name == g.rhs.element.name == "e2m1" for g in gemms
             if native.unsupported(g) is None)


@needs_new_jax
@pytest.mark.parametrize("name,route", [(n, "auto") for n in NATIVE_PRESETS] + [
    ("mxfp4-dh16", "scaled_matmul"), ("nvfp4", "scaled_dot")])
def test_native_matches_xla_bitwise(name, route):
  """y, dX, dW; K = 72, N = 40 and M = 2 x 20 tokens pad every block and rotation;
  each preset on its own route, and FP4 on the other route too.

  FP4 GEMMs agree bit for bit: every E2M1 x E2M1 product times the two block
  scales, and here every partial sum, is exact in float32, so the order in
  which the CPU GEMMs add (bf16 dot with float32 accumulation in xla and in
  lax.scaled_dot's decomposition, convert + multiply + float32 dot in
  scaled_matmul's CPU lowering) cannot matter. MXFP8 products carry 8
  significant bits, sums round, and the orders differ: a few outputs differ in
  the last bit.
  """
  x = jax.random.normal(jax.random.key(0), (2, 20, 72)) * 3.0
  w = jax.random.normal(jax.random.key(1), (72, 40)) * 0.1
  key = jax.random.key(4)
  want, _ = _value_and_grads(recipes.recipe(name), x, w, DENSE, key)
  got, jaxpr = _value_and_grads(native_recipe(name, route), x, w, DENSE, key)
  assert jaxpr.count("scaled_matmul_wrapper[") + jaxpr.count("scaled_dot[") == native_gemms(name)
  if _fp4_only(name):
    _assert_same_bits(got, want)
  else:
    for a, b in zip(got, want):
      scale = np.abs(np.asarray(b)).max()
      np.testing.assert_allclose(a, b, rtol=2**-21, atol=2**-21 * scale)


@needs_new_jax
@pytest.mark.parametrize("layout", ["attention", "kernel first", "dense general"])
def test_native_matches_xla_bitwise_in_other_layouts(layout):
  """Batch dims, a kernel contracting its last axis, two contraction axes; bf16 inputs."""
  ls, rs, dims = {
      "attention": ((2, 40, 3, 32), (2, 24, 3, 32), (((3,), (3,)), ((0, 2), (0, 2)))),
      "kernel first": ((40, 96), (24, 96), (((1,), (1,)), ((), ()))),
      "dense general": ((2, 20, 4, 24), (4, 24, 16), (((2, 3), (0, 1)), ((), ()))),
  }[layout]
  x = jax.random.normal(jax.random.key(0), ls, jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), rs, jnp.bfloat16)
  want, _ = _value_and_grads(recipes.recipe("mxfp4-dh16"), x, w, dims, None)
  got, _ = _value_and_grads(native_recipe("mxfp4-dh16"), x, w, dims, None)
  _assert_same_bits(got, want)


@needs_new_jax
def test_native_llama_gradients_match_xla_bitwise():
  """Two scanned, rematerialized Llama blocks with bf16 activations and quantized
  attention products (batch dims): loss and every gradient, jitted."""
  from fp4jax.llama import model  # pylint: disable=g-import-not-at-top
  cfg = model.model_config("tiny", vocab_size=64, dim=128, n_layers=2, n_heads=4,
                           n_kv_heads=2, mlp_dim=96, dtype="bfloat16", scan_layers=True,
                           remat="full", quantize_attention=True)
  toks = jax.random.randint(jax.random.key(0), (2, 32), 0, 64, jnp.int32)
  params = model.Llama(cfg, recipes.recipe("bf16")).init(jax.random.key(1), toks)["params"]

  def loss_and_grads(recipe):
    llama = model.Llama(cfg, recipe)
    def loss(p):
      logits = llama.apply({"params": p}, toks, rngs={"quant": jax.random.key(2)})
      return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])
    return jax.jit(jax.value_and_grad(loss))(params)

  want = jax.tree.leaves(loss_and_grads(recipes.recipe("mxfp4-dh16")))
  got = jax.tree.leaves(loss_and_grads(native_recipe("mxfp4-dh16")))
  _assert_same_bits(got, want)


@needs_new_jax
def test_native_data_parallel_matches_xla_bitwise():
  """Tokens split over 8 devices (64 each: two MX blocks for Wgrad), jitted grads.

  (scaled_matmul's partitioning rule runs here; under Explicit mesh axes with
  out_sharding jax 0.12's CPU runtime has no "Sharding" custom call, untested
  on GPUs.)
  """
  sharding = jax.sharding
  mesh = jax.make_mesh((8,), ("data",), axis_types=(sharding.AxisType.Auto,))
  x = jax.device_put(jax.random.normal(jax.random.key(0), (512, 64)),
                     sharding.NamedSharding(mesh, sharding.PartitionSpec("data", None)))
  w = jax.random.normal(jax.random.key(1), (64, 32))

  def grads(recipe):
    dg = dot.dot_general(recipe)
    loss = lambda a, b: jnp.sum(dg(a, b, (((1,), (0,)), ((), ()))) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  got = grads(native_recipe("mxfp4-dh16"))
  assert got[1][0].sharding.spec == sharding.PartitionSpec("data")
  _assert_same_bits(jax.tree.leaves(got), jax.tree.leaves(grads(recipes.recipe("mxfp4-dh16"))))


def _fp8_operands(dtype):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_t(3, (512, 384)), dtype)
  w = jnp.asarray(rng.standard_normal((384, 256)) * 0.05, dtype)
  e4m3 = formats.QuantSpec("fp8_e4m3")
  xla = backends.module("xla")
  return [xla.quantize(v, e4m3, None, None, axis, None, jnp.bfloat16)
          for v, axis in ((x, 1), (w, 0))], e4m3, x, w


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_fp8_values_are_fake_quantize_in_the_inputs_dtype(dtype):
  (a, b), e4m3, x, w = _fp8_operands(dtype)
  assert a.values.dtype == dtype and a.factor is None
  np.testing.assert_array_equal(np.asarray(a.values, np.float32),
                                np.asarray(formats.fake_quantize(x, e4m3, 1), np.float32))
  saved = backends.module("xla").from_qarray(formats.quantize(w, e4m3, 0), dtype, jnp.bfloat16)
  assert saved.values.dtype == dtype
  np.testing.assert_array_equal(saved.values, b.values)


def test_xla_fp8_gemm_runs_in_bf16_and_differs_from_float32_by_round_off_only():
  """bf16 FP8 operands take the bf16 GEMM (float32 accumulation): the same
  products, summed in another order than a float32 GEMM's. The difference is
  float32 round-off, and after rounding the output to bf16 it survives only
  where the float32 value sits at a bf16 rounding tie."""
  (a, b), _, _, _ = _fp8_operands(jnp.bfloat16)
  xla = backends.module("xla")
  dims = (((1,), (0,)), ((), ()))
  text = jax.jit(lambda a, b: xla.matmul(a, b, dims, None, None)).lower(a, b).as_text()
  assert "dot_general" in text and "bf16" in text.split("dot_general")[1].split("\n")[0]
  got = np.asarray(jax.jit(lambda a, b: xla.matmul(a, b, dims, None, None))(a, b))
  f32 = np.asarray(jax.jit(lambda u, v: jax.lax.dot_general(
      u.astype(jnp.float32), v.astype(jnp.float32), dims, precision="highest"))(a.values, b.values))
  exact = np.asarray(a.values, np.float64) @ np.asarray(b.values, np.float64)
  bound = 384 * 2.0 ** -24 * (np.abs(np.asarray(a.values, np.float64))
                              @ np.abs(np.asarray(b.values, np.float64)))
  assert np.all(np.abs(got - exact) <= bound) and np.all(np.abs(f32 - exact) <= bound)
  as_bf16 = lambda y: np.asarray(jnp.asarray(y).astype(jnp.bfloat16)).view(np.uint16)
  assert (as_bf16(got) != as_bf16(f32)).mean() < 1e-3


def test_gemm_dtype_bench_measures_bf16_rounding_ties():
  """fp4jax.bench.gemm_dtype's difference fraction: right on planted float32
  pairs (3 of 100 straddle a bf16 rounding tie, by one float32 ulp; the rest
  differ by an ulp away from any tie), 0 where both GEMMs are exact (K = 1: one
  product of two bf16 values, exact in float32), and below 10^-3 on Gaussian
  operands at K = 384 (0 where the CPU's two GEMMs sum in the same order, as
  jax 0.12 does on an AVX2 CPU without bf16 instructions)."""
  from fp4jax.bench import gemm_dtype  # pylint: disable=g-import-not-at-top
  ones = np.ones(100, np.float32)
  tie = np.float32(1 + 2.0**-8)  # halfway between bf16 1 and 1 + 2^-7
  a = np.where(np.arange(100) < 3, np.nextafter(tie, np.float32(0)), np.nextafter(ones, 2))
  b = np.where(np.arange(100) < 3, np.nextafter(tie, np.float32(2)), ones)
  assert gemm_dtype.bf16_differ_fraction(a, b) == 0.03
  exact = gemm_dtype.measure(64, 1, 64, 1).differ
  gaussian = gemm_dtype.measure(1024, 384, 256, 1).differ
  assert exact == 0.0 and 0.0 <= gaussian < 1e-3, (exact, gaussian)
