"""The shapes of the JSON files fp4jax reads back, each checked in one place.

Every kind of record (a run's summary.json, a metrics.jsonl row, a Hugging
Face config.json, ...) is a dataclass below whose annotated fields say what
the file must hold: `check(Kind, value, where)` returns `value` when it fits
and raises RecordError, one line naming the file (`where`) and the first
field that does not ("field 'step' must be an integer, got 'x'"). A field
with a default may be missing; fields a kind does not name are allowed (the
files grow). `read(Kind, path)` also turns a missing, unreadable or
non-JSON file into a RecordError (`read_if_present`: None when missing). Annotations: int, float (ints accepted),
str, bool, dict, list (or tuple), Any, `X | None`, `dict[str, X]` and
`list[X]`. Kinds whose module has a dataclass of that file already (a
study's declaration: fp4jax.experiments.declaration) are checked with it.

`inside(folder, name)` checks a name read from a file before it is used as
a path: it must stay inside `folder`.
"""

import dataclasses
import json
import os
import types
import typing
from typing import Any

from fp4jax import errors


class RecordError(errors.UserError):
  """A file fp4jax reads back does not have the shape it wrote."""


def _fits(value, kind) -> bool:
  if kind is Any:
    return True
  if kind is type(None) or kind is None:
    return value is None
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    return any(_fits(value, a) for a in args)
  if origin is dict:
    return isinstance(value, dict) and all(
        _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
  if origin is list:
    return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
  if kind is tuple:  # a dataclass field that JSON holds as a list
    return isinstance(value, list)
  if kind in (int, float):
    ok = (int,) if kind is int else (int, float)
    return isinstance(value, ok) and not isinstance(value, bool)
  return isinstance(value, kind)


_WORDS = {int: "an integer", float: "a number", str: "a string",
          bool: "true or false", dict: "an object", list: "a list", tuple: "a list",
          type(None): "null"}


def _describe(kind) -> str:
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in args)
  if origin is dict:
    return f"an object of {_describe(args[1])} values"
  if origin is list:
    return f"a list (each item {_describe(args[0])})"
  return _WORDS.get(kind, getattr(kind, "__name__", str(kind)))


def _shown(value) -> str:
  text = json.dumps(value, default=str)
  return text if len(text) <= 60 else text[:57] + "..."


def _what(kind) -> str:
  """The first line of a kind's docstring: what file or block it is."""
  return (kind.__doc__ or kind.__name__).strip().splitlines()[0].rstrip(".")


def check(kind, value, where):
  """`value` when it is a JSON object with the fields of dataclass `kind`;
  RecordError naming `where` and the first field that is not as it should."""
  if not isinstance(value, dict):
    raise RecordError(f"{where}: must hold a JSON object ({_what(kind)}), "
                      f"got {_describe(type(value)) if type(value) in _WORDS else type(value).__name__} "
                      f"{_shown(value)}")
  hints = typing.get_type_hints(kind)
  for field in dataclasses.fields(kind):
    required = (field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING)
    if field.name not in value:
      if required:
        raise RecordError(f"{where}: field {field.name!r} is missing "
                          f"({_what(kind)})")
      continue
    if not _fits(value[field.name], hints[field.name]):
      raise RecordError(f"{where}: field {field.name!r} must be "
                        f"{_describe(hints[field.name])}, got "
                        f"{_shown(value[field.name])}")
  return value


def read(kind, path):
  """The JSON object in `path`, checked against `kind` (RecordError when
  it is missing, unreadable, not JSON or not of that shape)."""
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except FileNotFoundError:
    raise RecordError(f"{path}: missing ({_what(kind)})") from None
  except (OSError, ValueError) as e:
    raise RecordError(f"{path}: cannot be read as JSON ({e})") from None
  return check(kind, value, path)


def read_if_present(kind, path):
  """`read(kind, path)`, or None when there is no file at `path`."""
  return read(kind, path) if os.path.exists(path) else None


def inside(folder, name) -> bool:
  """True when `name` (read from a file) is a path inside `folder`: a
  relative name without "..", whose real path (links followed) stays there."""
  if not isinstance(name, str) or not name or os.path.isabs(name) or (
      ".." in name.replace("\\", "/").split("/")):
    return False
  root = os.path.realpath(folder)
  return os.path.realpath(os.path.join(root, name)).startswith(root + os.sep)


# ---------------------------------------------------------------------------
# A run's files (fp4jax.train.trainer, the ablation runner).


@dataclasses.dataclass(frozen=True)
class Summary:
  """a run's summary.json"""
  status: str
  step: int | None = None
  tokens: int | None = None
  skipped_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class Wall:
  """the ablation's wall.json of a run (fp4jax.experiments.code_version: the
  code and core count that made it, and the environments its attempts ran
  in; missing in runs before they were recorded)"""
  wall_s: float
  code: str | None = None
  commit: str | None = None
  cpus: int | None = None
  environments: list[dict] | None = None


@dataclasses.dataclass(frozen=True)
class MetricsRow:
  """a metrics.jsonl row"""
  step: int
  tokens: int | None = None
  loss: float | None = None
  eval_loss: float | None = None
  skipped_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """a run's config.json as fp4jax's trainer writes it"""
  model: dict
  quant: dict
  resolved: dict


@dataclasses.dataclass(frozen=True)
class RunRecipe:
  """a run's config.json (what names its recipe)"""
  resolved: dict


@dataclasses.dataclass(frozen=True)
class ResolvedRecipe:
  """the "resolved" block of a run's config.json (its recipe)"""
  recipe: dict


@dataclasses.dataclass(frozen=True)
class Resolved:
  """the "resolved" block of a run's config.json"""
  model: dict
  recipe: dict
  tokenizer: dict | None = None
  data: dict | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedData:
  """the "resolved.data" block of a run's config.json (its data files)"""
  paths: dict[str, str]
  validation: dict | None = None


@dataclasses.dataclass(frozen=True)
class LockRecord:
  """a workdir's lock file"""
  pid: int | None = None
  host: str | None = None
  run_id: str | None = None
  started: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointData:
  """a checkpoint's data/metadata (data positions, the run's config)"""
  processes: list[dict]
  config: dict | None = None
  tokens: int | None = None
  adaptive_wgrad: dict | None = None


# ---------------------------------------------------------------------------
# A study's files (fp4jax.experiments).


@dataclasses.dataclass(frozen=True)
class Manifest:
  """a results folder's MANIFEST.json"""
  files: dict[str, str]


@dataclasses.dataclass(frozen=True)
class DeclarationRecord:
  """declaration_record.json (the declaration's hash before the first run)"""
  path: str
  sha256: str
  recorded_utc: str | None = None


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  """a study's ablation_config.json"""
  ablation: dict
  diagnostics: dict | None = None


@dataclasses.dataclass(frozen=True)
class AblationBlock:
  """the "ablation" block of ablation_config.json"""
  recipes: str | None = None
  baseline: str | None = None
  target_loss: float | None = None
  target_at: float | None = None
  diverge_loss: float | None = None
  zoom: float | None = None
  late_from: float | None = None
  declaration: str | None = None


@dataclasses.dataclass(frozen=True)
class DiagnosticsBlock:
  """the "diagnostics" block of ablation_config.json"""
  enabled: bool | None = None
  window: int | None = None


@dataclasses.dataclass(frozen=True)
class HorizonDeclaration:
  """the long-horizon study's declaration file (its growth family)"""
  growth: dict
  validity: list[dict] | None = None


@dataclasses.dataclass(frozen=True)
class Growth:
  """the "growth" block of the long-horizon study's declaration"""
  from_step: int
  to_step: int


@dataclasses.dataclass(frozen=True)
class ValidityRule:
  """a validity rule of the long-horizon study's declaration"""
  arms: list[str]
  tolerance: float
  claim: str
  role: str | None = None


# ---------------------------------------------------------------------------
# Hugging Face files (fp4jax.llama.hf, fp4jax.data.tokenizers).


@dataclasses.dataclass(frozen=True)
class HfConfig:
  """a Hugging Face Llama config.json"""
  model_type: str | None = None
  hidden_size: int | None = None
  intermediate_size: int | None = None
  num_hidden_layers: int | None = None
  num_attention_heads: int | None = None
  num_key_value_heads: int | None = None
  vocab_size: int | None = None
  head_dim: int | None = None
  rms_norm_eps: float | None = None
  rope_theta: float | None = None
  rope_scaling: dict | None = None
  rope_parameters: dict | None = None
  tie_word_embeddings: bool | None = None
  hidden_act: str | None = None
  attention_bias: bool | None = None
  mlp_bias: bool | None = None
  quantization_config: dict | None = None


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
  """config.json's quantization_config (compressed-tensors)"""
  quant_method: str | None = None
  format: str | None = None
  config_groups: dict[str, dict] | None = None
  transform_config: dict | None = None


@dataclasses.dataclass(frozen=True)
class QuantizationGroup:
  """a group of quantization_config's config_groups"""
  weights: dict


@dataclasses.dataclass(frozen=True)
class QuantizationArgs:
  """the weights of a quantization_config group"""
  num_bits: int
  type: str
  group_size: int | None


@dataclasses.dataclass(frozen=True)
class TransformConfig:
  """quantization_config's transform_config"""
  config_groups: dict[str, dict] | None = None


@dataclasses.dataclass(frozen=True)
class TransformScheme:
  """a group of transform_config's config_groups"""
  type: str
  head_dim: int
  randomize: bool | None = None
  apply: list[dict] | None = None


@dataclasses.dataclass(frozen=True)
class TransformApply:
  """an item of a transform scheme's apply list"""
  targets: list[str] | None = None
  location: str | None = None
  inverse: bool | None = None
  ignore: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class ModelOptConfig:
  """a ModelOpt hf_quant_config.json"""
  quantization: dict


@dataclasses.dataclass(frozen=True)
class ModelOptQuantization:
  """the "quantization" block of a ModelOpt hf_quant_config.json"""
  quant_algo: str
  group_size: int | None = None


@dataclasses.dataclass(frozen=True)
class HfIndex:
  """a model.safetensors.index.json"""
  weight_map: dict[str, str]


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """a Hugging Face tokenizer_config.json"""
  bos_token: str | dict | None = None
  eos_token: str | dict | None = None
