"""Tokens per second of the jitted train step, per recipe, interleaved in one run.

  python -m fp4jax.bench train_step [--config configs/ablation_tiny.py]
      [--recipes mxfp4-dh16,...] [--steps 20] [--rounds 3]

The train step of the config (model, batch, sequence length, micro-batches,
mesh) is built as the trainer builds it (fp4jax.train.step.make_programs),
once per recipe, compiled, and run on random tokens: `--rounds` rounds, each running `--steps`
steps of every recipe in turn, so that a load change on a shared machine hits
all recipes alike. Two bf16 baselines always run first: "bf16" (plain_route
"lax": lax.dot_general, what an unquantized model runs) and "bf16
float32_output" (plain_route "float32_output": its GEMMs take the quantized
GEMMs' float32-output route; fp4jax.dot, "Plain GEMMs"). Printed per recipe:
the median tokens/s over rounds, its spread (min-max), and the ratio of its
step time to each baseline's (median and spread of the per-round ratios).
"NAME+qres" runs NAME with residuals="quantized".
"""

import argparse
import datetime
import os
import time

import jax
import numpy as np

from fp4jax import sharding
from fp4jax.data import tokenizers
from fp4jax.train import config as train_config
from fp4jax.train import step as train_step
from fp4jax.bench import machine
from fp4jax.bench.memory import named_recipe
from fp4jax.train.cli import load_config_file

DEFAULT_CONFIG = "configs/ablation_tiny.py"
# Row label -> (preset, plain_route) of the two baselines.
BASELINES = {"bf16": ("bf16", "lax"), "bf16 float32_output": ("bf16", "float32_output")}


def build(config, recipe_name, plain_route="lax"):
  """(jitted step, state, tokens) of `config` with the recipe `recipe_name`."""
  config = config.copy_and_resolve_references()
  r = named_recipe(recipe_name)
  config.quant.name, config.quant.residuals = recipe_name.removesuffix("+qres"), r.residuals
  config.quant.plain_route = plain_route
  tokenizer = tokenizers.make_tokenizer(config.data.tokenizer)
  model_cfg, recipe = train_config.resolve(config, tokenizer)
  mesh = sharding.make_mesh(config.mesh)
  programs = train_step.make_programs(config, model_cfg, recipe, mesh)
  state = programs.init(programs.params_key)
  rows = np.random.default_rng(0).integers(
      0, model_cfg.vocab_size, (config.batch_size, config.seq_len + 1), np.int32)
  return programs.step, state, sharding.global_batch(rows, mesh)


def _run(step, state, tokens, n):
  start = time.perf_counter()
  for _ in range(n):
    state, metrics = step(state, tokens)
  jax.block_until_ready(metrics)
  return state, time.perf_counter() - start


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench train_step",
                              description=__doc__.splitlines()[0])
  p.add_argument("--config", default=DEFAULT_CONFIG)
  p.add_argument("--recipes", default="mxfp4-dh16",
                 help="comma-separated presets to compare with bf16 (NAME+qres allowed)")
  p.add_argument("--steps", type=int, default=20, help="steps per recipe per round")
  p.add_argument("--rounds", type=int, default=3)
  return p


def main(argv):
  parser_ = parser()
  args = parser_.parse_args(argv)
  if not os.path.isfile(args.config):
    parser_.exit(2, f"--config {args.config!r} is not a file\n")
  if args.steps < 1 or args.rounds < 1:
    parser_.exit(2, f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}\n")
  recipes = {n: (n, "lax") for n in args.recipes.split(",") if n and n != "bf16"}
  try:
    for n in recipes:
      named_recipe(n)
  except ValueError as e:
    parser_.exit(2, f"--recipes: {e}\n")
  config = load_config_file(args.config)
  tokens_per_step = config.batch_size * config.seq_len
  arms = {**BASELINES, **recipes}
  names = list(arms)
  runs = {}
  for n in names:
    step, state, tokens = build(config, *arms[n])
    state, _ = _run(step, state, tokens, 2)  # compile and warm up
    runs[n] = [step, state, tokens]
  times = {n: [] for n in names}
  for _ in range(args.rounds):
    for n in names:
      step, state, tokens = runs[n]
      runs[n][1], seconds = _run(step, state, tokens, args.steps)
      times[n].append(seconds)
  load = os.getloadavg()
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax "
        f"{jax.__version__}, {machine.describe()}, load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.config}: {tokens_per_step} tokens "
        f"a step, {args.rounds} rounds x {args.steps} steps")
  print("| recipe | tokens/s (median, min-max) | "
        + " | ".join(f"step time / {b} (median, min-max)" for b in BASELINES) + " |")
  print("|---|---|" + "---|" * len(BASELINES))
  for n in names:
    t = np.asarray(times[n])
    tps = tokens_per_step * args.steps / t
    ratios = [t / np.asarray(times[b]) for b in BASELINES]
    print(f"| {n} | {np.median(tps):,.0f} ({tps.min():,.0f}-{tps.max():,.0f}) | "
          + " | ".join(f"{np.median(r):.3f} ({r.min():.3f}-{r.max():.3f})" for r in ratios)
          + " |")
