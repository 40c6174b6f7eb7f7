"""`config.init_from`: start a run from a Hugging Face Llama or an fp4jax run.

init_from is a directory, one of
  a Hugging Face Llama: config.json and model.safetensors (or shards listed
    in model.safetensors.index.json), e.g. a published Llama 3.1 or the
    output of `python -m fp4jax.convert export`, its linear layers dense or
    packed in FP4 (compressed-tensors or ModelOpt; dequantized to float32,
    fp4jax.llama.hf_packed);
  an fp4jax run directory (its newest checkpoint is read) or one of its
    checkpoints/<step> directories.
Only the parameters are taken; optimizer state, step and data position
start fresh. A workdir that already holds a checkpoint resumes from it
instead. The config's model must have the checkpoint's sizes: `open_source`
checks config.json and the tensor headers at start-up and names the first
field or tensor that differs; a run's checkpoint must hold exactly the
arrays its config.json describes (checkpointing.restore_params: one line
naming the first that differs otherwise). The parameters read are refused
when any holds NaN or Inf (`load`). Loading is sharded: each process reads only the
blocks its devices hold, so an 8B checkpoint lands on an FSDP mesh without a
full host copy per process.
"""

import os

from fp4jax import checkpointing
from fp4jax import records
from fp4jax.train import export
from fp4jax.train import run_layout
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import hf_packed
from fp4jax.train.config import ConfigError


class _RunCheckpoint:
  """The parameters of one checkpoint of an fp4jax run."""

  def __init__(self, path, cfg):
    run_dir, step = run_layout.run_of_checkpoint(path)  # step: None for a run
    _, theirs = export.run_config(run_dir)
    where = run_layout.config_file(run_dir)
    hf_llama.check_model_fields(
        cfg, {k: getattr(theirs, k) for k in hf_llama.MODEL_FIELDS}, where)
    if theirs.scan_layers != cfg.scan_layers:
      raise hf_llama.ConvertError(
          f"{where}: model.scan_layers is {cfg.scan_layers} in this config "
          f"but {theirs.scan_layers} in the checkpoint; set "
          f"--config.model.scan_layers={theirs.scan_layers}")
    self.directory = run_layout.checkpoints(run_dir)
    self.step = export.run_step(run_dir, step)
    self._fall_back = step is None

  def load(self, abstract_params):
    """The parameters of its step (when a run directory was given and that
    newest checkpoint is damaged, of the newest readable one, said)."""
    try:
      return checkpointing.restore_params_newest(
          self.directory, self.step, abstract_params, fall_back=self._fall_back)[1]
    except (checkpointing.CheckpointUnreadable,
            checkpointing.CheckpointMismatch) as e:
      raise ConfigError(f"bad config: config.init_from: {e}") from None


def load(source, abstract_params, path):
  """source.load(abstract_params), refusing parameters that are not finite
  (ConfigError naming the tensors that hold NaN or Inf: a run from them
  would skip every step); a tensor refused while it is read (a packed block
  scale that is NaN, hf_packed) is a ConfigError too."""
  try:
    params = source.load(abstract_params)
  except hf_llama.ConvertError as e:
    raise ConfigError(f"bad config: config.init_from: {e}") from None
  bad = checkpointing.non_finite(params)
  if bad:
    raise ConfigError(f"bad config: config.init_from: {path!r} {bad}; give a "
                      "checkpoint with finite weights")
  return params


def open_source(path, cfg):
  """The checkpoint `path` checked against LlamaConfig `cfg`, or None for "".

  Returns an object whose `load(abstract_params)` gives the parameters as
  jax.Arrays with the shardings of `abstract_params` (ShapeDtypeStructs).
  Raises ConfigError (one line) when the checkpoint does not fit.
  """
  if not path:
    return None
  try:
    if not os.path.isdir(path):
      raise hf_llama.ConvertError(f"{path!r} is not a directory")
    return _RunCheckpoint(path, cfg) if run_layout.is_run_or_checkpoint(
        path) else hf_packed.checkpoint(path, cfg)
  except (hf_llama.ConvertError, records.RecordError) as e:
    raise ConfigError(f"bad config: config.init_from: {e}") from e
