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
    to at least top_p (nucleus sampling; 1: all).
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


def next_tokens(logits_BxV, sampling, key):
  """int32 [B]: each row's next token under `sampling`, drawn with `key`."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits_BxV.shape[-1]:
    kth_Bx1 = jax.lax.top_k(logits_BxV, sampling.top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  if sampling.top_p < 1:
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # A token is kept when the likelier ones add up to less than top_p.
    kept_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV < sampling.top_p
    last_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < last_Bx1, -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)
