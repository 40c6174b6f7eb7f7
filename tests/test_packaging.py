"""pyproject.toml puts every part of fp4jax/ into a wheel.

setuptools installs only the `packages` listed and, of their files other
than .py, those `package-data` names: a folder left out (a new subpackage,
a data folder such as bench/gpu_targets/) is missing from a built wheel,
while an editable install, which reads the source tree, still finds it.
"""

import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def unpackaged(root):
  """Files under root/fp4jax that a wheel built from root's pyproject.toml would lack."""
  with open(root / "pyproject.toml", "rb") as f:
    tool = tomllib.load(f)["tool"]["setuptools"]
  packages, data = set(tool["packages"]), tool.get("package-data", {})
  missing = []
  for path in sorted((root / "fp4jax").rglob("*")):
    if not path.is_file() or "__pycache__" in path.parts:
      continue
    package = ".".join(path.parent.relative_to(root).parts)
    wanted = ["*.py"] + data.get(package, [])
    if package not in packages or not any(fnmatch.fnmatch(path.name, w) for w in wanted):
      missing.append(str(path.relative_to(root)))
  return missing


def test_every_file_of_the_package_goes_into_the_wheel():
  assert not unpackaged(ROOT), unpackaged(ROOT)


def test_a_folder_or_data_file_left_out_is_named(tmp_path):
  (tmp_path / "fp4jax" / "bench" / "gpu_targets").mkdir(parents=True)
  (tmp_path / "fp4jax" / "new").mkdir()
  for name in ("__init__.py", "bench/__init__.py", "bench/gpu_targets/h200.txtpb",
               "bench/notes.txt", "new/__init__.py"):
    (tmp_path / "fp4jax" / name).write_text("")
  (tmp_path / "pyproject.toml").write_text(
      '[tool.setuptools]\npackages = ["fp4jax", "fp4jax.bench", "fp4jax.bench.gpu_targets"]\n'
      '[tool.setuptools.package-data]\n"fp4jax.bench.gpu_targets" = ["*.txtpb"]\n')
  assert unpackaged(tmp_path) == ["fp4jax/bench/notes.txt", "fp4jax/new/__init__.py"]
