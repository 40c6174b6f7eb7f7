"""A run directory's layout is spelled once: fp4jax.train.run_layout.

The file names of a run's workdir (the upper-case str constants of
run_layout: config.json, metrics.jsonl, checkpoints, ...) appear as string
constants only there, and orbax's folder names (a checkpoint's state/ and
data/metadata, _CHECKPOINT_METADATA, its temporary folders) only in
fp4jax/checkpointing.py. A constant counts when it is a path (no white
space) one of whose "/"-separated parts is such a name; docstrings and
messages that name a file in prose do not.
"""

import ast
import os

from fp4jax.train import run_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWNER = "fp4jax/train/run_layout.py"
RUN_NAMES = {v for k, v in vars(run_layout).items() if k.isupper() and isinstance(v, str)}
# Files of the same name that are not a run's.
OTHER_FILES = {
    # Hugging Face's own config.json of a model directory (hf.CONFIG_FILE),
    # which hf, hf_packed, init_from and the export read or write.
    "fp4jax/llama/hf.py": {"config.json"},
    # The GPU check's closing summary beside summary.md in its --out folder.
    "fp4jax/bench/gpu_summary.py": {"summary.json"},
}
ORBAX_OWNER = "fp4jax/checkpointing.py"
ORBAX_PARTS = {"state", "data", "metadata"}  # a checkpoint's items, as path parts
ORBAX_NAMES = ("_CHECKPOINT_METADATA", "orbax-checkpoint-tmp")  # anywhere in a constant


def _constants(path):
  """[(line, text)] of the str constants of a source file, docstrings aside
  (an f-string counts as its constant pieces)."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
  return [(node.lineno, node.value) for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings]


def _path_parts(text):
  """The "/"-separated parts of a constant that could be a path, else set()."""
  return set() if any(c.isspace() for c in text) else set(text.split("/"))


def _sources(root):
  """{"fp4jax/x/y.py": absolute path} of the sources under root/fp4jax."""
  out = {}
  for directory, _, names in os.walk(os.path.join(root, "fp4jax")):
    for name in names:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        out[os.path.relpath(path, root).replace(os.sep, "/")] = path
  return out


def _misplaced(root, owner, found_in):
  """["fp4jax/x.py:line: what", ...] of found_in(rel, path) -> [(line, what)]
  over the sources but `owner`'s, sorted."""
  return sorted(f"{rel}:{line}: {what!r}" for rel, path in _sources(root).items()
                if rel != owner for line, what in found_in(rel, path))


def _run_names_in(rel, path):
  return [(line, name) for line, text in _constants(path)
          for name in sorted((_path_parts(text) & RUN_NAMES) - OTHER_FILES.get(rel, set()))]


def _orbax_names_in(_, path):
  found = [(line, text) for line, text in _constants(path)
           if any(name in text for name in ORBAX_NAMES)
           or (len(_path_parts(text)) > 1 and _path_parts(text) & ORBAX_PARTS)]
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"):  # os.path.join(x, "state"), ...
      found += [(node.lineno, arg.value) for arg in node.args
                if isinstance(arg, ast.Constant) and arg.value in ORBAX_PARTS]
  return found


def misplaced_run_names(root):
  """["fp4jax/x.py:line: 'name'"] of run file names spelled outside OWNER."""
  return _misplaced(root, OWNER, _run_names_in)


def misplaced_orbax_names(root):
  """["fp4jax/x.py:line: 'text'"] of orbax folder names outside ORBAX_OWNER."""
  return _misplaced(root, ORBAX_OWNER, _orbax_names_in)


def test_the_run_layout_names_every_file_of_a_workdir():
  assert {"checkpoints", "checkpoints_corrupt", "config.json", "metrics.jsonl",
          "summary.json", "history", "lock", "tensorboard", "wandb_id",
          "wall.json", "resume_override.json"} <= RUN_NAMES


def test_run_file_names_are_spelled_only_in_the_run_layout():
  assert misplaced_run_names(ROOT) == []


def test_orbax_folder_names_stay_in_checkpointing():
  assert misplaced_orbax_names(ROOT) == []


def test_a_name_planted_elsewhere_is_found(tmp_path):
  (tmp_path / "fp4jax" / "train").mkdir(parents=True)
  (tmp_path / "fp4jax" / "plot.py").write_text(
      '"""Reads metrics.jsonl."""\n'
      'import os\n'
      'def f(w, step):\n'
      '  """The summary.json of w."""\n'
      '  print("no config.json in", w)\n'
      '  os.path.join(w, "state")\n'
      '  return os.path.join(w, "metrics.jsonl"), f"{w}/checkpoints/{step}/data/metadata"\n')
  (tmp_path / "fp4jax" / "llama").mkdir()
  (tmp_path / "fp4jax" / "llama" / "hf.py").write_text('A = "config.json"\nB = "lock"\n')
  assert misplaced_run_names(str(tmp_path)) == [
      "fp4jax/llama/hf.py:2: 'lock'", "fp4jax/plot.py:7: 'checkpoints'",
      "fp4jax/plot.py:7: 'metrics.jsonl'"]
  assert misplaced_orbax_names(str(tmp_path)) == [
      "fp4jax/plot.py:6: 'state'", "fp4jax/plot.py:7: '/data/metadata'"]


def test_a_checkpoint_folder_names_its_run_and_step(tmp_path):
  run = str(tmp_path / "run")
  assert run_layout.run_of_checkpoint(os.path.join(run, "checkpoints", "12")) == (run, 12)
  assert run_layout.run_of_checkpoint(os.path.join(run, "checkpoints", "12") + "/") == (run, 12)
  assert run_layout.run_of_checkpoint(run) == (run, None)
  assert not run_layout.is_run_or_checkpoint(run)
  os.makedirs(os.path.join(run, "checkpoints", "12", "state"))
  assert run_layout.is_run_or_checkpoint(run)
  assert run_layout.is_run_or_checkpoint(os.path.join(run, "checkpoints", "12"))


def test_a_saved_config_is_judged_by_one_rule(tmp_path):
  run = str(tmp_path)
  assert run_layout.saved_config(run) == (None, "is missing")
  for text, problem in (("[]", "is not a config written by fp4jax's trainer (it holds a list)"),
                        ('{"model": {}}', "is not a config written by fp4jax's trainer "
                         "(it holds a dict)")):
    with open(run_layout.config_file(run), "w") as f:
      f.write(text)
    assert run_layout.saved_config(run) == (None, problem)
  with open(run_layout.config_file(run), "w") as f:
    f.write("{")
  assert run_layout.saved_config(run)[1].startswith("cannot be read (")
  saved = {"model": {}, "quant": {}, "resolved": {}}
  with open(run_layout.config_file(run), "w") as f:
    f.write('{"model": {}, "quant": {}, "resolved": {}}')
  assert run_layout.saved_config(run) == (saved, None)
  assert run_layout.usable_config(saved) and not run_layout.usable_config([])
