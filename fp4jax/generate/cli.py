"""The command line of fp4jax.generate: text from a trained model.

  python -m fp4jax.generate RUN [--step N] (--prompt TEXT ... | --prompt_file PATH)
      [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S]
      [--num_samples N] [--quant recipe|bf16|PRESET]

RUN: a run directory (its newest checkpoint), RUN/checkpoints/<step> or
--step, or an export (fp4jax.trained). Each prompt (several --prompt, or a
file of one prompt per line) is encoded with the run's tokenizer after BOS;
--num_samples rows per prompt run as one batch. The text of each row (prompt
and continuation; the byte tokenizer's invalid UTF-8 shown as \\xNN) goes to
stdout, what ran and the tokens/s to stderr. --quant recipe (the default)
runs the forward in the recipe that trained the checkpoint, bf16 without
quantization. Bad input: one line, exit status 2.
"""

import argparse
import dataclasses
import sys

from fp4jax import errors
from fp4jax import generate as generate_lib
from fp4jax import trained as trained_lib
from fp4jax.data import tokenizers
from fp4jax.generate import sampling as sampling_lib
from fp4jax.llama import hf as hf_llama

PROG = "python -m fp4jax.generate"
DEFAULT_NEW_TOKENS = 128


def _parser():
  parser = argparse.ArgumentParser(prog=PROG, description=(
      "Text from a trained fp4jax model (a run, one of its checkpoints, or an export)."))
  trained_lib.add_arguments(parser)
  parser.add_argument("--prompt", action="append", default=[],
                      help="a prompt (repeat for a batch)")
  parser.add_argument("--prompt_file", default=None,
                      help="a UTF-8 file of prompts, one per line (blank lines skipped)")
  parser.add_argument("--max_new_tokens", type=int, default=None,
                      help=f"new tokens per row at most (default {DEFAULT_NEW_TOKENS}, or "
                      "what the model's context leaves)")
  parser.add_argument("--temperature", type=float, default=0.8,
                      help="0 = greedy (default 0.8)")
  parser.add_argument("--top_k", type=int, default=0, help="0 = every token (default)")
  parser.add_argument("--top_p", type=float, default=1.0, help="1 = every token (default)")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
  parser.add_argument("--num_samples", type=int, default=1, help="rows per prompt")
  return parser


def _prompts(args):
  """The prompts' texts; UserError for none, an empty one or an unreadable file."""
  texts = list(args.prompt)
  if args.prompt_file is not None:
    try:
      with open(args.prompt_file, encoding="utf-8") as f:
        lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as e:
      raise errors.UserError(f"--prompt_file {args.prompt_file!r} cannot be read: {e}") from None
    if not any(line.strip() for line in lines):
      raise errors.UserError(f"--prompt_file {args.prompt_file!r} holds no prompt; give one "
                             "prompt per line")
    texts += [line for line in lines if line.strip()]
  if not texts:
    raise errors.UserError("no prompt; give --prompt TEXT (repeat it for a batch) or "
                           "--prompt_file PATH")
  for i, text in enumerate(texts):
    if not text:
      raise errors.UserError(f"prompt {i + 1} is empty; give some text to continue")
  return texts


def _encode(texts, tokenizer, context, max_new_tokens):
  """(BOS + ids of each text, new tokens per row): UserError when a prompt
  leaves no room in the model's `context` or max_new_tokens does not fit."""
  prompts = [[tokenizer.bos_id] + tokenizer.encode(t).tolist() for t in texts]
  longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
  room = context - len(prompts[longest])
  if room < 1:
    raise errors.UserError(
        f"prompt {longest + 1} is {len(prompts[longest])} tokens with BOS; the model's "
        f"context is {context} tokens, so a prompt may have at most {context - 1}")
  if max_new_tokens is None:
    return prompts, min(DEFAULT_NEW_TOKENS, room)
  if not 1 <= max_new_tokens <= room:
    raise errors.UserError(
        f"--max_new_tokens {max_new_tokens}; allowed: 1 to {room} (the model's context "
        f"of {context} tokens less the longest prompt's {len(prompts[longest])})")
  return prompts, max_new_tokens


def shown(tokenizer, ids):
  """The text of `ids`; the byte tokenizer's bytes that are not UTF-8 as \\xNN."""
  if isinstance(tokenizer, tokenizers.ByteTokenizer):
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "backslashreplace")
  return tokenizer.decode(ids)


def main(argv=None):
  args = _parser().parse_args(argv)
  try:
    return _main(args)
  except errors.UserError as e:
    return errors.report(PROG, e)


def _main(args):
  sampling = sampling_lib.Sampling(args.temperature, args.top_k, args.top_p)
  if args.num_samples < 1:
    raise errors.UserError(f"--num_samples {args.num_samples}; allowed: >= 1")
  texts = _prompts(args)
  model = trained_lib.locate(args.run, args.step)
  prompts, max_new = _encode(texts, model.tokenizer, model.context, args.max_new_tokens)
  step, params = model.load(hf_llama.abstract_params(model.model_cfg))
  recipe = model.recipe(args.quant, step)
  cfg = dataclasses.replace(model.model_cfg, remat="none")  # remat: the same forward
  if cfg.quantize_attention:
    if recipe.name != trained_lib.PLAIN:
      raise errors.UserError(
          f"{model.describe(step)} quantizes attention (QK^T, PV) along the key axis, which "
          "cached decoding cannot reproduce; use --quant bf16")
    cfg = dataclasses.replace(cfg, quantize_attention=False)  # bf16: the same plain dots
  rows = [p for p in prompts for _ in range(args.num_samples)]
  how = ("greedy" if sampling.temperature == 0 else
         f"temperature {sampling.temperature}, top_k {sampling.top_k or 'all'}, "
         f"top_p {sampling.top_p}, seed {args.seed}")
  print(f"{PROG}: {model.describe(step)}, forward {recipe.name}, {len(rows)} row(s), "
        f"{max_new} new tokens at most, {how}", file=sys.stderr, flush=True)
  out = generate_lib.generate(
      cfg, recipe, params, rows, max_new_tokens=max_new, sampling=sampling, seed=args.seed,
      eos_id=model.tokenizer.eos_id,
      run_seed=int(model.config.get("seed", 0)) if model.config else 0)
  _reconfigure_stdout()
  for i, (prompt, new) in enumerate(zip(rows, out.tokens)):
    print(f"=== {i + 1} ===")
    print(shown(model.tokenizer, prompt[1:] + new), flush=True)
  print(f"{PROG}: {sum(map(len, out.tokens))} new tokens; decode {out.decode_tokens} "
        f"tokens in {out.decode_s:.2f} s = {_rate(out.decode_tokens, out.decode_s)} "
        f"tokens/s, prefill {out.prefill_tokens} tokens in {out.prefill_s:.2f} s = "
        f"{_rate(out.prefill_tokens, out.prefill_s)} tokens/s (after {out.compile_s:.1f} s "
        "of compilation)", file=sys.stderr, flush=True)
  return 0


def _rate(tokens, seconds):
  return f"{tokens / seconds:,.0f}" if seconds > 0 else "-"


def _reconfigure_stdout():
  """Characters the terminal's encoding lacks are printed escaped, not an error."""
  if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(errors="backslashreplace")

