"""Precision that changes during a run: `config.quant_schedule`.

config.quant is the recipe from step 0; config.quant_schedule lists later
switches as (start, recipe) pairs, e.g. NVIDIA's NVFP4 pretraining (arXiv
2509.25149), which moved the forward pass to BF16 for the last ~18% of
training:

  config.quant.name = "nvfp4"
  config.quant_schedule = ((0.82, nvfp4_with_bf16_fprop),)

start: an int step (the switch happens before step `start` + 1 of
metrics.jsonl, i.e. when state.step == start) or a float fraction of
config.steps in (0, 1), rounded to the nearest step. recipe: a preset name or
a recipes.config_template() ConfigDict (or plain dict of its fields) with
overrides, e.g. {"name": "mxfp4-dh16", "fprop": {"lhs": {"fmt": "none"},
"rhs": {"fmt": "none"}, "hadamard": {"block": 0}}} (a BF16 forward). Starts must increase and lie in (0, steps).

The trainer compiles one step (and eval) per recipe and picks the recipe of a
step from the step number alone, so a run resumed from any checkpoint, before
or after a switch, takes the same steps as an uninterrupted one. The first
metrics.jsonl row of each new recipe carries `recipe` (its name).
"""

import dataclasses

import ml_collections

from fp4jax import recipes


@dataclasses.dataclass(frozen=True)
class Segment:
  """Steps [start, next segment's start) run on `recipe`."""
  start: int
  recipe: recipes.Recipe


def _quant_config(entry_recipe, where):
  if isinstance(entry_recipe, str):
    cfg = recipes.config_template(entry_recipe)
  elif isinstance(entry_recipe, (dict, ml_collections.ConfigDict)):
    cfg = recipes.config_template()
    fields = dict(entry_recipe)
    if "name" not in fields:
      raise ValueError(f"{where}: a recipe given as a dict needs 'name' (a preset), got "
                       f"{sorted(fields)}")
    _merge(cfg, fields, where)
  else:
    raise ValueError(f"{where}: recipe must be a preset name or a dict of "
                     f"recipes.config_template() fields, got {entry_recipe!r}")
  return cfg


def _merge(cfg, fields, where):
  """Sets the (nested) fields on the config_template `cfg`; unknown keys raise."""
  for key, value in dict(fields).items():
    if key not in cfg:
      raise ValueError(f"{where}: {key!r} is not a recipe field; valid: {', '.join(cfg)}")
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      _merge(cfg[key], value, where)
    else:
      cfg[key] = value


def _start_step(start, steps, where):
  if isinstance(start, bool) or not isinstance(start, (int, float)):
    raise ValueError(f"{where}: start must be a step (int) or a fraction of steps (float), "
                     f"got {start!r}")
  if isinstance(start, float):
    if not 0.0 < start < 1.0:
      raise ValueError(f"{where}: a fractional start must be in (0, 1), got {start}")
    start = round(start * steps)
  if not 0 < start < steps:
    raise ValueError(f"{where}: start step {start} must be in (0, steps={steps})")
  return int(start)


def segments(first: recipes.Recipe, schedule, steps: int,
             compute_dtype=None) -> list[Segment]:
  """[Segment(0, first), Segment(start_1, recipe_1), ...] of a schedule.

  schedule: config.quant_schedule (a sequence of (start, recipe) pairs).
  compute_dtype: the compute dtype of a switched-to recipe that sets none (the
  run's config.dtype). ValueError on a bad entry, naming it.
  """
  out = [Segment(0, first)]
  for i, entry in enumerate(schedule or ()):
    where = f"config.quant_schedule[{i}]"
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      raise ValueError(f"{where} must be a (start, recipe) pair, got {entry!r}")
    start = _start_step(entry[0], steps, where)
    if start <= out[-1].start:
      raise ValueError(f"{where}: start step {start} is not after the previous switch at "
                       f"step {out[-1].start}; starts must increase")
    out.append(Segment(start, recipes.from_config(_quant_config(entry[1], where),
                                                  compute_dtype)))
  return out


def segment_index(segs: list[Segment], step: int) -> int:
  """Index of the segment whose recipe runs the step taken at state.step == step."""
  return max(i for i, s in enumerate(segs) if s.start <= step)
