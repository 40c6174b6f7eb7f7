"""llama.cpp itself (llama-cpp-python) runs fp4jax's GGUF exports: `make test-llamacpp`.

One small run (2 layers of width 128, MXFP4 recipe, float32 model dtype) is
trained long enough to continue Python with some confidence; its NVFP4 export is of a copy
whose config.json records the nvfp4 recipe. llama.cpp's CPU path multiplies
an MXFP4 or NVFP4 weight by the activations rounded to Q8_0 (ggml-cpu.c:
the vec_dot_type of both is GGML_TYPE_Q8_0): each 32 inputs as int8 times
one float16 scale d = fp16(amax / 127), the int8 values round(x * 127 /
amax), to nearest even (ggml-cpu/arch/x86/quants.c). The reference is
fp4jax's own forward (fp4jax.llama.model, float32, recipe bf16: no
quantization of its own) with the exported weights (the trained forward's
weight operands; tests/test_gguf.py checks them bit for bit) and every
input of an FP4 linear rounded so. The caches are float32 (type_k, type_v)
and attention is not flash, so llama.cpp computes the rest in float32 as
the reference does; what differs is the order of float32 sums and ggml's
exp, which the stated tolerance bounds.
"""

import dataclasses
import functools
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import checkpointing
from fp4jax import generate as generate_lib
from fp4jax.data import pipeline
from fp4jax.data import tokenizers
from fp4jax.generate import sampling as sampling_lib
from fp4jax.llama import fp4_weights
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax.train import export
from fp4jax.train import export_fp4
from fp4jax.train import export_gguf
from tests.helpers import run_with_recipe
from tests.helpers import tiny_config

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install "
    "'fp4jax[llamacpp]' or make test-llamacpp): llama.cpp does not load the exports")
pytestmark = pytest.mark.slow  # trains a run, builds llama.cpp contexts

STEPS = 500  # validation loss about 1.75 nats a byte (from 6.3)
FORMATS = {"mxfp4": "mxfp4", "nvfp4": "nvfp4"}  # recipe -> export format
PROMPT = "def "
GREEDY_TOKENS = 24
TRAINED_AGREE = 8  # greedy tokens llama.cpp and the trained forward share at least
# llama.cpp against the reference: |logit difference| <= LOGIT_ATOL +
# LOGIT_RTOL * the row's largest |logit|. Measured 2026-12-07 (Xeon, AVX-512
# build): at most 4.7e-7 (MXFP4) and 3.2e-6 (NVFP4) of the largest logit,
# float32 sums in another order; without the Q8_0 rounding of the inputs the
# reference is about 1e-2 away. The bound leaves room for an input that
# another SIMD path's last bit moves across a Q8_0 rounding boundary.
LOGIT_RTOL, LOGIT_ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from fp4jax.train import trainer  # pylint: disable=import-outside-toplevel
  from sharded_runs import on_first_devices  # pylint: disable=import-outside-toplevel
  run_dir = str(tmp_path_factory.mktemp("run"))
  config = tiny_config(**{"quant.name": "mxfp4", "steps": STEPS, "eval_every": STEPS,
                          "checkpoint_every": STEPS, "async_checkpointing": False,
                          "log_every": STEPS, "seq_len": 64, "batch_size": 16,
                          "warmup_steps": 20})
  config.model.update(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, mlp_dim=256)
  with on_first_devices(1):
    trainer.train(config, run_dir)
  return run_dir


@pytest.fixture(scope="module")
def exports(trained, tmp_path_factory):
  """recipe -> (run directory, GGUF file)."""
  folder = tmp_path_factory.mktemp("gguf")
  out = {}
  for name, fmt in FORMATS.items():
    run_dir = trained
    if name != "mxfp4":
      run_dir = str(folder / f"run-{name}")
      shutil.rmtree(run_dir, ignore_errors=True)
      run_with_recipe(trained, run_dir, name)
    path = str(folder / f"{name}.gguf")
    export_gguf.export_gguf(run_dir, path, quantize=fmt)
    out[name] = run_dir, path
  return out


def _run(run_dir):
  """(config dict, LlamaConfig, recipe, params) of a run's last checkpoint."""
  config, cfg = export.run_config(run_dir)
  step = export.run_step(run_dir)
  params = checkpointing.restore_params(os.path.join(run_dir, "checkpoints"), step,
                                        hf_llama.abstract_params(cfg))
  return config, cfg, export_fp4.run_recipe(config, step), params


def _held_out(run_dir, rows=2):
  """Token rows [rows, seq_len] of the run's validation set (BOS first)."""
  config, _ = export.run_config(run_dir)
  data_cfg, _ = export_fp4.run_data_config(config)
  windows = pipeline.validation_windows(
      data_cfg, tokenizers.make_tokenizer(data_cfg.tokenizer), seq_len=config["seq_len"],
      batch_size=rows, num_batches=1, disjoint=True)
  return np.asarray(next(iter(windows))[:, :-1])


def q8_0(x):
  """ggml's Q8_0 rounding of x [..., K] (K a multiple of 32), dequantized:
  per 32 values, int8 round_half_even(x * 127 / amax) times fp16(amax / 127)."""
  xb = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 32)
  amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  d = (amax / 127).astype(jnp.float16).astype(jnp.float32)
  q = jnp.round(xb * jnp.where(amax == 0, 0, 127 / amax))
  return (q * d).reshape(x.shape)


def _q8_0_inputs(fp4_blocks):
  """A flax interceptor that rounds the input of every linear of the blocks
  `fp4_blocks` (block names) to Q8_0 along its contracted axes."""
  def interceptor(next_fun, args, kwargs, context):
    path = context.module.scope.path if context.module.scope else ()
    if (context.method_name != "__call__" or not isinstance(context.module, nn.DenseGeneral)
        or path[0] not in fp4_blocks):
      return next_fun(*args, **kwargs)
    x, n_in = args[0], linears.linear("/".join(path[1:])).n_in
    flat = x.reshape(*x.shape[:x.ndim - n_in], -1)
    return next_fun(q8_0(flat).reshape(x.shape), *args[1:], **kwargs)
  return interceptor


@functools.lru_cache(maxsize=None)
def _reference(run_dir, fmt, rounded=True):
  """(jitted tokens [B, L] -> logits [B, L, V], LlamaConfig): fp4jax's
  float32 forward with the export's weights and (rounded) Q8_0 inputs to
  its FP4 linears."""
  _, cfg, recipe, params = _run(run_dir)
  plan = export_gguf.plan(recipe, fmt)
  params = jax.tree.map(np.asarray, params)
  fp4_blocks = [f"block_{i}" for i in range(cfg.n_layers) if not cfg.is_bf16(i)]
  for block in fp4_blocks:
    for layer in linears.BLOCK:
      node = params[block]
      for key in layer.path.split("/"):
        node = node[key]
      w = fp4_weights.fp4_weight(node["kernel"], layer.n_in, cfg.dtype, plan)
      node["kernel"] = w.dequantize().T.reshape(node["kernel"].shape)
  model = model_lib.Llama(dataclasses.replace(cfg, dtype="float32"), fp4jax.recipe("bf16"))

  @jax.jit
  def logits(tokens):
    with nn.intercept_methods(_q8_0_inputs(fp4_blocks if rounded else ())):
      return model.apply({"params": params}, tokens)
  return logits, cfg


def _llama(path):
  """llama.cpp on the CPU: float32 KV cache, no flash attention, every logit kept."""
  return llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=128, logits_all=True,
                         type_k=0, type_v=0, flash_attn=False, n_threads=2, seed=0,
                         verbose=False)


def _llama_logits(llm, row):
  llm.reset()
  llm.eval([int(t) for t in row])
  return np.array(llm.scores[:len(row)], np.float32)


@pytest.mark.parametrize("name", list(FORMATS))
def test_llama_cpp_logits_match_the_forward_with_q8_0_inputs(exports, name):
  run_dir, path = exports[name]
  reference, cfg = _reference(run_dir, FORMATS[name])
  tokens = _held_out(run_dir)
  want = np.asarray(reference(jnp.asarray(tokens)))
  llm = _llama(path)
  assert llm.n_vocab() == cfg.vocab_size
  for row, want_row in zip(tokens, want):
    got = _llama_logits(llm, row)
    scale = np.max(np.abs(want_row), axis=-1, keepdims=True)
    print(f"{name}: max |llama.cpp - reference| {np.max(np.abs(got - want_row)):.3g}, "
          f"relative to the row's largest logit {np.max(np.abs(got - want_row) / scale):.3g}")
    np.testing.assert_array_less(np.abs(got - want_row),
                                 np.broadcast_to(LOGIT_ATOL + LOGIT_RTOL * scale, got.shape))
    np.testing.assert_array_equal(got.argmax(-1), want_row.argmax(-1))
  # Without the Q8_0 rounding of the inputs the reference is 10x further
  # away: the tolerance resolves llama.cpp's activation rounding.
  unrounded, _ = _reference(run_dir, FORMATS[name], rounded=False)
  far = np.asarray(unrounded(jnp.asarray(tokens)))
  got = _llama_logits(llm, tokens[0])
  near, away = np.max(np.abs(got - want[0])), np.max(np.abs(got - far[0]))
  print(f"{name}: without the Q8_0 rounding the reference is {away:.3g} away")
  assert near * 10 < away, (near, away)


def _greedy(forward, prompt, n):
  """n greedy tokens of forward (tokens [1, L] -> logits [1, L, V]), uncached:
  the whole sequence each step, padded to one length (causal: the padding
  changes no earlier logit)."""
  tokens = list(prompt)
  length = len(prompt) + n
  for _ in range(n):
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(tokens)] = tokens
    tokens.append(int(np.asarray(forward(jnp.asarray(padded)))[0, len(tokens) - 1].argmax()))
  return tokens[len(prompt):]


def _generated(run_dir, prompt, n):
  """fp4jax.generate's n greedy tokens after `prompt` in the run's own recipe
  (W4A4: MXFP4 or NVFP4 inputs too) and weights, with a KV cache."""
  config, cfg, recipe, params = _run(run_dir)
  return generate_lib.generate(
      cfg, recipe, params, [prompt], max_new_tokens=n,
      sampling=sampling_lib.Sampling(temperature=0.0), seed=0,
      eos_id=tokenizers.ByteTokenizer.eos_id, run_seed=int(config.get("seed", 0))).tokens[0]


@pytest.mark.parametrize("name", list(FORMATS))
def test_llama_cpp_greedy_text_is_fp4jax_greedy_text(exports, name):
  """llama.cpp's own greedy completion (its tokenizer, sampler and
  detokenizer) equals the reference's greedy text token for token, and
  fp4jax.generate's in the run's recipe (W4A4, where llama.cpp computes
  W4A8) for the first tokens; printed: where they part."""
  run_dir, path = exports[name]
  tok = tokenizers.make_tokenizer("bytes")
  prompt = [tok.bos_id, *tok.encode(PROMPT).tolist()]
  llm = _llama(path)
  assert llm.tokenize(PROMPT.encode()) == prompt
  completion = llm.create_completion(PROMPT, max_tokens=GREEDY_TOKENS, temperature=0.0,
                                     top_k=1)
  text = completion["choices"][0]["text"]
  reference, _ = _reference(run_dir, FORMATS[name])
  assert text == tok.decode(_greedy(reference, prompt, GREEDY_TOKENS)), text
  trained = tok.decode(_generated(run_dir, prompt, GREEDY_TOKENS))
  same = next((i for i, (a, b) in enumerate(zip(text, trained)) if a != b),
              min(len(text), len(trained)))
  print(f"{name}: llama.cpp {text!r}, fp4jax.generate {trained!r}: the first "
        f"{same} tokens agree")
  assert same >= TRAINED_AGREE, (text, trained)


def test_llama_cpp_tokenizes_and_detokenizes_bytes_as_fp4jax(exports):
  llm = _llama(exports["mxfp4"][1])
  tok = tokenizers.make_tokenizer("bytes")
  text = "héllo  wörld\n\tdef f(x):\r\n  return x ~ \U0001f642 \x7f"
  ids = llm.tokenize(text.encode(), add_bos=False)
  assert ids == tok.encode(text).tolist()
  assert llm.detokenize(ids) == text.encode()
  assert llm.token_bos() == tok.bos_id and llm.token_eos() == tok.eos_id
