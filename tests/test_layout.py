"""The import graph of fp4jax/, configs/ and train.py.

Every `import` statement counts, at module level or inside a function. The
graph has no cycle; the numerics, backends and kernels never import the
model, data or trainer (nor the other way round: those go through recipes,
dot and flax); numerics/ imports only itself, jax, numpy and the standard
library; recipes.py imports only the numerics; dot.py and diagnostics.py take no helpers from backends/xla.py;
residuals.py does not import the kernels. Nothing at the top of the checkout
(which `python -m ...` and `python train.py` put first on sys.path) takes the
import name of an installed distribution.
"""

import ast
import importlib.metadata
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TREES = (("fp4jax", "fp4jax"), ("configs", "configs"))


def _sources():
  """{module name: path} of every module of the graph."""
  out = {"train": os.path.join(ROOT, "train.py")}
  for folder, package in _TREES:
    for directory, _, names in os.walk(os.path.join(ROOT, folder)):
      for name in names:
        if not name.endswith(".py"):
          continue
        rel = os.path.relpath(os.path.join(directory, name), os.path.join(ROOT, folder))
        parts = rel[:-len(".py")].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join([package] + parts)] = os.path.join(directory, name)
  return out


SOURCES = _sources()


def _imports(module, path):
  """[(line, imported name)] of every import statement in `path`.

  `from a import b` names a.b when that is a module, else a; relative
  imports are resolved against `module`'s package.
  """
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        out.append((node.lineno, full if full in SOURCES else base))
  return out


def _edges():
  """[(importer, line, imported module of the graph)]: the import's module and
  the packages above it (Python runs their __init__ first)."""
  edges = []
  for module, path in SOURCES.items():
    for line, name in _imports(module, path):
      parts = name.split(".")
      for n in range(len(parts), 0, -1):
        target = ".".join(parts[:n])
        if target in SOURCES and target != module and not module.startswith(target + "."):
          edges.append((module, line, target))
  return edges


EDGES = _edges()


def _where(importer, line, target):
  return f"{os.path.relpath(SOURCES[importer], ROOT)}:{line} imports {target}"


def _under(module, *packages):
  return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_graph_holds_every_wing():
  for module in ("fp4jax.numerics.formats", "fp4jax.backends.xla", "fp4jax.kernels.quantize",
                 "fp4jax.llama.model", "fp4jax.data.pipeline", "fp4jax.train.trainer",
                 "configs.default", "train"):
    assert module in SOURCES, module
  assert ("fp4jax.train.step", "fp4jax.llama.model") in {(a, b) for a, _, b in EDGES}


def test_no_import_cycle():
  graph = {}
  for importer, line, target in EDGES:
    graph.setdefault(importer, {}).setdefault(target, line)
  done, path = set(), []

  def visit(module):
    path.append(module)
    for target, line in sorted(graph.get(module, {}).items()):
      if target in path:
        cycle = path[path.index(target):] + [target]
        steps = [_where(a, graph[a][b], b) for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle: " + "; ".join(steps))
      if target not in done:
        visit(target)
    path.pop()
    done.add(module)

  for module in sorted(SOURCES):
    if module not in done:
      visit(module)


def test_the_numerics_backends_and_kernels_stay_apart_from_model_data_and_trainer():
  low = ("fp4jax.numerics", "fp4jax.backends", "fp4jax.kernels")
  high = ("fp4jax.llama", "fp4jax.data", "fp4jax.train")
  bad = [_where(*e) for e in EDGES
         if (_under(e[0], *low) and _under(e[2], *high))
         or (_under(e[0], *high) and _under(e[2], *low))]
  assert not bad, bad


def test_numerics_imports_only_numerics_jax_and_numpy():
  allowed = ("jax", "numpy", "ml_dtypes")
  bad = []
  for module, path in SOURCES.items():
    if not _under(module, "fp4jax.numerics"):
      continue
    for line, name in _imports(module, path):
      top = name.split(".")[0]
      if not (_under(name, "fp4jax.numerics") or top in allowed
              or top in sys.stdlib_module_names):
        bad.append(_where(module, line, name))
  assert not bad, bad


def test_recipes_are_values_of_the_numerics_alone():
  """recipes.py imports no other fp4jax module than the numerics: a recipe is a
  value; the installed jax and the backends judge it where it is used."""
  bad = [_where(*e) for e in EDGES
         if e[0] == "fp4jax.recipes" and not _under(e[2], "fp4jax.numerics")]
  assert not bad, bad


def test_dot_and_diagnostics_take_no_helpers_from_the_xla_backend():
  bad = [_where(*e) for e in EDGES
         if e[0] in ("fp4jax.dot", "fp4jax.diagnostics") and e[2] == "fp4jax.backends.xla"]
  assert not bad, bad


def test_residuals_does_not_import_the_kernels():
  bad = [_where(*e) for e in EDGES
         if e[0] == "fp4jax.residuals" and _under(e[2], "fp4jax.kernels")]
  assert not bad, bad


def test_no_top_level_name_of_the_checkout_shadows_an_installed_distribution():
  # transformers >= 5.2x imports the `kernels` distribution: a top-level kernels/
  # package here made every `import transformers` run from the checkout fail.
  names = {entry.name for entry in os.scandir(ROOT)
           if os.path.exists(os.path.join(entry.path, "__init__.py"))}
  names |= {name[:-len(".py")] for name in os.listdir(ROOT) if name.endswith(".py")}
  owners = importlib.metadata.packages_distributions()
  clashes = {name: owners[name] for name in names if set(owners.get(name, ["fp4jax"])) != {"fp4jax"}}
  assert not clashes, f"top-level names of the checkout that installed distributions own: {clashes}"
