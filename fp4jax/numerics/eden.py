"""MS-EDEN: unbiased NVFP4 quantization through stochastically rounded block scales.

Quartet II (Panferov, Schultheis, Tabesh, Alistarh, arXiv 2601.22813)
quantizes the backward-pass operands after a random-sign Hadamard rotation
(128 points, fresh signs every step) with round-to-nearest E2M1 elements and
moves the randomness needed for unbiasedness from the elements to the block
scales ("EDEN" scale correction, then stochastic rounding of the scales):

  g    = amax(x) / (SCALE_BUDGET * PEAK)           FP32 tensor scale
  s_b  = E4M3(amax_b / PEAK / g)                   per 16-element block
  v    = x / (s_b g),  q = nearest E2M1 of v
  c    = sum(v^2) / sum(v q) over each GROUP-element group (1 where 0)
  s'_b = s_b * c, stochastically rounded onto the E4M3 grid
  x^   = q * s'_b * g

With a random rotation the corrected q * c is an unbiased estimate of v
(EDEN), and stochastic rounding of the scale keeps it so. The constants are
those of Quartet II's public training code (scheme quartet_2.py): groups of
128 (its Hadamard size), a scale budget of 255.99 instead of 448 to leave room
for corrections above 1, and PEAK = 6 / ((17/16) * 0.93). fp4jax rounds E2M1
ties to even where that code rounds them up, and uses the current tensor amax
(Quartet II can delay it by one step). The rotation is the recipe's
(Hadamard(128, "per-step") in the quartet2 preset); the group must match it.
"""

import jax.numpy as jnp

GROUP = 128
SCALE_BUDGET = 255.99
PEAK = 6.0 / ((17.0 / 16.0) * 0.93)
GLOBAL_DIVISOR = SCALE_BUDGET * PEAK


def corrected_scales(v, q, s, axis):
  """s * c: block scales s (float32, keepdims on `axis`) times the EDEN
  correction sum(v^2) / sum(v q) of their GROUP-element group.

  v, q: the scaled and the rounded elements, blocked [..., n_blocks, block,
  ...] with the block elements along `axis` (n_blocks along axis - 1).
  Groups are GROUP // block consecutive blocks; a short last group is
  padded with zero blocks (which add nothing to either sum).
  """
  nb, block = v.shape[axis - 1], v.shape[axis]
  per = max(GROUP // block, 1)
  num = jnp.sum(v * v, axis=axis, keepdims=True)
  den = jnp.sum(v * q, axis=axis, keepdims=True)

  def group_sum(t):  # [..., nb, 1, ...] -> per-group sums broadcast back to blocks
    pad = [(0, 0)] * t.ndim
    pad[axis - 1] = (0, -nb % per)
    t = jnp.pad(t, pad)
    shape = t.shape[:axis - 1] + (t.shape[axis - 1] // per, per) + t.shape[axis:]
    total = jnp.sum(t.reshape(shape), axis=axis, keepdims=True)
    total = jnp.broadcast_to(total, shape).reshape(t.shape)
    return jnp.take(total, jnp.arange(nb), axis=axis - 1)

  num, den = group_sum(num), group_sum(den)
  return s * jnp.where(den == 0, 1.0, num / jnp.where(den == 0, 1.0, den))
