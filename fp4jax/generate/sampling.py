"""The next token from the logits: greedy, or sampled with temperature, top-k, top-p."""

import dataclasses

import jax
import jax.numpy as jnp

from fp4jax import errors


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen.

  temperature: 0 is greedy (the argmax; top_k, top_p unused), else the
    logits are divided by it before sampling.
  top_k: sample among the k likeliest tokens only (0: all).
  top_p: sample among the fewest likeliest tokens whose probability adds up
    to at least top_p (nucleus sampling, after top_k; 1: all).
  """
  temperature: float = 0.8
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise errors.UserError(f"--temperature {self.temperature}; allowed: >= 0 "
                             "(0 is greedy)")
    if self.top_k < 0:
      raise errors.UserError(f"--top_k {self.top_k}; allowed: >= 0 (0 keeps every token)")
    if not 0 < self.top_p <= 1:
      raise errors.UserError(f"--top_p {self.top_p}; allowed: 0 < top_p <= 1 "
                             "(1 keeps every token)")

  def arrays(self):
    """(temperature, top_k, top_p) as JAX scalars: next_tokens' `how`, traced,
    so that one compiled program serves every setting."""
    return (jnp.float32(self.temperature), jnp.int32(self.top_k), jnp.float32(self.top_p))


def next_tokens(logits_BxV, how, key):
  """int32 [B]: each row's next token under `how` (Sampling.arrays()), drawn with `key`."""
  temperature, top_k, top_p = how
  vocab = logits_BxV.shape[-1]
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  logits_BxV = logits_BxV.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1)
  sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth_Bx1 = jax.lax.dynamic_index_in_dim(sorted_BxV, k - 1, axis=-1)
  sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
  probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
  # A token of the top k is kept when the likelier ones add up to less than
  # top_p (all at 1, whatever float32's sums do).
  kept_BxV = ((jnp.cumsum(probs_BxV, axis=-1) - probs_BxV < top_p) | (top_p >= 1)) & (
      sorted_BxV > -jnp.inf)
  last_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
  logits_BxV = jnp.where(logits_BxV < last_Bx1, -jnp.inf, logits_BxV)
  sampled_B = jax.random.categorical(key, logits_BxV, axis=-1)
  return jnp.where(temperature > 0, sampled_B, greedy_B).astype(jnp.int32)
