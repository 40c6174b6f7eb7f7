"""Every file fp4jax reads back, fed wrong-typed variants: one line naming it.

Table-driven: each kind of file is written with variants of the wrong shape
(a list for an object, a string for a number, null for a step, ...), read
by the function of the project that reads it, and must raise a UserError
(the CLIs print it as one line, exit status 2) whose message names the file
and the field; where the project treats such a file as damaged (a results
manifest, a lock, a checkpoint's metadata) it must do so without an error.
"""

import dataclasses
import json
import os

import ml_collections
import pytest

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import records
from fp4jax.data import tokenizers
from fp4jax.experiments import ablation
from fp4jax.experiments import committed
from fp4jax.experiments import declaration
from fp4jax.experiments import horizon
from fp4jax.experiments import report
from fp4jax.experiments import study_config
from fp4jax.llama import hf
from fp4jax.llama import model as model_lib
from fp4jax.train import cli
from fp4jax.train import export
from fp4jax.train import metrics_log
from fp4jax.train import curves
from fp4jax.train import run_layout
from fp4jax.train import workdir as workdir_lib

ROWS = [dict(step=0, tokens=0, eval_loss=5.0), dict(step=2, tokens=20, loss=4.0, eval_loss=4.5)]
DECLARATION = dict(
    study="t", baseline="A0", primary="late_mean", late_from=0.5, smallest_effect_tokens=0.05,
    alpha=0.05, correction="holm", power=0.8,
    claims=[dict(text="C1", contrasts=[dict(label="A1 - A0", weights=dict(A1=1, A0=-1),
                                            direction=">")])],
    growth=dict(from_step=2, to_step=4))
HF_CONFIG = dict(model_type="llama", vocab_size=288, hidden_size=64, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 rms_norm_eps=1e-5, rope_theta=500000.0)
WORD_TOKENIZER = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                  "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
                  "post_processor": None, "decoder": None,
                  "model": {"type": "WordLevel", "vocab": {"<s>": 0, "</s>": 1, "a": 2},
                            "unk_token": "a"}}


def _write(path, value):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(value if isinstance(value, str) else json.dumps(value))


def _run_dir(root, summary=None, wall=None, rows=ROWS):
  run = os.path.join(root, "A0")
  _write(os.path.join(run, "metrics.jsonl"), "".join(
      (r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  _write(os.path.join(run, "summary.json"), dict(status="completed") if summary is None
         else summary)
  _write(os.path.join(run, "wall.json"), dict(wall_s=1.0) if wall is None else wall)
  return run


def _tiny_model():
  return model_lib.LlamaConfig(vocab_size=288, dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                               mlp_dim=64)


# (case, file written, reader) -> each variant: (content, the field named).
def _summary(root, bad):
  run = _run_dir(root, summary=bad)
  return os.path.join(run, "summary.json"), lambda: (report.load_run(run, "A0", None),
                                                     ablation._status(run))


def _wall(root, bad):
  run = _run_dir(root, wall=bad)
  return os.path.join(run, "wall.json"), lambda: report.load_run(run, "A0", None)


def _metrics_row(root, bad):
  run = _run_dir(root, rows=[ROWS[0], bad, ROWS[1]])
  readers = (metrics_log.read_metrics, curves.eval_curve, lambda r: report.load_run(r, "A0", 0),
             lambda r: workdir_lib.set_aside_history(r, 1))
  return os.path.join(run, "metrics.jsonl"), lambda: [f(run) for f in readers]


def _declaration_record(root, bad):
  _write(os.path.join(root, "DECLARATION.json"), DECLARATION)
  _write(os.path.join(root, declaration.RECORD), bad)
  return (os.path.join(root, declaration.RECORD),
          lambda: declaration.status(root, os.path.join(root, "DECLARATION.json")))


def _declaration(root, bad):
  path = os.path.join(root, "DECLARATION.json")
  _write(path, bad)
  return path, lambda: declaration.load(path)


def _growth(root, bad):
  path = os.path.join(root, "DECLARATION.json")
  _write(path, dict(DECLARATION, **bad))
  return path, lambda: horizon.growth_section(root)


def _study_record(root, bad):
  path = os.path.join(root, study_config.RECORD)
  _write(path, bad)
  _run_dir(root)
  return path, lambda: (report._redraw(root, {}),
                        study_config.study_differences(root, ml_collections.ConfigDict()))


def _run_config(root, bad):
  path = os.path.join(root, "config.json")
  _write(path, bad)
  return path, lambda: export.run_config(root)


def _hf_config(root, bad):
  path = os.path.join(root, "config.json")
  _write(path, dict(HF_CONFIG, **bad) if isinstance(bad, dict) else bad)
  return path, lambda: hf.HfCheckpoint(root, _tiny_model())


def _hf_index(root, bad):
  path = os.path.join(root, hf.INDEX_FILE)
  _write(path, bad)
  return path, lambda: hf.weight_files(root)


def _tokenizer_config(root, bad):
  _write(os.path.join(root, "tok", "tokenizer.json"), WORD_TOKENIZER)
  path = os.path.join(root, "tok", "tokenizer_config.json")
  _write(path, bad)
  return path, lambda: tokenizers.make_tokenizer(os.path.join(root, "tok"))


def _config_file(root, bad):
  path = os.path.join(root, "cfg.py")
  _write(path, bad)
  return path, lambda: cli.load_config_file(path)


CASES = {
    "summary.json": (_summary, [([], "JSON object"), ({"status": 3}, "'status'"),
                                ({}, "'status'"), ({"status": "completed", "step": "4"},
                                                   "'step'")]),
    "wall.json": (_wall, [("[1]", "JSON object"), ({"wall_s": "1"}, "'wall_s'"),
                          ({"wall_s": None}, "'wall_s'")]),
    "metrics row": (_metrics_row, [({"step": "3"}, "line 2: field 'step'"),
                                   ({"step": None}, "line 2: field 'step'"),
                                   ({"tokens": 1}, "line 2: field 'step' is missing"),
                                   ("[1, 2]", "line 2: must hold a JSON object"),
                                   ({"step": 1, "skipped_steps": "2"}, "'skipped_steps'"),
                                   ({"step": 1, "eval_loss": "x"}, "'eval_loss'")]),
    "declaration_record.json": (_declaration_record, [
        ([], "JSON object"), ({"path": 1, "sha256": "x"}, "'path'"),
        ({"path": "p", "sha256": None}, "'sha256'")]),
    "declaration": (_declaration, [
        ([], "JSON object"), (dict(DECLARATION, claims="x"), "'claims'"),
        (dict(DECLARATION, claims=["x"]), "claims[0]: must hold a JSON object"),
        (dict(DECLARATION, alpha="0.05"), "'alpha'"),
        (dict(DECLARATION, claims=[dict(text="C", contrasts=[5])]),
         "claims[0].contrasts[0]"),
        (dict(DECLARATION, claims=[dict(text="C", contrasts=[
            dict(label="l", weights={"A1": "1"}, direction=">")])]), "'weights'")]),
    "declaration growth": (_growth, [({"growth": "x"}, "'growth'"),
                                     ({"growth": {"from_step": "1", "to_step": 2}},
                                      "growth: field 'from_step'"),
                                     ({"validity": [{"arms": "A0"}]}, "validity[0]")]),
    "ablation_config.json": (_study_record, [
        ([], "JSON object"), ({"ablation": []}, "'ablation'"),
        ({"ablation": {"recipes": 5}}, "ablation: field 'recipes'"),
        ({"ablation": {}, "diagnostics": {"window": "2"}}, "diagnostics: field 'window'")]),
    "run config.json": (_run_config, [
        ([], "JSON object"), ({"model": {}, "quant": {}, "resolved": []}, "'resolved'"),
        ({"model": {}, "quant": {}, "resolved": {"model": "x", "recipe": {}}},
         "resolved: field 'model'")]),
    "HF config.json": (_hf_config, [
        ([], "JSON object"), ({"rope_scaling": "llama3"}, "'rope_scaling'"),
        ({"num_hidden_layers": "1"}, "'num_hidden_layers'"),
        ({"rope_parameters": 5}, "'rope_parameters'")]),
    "HF index": (_hf_index, [
        ({"weight_map": []}, "'weight_map'"), ({"weight_map": {"a": 1}}, "'weight_map'"),
        ({"weight_map": {"a": "../x.safetensors"}}, "not inside"), ("[]", "JSON object")]),
    "tokenizer_config.json": (_tokenizer_config, [
        ([], "JSON object"), ({"bos_token": 5}, "'bos_token'"), ("{", "cannot be read")]),
    "config file": (_config_file, [
        ("def get_config():\n  pass\n", "returned None"),
        ("def get_config():\n  return [1]\n", "not an ml_collections.ConfigDict")]),
}


@pytest.mark.parametrize("kind", CASES)
def test_a_wrong_typed_file_is_one_line_naming_it(tmp_path, kind):
  make, variants = CASES[kind]
  for i, (bad, field) in enumerate(variants):
    path, read = make(str(tmp_path / str(i)), bad)
    with pytest.raises(errors.UserError) as raised:
      read()
    message = str(raised.value)
    assert "\n" not in message and os.path.basename(path) in message, (bad, message)
    assert field in message, (bad, field, message)


def test_damaged_records_the_project_sets_aside_raise_nothing(tmp_path):
  """A results manifest, a lock and a checkpoint's metadata of the wrong
  shape: not complete, held, set aside (naming the file), never a traceback."""
  run = _run_dir(str(tmp_path / "results"))
  for bad in ([], {"files": []}, {"files": {"summary.json": 1}}):
    _write(os.path.join(run, committed.MANIFEST), bad)
    assert not committed.is_complete(run)
  workdir = tmp_path / "work"
  for bad in ("[]", '{"pid": "12"}'):
    _write(str(workdir / "lock"), bad)
    with pytest.raises(workdir_lib.WorkdirError, match="unreadable lock file"):
      workdir_lib.WorkdirLock(str(workdir)).acquire()
  checkpoints = tmp_path / "run" / "checkpoints"
  for step, (name, bad) in enumerate((("_CHECKPOINT_METADATA", "[]"),
                                      ("_CHECKPOINT_METADATA", '{"item_handlers": 5}'),
                                      ("data/metadata", '{"processes": 3}'))):
    (checkpoints / str(step) / "state").mkdir(parents=True)
    _write(str(checkpoints / str(step) / name), bad)
  assert run_layout.checkpoint_config(str(tmp_path / "run")) is None
  ckpts = checkpointing.Checkpoints(
      str(checkpoints), keep=3, async_save=False,
      set_aside_to=run_layout.corrupt_checkpoints(str(tmp_path / "run")))
  assert ckpts.steps() == [2]  # the two orbax cannot open are set aside at once
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints_corrupt")) == ["0", "1"]
  ckpts.close()



def test_absurd_hf_sizes_are_refused_from_the_config_alone(tmp_path, monkeypatch):
  """A million layers in config.json (and asked by the run's config): the
  tensor count is compared before any table grows with the layers."""
  _write(str(tmp_path / "config.json"), dict(HF_CONFIG, num_hidden_layers=10**6))
  names = [row[0] for row in hf.tensor_table(_tiny_model())]
  _write(str(tmp_path / hf.INDEX_FILE), {"weight_map": {n: "model.safetensors" for n in names}})
  monkeypatch.setattr(hf, "tensor_table", lambda cfg: pytest.fail("table built"))
  with pytest.raises(errors.UserError, match=r"its 1000000 layers make 9,000,003 tensors, but "
                     "the weights of .* hold 12"):
    hf.HfCheckpoint(str(tmp_path), dataclasses.replace(_tiny_model(), n_layers=10**6,
                                                       rope_factor=1.0))
