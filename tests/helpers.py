"""Helpers that several test files share: small configs, runs and references.

Test files import them from here (`from tests.helpers import ...`), never from
one another.
"""

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp4jax import backends, checkpointing, errors, recipes
from fp4jax.backends import native
from fp4jax.data import tokenizers
from fp4jax.train import config as train_config
from fp4jax.train import run_layout

# --- data ---------------------------------------------------------------------

TOK = tokenizers.make_tokenizer("bytes")
BOS, EOS = TOK.bos_id, TOK.eos_id


def expected_rows(texts, rows, seq_len, num_windows):
  """Row r: documents r, r + rows, ... (repeating), packed into windows."""
  out = []
  for r in range(rows):
    stream, i = [], r
    while len(stream) < num_windows * (seq_len + 1):
      stream += [BOS] + list(TOK.encode(texts[i % len(texts)])) + [EOS]
      i += rows
    out.append(np.array(stream[:num_windows * (seq_len + 1)]).reshape(
        num_windows, seq_len + 1))
  return np.stack(out, axis=1)  # [windows, rows, seq_len + 1]


# --- numerics -----------------------------------------------------------------

def row_scaled_normal(shape, seed):
  """float32 normal data of `shape` whose rows (axis 0) are scaled by powers
  of two from 2^-20 to 2^19, with about 5% zeros."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0**rng.integers(-20, 20, shape[:1] + (1,) *
                                                    (len(shape) - 1))
  x[rng.random(shape) < 0.05] = 0.0
  return x.astype(np.float32)


# --- the model ----------------------------------------------------------------

def reference_llama3_freqs(head_dim, theta, factor, low, high, context):
  """Meta's reference apply_scaling, as a direct loop."""
  out = []
  for i in range(0, head_dim, 2):
    freq = 1.0 / theta ** (i / head_dim)
    wavelen = 2 * np.pi / freq
    if wavelen < context / high:
      out.append(freq)
    elif wavelen > context / low:
      out.append(freq / factor)
    else:
      s = (context / wavelen - low) / (high - low)
      out.append((1 - s) * freq / factor + s * freq)
  return np.array(out)


def numpy_llama(p, toks, cfg):
  """Llama 3.1 forward written directly in NumPy (float64), from the paper's equations.

  cfg: any object with the LlamaConfig size, rope and norm_eps attributes.
  """
  p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), p)
  rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w
  freq = reference_llama3_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_factor,
                                 cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                 cfg.rope_original_context)
  rot = np.exp(1j * np.arange(toks.shape[1])[:, None] * freq)[None, :, None, :]

  def rope(x):
    half = x.shape[-1] // 2
    z = (x[..., :half] + 1j * x[..., half:]) * rot
    return np.concatenate([z.real, z.imag], -1)

  x = p["embed"]["embedding"][np.asarray(toks)]
  length, group = toks.shape[1], cfg.n_heads // cfg.n_kv_heads
  for i in range(cfg.n_layers):
    blk = p[f"block_{i}"]
    h = rms(x, blk["attn_norm"]["scale"])
    q = rope(np.einsum("bld,dhk->blhk", h, blk["attn"]["q"]["kernel"]))
    k = rope(np.einsum("bld,dhk->blhk", h, blk["attn"]["k"]["kernel"]))
    v = np.einsum("bld,dhk->blhk", h, blk["attn"]["v"]["kernel"])
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # Meta's repeat_kv
    s = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(cfg.head_dim)
    s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("blhk,hkd->bld", np.einsum("bhls,bshk->blhk", a, v),
                      blk["attn"]["o"]["kernel"])
    h = rms(x, blk["mlp_norm"]["scale"])
    g, u = h @ blk["mlp"]["gate"]["kernel"], h @ blk["mlp"]["up"]["kernel"]
    x = x + (g / (1 + np.exp(-g)) * u) @ blk["mlp"]["down"]["kernel"]
  return rms(x, p["final_norm"]["scale"]) @ p["head"]["kernel"]


# --- training runs ------------------------------------------------------------

def tiny_config(**overrides):
  """A one-layer model, 8 x 32 tokens per step, eval every 4 steps."""
  config = train_config.base_config()
  config.model = train_config.model_template(
      "tiny", dim=64, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=64)
  config.quant.name = "bf16"
  config.update(dict(
      steps=8, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2,
      eval_every=4, eval_batches=1, eval_batch_size=8, checkpoint_every=4,
      keep_checkpoints=5, log_every=1))
  for key, value in overrides.items():
    if key.startswith("quant."):
      config.quant[key[len("quant."):]] = value
    else:
      config[key] = value
  return config


def final_state(workdir):
  """The newest checkpoint's state of a finished run, as numpy arrays."""
  ckpts = checkpointing.Checkpoints(run_layout.checkpoints(workdir), keep=100,
                                    async_save=False,
                                    set_aside_to=run_layout.corrupt_checkpoints(workdir))
  step = ckpts.steps()[-1]
  ckpts.close()
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  return step, ocp.StandardCheckpointer().restore(path)


# --- exports and what reads them back -----------------------------------------
# A tiny run to export (tests/test_export_fp4.py, tests/test_tampered_exports.py),
# its files edited on disk, and how a refusal must look: one line, exit status 2.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT_STEPS = 2
# train.py for one step from --config.init_from, with the model of export_config.
INIT_FROM = ["train.py", "--config=configs/default.py", "--config.quant=bf16",
             "--config.model.dim=64", "--config.model.n_layers=2",
             "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
             "--config.model.mlp_dim=64", "--config.steps=1",
             "--config.seq_len=32", "--config.eval_batches=1",
             "--config.async_checkpointing=False"]


def export_config(**overrides):
  """The config of the run to export: 2 layers, block 0 kept in bf16, bfloat16
  compute, EXPORT_STEPS steps."""
  config = tiny_config(**{"steps": EXPORT_STEPS, "eval_every": EXPORT_STEPS,
                          "checkpoint_every": EXPORT_STEPS, "dtype": "bfloat16",
                          "async_checkpointing": False, **overrides})
  config.model.n_layers = 2
  config.model.bf16_layers = ("block_0",)
  return config


def train_export_run(run_dir):
  """Trains export_config() into run_dir, on one device."""
  from fp4jax.train import trainer  # pylint: disable=import-outside-toplevel
  from sharded_runs import on_first_devices  # pylint: disable=import-outside-toplevel
  with on_first_devices(1):
    trainer.train(export_config(), run_dir)


def run_with_recipe(trained, run_dir, name):
  """A copy of run `trained` at run_dir whose config.json records recipe `name`
  (bfloat16 compute), as its trainer writes it."""
  import fp4jax  # pylint: disable=import-outside-toplevel
  shutil.copytree(trained, run_dir)
  path = os.path.join(run_dir, "config.json")
  with open(path) as f:
    config = json.load(f)
  recipe = dataclasses.replace(fp4jax.recipe(name), compute_dtype="bfloat16")
  config["resolved"]["recipe"] = recipe.to_config().to_dict()
  with open(path, "w") as f:
    json.dump(config, f)
  return run_dir


def export_run(run_dir):
  """(LlamaConfig, recipe of the last step, params) of a run trained by
  train_export_run (its checkpoint at EXPORT_STEPS)."""
  from fp4jax.llama import hf as hf_llama  # pylint: disable=import-outside-toplevel
  from fp4jax.train import export, export_fp4  # pylint: disable=import-outside-toplevel
  config, cfg = export.run_config(run_dir)
  params = checkpointing.restore_params(os.path.join(run_dir, "checkpoints"),
                                        EXPORT_STEPS, hf_llama.abstract_params(cfg))
  return cfg, export_fp4.run_recipe(config, EXPORT_STEPS), params


@functools.lru_cache(maxsize=None)
def forward_weight_operands(run_dir):
  """{hf module name: the Fprop weight operand of block 1's layers, [out, in]}
  of an export_run

  as (values float32, per-tensor factor or None): values * factor is what
  the trained forward multiplies, dequantized in float32. The model itself
  gives it: its DotGeneral modules sow the kernel they receive, and
  fp4jax.dot's own operand preparation (flatten, rotate, quantize; the xla
  backend) gives what Fprop multiplies. Computed once per run (not to be
  modified).
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from fp4jax import dot  # pylint: disable=import-outside-toplevel
  from fp4jax.llama import linears  # pylint: disable=import-outside-toplevel
  from fp4jax.llama import model as model_lib  # pylint: disable=import-outside-toplevel
  cfg, recipe, params = export_run(run_dir)
  llama = model_lib.Llama(dataclasses.replace(cfg, capture_dots=True), recipe)

  @jax.jit  # one program: op by op, the forward compiles hundreds
  def operands(params):
    _, sown = llama.apply({"params": params}, jnp.zeros((1, 8), jnp.int32),
                          mutable=["intermediates", "perturbations"],
                          rngs={"quant": jax.random.key(0)})
    out = {}
    for layer in linears.BLOCK:
      node = sown["intermediates"]["block_1"]
      for key in layer.path.split("/"):
        node = node[key]
      rhs = node["DotGeneral_0"]["rhs"][0]
      op, _, _ = dot._quantized(  # pylint: disable=protected-access
          backends.module("xla"), rhs, tuple(range(layer.n_in)), False,
          recipe.fprop.rhs, recipe.fprop.hadamard, None, None,
          jnp.dtype(recipe.compute_dtype))
      out[f"model.layers.1.{layer.hf_name[:-len('.weight')]}"] = (op.values,
                                                                  op.factor)
    return out

  out = {}
  for module, (values, factor) in operands(params).items():
    values = np.asarray(values, np.float32)
    factor = None if factor is None else np.float32(factor)
    out[module] = values.reshape(values.shape[0], -1).T, factor
  return out


def cli(*args):
  """(exit status, stdout + stderr) of `python ARGS` in the repository."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  return result.returncode, result.stdout + result.stderr


def refused(rc, out, *names):
  """Exit status 2 and one line naming each of `names`, no traceback and
  no NumPy warning."""
  assert rc == 2, out[-3000:]
  assert "Traceback" not in out and "RuntimeWarning" not in out, out[-3000:]
  line = out.strip().splitlines()[-1]
  for name in names:
    assert name in line, (name, out[-3000:])


def main_in_process(main, argv):
  """(exit status, stdout + stderr) of a CLI's main(argv) run in this process,
  as `python -m` would give them: a SystemExit's code, else main's return."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
      rc = main(argv)
    except SystemExit as e:
      rc = e.code
  return rc or 0, out.getvalue()


def exit_2_line(capsys, main, argv):
  """The last line a CLI's main(argv) writes to stderr (argparse prints its
  usage first) when it exits with status 2 and no traceback."""
  with pytest.raises(SystemExit) as done:
    main(list(argv))
  err = capsys.readouterr().err
  assert done.value.code == 2, err
  assert "Traceback" not in err
  return err.strip().splitlines()[-1]


def refused_in_process(call, *names):
  """call() raises a UserError of one line naming each of `names` (what the
  CLIs print before exiting with status 2), and warns no RuntimeWarning;
  returns the line."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pytest.raises(errors.UserError) as refusal:
      call()
  assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [
      str(w.message) for w in caught]
  line = str(refusal.value)
  assert "\n" not in line, line
  for name in names:
    assert name in line, (name, line)
  return line


def init_from_refused(tmp_path, bad, *names, process=False):
  """A one-step run from config.init_from=`bad` (the model of export_config)
  is refused naming config.init_from and `names`; process: as train.py."""
  if process:
    rc, log = cli(*INIT_FROM, f"--workdir={tmp_path / 'run'}",
                  f"--config.init_from={bad}")
    refused(rc, log, "config.init_from", *names)
    return
  from fp4jax.train import trainer  # pylint: disable=import-outside-toplevel
  from sharded_runs import on_first_devices  # pylint: disable=import-outside-toplevel
  with on_first_devices(1):
    refused_in_process(lambda: trainer.train(
        export_config(steps=1, init_from=bad), str(tmp_path / "run")),
                       "config.init_from", *names)


def poke(path, name, raw, index=0):
  """Writes bytes `raw` over element `index` of tensor `name` of the
  safetensors file `path`, in place."""
  with open(path, "r+b") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    entry = json.loads(f.read(size))[name]
    itemsize = {"F32": 4, "U8": 1, "F8_E4M3": 1, "BF16": 2}[entry["dtype"]]
    f.seek(8 + size + entry["data_offsets"][0] + index * itemsize)
    f.write(raw)


def edited_config(directory, edit, name="config.json"):
  """Applies edit(dict) to the JSON file `name` (config.json) of `directory`."""
  path = os.path.join(directory, name)
  with open(path) as f:
    config = json.load(f)
  edit(config)
  with open(path, "w") as f:
    json.dump(config, f)


# --- the native backend -------------------------------------------------------

NEW_JAX = backends.jax_version() >= backends.MIN_JAX["native"]
needs_new_jax = pytest.mark.skipif(
    not NEW_JAX, reason=f"backend native needs jax >= 0.11 (jax.nn.scaled_matmul's CPU "
    f"lowering); installed jax {jax.__version__}")


def native_recipe(name, route="auto"):
  """Preset `name` on the native backend, its GEMMs forced to `route`."""
  return dataclasses.replace(recipes.recipe(name), backend="native", native_route=route)


def native_gemms(name):
  """How many of the preset's three GEMMs the native backend runs itself."""
  r = recipes.recipe(name)
  return sum(native.unsupported(getattr(r, role)) is None for role in recipes.ROLES)


NATIVE_PRESETS = [n for n in recipes.recipe_names() if native_gemms(n)]


def _log_binomial_pmf(n, p):
  """log P(K = k) for k = 0..n of Binomial(n, p), p an array [V] in [0, 1]: [V, n + 1]."""
  k = np.arange(n + 1)
  log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
  log_choose = log_fact[n] - log_fact[k] - log_fact[n - k]
  with np.errstate(divide="ignore", invalid="ignore"):
    lp, lq = np.log(p)[:, None], np.log1p(-p)[:, None]
    out = log_choose + np.where(k > 0, k * lp, 0.0) + np.where(k < n, (n - k) * lq, 0.0)
  return out


def binomial_two_sided_p(count, n, p):
  """Exact two-sided p-values of counts [V] under Binomial(n, p [V]): the
  probability of an outcome no likelier than the one seen."""
  logpmf = _log_binomial_pmf(n, np.asarray(p, np.float64))
  seen = np.take_along_axis(logpmf, np.asarray(count)[:, None], 1)
  pmf = np.exp(logpmf)
  return np.minimum(1.0, np.sum(np.where(logpmf <= seen + 1e-9, pmf, 0.0), axis=1))


# --- what the partitioner did -------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
_COLLECTIVE_OP = re.compile(
    r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(hlo_text: str) -> dict[str, int]:
  """Collective ops in compiled HLO text, e.g. of
  `jax.jit(step).lower(*args).compile().as_text()`.

  Counts instructions in the program text (an async start/done pair once);
  one inside a loop body runs once per iteration.
  """
  counts = dict.fromkeys(COLLECTIVES, 0)
  for match in _COLLECTIVE_OP.finditer(hlo_text):
    counts[match.group(1)] += 1
  return counts


def jaxpr_equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it (jit, custom_vjp, cond)."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from jaxpr_equations(inner)


def fake_run(workdir, name, losses, status="completed", tokens_per_eval=100):
  """A finished run's records for the report: WORKDIR/NAME/metrics.jsonl with one
  eval row per loss (step i at i * tokens_per_eval tokens) and summary.json."""
  path = os.path.join(workdir, name)
  os.makedirs(path)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, loss in enumerate(losses):
      f.write(json.dumps({"step": i, "tokens": i * tokens_per_eval, "eval_loss": loss}) + "\n")
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump({"status": status}, f)
