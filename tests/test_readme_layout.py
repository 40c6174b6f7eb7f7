"""The README's "Layout" block names exactly the package's parts.

Checked: every subpackage (a folder with __init__.py) and every top-level
module of fp4jax/, by name (`fp4jax/numerics/`, `fp4jax/dot.py`), and every
top-level folder or script of the repository that holds Python code
(`configs/`, `tests/`, `train.py`); any other entry (`docs/`,
`benchmarks/`) must exist. Files inside a subpackage are not listed, so
moving one within its wing needs no README change.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
_NOT_SOURCE = ("build", "dist", "runs")  # git-ignored outputs


def layout_entries(readme_text):
  """The first token of each line of the first code block under "## Layout"."""
  match = re.search(r"^## Layout\n.*?^```\n(.*?)^```", readme_text, re.M | re.S)
  assert match, 'README.md has no "## Layout" section with a ``` block'
  return {line.split()[0] for line in match.group(1).splitlines() if line.strip()}


def package_parts(root):
  """fp4jax/'s subpackages ("fp4jax/NAME/") and top-level modules ("fp4jax/NAME.py")."""
  pkg = root / "fp4jax"
  return ({f"fp4jax/{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").is_file()}
          | {f"fp4jax/{f.name}" for f in pkg.glob("*.py")})


def top_level_code(root):
  """Top-level folders with Python files ("NAME/") and scripts ("NAME.py"), fp4jax/ aside."""
  folders = {f"{d.name}/" for d in root.iterdir()
             if d.is_dir() and d.name != "fp4jax" and not d.name.startswith(".")
             and d.name not in _NOT_SOURCE and not d.name.endswith(".egg-info")
             and any(d.glob("*.py"))}
  return folders | {f.name for f in root.glob("*.py")}


def layout_drift(readme_text, root):
  """(missing, extra): names the tree has and the block lacks, and the reverse."""
  listed = layout_entries(readme_text)
  listed_pkg = {e for e in listed if e.startswith("fp4jax/")}
  expected_pkg = package_parts(root)
  missing = (expected_pkg - listed_pkg) | (top_level_code(root) - listed)
  extra = (listed_pkg - expected_pkg) | {
      e for e in listed - listed_pkg if not (root / e.rstrip("/")).exists()}
  return sorted(missing), sorted(extra)


def test_readme_layout_names_the_package_parts():
  missing, extra = layout_drift((ROOT / "README.md").read_text(), ROOT)
  assert not missing and not extra, (
      f"README.md's Layout block drifted from the tree: missing {missing}, "
      f"listed but absent {extra}")


def test_drift_is_reported_by_name(tmp_path):
  (tmp_path / "fp4jax" / "numerics").mkdir(parents=True)
  (tmp_path / "fp4jax" / "numerics" / "__init__.py").write_text("")
  (tmp_path / "fp4jax" / "dot.py").write_text("")
  (tmp_path / "fp4jax" / "new.py").write_text("")
  (tmp_path / "tools").mkdir()
  (tmp_path / "tools" / "gemm.py").write_text("")
  (tmp_path / "docs").mkdir()
  readme = ("## Layout\n\n```\nfp4jax/numerics/   x\nfp4jax/dot.py   y\n"
            "fp4jax/gone.py  z\ndocs/  pages\nresults/  runs\n```\n")
  assert layout_drift(readme, tmp_path) == (
      ["fp4jax/new.py", "tools/"], ["fp4jax/gone.py", "results/"])
