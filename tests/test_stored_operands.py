"""Inside one compiled program the quantizers see the bf16 values the program holds.

XLA:CPU computes bf16 elementwise work in float32 and by default drops a bf16
rounding that a cast back to float32 follows (fp4jax.numerics.operand.as_stored). Each
test compiles a bf16 producer, the quantized dot_general and a bf16 cotangent
as one program and as separate programs (whose boundaries store every value
in bf16), and asserts that the forward output and both gradients are the same
bits: they would not be if any quantizer (Fprop, Dgrad, Wgrad; rotated or not)
read an unrounded float32 value.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from fp4jax import dot, recipes
from fp4jax.numerics import operand

from helpers import native_recipe, needs_new_jax

DIMS = (((1,), (0,)), ((), ()))


def _producer(x):
  """bf16 elementwise work before the GEMM (an MLP's silu(gate) * up)."""
  return jax.nn.silu(x) * (x + 0.5)


def _cotangent(x):
  """bf16 elementwise work that gives the GEMM's output its gradient."""
  return jnp.tanh(x[:, :64]) * 1.7


def _operands():
  kx, kw = jax.random.split(jax.random.key(0))
  return (jax.random.normal(kx, (64, 128), jnp.bfloat16),
          jax.random.normal(kw, (128, 64), jnp.bfloat16))


def _quantized_dot(recipe):
  """dot.dot_general(recipe) with a fixed key (random recipes need one)."""
  fn = dot.dot_general(recipe)
  return lambda a, b: fn(a, b, DIMS, key=jax.random.key(1))


def _one_program(qdot, x, w):
  """(forward, Dgrad, Wgrad), each in one program with its bf16 producers: the
  forward and Wgrad quantize _producer(x), Dgrad and Wgrad _cotangent(x)."""
  def loss(a, x, w):
    return jnp.sum((qdot(a, w) * jax.lax.stop_gradient(_cotangent(x))).astype(jnp.float32))
  y = jax.jit(lambda x, w: qdot(_producer(x), w))(x, w)
  dw = jax.jit(jax.grad(lambda x, w: loss(_producer(x), x, w), argnums=1))(x, w)
  # Dgrad's output is the gradient of its lhs: here a stored input, not a producer.
  da = jax.jit(jax.grad(loss))(jax.jit(_producer)(x), x, w)
  return y, da, dw


def _separate_programs(qdot, x, w):
  """The same three, every bf16 value stored between programs."""
  a = jax.jit(_producer)(x)
  dy = jax.jit(lambda x: _cotangent(x) * jnp.ones((), jnp.bfloat16))(x)
  y = jax.jit(qdot)(a, w)
  da, dw = jax.jit(lambda a, w, dy: jax.vjp(qdot, a, w)[1](dy))(a, w, dy)
  return y, da, dw


def _differing(recipe):
  """{GEMM: elements that differ between one program and separate ones}."""
  qdot = _quantized_dot(recipe)
  x, w = _operands()
  one, separate = _one_program(qdot, x, w), _separate_programs(qdot, x, w)
  return {name: int(jnp.sum(got != want))
          for name, got, want in zip(("forward", "Dgrad", "Wgrad"), one, separate)}


def _check(recipe):
  assert _differing(recipe) == {"forward": 0, "Dgrad": 0, "Wgrad": 0}


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4-dh16", "fp8", "nvfp4", "mxfp4-rh16"])
def test_xla_quantizers_read_stored_bf16(name):
  _check(recipes.recipe(name))


# mxfp4: an unrotated recipe, whose quantizer widens the bf16 input itself.
def test_pallas_quantizers_read_stored_bf16():
  _check(dataclasses.replace(recipes.recipe("mxfp4"), backend="pallas"))


@needs_new_jax
def test_native_quantizers_read_stored_bf16():
  _check(native_recipe("mxfp4"))


def test_without_the_barrier_one_program_differs(monkeypatch):
  """The comparison can fail: with as_stored a no-op, every GEMM of the one
  program quantizes unrounded float32 values (XLA:CPU, jax 0.10.2 to 0.12).
  mxfp4: its quantizer widens the bf16 input itself (mxfp4-dh16's bf16
  rotation reads it as bf16, hadamard.matmul_dtype). jax caches traced
  custom_vjp functions, hence the cleared caches."""
  monkeypatch.setattr(operand, "as_stored", lambda v: v)
  jax.clear_caches()
  try:
    differing = _differing(recipes.recipe("mxfp4"))
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert all(n > 0 for n in differing.values()), differing
