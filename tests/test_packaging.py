"""pyproject.toml puts every file of fp4jax/ into a wheel.

setuptools finds the packages by pyproject's [tool.setuptools.packages.find]
(with namespaces, every folder whose dotted name `include` matches and
`exclude` does not, a data folder such as bench/gpu_targets/ too) and
installs their .py files and, of the others, those `package-data` names: a
file left out is missing from a built wheel, while an editable install,
which reads the source tree, still finds it.
"""

import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _matches(name, patterns):
  return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def unpackaged(root):
  """Files under root/fp4jax that a wheel built from root's pyproject.toml would lack."""
  with open(root / "pyproject.toml", "rb") as f:
    tool = tomllib.load(f)["tool"]["setuptools"]
  find, data = tool["packages"]["find"], tool.get("package-data", {})
  assert find.get("namespaces", True), "without namespaces a data folder is no package"
  missing = []
  for path in sorted((root / "fp4jax").rglob("*")):
    if not path.is_file() or "__pycache__" in path.parts:
      continue
    package = ".".join(path.parent.relative_to(root).parts)
    found = _matches(package, find["include"]) and not _matches(package, find.get("exclude", []))
    if not found or not _matches(path.name, ["*.py"] + data.get(package, [])):
      missing.append(str(path.relative_to(root)))
  return missing


def test_every_file_of_the_package_goes_into_the_wheel():
  assert not unpackaged(ROOT), unpackaged(ROOT)


def test_a_folder_or_data_file_left_out_is_named(tmp_path):
  (tmp_path / "fp4jax" / "bench" / "gpu_targets").mkdir(parents=True)
  (tmp_path / "fp4jax" / "tools").mkdir()
  for name in ("__init__.py", "bench/__init__.py", "bench/gpu_targets/h200.txtpb",
               "bench/notes.txt", "tools/__init__.py"):
    (tmp_path / "fp4jax" / name).write_text("")
  (tmp_path / "pyproject.toml").write_text(
      '[tool.setuptools.packages.find]\ninclude = ["fp4jax", "fp4jax.*"]\n'
      'exclude = ["fp4jax.tools"]\n'
      '[tool.setuptools.package-data]\n"fp4jax.bench.gpu_targets" = ["*.txtpb"]\n')
  assert unpackaged(tmp_path) == ["fp4jax/bench/notes.txt", "fp4jax/tools/__init__.py"]
