"""Packed FP4 exports: the block linears as NVFP4 / MXFP4 codes and scales.

`python -m fp4jax.convert export RUN OUT --quantize nvfp4|mxfp4 [--layout
compressed-tensors|modelopt]` (fp4jax.train.export) writes, for every linear
layer of every block (q, k, v, o, gate, up, down) that the run does not keep
in bf16, in place of its dense weight (`model.layers.i.<proj>`):

  compressed-tensors (vLLM, SGLang; transformers through compressed-tensors)
    weight_packed        uint8 [out, in/2], two E2M1 codes per byte
    weight_scale         float8_e4m3fn [out, in/16] (NVFP4) or uint8 E8M0
                         [out, in/32] (MXFP4)
    weight_global_scale  float32 [1], NVFP4 only: 1 / fp4jax's per-tensor
                         scale (compressed-tensors divides by it)
    and config.json's `quantization_config`, the block compressed-tensors
    0.20 writes ("nvfp4-pack-quantized" / "mxfp4-pack-quantized"), with a
    `transform_config` declaring the Fprop Hadamard rotation when there is one
  modelopt (NVFP4; TensorRT-LLM, vLLM's modelopt loader)
    weight (packed uint8), weight_scale (float8_e4m3fn), weight_scale_2
    (float32 scalar, fp4jax's per-tensor scale amax / (6 * 448)), and
    hf_quant_config.json

Activations (`--activations`): "none" (W4A16, the default of the
compressed-tensors layout) or "fp4" (W4A4, the modelopt layout's only one):
MXFP4 inputs are quantized dynamically by the engine; NVFP4 inputs need a
per-tensor scale, calibrated here as fp4jax computes one (max |x| / (6 *
448)) over the largest input each layer sees in the run's first
--calibration_batches validation batches (at most the batches of disjoint
windows the validation set holds; read from the absolute paths the run
recorded, and refused in one line when those files' names or sizes are no
longer those it recorded: `run_data_config`), run through the W4A4 forward an engine
computes from the export (PackedExport.served: the exported weights times
NVFP4 inputs, rotated only as the export declares); written as
input_global_scale (its reciprocal, compressed-tensors) or input_scale
(modelopt).

Codes and scales come from fp4jax.llama.fp4_weights: exactly those of the
trained forward when its Fprop weight operand is the exported format, else
a post-training round to nearest (`PackedExport.notice` says so). Embeddings,
norms, the head and the layers kept in bf16 stay dense, and are named in
`ignore` / `exclude_modules`.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fp4jax import fprop_operands
from fp4jax import records
from fp4jax import recipes
from fp4jax import schedule
from fp4jax.data import fingerprint
from fp4jax.data import pipeline
from fp4jax.data import sources
from fp4jax.llama import fp4_weights
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax.llama.hf import ConvertError
from fp4jax.train.config import recipe_segments

LAYOUTS = {"compressed-tensors": ("nvfp4", "mxfp4"), "modelopt": ("nvfp4",)}
# compressed-tensors' format names and the version whose config block is written.
CT_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
CT_VERSION = "0.20.0"
_BLOCK_PATHS = {layer.path: layer for layer in linears.BLOCK}
# The projections vLLM and TensorRT-LLM fuse into one GEMM.
FUSED_GROUPS = (("attn/q", "attn/k", "attn/v"), ("mlp/gate", "mlp/up"))
FUSED_SCALES = ("shared", "per-projection")
ACTIVATIONS = ("none", "fp4")


def run_recipe(config, step):
  """The Recipe whose forward trained the run's last step before checkpoint
  `step` (config: the run's config.json; its quant_schedule included)."""
  try:
    first = recipes.from_config(ml_collections.ConfigDict(
        config["resolved"]["recipe"]))
    segs = recipe_segments(first, config)
  except (KeyError, TypeError, ValueError) as e:
    raise ConvertError(f"the run's recipe cannot be read from its config.json: "
                       f"{e}") from e
  return segs[schedule.segment_index(segs, max(step - 1, 0))].recipe


class PackedExport:
  """What a packed export writes instead of the quantized layers' dense weights.

  config: the run's config.json; cfg: its LlamaConfig; step: the checkpoint.
  """

  def __init__(self, config, cfg, step, fmt, layout, fused_scale="shared",
               activations=None):
    if fmt not in fp4_weights.FORMATS:
      raise ConvertError(f"--quantize {fmt!r}; allowed: "
                         f"{list(fp4_weights.FORMATS)}")
    if layout not in LAYOUTS:
      raise ConvertError(f"--layout {layout!r}; allowed: {list(LAYOUTS)}")
    if fmt not in LAYOUTS[layout]:
      raise ConvertError(f"--layout {layout} holds {list(LAYOUTS[layout])} "
                         f"only, not --quantize {fmt!r}")
    if fused_scale not in FUSED_SCALES:
      raise ConvertError(f"--fused_scale {fused_scale!r}; allowed: "
                         f"{list(FUSED_SCALES)}")
    activations = activations or ("fp4" if layout == "modelopt" else "none")
    if activations not in ACTIVATIONS:
      raise ConvertError(f"--activations {activations!r}; allowed: "
                         f"{list(ACTIVATIONS)}")
    if layout == "modelopt" and activations != "fp4":
      raise ConvertError("--layout modelopt is NVFP4 with FP4 activations "
                         "(W4A4) only; for W4A16 use --layout "
                         "compressed-tensors")
    self.cfg, self.fmt, self.layout = cfg, fmt, layout
    self.activations = activations
    self.input_amax = {}  # hf module name -> float32, set by calibrate()
    # NVFP4's per-tensor scale is shared by each fused group (MXFP4 has none).
    self.shared = fused_scale == "shared" and fmt == "nvfp4"
    self.changed = {}  # projection path -> [weights changed, weights]
    self._group_cache = {}
    self.recipe = run_recipe(config, step)
    self.plan = fp4_weights.plan(self.recipe, fmt)
    if layout == "modelopt" and self.plan.rotation is not None:
      raise ConvertError(
          f"recipe {self.recipe.name!r} rotates Fprop (Hadamard block "
          f"{self.plan.rotation.block}), which the modelopt layout cannot "
          "declare (an engine would not rotate the inputs); use --layout "
          "compressed-tensors, whose transform_config declares it")

  def notice(self):
    """One line for the user when the weights are quantized after training."""
    if self.plan.exact:
      return None
    return (f"quantize: recipe {self.recipe.name!r} {self.plan.why}, so the "
            f"weights are quantized to {self.fmt} after training (round to "
            "nearest), not as the forward computed")

  def is_packed(self, row):
    """Whether tensor_table row (hf name, path, layer, layout) is packed."""
    return self._block_linear(row) is not None and not self.cfg.is_bf16(
        self._block(row))

  @property
  def calibrates(self):
    """Whether the layers need static input scales (NVFP4, FP4 activations)."""
    return self.activations == "fp4" and self.fmt == "nvfp4"

  def calibrate(self, config, params, n_batches, given=True):
    """Sets the input amax of every packed layer over the run's first
    `n_batches` validation batches (config: the run's config.json; params:
    its parameters) through the forward the export serves (`served`).
    given: n_batches came from the user, so it may not exceed the batches of
    disjoint windows the validation set holds (the default, the run's own
    eval_batches, is what its trainer evaluated on)."""
    self.input_amax = input_amax(config, self.cfg, self.served, params,
                                 n_batches, given)

  @property
  def served(self):
    """The Recipe whose forward an engine serving this NVFP4 export (W4A4)
    computes: Fprop multiplies the weights as exported (the plan's spec and
    rotation, the only rotation the export declares) by the inputs rotated
    the same way and quantized to NVFP4 (the per-tensor scale the engine
    reads statically computed from each tensor); dgrad and wgrad, which no
    forward uses, are the run's."""
    return dataclasses.replace(self.recipe, fprop=recipes.Gemm(
        fp4_weights.POST_TRAINING["nvfp4"], self.plan.spec, self.plan.rotation))

  def nbytes(self, shape):
    """Bytes of a packed layer whose fp4jax kernel (one layer) has `shape`."""
    n = int(np.prod(shape))
    return n // 2 + n // fp4_weights.FORMATS[self.fmt] + 8

  def fused_line(self):
    """One line: how many weights the shared scales change, per projection."""
    if not self.shared:
      return None
    counts = ", ".join(f"{path.split('/')[1]} {c:,} of {n:,}"
                       for path, (c, n) in self.changed.items())
    return ("fused projections share their NVFP4 per-tensor scale (vLLM fuses "
            f"q/k/v and gate/up); weights changed from the trained forward: "
            f"{counts}")

  def tensors(self, row, kernel, kernel_of):
    """{name: array} of a packed row; kernel: its float32 fp4jax kernel;
    kernel_of(path): the kernel of another linear of the same block
    ("attn/k")."""
    layer = self._block_linear(row)
    group = next((g for g in FUSED_GROUPS if layer.path in g), None)
    if self.shared and group:
      w = self._fused(row, group, kernel_of)[group.index(layer.path)]
    else:
      w = fp4_weights.fp4_weight(kernel, layer.n_in, self.cfg.dtype, self.plan)
    module = row[0][:-len(".weight")]
    input_scale = None
    if self.calibrates:
      input_scale = _per_tensor_scale(self.input_amax[module])
    if self.layout == "modelopt":
      return {f"{module}.weight": w.packed, f"{module}.weight_scale": w.scales,
              f"{module}.weight_scale_2": np.asarray(w.global_scale, np.float32),
              f"{module}.input_scale": np.asarray(input_scale, np.float32)}
    out = {f"{module}.weight_packed": w.packed,
           f"{module}.weight_scale": w.scales}
    if w.global_scale is not None:
      out[f"{module}.weight_global_scale"] = np.float32(1) / np.asarray(
          [w.global_scale], np.float32)
    if input_scale is not None:
      out[f"{module}.input_global_scale"] = np.float32(1) / np.asarray(
          [input_scale], np.float32)
    return out

  def _fused(self, row, group, kernel_of):
    """The group's Fp4Weights with one shared scale (computed once per block),
    counting the weights that differ from each layer's own quantization."""
    key = (self._block(row), group)
    if key not in self._group_cache:
      n_in = _BLOCK_PATHS[group[0]].n_in
      kernels = [kernel_of(path) for path in group]
      fused = fp4_weights.fused_fp4_weights(kernels, n_in, self.cfg.dtype,
                                            self.plan)
      for path, x, w in zip(group, kernels, fused):
        own = fp4_weights.fp4_weight(x, n_in, self.cfg.dtype, self.plan)
        count = self.changed.setdefault(path, [0, 0])
        count[0] += int(np.sum(own.dequantize() != w.dequantize()))
        count[1] += x.size
      self._group_cache = {key: fused}  # a block's rows are written together
    return self._group_cache[key]

  def ignored(self, table):
    """Module names of the dense linears (the head, the bf16 layers)."""
    return [row[0][:-len(".weight")] for row in table
            if row[0].endswith("_proj.weight") or row[0] == "lm_head.weight"
            if not self.is_packed(row)]

  def quantization_config(self, table):
    """config.json's quantization_config (compressed-tensors) or None."""
    if self.layout != "compressed-tensors":
      return None
    ignore = self.ignored(table)
    return {
        "config_groups": {"group_0": {
            "format": None,
            "input_activations": (_ct_inputs(self.fmt)
                                  if self.activations == "fp4" else None),
            "output_activations": None, "targets": ["Linear"],
            "weights": _ct_weights(self.fmt)}},
        "format": CT_FORMATS[self.fmt], "global_compression_ratio": None,
        "ignore": ignore, "kv_cache_scheme": None,
        "moe_sparsity_config": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": self._transform_config(ignore),
        "version": CT_VERSION}

  def _transform_config(self, ignore):
    """The Fprop rotation, applied online to every packed Linear's input."""
    rotation = self.plan.rotation
    if rotation is None:
      return {}
    return {"config_groups": {f"h{rotation.block}": {
        "type": "hadamard", "head_dim": rotation.block, "randomize": False,
        "requires_grad": False, "precision": "torch.float32",
        "apply": [{"targets": ["Linear"], "location": "input",
                   "inverse": False, "ignore": ignore}]}}}

  def modelopt_config(self, table):
    """hf_quant_config.json's content (modelopt) or None."""
    if self.layout != "modelopt":
      return None
    return {"producer": {"name": "modelopt", "version": "0.0.0+fp4jax"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                             "group_size": 16,
                             "exclude_modules": self.ignored(table)}}

  def _block_linear(self, row):
    path = row[1]
    return _BLOCK_PATHS.get("/".join(path[1:-1])) if path[-1] == "kernel" else None

  def _block(self, row):
    return int(row[0].split(".")[2])  # model.layers.<i>.


def _per_tensor_scale(amax):
  """fp4jax's NVFP4 per-tensor scale of a tensor of max |x| `amax` (float32;
  1 for 0), as fp4jax.numerics.formats computes it."""
  g = np.float32(amax) * np.float32(1 / fprop_operands.NVFP4_GLOBAL_DIVISOR)
  return g if g > 0 else np.float32(1)


def input_amax(config, cfg, recipe, params, n_batches, bounded):
  """{hf module name: float32 max |input|} of the block linears over the
  run's first `n_batches` validation batches, through `recipe`'s forward
  (the input as its Fprop quantizes it: flattened and rotated). bounded:
  refuse more batches than the validation set holds without overlap."""
  data_cfg, recorded = run_data_config(config)
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  try:
    windows = pipeline.validation_windows(
        data_cfg, tokenizers.make_tokenizer(data_cfg.tokenizer),
        seq_len=config["seq_len"],
        batch_size=config.get("eval_batch_size") or config["batch_size"],
        num_batches=n_batches, disjoint=bounded)
  except pipeline.TooManyBatches as e:
    raise ConvertError(f"--calibration_batches {n_batches}: {e}") from e
  except (ValueError, OSError, ImportError) as e:
    raise ConvertError(f"calibration: the run's validation data: {e}") from e
  changed = recorded and recorded.get("validation") is not None and (
      fingerprint.changes(recorded["validation"], windows.fingerprint))
  if changed:
    shown = ", ".join(f"data.{k} {v!r}" for k, v in recorded["paths"].items() if v)
    raise ConvertError(
        "calibration: the run's validation files changed since it was "
        f"trained ({shown or 'data.source ' + repr(data_cfg.source)}: "
        f"{changed}), so they are not the text it evaluated on; restore them, "
        "or export without --activations fp4 (W4A16)")
  cfg, params = _unscanned(cfg, params)
  llama = model_lib.Llama(dataclasses.replace(cfg, capture_dots=True), recipe)
  rotation = recipe.fprop.hadamard

  @jax.jit
  def batch_amax(tokens):
    _, sown = llama.apply({"params": params}, tokens,
                          mutable=["intermediates", "perturbations"],
                          rngs={"quant": jax.random.key(0),
                                "hadamard": jax.random.key(0)})
    out = {}
    for i in range(cfg.n_layers):
      for layer in linears.BLOCK:
        node = sown["intermediates"][f"block_{i}"]
        for key in layer.path.split("/"):
          node = node[key]
        x = node["DotGeneral_0"]["lhs"][0]
        x = x.reshape(x.shape[:x.ndim - layer.n_in] + (-1,))
        x = fprop_operands.rotated_input(x, rotation, x.ndim - 1)
        out[f"model.layers.{i}.{layer.hf_name[:-len('.weight')]}"] = (
            jnp.max(jnp.abs(x.astype(jnp.float32))))
    return out

  amax = {}
  for window in windows:
    for name, a in batch_amax(jnp.asarray(window[:, :-1])).items():
      amax[name] = max(amax.get(name, np.float32(0)), np.float32(a))
  return amax


def run_data_config(config):
  """(the data config of a run's config.json as its trainer read it, the
  run's resolved.data record or None).

  The paths are those the run recorded made absolute (resolved.data.paths:
  the files it read, from whatever directory this runs in); a run from
  before they were recorded has its relative paths read from the current
  directory, with a warning on stderr."""
  data_cfg = pipeline.data_config()
  data_cfg.update(config.get("data", {}))
  recorded = (config.get("resolved") or {}).get("data")
  if recorded is None:
    relative = [f"data.{k} {data_cfg[k]!r}" for k in sources.PATH_KEYS.get(
        data_cfg.source, ()) if data_cfg[k] and not os.path.isabs(
            os.path.expanduser(data_cfg[k]))]
    if relative:
      print(f"fp4jax: warning: the run recorded no absolute data paths; "
            f"{', '.join(relative)} is read from the current directory "
            f"{os.getcwd()!r}", file=sys.stderr, flush=True)
    return data_cfg, None
  recorded = records.check(records.ResolvedData, recorded,
                           "the run's config.json: resolved.data")
  data_cfg.update({k: v for k, v in recorded["paths"].items() if k in data_cfg})
  return data_cfg, recorded


def _unscanned(cfg, params):
  """(cfg, params) with scanned blocks split into block_<i> trees."""
  if not cfg.scan_layers:
    return cfg, params
  params = dict(params)
  blocks = params.pop("blocks")
  for i in range(cfg.n_layers):
    params[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], blocks)
  return dataclasses.replace(cfg, scan_layers=False), params


def _ct_inputs(fmt):
  """compressed-tensors' input QuantizationArgs of NVFP4 / MXFP4 (W4A4)."""
  if fmt == "nvfp4":
    return {"dynamic": "local", "group_size": 16, "num_bits": 4,
            "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn",
            "strategy": "tensor_group", "symmetric": True, "type": "float"}
  return {"dynamic": True, "group_size": 32, "num_bits": 4,
          "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True,
          "type": "float"}


def _ct_weights(fmt):
  """compressed-tensors' weight QuantizationArgs of NVFP4A16 / MXFP4A16."""
  if fmt == "nvfp4":
    return {"dynamic": False, "group_size": 16, "num_bits": 4,
            "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group",
            "symmetric": True, "type": "float"}
  return {"dynamic": False, "group_size": 32, "num_bits": 4,
          "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True,
          "type": "float"}
