"""Every package's docstring names each of its modules (the map a newcomer reads first)."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = sorted(
    os.path.relpath(d, ROOT) for folder in ("fp4jax", "kernels")
    for d, _, files in os.walk(os.path.join(ROOT, folder)) if "__init__.py" in files)


def missing(package_dir):
  """Module names of `package_dir` (no __init__/__main__) its docstring does not name."""
  with open(os.path.join(package_dir, "__init__.py")) as f:
    words = set(re.findall(r"[A-Za-z_]\w*", ast.get_docstring(ast.parse(f.read())) or ""))
  modules = [n[:-3] for n in os.listdir(package_dir)
             if n.endswith(".py") and n not in ("__init__.py", "__main__.py")]
  return sorted(m for m in modules if m not in words)


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_docstring_names_each_module(package):
  assert not missing(os.path.join(ROOT, package)), package


def test_a_module_left_out_is_found(tmp_path):
  (tmp_path / "__init__.py").write_text('"""Parts: alpha, beta."""\n')
  for name in ("alpha", "beta", "gamma"):
    (tmp_path / f"{name}.py").write_text("")
  assert missing(str(tmp_path)) == ["gamma"]
