"""A trained model to run: a run's checkpoint or an export, and what it needs.

`locate(path, step=None)` says what `path` is, without reading weights:
  RUN                  an fp4jax run directory (its newest checkpoint, or `step`)
  RUN/checkpoints/N    one checkpoint of a run
  EXPORT               a folder `python -m fp4jax.convert export` wrote (a
                       Hugging Face Llama, dense or packed in FP4)
and returns a `Trained`: its LlamaConfig, tokenizer, context and the recipe
its forward trained in; `Trained.load(abstract_params)` reads the parameters.
An export records no recipe and no data: its forward is "bf16" (the
unquantized recipe) unless a preset is named. Bad input raises
errors.UserError, one line (the commands print it and exit with status 2).
Used by fp4jax.generate and fp4jax.evaluate.
"""

import dataclasses
import json
import os

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import recipes
from fp4jax import records
from fp4jax.data import tokenizers
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import hf_packed
from fp4jax.llama import model as model_lib
from fp4jax.train import export
from fp4jax.train import export_fp4
from fp4jax.train import run_layout

# --quant: the run's own recipe, the unquantized one, or a preset's name.
RECIPE, PLAIN = "recipe", "bf16"


def add_arguments(parser):
  """The arguments of a command that runs a Trained: RUN, --step, --quant."""
  parser.add_argument("run", metavar="RUN",
                      help="run directory, RUN/checkpoints/<step>, or an export folder")
  parser.add_argument("--step", type=int, default=None,
                      help="the run's checkpoint (default: the newest)")
  parser.add_argument("--quant", default=RECIPE,
                      help=f"the forward: {RECIPE!r} (the run's, default; an export records "
                      f"none: {PLAIN}), {PLAIN!r} (unquantized) or a preset's name")


@dataclasses.dataclass(frozen=True)
class Trained:
  """One trained model.

  path: as given. run_dir: the run (None for an export). step: the
  checkpoint asked (None: the run's newest; an export has none). config:
  the run's config.json (None for an export). model_cfg: its LlamaConfig.
  tokenizer: the one it trained with. context: the
  longest sequence it saw (the run's seq_len; an export's
  max_position_embeddings).
  """
  path: str
  run_dir: str | None
  step: int | None
  config: dict | None
  model_cfg: model_lib.LlamaConfig
  tokenizer: object
  context: int

  def describe(self, step):
    """'step 200 of RUN' or 'the export EXPORT'."""
    return (f"the export {self.path}" if self.run_dir is None
            else f"step {step} of {self.run_dir}")

  def recipe(self, quant, step):
    """The Recipe of the forward `quant` asks ("recipe": the one that
    trained checkpoint `step`, its quant_schedule included; "bf16": the
    unquantized recipe; or a preset's name), computing in the model's dtype."""
    if quant == RECIPE and self.config is not None:
      return export_fp4.run_recipe(self.config, step)
    name = PLAIN if quant == RECIPE else quant
    if name not in recipes.recipe_names():
      raise errors.UserError(f"--quant {quant!r}; allowed: {RECIPE!r} (the run's), "
                             f"{PLAIN!r} or a preset: {recipes.recipe_names()}"
                             + errors.did_you_mean(name, recipes.recipe_names()))
    return dataclasses.replace(recipes.recipe(name), compute_dtype=self.model_cfg.dtype)

  def load(self, abstract_params):
    """(step, params as jax.Arrays laid out as `abstract_params`): a run's
    checkpoint `step` (its newest readable one when none was asked and the
    newest is damaged, said on stderr), or an export's weights; refused
    (UserError) when a weight is NaN or Inf."""
    if self.run_dir is None:
      step, params = None, hf_packed.checkpoint(self.path, self.model_cfg).load(abstract_params)
    else:
      directory = run_layout.checkpoints(self.run_dir)
      step, params = checkpointing.restore_params_newest(
          directory, export.run_step(self.run_dir, self.step), abstract_params,
          fall_back=self.step is None)
    bad = checkpointing.non_finite(params)
    if bad:
      raise errors.UserError(f"{self.describe(step)} {bad}; give a checkpoint whose "
                             "weights are finite")
    return step, params


def locate(path, step=None):
  """The Trained at `path` (see the module doc); `step` picks a run's checkpoint."""
  if not os.path.exists(path):
    raise errors.UserError(f"RUN {path!r} does not exist; give a run directory, one of "
                           "its checkpoints/<step> or an export")
  run_dir, named_step = run_layout.run_of_checkpoint(path)
  if named_step is not None and step is not None and step != named_step:
    raise errors.UserError(f"--step {step} and the checkpoint {path!r} (step "
                           f"{named_step}) disagree; give one of them")
  step = named_step if named_step is not None else step
  if os.path.isdir(path) and export.is_export(path):
    if step is not None:
      raise errors.UserError(f"--step {step}: {path!r} is an export, which holds one "
                             "set of weights; --step picks a run's checkpoint")
    return _export(path)
  if os.path.isfile(run_layout.config_file(run_dir)):
    return _run(path, run_dir, step)
  raise errors.UserError(
      f"{path!r} is neither an fp4jax run (config.json and checkpoints/), one of its "
      "checkpoints/<step>, nor an export (config.json and model.safetensors)")


def _run(path, run_dir, step):
  config, cfg = export.run_config(run_dir)
  export.run_step(run_dir, step)  # refuses a run without (that) checkpoint
  try:
    name = tokenizers.recorded(config.get("data", {}).get("tokenizer", "bytes"),
                               config["resolved"].get("tokenizer"))
    tokenizer = tokenizers.make_tokenizer(name)
  except (ValueError, OSError, ImportError) as e:
    raise errors.UserError(f"the tokenizer of {run_dir!r}: {e}") from None
  return Trained(path=path, run_dir=run_dir, step=step, config=config,
                 model_cfg=cfg, tokenizer=tokenizer,
                 context=int(config["seq_len"]))


def _export(path):
  config_path = os.path.join(path, hf_llama.CONFIG_FILE)
  hf = records.check(records.HfConfig, hf_llama.read_json(config_path, "config"),
                     config_path)
  fields, _ = hf_llama.llama_fields(hf, config_path)
  dtype = hf.get("torch_dtype") if hf.get("torch_dtype") in model_lib.DTYPES else "bfloat16"
  cfg = model_lib.LlamaConfig(**fields, dtype=dtype)
  return Trained(path=path, run_dir=None, step=None, config=None, model_cfg=cfg,
                 tokenizer=_export_tokenizer(path),
                 context=int(hf.get("max_position_embeddings") or cfg.rope_original_context))


def _export_tokenizer(path):
  """The export's tokenizer: fp4jax's byte tokenizer when its tokenizer.json is
  the one the export writes for it (no package needed), else the file read
  by Hugging Face `tokenizers`."""
  byte_json, _ = export.byte_tokenizer_files(tokenizers.ByteTokenizer(), 0)
  try:
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
      if json.load(f) == byte_json:
        return tokenizers.ByteTokenizer()
    return tokenizers.make_tokenizer(path)
  except (ValueError, OSError, ImportError) as e:
    raise errors.UserError(f"the tokenizer of the export {path!r}: {e}") from None
