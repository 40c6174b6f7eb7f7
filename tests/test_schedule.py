"""config.quant_schedule: segments, switching inside a run, resume across a switch."""

import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

from fp4jax import recipes, schedule
from fp4jax.train import config as train_config
from fp4jax.train import trainer
from fp4jax.train.metrics_log import read_metrics
from tests.helpers import final_state, tiny_config


def test_segments_from_steps_fractions_and_dicts():
  first = recipes.recipe("mxfp4-dh16")
  bf16_fwd = {"name": "mxfp4-dh16",
              "fprop": {"lhs": {"fmt": "none"}, "rhs": {"fmt": "none"}, "hadamard": {"block": 0}}}
  segs = schedule.segments(first, ((0.5, "nvfp4"), (80, bf16_fwd)), 100)
  assert [s.start for s in segs] == [0, 50, 80]
  assert segs[1].recipe == recipes.recipe("nvfp4")
  assert segs[2].recipe.fprop.is_plain and segs[2].recipe.wgrad == first.wgrad
  assert segs[2].recipe.name == "mxfp4-dh16[fprop.hadamard.block=0,fprop.lhs.fmt=none,fprop.rhs.fmt=none]"
  assert [schedule.segment_index(segs, s) for s in (0, 49, 50, 79, 80, 99)] == [0, 0, 1, 1, 2, 2]
  assert schedule.segments(first, (), 100) == [schedule.Segment(0, first)]


def test_a_switched_to_recipe_takes_the_runs_dtype_unless_it_sets_one():
  own = {"name": "fp8", "compute_dtype": "bfloat16"}
  segs = schedule.segments(recipes.recipe("bf16"), ((3, "nvfp4"), (6, own)), 10, "float32")
  assert segs[1].recipe == dataclasses.replace(recipes.recipe("nvfp4"), compute_dtype="float32")
  assert segs[1].recipe.name == "nvfp4"  # the run's dtype is not an override of the recipe
  assert segs[2].recipe.compute_dtype == "bfloat16"


@pytest.mark.parametrize("entries,match", [
    (((0, "bf16"),), r"quant_schedule\[0\]: start step 0 must be in \(0, steps=10\)"),
    (((1.5, "bf16"),), r"fractional start must be in \(0, 1\)"),
    (((5, "bf16"), (3, "fp8")), r"quant_schedule\[1\]: start step 3 is not after"),
    (((5, "nope"),), "unknown recipe 'nope'"),
    (((5,),), r"must be a \(start, recipe\) pair"),
    ((("5", "bf16"),), "start must be a step"),
    (((5, {"fprop": {}}),), "needs 'name'"),
    (((5, {"name": "bf16", "fprob": {}}),), "'fprob' is not a recipe field"),
])
def test_bad_entries_fail_naming_the_entry(entries, match):
  with pytest.raises(ValueError, match=match):
    schedule.segments(recipes.recipe("bf16"), entries, 10)


@pytest.mark.slow
@pytest.mark.usefixtures("one_device")
def test_trainer_switches_and_resumes_across_the_switch_bitwise(tmp_path):
  """mxfp4 for steps 1-3, bf16 from step 4 (fraction 0.5 of 6 steps). The
  scheduled run's steps 1-3 equal an mxfp4-only run's and its later ones
  differ; stopping at step 2 and resuming gives the same bits."""
  cfg = lambda: tiny_config(steps=6, eval_every=3, checkpoint_every=2,
                            quant_schedule=((0.5, "bf16"),), **{"quant.name": "mxfp4"})
  ref = str(tmp_path / "ref")
  trainer.train(cfg(), ref)
  rows = read_metrics(ref)
  assert [r.get("recipe") for r in rows if "loss" in r] == [None, None, None, "bf16", None, None]

  plain = str(tmp_path / "plain")
  trainer.train(tiny_config(steps=6, eval_every=3, checkpoint_every=2,
                            **{"quant.name": "mxfp4"}), plain)
  loss = lambda w: [r["loss"] for r in read_metrics(w) if "loss" in r]
  assert loss(ref)[:3] == loss(plain)[:3] and loss(ref)[3:] != loss(plain)[3:]

  def terminate(step, state, batch):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)

  work = str(tmp_path / "resumed")
  assert trainer.train(cfg(), work, callbacks=[terminate])["status"] == "interrupted"
  summary = trainer.train(cfg(), work)
  assert summary["resumed_from_step"] == 2 and summary["step"] == 6
  assert loss(work) == loss(ref)
  for a, b in zip(jax.tree.leaves(final_state(ref)[1]), jax.tree.leaves(final_state(work)[1])):
    np.testing.assert_array_equal(a, b)


def test_bad_schedule_is_a_config_error(tmp_path):
  with pytest.raises(train_config.ConfigError, match="quant_schedule"):
    trainer.train(tiny_config(quant_schedule=((99, "bf16"),)), str(tmp_path))
