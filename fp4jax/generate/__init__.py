"""Text from a trained model: batched prompts, a KV cache, greedy or sampled tokens.

  python -m fp4jax.generate RUN [--step N] --prompt TEXT [--prompt TEXT ...]

(fp4jax.generate.cli parses and checks the options.) `generate(...)` left-pads the
prompts (BOS + tokens) to the longest, runs them through the model once
(prefill) into a cache (fp4jax.llama.model.init_cache) and then one token at
a time; each row stops at EOS or after max_new_tokens. The forward is the
model's own (fp4jax.llama.model), in the recipe given: the run's recipe
gives the numbers it trained with. Its random streams are the trainer's
evaluation ones (the run's per-layer Hadamard signs, fixed "quant" keys), the
sampling draws from `seed` alone, so a seed repeats its text.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.generate import sampling as sampling_lib
from fp4jax.llama import model as model_lib
from fp4jax.train import step as train_step


@dataclasses.dataclass(frozen=True)
class Generated:
  """What generate() made: tokens[b], row b's new tokens (up to EOS, which is
  left out); the work done (rows x positions) and seconds of prefill and of
  the decode steps (after compilation, which took compile_s)."""
  tokens: list
  prefill_tokens: int
  prefill_s: float
  decode_tokens: int
  decode_s: float
  compile_s: float


def _step_fn(model, run_seed):
  """(params, cache, tokens_BxL, index, key, how) -> (next tokens [B], cache): the
  model on L new tokens per row, and the token after the last (sampling.next_tokens)."""
  seed_key = jax.random.key(run_seed)
  eval_key, layer_key = jax.random.split(seed_key)[1], train_step.layer_key(seed_key)

  def step(params, cache, tokens_BxL, index, key, how):
    rngs = {"quant": jax.random.fold_in(eval_key, index), "hadamard": layer_key}
    logits_BxLxV, mutated = model.apply({"params": params, "cache": cache}, tokens_BxL,
                                        rngs=rngs, mutable=["cache"])
    return sampling_lib.next_tokens(logits_BxLxV[:, -1], how, key), mutated["cache"]
  return step


# The compiled steps of this process: (model_cfg, recipe, run_seed, shapes) -> programs.
_COMPILED = {}


def _programs(model_cfg, recipe, run_seed, args):
  """(prefill, decode, seconds spent compiling them now): the step compiled for
  the prompts and for one token, once per model and shapes (`args`: a prefill
  call's arguments)."""
  params, cache, tokens_BxP = args[:3]
  key = (model_cfg, recipe, run_seed, tokens_BxP.shape,
         tuple(x.shape for x in jax.tree.leaves(cache)))
  if key in _COMPILED:
    return (*_COMPILED[key], 0.0)
  if len(_COMPILED) >= 8:
    _COMPILED.clear()
  t0 = time.perf_counter()
  step = jax.jit(_step_fn(model_lib.Llama(model_cfg, recipe), run_seed), donate_argnums=1)
  prefill = step.lower(*args).compile()
  decode = step.lower(params, cache, tokens_BxP[:, :1], *args[3:]).compile()
  _COMPILED[key] = prefill, decode
  return prefill, decode, time.perf_counter() - t0


def left_padded(prompts, pad_id=0):
  """(tokens int32 [B, P], start int32 [B]): the prompts (lists of ids) right-
  aligned in P = the longest's length, row b's first token at start[b]."""
  longest = max(len(p) for p in prompts)
  tokens_BxP = np.full((len(prompts), longest), pad_id, np.int32)
  start_B = np.array([longest - len(p) for p in prompts], np.int32)
  for row, (prompt, start) in enumerate(zip(prompts, start_B)):
    tokens_BxP[row, start:] = prompt
  return tokens_BxP, start_B


def generate(model_cfg, recipe, params, prompts, *, max_new_tokens, sampling, seed,
             eos_id, run_seed=0):
  """New tokens after each of `prompts` (lists of ids, BOS first).

  model_cfg, recipe, params: the model (fp4jax.llama.model.Llama) and its
  parameters; sampling: a sampling.Sampling; seed: of the sampling (step t
  draws fold_in(key(seed), t)); run_seed: the run's seed, whose evaluation
  keys and Hadamard signs the forward uses (fp4jax.train.step). Returns a
  Generated.
  """
  tokens_BxP, start_B = left_padded(prompts)
  rows, length = tokens_BxP.shape
  cache = model_lib.init_cache(model_cfg, start_B, length + max_new_tokens)
  sample_key, how = jax.random.key(seed), sampling.arrays()
  key0 = jax.random.fold_in(sample_key, 0)
  prefill, decode, compile_s = _programs(model_cfg, recipe, run_seed,
                                         (params, cache, tokens_BxP, 0, key0, how))
  t0 = time.perf_counter()
  next_B, cache = prefill(params, cache, jnp.asarray(tokens_BxP), 0, key0, how)
  next_B = np.asarray(next_B)
  prefill_s = time.perf_counter() - t0
  out, done = [[] for _ in range(rows)], np.zeros(rows, bool)
  t0, steps = time.perf_counter(), 0
  for t in range(1, max_new_tokens + 1):
    for row in np.flatnonzero(~done):
      if next_B[row] == eos_id:
        done[row] = True
      else:
        out[row].append(int(next_B[row]))
    if done.all() or t == max_new_tokens:
      break
    next_B, cache = decode(params, cache, jnp.asarray(next_B[:, None]), t,
                           jax.random.fold_in(sample_key, t), how)
    next_B = np.asarray(next_B)
    steps += 1
  return Generated(tokens=out, prefill_tokens=rows * length, prefill_s=prefill_s,
                   decode_tokens=rows * steps, decode_s=time.perf_counter() - t0,
                   compile_s=compile_s)
