"""Configuration of a training run: every key, its defaults and checks.

`base_config()` is what the files under configs/ start from; `resolve`
turns a config into the model's LlamaConfig and the quantization Recipe;
`check` rejects bad values of the trainer's own keys. Keys:

  steps, seed                 run length; the one seed everything derives from
  quant                       recipes.config_template(): quant.name is a preset,
                              per-role overrides below it
  quant_schedule              ((start, recipe), ...): later switches of the
                              recipe (fp4jax.schedule); () = config.quant
                              throughout
  adaptive_wgrad              fp4jax.train.adaptive.adaptive_config(): per-block
                              switch of Wgrad to fp8/bf16 when its SNR stays
                              below a threshold (enabled, threshold, window,
                              every, to)
  model                       model_template(): name (a MODEL_PRESETS key) and
                              LlamaConfig fields (None = the preset's value;
                              vocab_size None = the tokenizer's; scan_layers
                              None = scanned on GPUs, see scan_by_default)
  data                        fp4jax.data.pipeline.data_config()
  batch_size                  global sequences per step
  micro_batch                 global sequences per gradient-accumulation step
                              (0 = batch_size: no accumulation)
  seq_len, dtype              tokens per sequence; compute dtype (float32 or
                              bfloat16; parameters are float32)
  lr, warmup_steps, min_lr_ratio
                              linear warm-up to lr, cosine to lr * min_lr_ratio
                              (1.0: constant lr after warm-up, whatever steps is)
  weight_decay, b1, b2, eps, clip
                              AdamW and global-norm clipping
  eval_every, eval_batches, eval_batch_size
                              validation (eval_batch_size 0 = micro_batch)
  checkpoint_every, keep_checkpoints, async_checkpointing
  target_eval_loss            None = off; stop when eval_loss <= it
  max_bad_steps               non-finite steps in a row before stopping
  log_every                   metrics.jsonl / progress line interval
  mesh, distributed           fp4jax.sharding.mesh_config(), distributed_config()
  init_from                   "" or the parameters to start from: a Hugging Face
                              Llama directory or an fp4jax run (fp4jax.train.init_from)
  profile                     fp4jax.train.profile.profile_config(): a jax.profiler
                              trace of a few steps (enabled, start_step, steps)
  peak_tflops                 the device's dense bf16 peak for MFU; 0 = the table
                              in fp4jax.train.throughput (no MFU where unknown)
  wandb                       fp4jax.train.wandb_log.wandb_config(): Weights &
                              Biases logging (enabled, project, name)
"""

import dataclasses

import jax
import ml_collections
from ml_collections import config_dict

from fp4jax.train import adaptive
from fp4jax.train import step as train_step
from fp4jax.train import profile
from fp4jax.train import wandb_log
from fp4jax.data import pipeline
from fp4jax import dot
from fp4jax import errors
from fp4jax.llama import model as model_lib
from fp4jax import recipes
from fp4jax import schedule
from fp4jax import sharding

DTYPES = ("float32", "bfloat16")
# Model fields the trainer sets itself (dtype from config.dtype).
_MODEL_FIELDS_SET_BY_TRAINER = ("dtype",)


def model_template(name="tiny", **overrides):
  """ConfigDict: `name` (a MODEL_PRESETS key) and a typed None placeholder
  for every LlamaConfig field (None keeps the preset), so that e.g.
  `--config.model.n_layers=2` works from the command line.

  vocab_size None means the tokenizer's vocabulary size.
  """
  preset = model_lib.MODEL_PRESETS["llama3.1-8b"]
  cfg = ml_collections.ConfigDict({"name": name})
  for field in dataclasses.fields(model_lib.LlamaConfig):
    if field.name in _MODEL_FIELDS_SET_BY_TRAINER:
      continue
    example = preset.get(field.name, field.default)
    cfg[field.name] = config_dict.placeholder(type(example))
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def base_config():
  """Every trainer key with its default (the tiny CPU model, stdlib, bf16)."""
  return ml_collections.ConfigDict(dict(
      steps=1000,
      seed=0,
      quant=recipes.config_template("bf16"),
      quant_schedule=(),       # ((start step or fraction, recipe), ...): fp4jax.schedule
      adaptive_wgrad=adaptive.adaptive_config(),  # per-block Wgrad switch: fp4jax.train.adaptive
      model=model_template("tiny"),
      data=pipeline.data_config(),
      batch_size=8,            # global, sequences per step
      micro_batch=0,           # global sequences per accumulation step; 0 = batch_size
      seq_len=128,
      dtype="float32",         # compute dtype: float32 or bfloat16
      lr=3e-3,
      warmup_steps=100,
      min_lr_ratio=0.1,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      eps=1e-5,
      clip=1.0,
      eval_every=100,
      eval_batches=4,
      eval_batch_size=0,       # global sequences per eval batch; 0 = micro_batch
      checkpoint_every=500,
      keep_checkpoints=3,
      async_checkpointing=True,
      target_eval_loss=config_dict.placeholder(float),  # None = off
      max_bad_steps=10,
      log_every=10,
      mesh=sharding.mesh_config(),
      distributed=sharding.distributed_config(),
      init_from="",            # HF Llama dir or fp4jax run; "" = random init
      profile=profile.profile_config(),  # a trace of a few steps: fp4jax.train.profile
      peak_tflops=0.0,         # dense bf16 peak per device for MFU; 0 = fp4jax.train.throughput's table
      wandb=wandb_log.wandb_config(),    # Weights & Biases: fp4jax.train.wandb_log
  ))


class ConfigError(errors.UserError):
  """A config value, name or path that cannot work (raised before training)."""


def resolve(config, tokenizer):
  """(LlamaConfig, Recipe) of `config`; raises ValueError on bad values."""
  if config.dtype not in DTYPES:
    raise ValueError(f"dtype {config.dtype!r} is not one of {DTYPES}")
  overrides = {k: v for k, v in config.model.items()
               if k != "name" and v is not None}
  overrides.setdefault("vocab_size", tokenizer.vocab_size)
  if overrides["vocab_size"] < tokenizer.vocab_size:
    raise ValueError(
        f"model.vocab_size {overrides['vocab_size']} is smaller than the "
        f"tokenizer's vocabulary ({tokenizer.vocab_size})")
  model_cfg = model_lib.model_config(config.model.name, dtype=config.dtype,
                                     **overrides)
  if config.model.get("scan_layers") is None and scan_by_default(config, model_cfg):
    model_cfg = dataclasses.replace(model_cfg, scan_layers=True)
  return model_cfg, resolve_recipe(config.quant, config.dtype)


def scan_by_default(config, model_cfg, platform=None):
  """Whether a config that leaves model.scan_layers unset scans its blocks.

  On GPUs, yes (one block to compile: compiling the 125M step of
  configs/ablation_gpu.py for an H200 takes 1.5x (bf16) to 3.7x (mxfp4-dh16 on
  xla) less CPU time scanned, and XLA assigns it 21-27% more memory;
  docs/performance.md), unless something needs each block's own module path:
  bf16_layers other than the head, or the per-block Wgrad switch
  (adaptive_wgrad). Elsewhere, no. platform: default jax's.
  """
  platform = platform or jax.default_backend()
  return (platform == "gpu" and all(n == "head" for n in model_cfg.bf16_layers)
          and not config.adaptive_wgrad.enabled)


def resolve_recipe(quant, dtype):
  """The Recipe of a quant ConfigDict; compute dtype `dtype` unless it sets one."""
  recipe = recipes.from_config(quant, dtype)
  dot.check(recipe)
  return recipe


def recipe_segments(first, config):
  """schedule.segments of the run `config` (a ConfigDict or its config.json)
  from its first Recipe, each switched-to recipe checked as resolve_recipe's."""
  segs = schedule.segments(first, config.get("quant_schedule"), config["steps"],
                           config["dtype"])
  for seg in segs[1:]:
    dot.check(seg.recipe)
  return segs


def check(config):
  """Start-up checks of the trainer's own keys (ValueError naming the key)."""
  positive = ("steps", "batch_size", "seq_len", "eval_every", "eval_batches",
              "checkpoint_every", "keep_checkpoints", "max_bad_steps",
              "log_every")
  for key in positive:
    if not config[key] >= 1:
      raise ValueError(f"config.{key} must be >= 1, got {config[key]!r}")
  if config.micro_batch < 0 or config.batch_size % train_step.micro_batch(config):
    raise ValueError(f"config.micro_batch {config.micro_batch} must divide "
                     f"batch_size {config.batch_size} (0 = no accumulation)")
  if not 0 <= config.min_lr_ratio <= 1 or not config.lr > 0:
    raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got lr="
                     f"{config.lr}, min_lr_ratio={config.min_lr_ratio}")
  if config.warmup_steps < 0:
    raise ValueError(f"config.warmup_steps must be >= 0, got "
                     f"{config.warmup_steps}")
  if config.peak_tflops < 0:
    raise ValueError(f"config.peak_tflops must be >= 0 (0 = the device "
                     f"table's), got {config.peak_tflops}")
  profile.check(config.profile)
  wandb_log.check(config.wandb)
