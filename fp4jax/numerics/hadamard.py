"""Block-diagonal Hadamard rotations along one axis.

rotate(x, block, axis, signs) replaces each run of `block` consecutive elements
along `axis` by x_blk @ diag(signs) @ H_block (H orthonormal Sylvester, so
symmetric and its own inverse). The inverse is unrotate: y_blk @ H @
diag(signs), i.e. rotate with signs=None, then multiply each block by the
signs. Cost: one (block x block) matmul per block, i.e. `block` multiply-adds
per element (16 for H16), accumulated in float32, returned in x's dtype.
Along the last axis it is x[..., n/block, block] @ M; along any other axis a
batched M^T @ x[p, block, rest] (M broadcast over the batch), so no axis moves.

The matmul's operands (`matmul_dtype`) are bfloat16 when x is bfloat16 and
1/sqrt(block) is a power of two (block 4, 16, 64, 256: every entry of
diag(signs) @ H is +-2^-k, exact in bfloat16; a CPU with bfloat16 matrix
units runs that matmul faster), float32 otherwise. Either way every product
is exact in float32 and only the order of the float32 sums is the compiler's:
where a block's nonzero products span at most 12 binades every partial sum
is exact, so the result is the exact rotation rounded once to x's dtype
whatever the order; beyond that two orders can differ in the last float32
bit, which moves the rounded result only at a rounding tie
(tests/test_hadamard.py measures how often).

Sign policies (`policy_signs`), the meanings "random Hadamard" has in use:
"none" (plain Sylvester), "fixed" (one vector from a seed, as NVIDIA
TransformerEngine hard-codes), "per-layer" (one vector per layer, drawn from a
key derived from the run's seed and the layer, fixed for the run, as torchao)
and "per-step" (fresh from the call's key, as Quartet and Tseng et al.).
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


def hadamard_matrix(n: int, dtype=jnp.float32):
  """Orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two)."""
  if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
    raise ValueError(f"Hadamard size must be a power of two, got {n!r}")
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return jnp.asarray(h / np.sqrt(n), dtype)


def random_signs(key, block: int):
  """Random +-1 float32 vector [block] drawn from `key`."""
  return jax.random.rademacher(key, (block,), jnp.float32)


SIGN_POLICIES = ("none", "fixed", "per-layer", "per-step")


def check_sign_policy(policy) -> None:
  """ValueError naming `policy` and the valid ones unless it is in SIGN_POLICIES."""
  if policy not in SIGN_POLICIES:
    hint = " ('random' is now 'per-step')" if policy == "random" else ""
    raise ValueError(f"Hadamard sign policy {policy!r} is not one of "
                     f"{', '.join(SIGN_POLICIES)}{hint}")


def policy_signs(policy: str, block: int, seed: int = 0, key=None, layer_key=None):
  """The +-1 float32 vector [block] of a sign policy, or None for "none".

  "fixed": random_signs(jax.random.key(seed), block); "per-layer":
  random_signs(layer_key, block); "per-step": random_signs(key, block).
  A policy whose key is None raises ValueError.
  """
  check_sign_policy(policy)
  if policy == "none":
    return None
  if policy == "fixed":
    return random_signs(jax.random.key(seed), block)
  source = layer_key if policy == "per-layer" else key
  if source is None:
    what = "layer_key" if policy == "per-layer" else "key"
    raise ValueError(f"Hadamard sign policy {policy!r} needs a {what}, got None")
  return random_signs(source, block)


def _is_key(signs):
  dtype = jnp.result_type(signs)
  return (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
          or dtype == jnp.uint32)


def _matrix(block, signs, inverse):
  """diag(s) @ H (forward) or H @ diag(s) (inverse), float32 [block, block]."""
  h = hadamard_matrix(block)
  if signs is None:
    return h
  if _is_key(signs):
    signs = random_signs(signs, block)
  signs = jnp.asarray(signs, jnp.float32)
  if signs.shape != (block,):
    raise ValueError(f"signs must have shape ({block},), got {signs.shape}")
  return h * signs[None, :] if inverse else signs[:, None] * h


def matmul_dtype(dtype, block: int):
  """The operand dtype of the rotation matmul of a `dtype` array (module docstring)."""
  power_of_four = block.bit_length() % 2 == 1  # 1/sqrt(block) = 2^-k
  return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 and power_of_four else jnp.float32


def _apply(x, m, block, axis):
  """Multiplies each block along `axis` by m, without moving axes."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"can only rotate real floating arrays, got dtype {dtype}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} out of range for an array of rank {x.ndim}")
  axis %= x.ndim
  n = x.shape[axis]
  if n % block:
    raise ValueError(f"axis {axis} has length {n}, not a multiple of the "
                     f"Hadamard block {block}")
  mdt = matmul_dtype(dtype, block)
  xm, m = x.astype(mdt), m.astype(mdt)
  hi, f32 = lax.Precision.HIGHEST, jnp.float32
  if axis == x.ndim - 1:
    y = jnp.matmul(xm.reshape(x.shape[:-1] + (n // block, block)), m,
                   precision=hi, preferred_element_type=f32)
  else:
    # [P, block, R] with batch P: out[p] = m^T @ x[p], layout kept.
    p = int(np.prod(x.shape[:axis])) * (n // block)
    xr = xm.reshape(p, block, -1)
    mt = jnp.broadcast_to(m.T, (p, block, block))
    y = lax.dot_general(mt, xr, (((2,), (1,)), ((0,), (0,))), precision=hi,
                        preferred_element_type=f32)
  if mdt != f32:
    # XLA:CPU (jax 0.10.2) fails on a bf16 x bf16 -> f32 dot that gets a later
    # transpose folded into it ("Unsupported element type for DotThunk").
    y = lax.optimization_barrier(y)
  return y.reshape(x.shape).astype(x.dtype)


def rotate(x, block: int = 16, axis: int = -1, signs=None):
  """Block-diagonal rotation of x along `axis`, shape and dtype kept.

  signs: None (plain Sylvester H), a +-1 float vector [block] (fixed signs), or
  a PRNG key (random signs from random_signs(key, block)).
  """
  return _apply(x, _matrix(block, signs, inverse=False), block, axis)


def unrotate(y, block: int = 16, axis: int = -1, signs=None):
  """Inverse of rotate with the same block, axis and signs."""
  return _apply(y, _matrix(block, signs, inverse=True), block, axis)
