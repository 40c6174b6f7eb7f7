"""Kernel backends on sharded operands (fp4jax.shard_local), on 8 virtual CPU devices.

A Dense layer's forward and backward through fp4jax.dot_general with the
operands' specs, under data, FSDP and tensor-parallel meshes, equals the same
layer on one device bit for bit, for every backend that runs on a CPU (xla;
pallas's and mosaic's kernels as their CPU twins); the kernels see each
device's shard; a mesh that splits a quantization block is refused before
anything compiles. The inputs are multiples of 1/16 below 1/2, so every float32
sum of the GEMMs is exact and its order (which a split contraction changes,
in bf16 too) cannot hide a difference in the quantized operands.
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp4jax import backends, dot, recipes, sharding
from fp4jax.kernels import hopper_gemm
from fp4jax.kernels import quantize as kernel_quantize
from fp4jax.llama import model as model_lib

BATCH, SEQ, E, F = 8, 32, 128, 128  # 256 tokens: 32 per device on 8 batch shards
TOKENS = ("data", "fsdp")
# (mesh sizes data x fsdp x tensor, layer): a column-parallel layer (x . w[embed, mlp],
# as q, gate, up) or a row-parallel one (h[..., mlp] . w[mlp, embed], as o, down).
MESHES = {"data": ((8, 1, 1), "column"), "fsdp": ((1, 8, 1), "column"),
          "tensor": ((1, 2, 4), "row"), "2x2x2": ((2, 2, 2), "column")}
SPECS = {"column": (P(TOKENS, None, None), P("fsdp", "tensor")),
         "row": (P(TOKENS, None, "tensor"), P("tensor", "fsdp"))}
CPU_BACKENDS = ("xla", "pallas", "mosaic", "mosaic_fast")


def _mesh(sizes):
  cfg = ml_collections.ConfigDict(dict(zip(sharding.MESH_AXES, sizes)))
  return sharding.make_mesh(cfg, jax.devices()[:math.prod(sizes)])


def _needs(backend):
  try:
    backends.check_jax(backend)
  except ValueError as e:
    pytest.skip(str(e))


def _inputs():
  """x, w, dy: multiples of 1/16 in [-6/16, 6/16], one 7/16 each (the per-tensor
  amax, on one device's shard only)."""
  rng = np.random.default_rng(0)
  def draw(*shape):
    a = rng.integers(-6, 7, shape).astype(np.float32)
    a.flat[rng.integers(a.size)] = 7
    return jnp.asarray(a / 16, jnp.bfloat16)
  return draw(BATCH, SEQ, E), draw(E, F), draw(BATCH, SEQ, F)


def _layer(recipe, backend, sizes, layer, specs=True):
  """(y, dx, dw) of the Dense layer on the mesh, as float32 numpy arrays."""
  r = dataclasses.replace(recipes.recipe(recipe), backend=backend)
  dg = dot.dot_general(r)
  x_spec, w_spec = SPECS[layer]
  key, layer_key = jax.random.key(3), jax.random.key(4)

  def fwd_bwd(x, w, dy):
    f = lambda a, b: dg(a, b, (((2,), (0,)), ((), ())), key=key, layer_key=layer_key,
                        specs=(x_spec, w_spec) if specs else None)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)

  x, w, dy = _inputs()
  mesh = _mesh(sizes)
  y_spec = P(TOKENS, None, "tensor" if layer == "column" else None)
  with sharding.use_mesh(mesh):
    args = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in ((x, x_spec), (w, w_spec), (dy, y_spec))]
    out = jax.jit(fwd_bwd)(*args)
  return [np.asarray(o.astype(jnp.float32)) for o in out]


_ONE_DEVICE = {}


def _reference(recipe, backend, layer):
  if (recipe, backend, layer) not in _ONE_DEVICE:
    _ONE_DEVICE[recipe, backend, layer] = _layer(recipe, backend, (1, 1, 1), layer)
  return _ONE_DEVICE[recipe, backend, layer]


# Every backend on every mesh with mxfp4-dh16 (blocks, rotations and all three
# GEMMs' layouts); mxfp4 on the mesh that splits data, FSDP and tensor at once;
# fp8 (its amax reduced across shards) there and with K split (row layout).
_LAYER_CASES = [("mxfp4-dh16", m) for m in MESHES] + [
    ("mxfp4", "2x2x2"), ("fp8", "2x2x2"), ("fp8", "tensor")]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("recipe,mesh_name", _LAYER_CASES)
def test_a_sharded_dense_layer_equals_one_device_bit_for_bit(recipe, backend, mesh_name):
  _needs(backend)
  _assert_as_on_one_device(recipe, backend, mesh_name)


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_stochastic_rounding_draws_the_bits_of_one_device(backend):
  """mxfp4-sr's Dgrad and Wgrad round stochastically in the kernels: each device
  rounds its shard with the bits one device draws for it."""
  _needs(backend)
  _assert_as_on_one_device("mxfp4-sr", backend, "2x2x2")


def _assert_as_on_one_device(recipe, backend, mesh_name):
  sizes, layer = MESHES[mesh_name]
  got = _layer(recipe, backend, sizes, layer)
  for name, a, b in zip(("y", "dx", "dw"), got, _reference(recipe, backend, layer)):
    np.testing.assert_array_equal(a, b, err_msg=f"{name} on mesh {sizes}")
  assert np.abs(got[2]).max() > 0


def _kernel_shapes(monkeypatch):
  """Records the first operand's shape of every kernel call fp4jax's backends make."""
  seen = []
  for module, name in ((kernel_quantize, "fake_quantize"), (kernel_quantize, "quantize_fp8"),
                       (hopper_gemm, "matmul")):
    def recording(x, *args, _call=getattr(module, name), _name=name, **kwargs):
      seen.append((_name, tuple(x.shape)))
      return _call(x, *args, **kwargs)
    monkeypatch.setattr(module, name, recording)
  return seen


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_each_kernel_sees_one_devices_tokens(backend, monkeypatch):
  """On 8 data shards every quantize kernel and GEMM reads one of the 8 sequences
  (32 of the 256 tokens); without specs they read all 256."""
  _needs(backend)
  tokens = BATCH * SEQ
  for specs in (True, False):
    seen = _kernel_shapes(monkeypatch)
    _layer("mxfp4", backend, (8, 1, 1), "column", specs=specs)
    assert {name for name, _ in seen} == (
        {"fake_quantize"} if backend == "pallas" else {"quantize_fp8", "matmul"}), seen
    whole = [shape for _, shape in seen if tokens in shape or BATCH in shape]
    assert bool(whole) != specs, (specs, seen)
    monkeypatch.undo()


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_a_mesh_that_splits_a_block_is_refused_before_compiling(backend):
  """8 sequences of 8 tokens on 8 data shards: Wgrad's tokens, 8 per device, are a
  quarter of an MX block (the trainer's start-up check, fp4jax.llama.block_check,
  refuses such a run before this)."""
  _needs(backend)
  r = dataclasses.replace(recipes.recipe("mxfp4"), backend=backend)
  dg = dot.dot_general(r)
  mesh = _mesh((8, 1, 1))
  x = jax.ShapeDtypeStruct((8, 8, E), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((E, F), jnp.bfloat16)
  f = lambda x, w: jax.grad(lambda x, w: dg(x, w, (((2,), (0,)), ((), ())),
                                            specs=SPECS["column"]).sum(), argnums=1)(x, w)
  with sharding.use_mesh(mesh), pytest.raises(ValueError) as err:
    jax.jit(f).lower(x, w)
  msg = str(err.value)
  for part in ("wgrad", "contraction axis of size 64", "('data', 'fsdp')", "8 devices",
               "8 per device", "MX block 32", "straddle"):
    assert part in msg, msg
  assert "\n" not in msg


def test_the_models_linears_run_their_kernels_per_shard(monkeypatch):
  """The tiny Llama (one layer) under the trainer's mesh and rules on 2x2x2 with the
  pallas backend: its linears pass their operands' logical names (fp4jax.flax.DotGeneral),
  so every quantize kernel of the forward and backward reads 2 of the 8 sequences
  (the numerics per shard: the Dense tests above)."""
  cfg = dataclasses.replace(model_lib.model_config("tiny"), n_layers=1)
  model = model_lib.Llama(cfg, dataclasses.replace(recipes.recipe("mxfp4"), backend="pallas"))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)

  def params_on(mesh):
    boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct(
        tokens.shape, jnp.int32))
    return jax.jit(lambda: nn.unbox(model.init(jax.random.key(0), tokens)),
                   out_shardings=sharding.logical_to_sharding(boxed, mesh))()

  def run(mesh, params):
    with sharding.use_mesh(mesh):
      t = jax.device_put(tokens, sharding.batch_sharding(mesh))
      return jax.jit(jax.value_and_grad(lambda p, t: jnp.mean(model.apply(p, t) ** 2)))(
          params, t)

  mesh = _mesh((2, 2, 2))
  params = params_on(mesh)  # (init runs the model on the whole batch, outside the mesh)
  seen = _kernel_shapes(monkeypatch)
  loss, grads = run(mesh, params)
  assert seen and all(BATCH * SEQ not in shape and shape[:2] != (BATCH, SEQ)
                      for _, shape in seen), seen
  assert any(shape[:2] == (BATCH // 4, SEQ) for _, shape in seen), seen
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
