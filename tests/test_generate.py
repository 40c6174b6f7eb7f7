"""fp4jax.generate: the cached decode against the uncached forward, sampling, the command.

One tiny run (one layer, mxfp4, two steps) is trained once for the module;
its greedy decode is checked token by token against the argmax of the
model's own forward over the whole sequence (no cache), in its recipe and in
bf16, with prompts of different lengths in one batch (left padding).
"""

import os
import shutil

import jax
import numpy as np
import pytest

import fp4jax
from fp4jax import generate
from fp4jax import trained
from fp4jax.generate import cli
from fp4jax.generate import sampling
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import model as model_lib
from fp4jax.train import export
from fp4jax.train import trainer
from sharded_runs import on_first_devices
from tests.helpers import edited_config, main_in_process, refused, tiny_config

STEPS = 2
PROMPTS = ("def f(x):", "import", "class Point:\n  ")
GREEDY = sampling.Sampling(temperature=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(run dir, its trained.Trained, step, params)."""
  run_dir = str(tmp_path_factory.mktemp("run"))
  with on_first_devices(1):
    trainer.train(tiny_config(**{"quant.name": "mxfp4", "steps": STEPS, "eval_every": STEPS,
                                 "checkpoint_every": STEPS, "async_checkpointing": False}),
                  run_dir)
  model = trained.locate(run_dir)
  step, params = model.load(hf_llama.abstract_params(model.model_cfg))
  return run_dir, model, step, params


def _prompts(model):
  return [[model.tokenizer.bos_id] + model.tokenizer.encode(p).tolist() for p in PROMPTS]


def _generate(run, quant="recipe", how=GREEDY, seed=0, new=10):
  _, model, step, params = run
  return generate.generate(model.model_cfg, model.recipe(quant, step), params, _prompts(model),
                           max_new_tokens=new, sampling=how, seed=seed,
                           eos_id=model.tokenizer.eos_id).tokens


@pytest.mark.parametrize("quant", ["recipe", "bf16"])
def test_cached_decode_is_the_uncached_forwards_argmax(run, quant):
  _, model, step, params = run
  recipe = model.recipe(quant, step)
  assert recipe.name.startswith("mxfp4" if quant == "recipe" else "bf16")
  llama = model_lib.Llama(model.model_cfg, recipe)
  forward = jax.jit(lambda tokens: llama.apply({"params": params}, tokens))
  new = 10
  for prompt, tokens in zip(_prompts(model), _generate(run, quant, new=new)):
    # The whole sequence at once, no cache: its argmax after each prefix.
    whole = np.array([prompt + tokens], np.int32)
    argmax = np.asarray(forward(whole)).argmax(-1)[0, len(prompt) - 1:]
    ended = [model.tokenizer.eos_id] if len(tokens) < new else []  # stopped at EOS
    assert argmax[:len(tokens) + len(ended)].tolist() == tokens + ended, (prompt, tokens, argmax)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_two_blocks_scanned_or_not_decode_as_their_forward(scan_layers):
  cfg = model_lib.model_config("tiny", vocab_size=64, dim=64, n_layers=2, n_heads=2,
                               n_kv_heads=1, mlp_dim=64, scan_layers=scan_layers)
  recipe = fp4jax.recipe("mxfp4")
  llama = model_lib.Llama(cfg, recipe)
  prompts = [[1, 2, 3, 4, 5], [6, 7]]
  params = jax.jit(llama.init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
  new = generate.generate(cfg, recipe, params, prompts, max_new_tokens=6, sampling=GREEDY,
                          seed=0, eos_id=-1).tokens
  # Both rows' whole sequences, right-padded to one shape (causal: padding after
  # a row's tokens changes none of their logits).
  whole = np.zeros((2, 11), np.int32)
  for row, (prompt, tokens) in enumerate(zip(prompts, new)):
    whole[row, :len(prompt) + 6] = prompt + tokens
  argmax = np.asarray(jax.jit(llama.apply)({"params": params}, whole)).argmax(-1)
  for row, (prompt, tokens) in enumerate(zip(prompts, new)):
    assert argmax[row, len(prompt) - 1:len(prompt) + 5].tolist() == tokens


def test_a_row_decodes_the_same_alone_and_in_a_batch(run):
  _, model, step, params = run
  alone = generate.generate(model.model_cfg, model.recipe("recipe", step), params,
                            _prompts(model)[1:2], max_new_tokens=10, sampling=GREEDY, seed=0,
                            eos_id=model.tokenizer.eos_id).tokens
  assert alone[0] == _generate(run)[1]


def test_a_seed_repeats_its_text_and_another_seed_differs(run):
  how = sampling.Sampling(temperature=1.0)
  first = _generate(run, how=how, seed=3)
  assert _generate(run, how=how, seed=3) == first
  assert _generate(run, how=how, seed=4) != first
  assert first != _generate(run)  # sampled, not greedy


def test_top_k_1_and_a_tiny_top_p_are_greedy(run):
  greedy = _generate(run)
  assert _generate(run, how=sampling.Sampling(temperature=1.0, top_k=1), seed=5) == greedy
  assert _generate(run, how=sampling.Sampling(temperature=1.0, top_p=1e-6), seed=5) == greedy


def _numpy_nucleus(logits, top_k, top_p):
  """{token: probability} that top-k then top-p (nucleus) sampling draws, per row, in NumPy."""
  out = []
  for row in logits.astype(np.float64):
    order = np.argsort(-row, kind="stable")
    keep = order[:top_k] if top_k else order
    p = np.exp(row[keep] - row[keep].max())
    p /= p.sum()
    kept = keep[np.cumsum(p) - p < top_p]  # the likelier ones add up to less than top_p
    q = np.exp(row[kept] - row[kept].max())
    out.append(dict(zip(kept.tolist(), q / q.sum())))
  return out


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (5, 0.7), (0, 1.0)])
def test_samples_come_from_the_top_k_and_top_p_sets(top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32) * 2
  how = sampling.Sampling(temperature=1.0, top_k=top_k, top_p=top_p)
  draw = jax.jit(lambda key: sampling.next_tokens(logits, how.arrays(), key))
  seen = [set() for _ in logits]
  for i in range(300):
    for row, token in enumerate(np.asarray(draw(jax.random.key(i)))):
      seen[row].add(int(token))
  for row, nucleus in zip(seen, _numpy_nucleus(logits, top_k, top_p)):
    assert row <= set(nucleus)  # nothing outside the set
    # and every token of probability > 3% in it (missed in 300 draws: p < 1e-4)
    assert {t for t, p in nucleus.items() if p > 0.03} <= row


def test_the_command_prints_each_rows_text_and_tokens_per_s(run, tmp_path):
  options = ["--max_new_tokens", "5", "--temperature", "0"]
  rc, out = main_in_process(cli.main, [run[0], "--prompt", "def f(x):", "--prompt", "é",
                                       *options])
  assert rc == 0, out
  assert "=== 1 ===\ndef f(x):" in out and "=== 2 ===\né" in out
  assert f"step {STEPS} of {run[0]}, forward mxfp4" in out
  assert "tokens/s" in out.strip().splitlines()[-1]
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def f(x):\n\né\n", encoding="utf-8")
  rc, from_file = main_in_process(cli.main, [run[0], "--prompt_file", str(prompts), *options])
  assert rc == 0 and from_file.splitlines()[1:-1] == out.splitlines()[1:-1], from_file


def test_the_byte_tokenizers_invalid_utf8_is_shown_escaped(run):
  tokenizer = run[1].tokenizer
  assert cli.shown(tokenizer, [0xC3, 0xA9, 0xFF, 0x41, 0xE2, 0x82]) == "é\\xffA\\xe2\\x82"


def test_an_export_gives_the_runs_greedy_text_in_bf16(run, tmp_path):
  out = str(tmp_path / "hf")
  export.export(run[0], out)
  model = trained.locate(out)
  assert isinstance(model.tokenizer, type(run[1].tokenizer)) and model.step is None
  _, params = model.load(hf_llama.abstract_params(model.model_cfg))
  tokens = generate.generate(model.model_cfg, model.recipe("recipe", None), params,
                             _prompts(run[1]), max_new_tokens=10, sampling=GREEDY, seed=0,
                             eos_id=model.tokenizer.eos_id).tokens
  assert tokens == _generate(run, "bf16")


def _refused(argv, *names):
  rc, out = main_in_process(cli.main, argv)
  refused(rc, out, *names)


def test_bad_input_is_one_line_and_exit_2(run, tmp_path):
  run_dir = run[0]
  _refused([run_dir, "--prompt", ""], "prompt 1 is empty")
  _refused([run_dir], "no prompt")
  _refused([run_dir, "--prompt", "x" * 40], "prompt 1 is 41 tokens", "context is 32")
  _refused([run_dir, "--prompt", "x", "--max_new_tokens", "31"], "--max_new_tokens 31",
           "1 to 30")
  _refused([run_dir, "--prompt", "x", "--top_p", "0"], "--top_p 0.0")
  _refused([run_dir, "--prompt", "x", "--top_p", "1.5"], "--top_p 1.5")
  _refused([run_dir, "--prompt", "x", "--temperature", "-1"], "--temperature -1.0")
  _refused([run_dir, "--prompt", "x", "--step", "7"], "no checkpoint at step 7")
  _refused([run_dir, "--prompt", "x", "--quant", "mxfp5"], "--quant 'mxfp5'", "mxfp4")
  _refused([str(tmp_path / "missing"), "--prompt", "x"], "does not exist")
  bare = tmp_path / "bare"
  os.makedirs(bare)
  shutil.copy(os.path.join(run_dir, "config.json"), bare)
  _refused([str(bare), "--prompt", "x"], "has no checkpoint")
  _refused([str(tmp_path), "--prompt", "x"], "is neither an fp4jax run")
  _refused([run_dir, "--prompt", "x", "--top_k", "-1"], "--top_k -1")
  _refused([run_dir, "--prompt", "x", "--num_samples", "0"], "--num_samples 0")
  quantized_attention = str(tmp_path / "qa")
  shutil.copytree(run_dir, quantized_attention)
  edited_config(quantized_attention,
                lambda c: c["resolved"]["model"].update(quantize_attention=True))
  _refused([quantized_attention, "--prompt", "x"], "quantizes attention", "--quant bf16")
  empty_file = tmp_path / "prompts.txt"
  empty_file.write_text("\n  \n")
  _refused([run_dir, "--prompt_file", str(empty_file)], "holds no prompt")
