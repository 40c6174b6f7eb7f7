"""Bytes of saved residuals (what the forward keeps for the backward), per token.

  python -m fp4jax.bench memory [--recipes bf16,fp8,...] [--models tiny,llama3.1-8b]

JAX's own accounting: `jax.ad_checkpoint.print_saved_residuals` of the loss
(or of one block, or of one linear layer) on `jax.eval_shape`'d parameters and
inputs, so nothing is allocated, not even at 8B scale. Parameters are
arguments and stay resident; they are not counted. Everything else is split
by tracing at batch 1 and batch 2 (residuals either grow with the batch or do
not): "per token" is the growth divided by the sequence length, "per step"
what does not grow (the compute-dtype casts of the weights, RoPE tables).

Rows per model and recipe (`+qres`: the recipe with residuals="quantized"):
  linear inputs   the seven linear layers of one block, each traced alone:
                  its saved input X (the weight excluded), summed; layers that
                  share an input (q, k, v; gate, up) count it once each
  block           one transformer block (its input x counted)
  model           the whole loss (embedding, blocks, final norm, head)
"""

import argparse
import contextlib
import dataclasses
import datetime
import io
import math
import platform
import re

import flax.linen as nn
import jax
from jax.ad_checkpoint import print_saved_residuals
import jax.numpy as jnp

from fp4jax import dot, recipes
from fp4jax.llama import model as model_lib

RECIPES = ("bf16", "fp8", "mxfp4-dh16", "mxfp4-dh16+qres")
# name -> (model preset, overrides, sequence length): the ablation's tiny model
# (bf16 compute, 64 tokens) and the MLPerf 8B shape (8,192 tokens), both unrematted.
MODELS = {
    "tiny": ("tiny", dict(dtype="bfloat16"), 64),
    "llama3.1-8b": ("llama3.1-8b", dict(dtype="bfloat16", scan_layers=True), 8192),
}
_LINE = re.compile(r"^(\S+?)\[([\d,]*)\]\S* (.*)$")
# dtype as print_saved_residuals writes it ("bf16", "u8", "f8_e8m0fnu") -> bytes
_DTYPES = {jnp.dtype(d).name.replace("float", "f").replace("uint", "u").replace("int", "i"):
           jnp.dtype(d).itemsize for d in (
    jnp.bool_, jnp.int8, jnp.uint8, jnp.int32, jnp.uint32, jnp.float32, jnp.bfloat16,
    jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu, jnp.float4_e2m1fn)}


def named_recipe(name: str) -> recipes.Recipe:
  """A preset; the suffix "+qres" sets residuals="quantized"."""
  base, qres = (name[:-5], True) if name.endswith("+qres") else (name, False)
  r = recipes.recipe(base)
  return dataclasses.replace(r, residuals="quantized") if qres else r


def saved_residuals(fn, *args, **kwargs):
  """[(shape, bytes, source)] of what fn's VJP saves, from print_saved_residuals."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(fn, *args, **kwargs)
  rows = []
  for line in out.getvalue().splitlines():
    match = _LINE.match(line)
    if match is None:
      raise ValueError(f"cannot parse print_saved_residuals line {line!r}")
    dtype, dims, source = match.groups()
    shape = tuple(int(d) for d in dims.split(",") if d)
    itemsize = 8 if dtype.startswith("key<") else _DTYPES[dtype]  # a key: two uint32
    rows.append((shape, math.prod(shape) * itemsize, source))
  return rows


def residual_bytes(fn, *args, skip=()) -> int:
  """Bytes fn saves, without the arguments named in `skip` (e.g. the parameters)."""
  return sum(b for _, b, src in saved_residuals(fn, *args)
             if not any(src.startswith(f"from the argument {name}") for name in skip))


def linear_residual_bytes(recipe, x, w, dims) -> int:
  """Bytes one linear layer y = dot_general(x, w) saves, the weight excluded."""
  dg = dot.dot_general(recipe)
  key, layer_key = jax.random.key(0), jax.random.key(1)

  def loss(x, w):
    return dg(x, w, dims, key=key, layer_key=layer_key).astype(jnp.float32).sum()

  return residual_bytes(loss, x, w, skip=("w",))


def _linears(cfg, batch, length):
  """(x, w, dims) of the seven linear layers of one block, as model.py calls them."""
  dt = jnp.dtype(cfg.dtype)
  sd = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
  b, l, d, h, kv, hd, f = (batch, length, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.mlp_dim)
  last = (((2,), (0,)), ((), ()))
  return [(sd(b, l, d), sd(d, h, hd), last), (sd(b, l, d), sd(d, kv, hd), last),
          (sd(b, l, d), sd(d, kv, hd), last), (sd(b, l, h, hd), sd(h, hd, d),
                                               (((2, 3), (0, 1)), ((), ()))),
          (sd(b, l, d), sd(d, f), last), (sd(b, l, d), sd(d, f), last),
          (sd(b, l, f), sd(f, d), last)]


def _split(measure, length):
  """(bytes per token, bytes per step) from measure(batch) at batch 1 and 2."""
  one, two = measure(1), measure(2)
  return (two - one) / length, 2 * one - two


def _shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def measure(model_name: str, recipe_name: str, seq_len: int | None = None) -> dict:
  """{row: (bytes per token, bytes per step)} for the rows of the module docstring."""
  preset, overrides, length = MODELS[model_name]
  length = seq_len or length
  cfg = model_lib.model_config(preset, **overrides)
  r = named_recipe(recipe_name)
  rngs = lambda: {"params": jax.random.key(0), "quant": jax.random.key(1),
                  "hadamard": jax.random.key(2)}

  def linears(batch):
    return sum(linear_residual_bytes(r, *layer) for layer in _linears(cfg, batch, length))

  block = model_lib.Block(cfg, r)

  def one_block(batch):
    x = jax.ShapeDtypeStruct((batch, length, cfg.dim), jnp.dtype(cfg.dtype))
    params = _shapes(nn.unbox(jax.eval_shape(block.init, rngs(), x))["params"])

    def loss(params, x):
      y, _ = block.apply({"params": params}, x, rngs=rngs())
      return y.astype(jnp.float32).sum()
    return residual_bytes(loss, params, x, skip=("params",))

  llama = model_lib.Llama(cfg, r)

  def whole(batch):
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    params = _shapes(nn.unbox(jax.eval_shape(llama.init, rngs(), tokens))["params"])

    def loss(params, tokens):
      logits = llama.apply({"params": params}, tokens, rngs=rngs())
      return logits.sum()
    return residual_bytes(loss, params, tokens, skip=("params",))

  return {"linear inputs (one block)": _split(linears, length),
          "block": _split(one_block, length), "model": _split(whole, length)}


def _kb(b):
  return f"{b / 1024:,.1f}"


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench memory",
                              description=__doc__.splitlines()[0])
  p.add_argument("--recipes", default=",".join(RECIPES),
                 help="comma-separated presets; NAME+qres for residuals='quantized'")
  p.add_argument("--models", default=",".join(MODELS),
                 help=f"comma-separated, from {list(MODELS)}")
  p.add_argument("--seq-len", type=int, default=None,
                 help="tokens per sequence (default: 64 tiny, 8192 for 8B)")
  return p


def main(argv):
  parser_ = parser()
  args = parser_.parse_args(argv)
  if args.seq_len is not None and args.seq_len < 1:
    parser_.exit(2, f"--seq-len must be >= 1, got {args.seq_len}\n")
  names = [n for n in args.recipes.split(",") if n]
  try:
    for n in names:
      named_recipe(n)  # unknown names fail before any tracing
  except ValueError as e:
    parser_.exit(2, f"--recipes: {e}\n")
  models = [m for m in args.models.split(",") if m]
  for m in models:
    if m not in MODELS:
      parser_.exit(2, f"unknown model {m!r}; valid: {', '.join(MODELS)}\n")
  print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax "
        f"{jax.__version__}, {platform.machine()}; python -m fp4jax.bench memory "
        f"--recipes {','.join(names)} --models {','.join(models)}")
  for m in models:
    length = args.seq_len or MODELS[m][2]
    print(f"\n{m}, {length} tokens per sequence: KiB per token (per step, not growing "
          "with the batch)")
    rows = {n: measure(m, n, args.seq_len) for n in names}
    kinds = list(rows[names[0]])
    print("| recipe | " + " | ".join(kinds) + " | linear inputs / bf16 |")
    print("|---|" + "---|" * (len(kinds) + 1))
    base = rows.get("bf16", rows[names[0]])[kinds[0]][0]
    for n in names:
      cells = [f"{_kb(t)} ({_kb(s)})" for t, s in rows[n].values()]
      print(f"| {n} | " + " | ".join(cells) + f" | {rows[n][kinds[0]][0] / base:.2f} |")
