"""fp4jax: MXFP4 (and NVFP4, MXFP6/8, FP8) training for JAX/Flax.

Public names (see README.md):
    QuantSpec, QArray, quantize, fake_quantize, pack_fp4, unpack_fp4  (numerics.formats)
    rotate, hadamard_matrix                                           (numerics.hadamard)
    Recipe, recipe, recipe_names                                      (recipes)
    dot_general                                                       (dot)
    flax.DotGeneral                                                   (flax adapters)

Modules: numerics/ (formats, scales, rounding, Hadamard), recipes, dot (the
quantized dot_general), backends/ (xla, pallas, native, mosaic) and kernels, flax
(adapters), residuals (quantized residuals), fprop_operands (a layer's Fprop
operands outside a forward), diagnostics (per-role error statistics),
schedule (precision that changes during a run), sharding (mesh and axis
rules), shard_local (kernel backends per device's shard), checkpointing (orbax), records (the JSON files read back), errors
(one-line user errors), cpuinfo (the host CPU's model and flags), trained (a
run's checkpoint or an export, loaded to run); llama/ (the model), data/, train/ (the trainer),
experiments/ (studies), bench/ (benchmarks), maxtext/; command lines: convert
(export / import), plot, generate, evaluate and audit.

Submodules are imported on first use, so `import fp4jax` stays light and the
numerics never pull in Flax; `dir(fp4jax)` (what tab completion reads) lists the
public names without importing them.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "QuantSpec": "numerics.formats",
    "QArray": "numerics.formats",
    "quantize": "numerics.formats",
    "fake_quantize": "numerics.formats",
    "pack_fp4": "numerics.formats",
    "unpack_fp4": "numerics.formats",
    "rotate": "numerics.hadamard",
    "hadamard_matrix": "numerics.hadamard",
    "Recipe": "recipes",
    "recipe": "recipes",
    "recipe_names": "recipes",
    "dot_general": "dot",
}

__all__ = sorted(_EXPORTS) + ["flax"]


def __getattr__(name):
  if name in _EXPORTS:
    module = importlib.import_module(f"fp4jax.{_EXPORTS[name]}")
    return getattr(module, name)
  if name == "flax":
    return importlib.import_module("fp4jax.flax")
  raise AttributeError(f"module 'fp4jax' has no attribute {name!r}")


def __dir__():
  """The public names, the dunders and the submodules already imported."""
  return sorted(set(__all__) | {n for n, v in globals().items() if n.startswith("__")
                                 or getattr(v, "__name__", "").startswith("fp4jax.")})
