"""Packed FP4 Hugging Face checkpoints read back, dequantized to float32.

`checkpoint(directory, cfg)` is fp4jax.llama.hf.HfCheckpoint for a dense
checkpoint and `PackedCheckpoint` for one whose linear layers are packed:

  compressed-tensors  config.json's quantization_config, format
                      "nvfp4-pack-quantized" (W = code * weight_scale /
                      weight_global_scale) or "mxfp4-pack-quantized" (W =
                      code * 2^(weight_scale - 127)); a transform_config
                      Hadamard at the input of the packed Linears (the
                      weights stored rotated) is undone
  modelopt            hf_quant_config.json with quant_algo NVFP4 (W = code *
                      weight_scale * weight_scale_2)

Each packed module's `weight_packed` (or ModelOpt's uint8 `weight`) and
scales stand for its dense `.weight`, so the checks and the sharded loading
of HfCheckpoint apply unchanged; a packed weight is dequantized whole when a
device first reads from it (one layer at a time). Input scales are not
needed for the float32 weights and are skipped.

Bad input raises ConvertError (one line): a declaration that is not of
that shape (fp4jax.records) or whose weights are not 4-bit floats in the
groups its format packs, a declared field the reader does not implement
exactly as written (_CT_WEIGHTS, _CT_SCHEME, _MODELOPT_FIELDS: the field,
its value and what is read), two declared layouts, packed tensors with no
declaration (a deleted quantization_config or hf_quant_config.json), a
per-tensor scale that is not positive and finite or (compressed-tensors,
which divides by it) whose reciprocal overflows float32 (checked when
opened), a block scale that is negative or NaN, and scales whose weights
leave float32: code x block scale, the per-tensor scale or the undone
rotation overflowing, or the per-tensor scale taking a weight below
float32's normal range (when dequantized, naming the scale).
"""

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import fp4jax
from fp4jax import records
from fp4jax.llama import fp4_weights
from fp4jax.llama import hf
from fp4jax.llama.hf import ConvertError

CT_GROUPS = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}
# The weights' QuantizationArgs the reader implements, per format: field ->
# the values read (as JSON holds them). A field not here is refused, but for
# _CT_CALIBRATION's, which only steer how scales were found.
_CT_WEIGHTS = {
    fmt: {"strategy": (strategy,), "symmetric": (True,), "dynamic": (False,),
          "block_structure": (None,), "scale_dtype": (None, scale_dtype),
          "zp_dtype": (None, "torch.float8_e4m3fn"),
          "actorder": (None, False, "weight", "static")}
    for fmt, strategy, scale_dtype in (
        ("nvfp4-pack-quantized", "tensor_group", "torch.float8_e4m3fn"),
        ("mxfp4-pack-quantized", "group", "torch.uint8"))}
# What compressed-tensors takes for a field that is missing (strategy: from a
# positive group_size).
_CT_DEFAULTS = {"strategy": "group", "symmetric": True, "dynamic": False,
                "block_structure": None, "scale_dtype": None, "zp_dtype": None,
                "actorder": None}
_CT_CALIBRATION = ("observer", "observer_kwargs")
# A config group's fields: the activations' quantization is the serving
# engine's (not read: the reader gives the weights).
_CT_SCHEME = ("targets", "weights", "input_activations", "output_activations",
              "format")
_CT_STATUS = "compressed"  # weights stored packed; other statuses are dense
# hf_quant_config.json's quantization block: fields read or only the engine's
# (kv_cache_quant_algo, exclude_modules: the packed tensors say which modules
# are packed); has_zero_point and pre_quant_scale only as false.
_MODELOPT_FIELDS = ("quant_algo", "group_size", "kv_cache_quant_algo",
                    "exclude_modules", "has_zero_point", "pre_quant_scale")
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal
MODELOPT_CONFIG = "hf_quant_config.json"
# The tensors that stand for a packed module's weight, by layout.
_PARTS = {"compressed-tensors": ("weight_packed", "weight_scale",
                                 "weight_global_scale", "input_global_scale"),
          "modelopt": ("weight", "weight_scale", "weight_scale_2",
                       "input_scale")}
_SAFETENSORS_DTYPES = {"U8": np.uint8, "F32": np.float32,
                       "F8_E4M3": ml_dtypes.float8_e4m3fn}


def checkpoint(directory, cfg):
  """HfCheckpoint or PackedCheckpoint of `directory`, checked against cfg."""
  if _layout(directory) is None:
    return hf.HfCheckpoint(directory, cfg)
  return PackedCheckpoint(directory, cfg)


def _layout(directory):
  """(layout, group size, rotation block or None, rotation's ignore list),
  or None for a dense checkpoint. The declaration must hold 4-bit floats in
  the groups its format packs; packed tensors without one are refused."""
  path = os.path.join(directory, MODELOPT_CONFIG)
  if os.path.isfile(path):
    quant = records.check(records.ModelOptQuantization, records.read(
        records.ModelOptConfig, path)["quantization"], f"{path}: quantization")
    if quant["quant_algo"] != "NVFP4":
      raise ConvertError(f"{path}: quant_algo {quant['quant_algo']!r} is not "
                         "read; allowed: 'NVFP4'")
    if quant.get("group_size") != 16:
      raise ConvertError(f"{path}: quantization.group_size is "
                         f"{quant.get('group_size', 'missing')}; NVFP4 packs "
                         "groups of 16")
    for key, value in quant.items():
      if key not in _MODELOPT_FIELDS:
        raise ConvertError(f"{path}: quantization.{key} is not read (it is "
                           f"{_json(value)}); fields read: "
                           f"{', '.join(_MODELOPT_FIELDS)}")
      if key in ("has_zero_point", "pre_quant_scale") and value not in (
          None, False):
        raise ConvertError(f"{path}: quantization.{key} is {_json(value)}; "
                           "NVFP4 is read only without it (false)")
    other = records.read(records.HfConfig, os.path.join(
        directory, hf.CONFIG_FILE)).get("quantization_config") if os.path.isfile(
            os.path.join(directory, hf.CONFIG_FILE)) else None
    if other and other.get("quant_method") != "modelopt":
      raise ConvertError(
          f"{directory!r} declares two layouts: {MODELOPT_CONFIG} (ModelOpt) "
          f"and config.json's quantization_config (quant_method "
          f"{_json(other.get('quant_method'))}); keep the one its tensors hold")
    return "modelopt", 16, None, ()
  path = os.path.join(directory, hf.CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  quant = records.read(records.HfConfig, path).get("quantization_config")
  if not quant:
    _undeclared(directory, path)
    return None
  where = f"{path}: quantization_config"
  quant = records.check(records.QuantizationConfig, quant, where)
  if quant.get("quant_method") != "compressed-tensors" or (
      quant.get("format") not in CT_GROUPS):
    raise ConvertError(f"{where}: {quant.get('quant_method')!r} format "
                       f"{quant.get('format')!r} is not read; allowed: "
                       f"compressed-tensors {list(CT_GROUPS)}")
  fmt = quant["format"]
  group = CT_GROUPS[fmt]
  if not quant.get("config_groups"):
    raise ConvertError(f"{where}: field 'config_groups' is missing (it "
                       "declares the weights' bits and group size)")
  status = quant.get("quantization_status")
  if status != _CT_STATUS:
    raise ConvertError(f"{where}.quantization_status is {_json(status)}; "
                       f"packed weights are read only as {_json(_CT_STATUS)}")
  if quant.get("sparsity_config"):
    raise ConvertError(f"{where}.sparsity_config is "
                       f"{_json(quant['sparsity_config'])[:100]}; sparse "
                       "compression is not read (allowed: {} or null)")
  for name, scheme in quant["config_groups"].items():
    at = f"{where}.config_groups.{name}"
    scheme = records.check(records.QuantizationGroup, scheme, at)
    for key in scheme:
      if key not in _CT_SCHEME:
        raise ConvertError(f"{at}.{key} is not read (it is "
                           f"{_json(scheme[key])[:100]}); fields read: "
                           f"{', '.join(_CT_SCHEME)}")
    if scheme.get("format") not in (None, fmt):
      raise ConvertError(f"{at}.format is {_json(scheme['format'])}; it is "
                         f"read only as the checkpoint's format {_json(fmt)} "
                         "or null")
    weights = records.check(records.QuantizationArgs, scheme["weights"],
                            f"{at}.weights")
    declared = (weights["num_bits"], weights["type"], weights["group_size"])
    if declared != (4, "float", group) and (
        declared[0], declared[1].lower(), declared[2]) != (4, "float", group):
      raise ConvertError(
          f"{at}.weights: num_bits {declared[0]}, type {declared[1]!r}, "
          f"group_size {declared[2]} do not fit format {fmt!r}, "
          f"whose tensors hold 4-bit floats (E2M1) in groups of {group}")
    _check_weights(weights, fmt, f"{at}.weights")
  block, ignore = _rotation(quant.get("transform_config") or {},
                            f"{where}.transform_config")
  return "compressed-tensors", group, block, ignore


def _json(value):
  """A value as the JSON file spells it (true, null, "tensor")."""
  return json.dumps(value, default=str)


def _check_weights(weights, fmt, at):
  """ConvertError naming the first field of a weights QuantizationArgs whose
  value the reader does not implement for format `fmt` (_CT_WEIGHTS)."""
  allowed = _CT_WEIGHTS[fmt]
  for key in weights:
    if key not in allowed and key not in ("num_bits", "type", "group_size") + (
        _CT_CALIBRATION):
      raise ConvertError(f"{at}.{key} is not a field compressed-tensors "
                         f"declares (it is {_json(weights[key])[:100]}); "
                         f"fields read: num_bits, type, group_size, "
                         f"{', '.join(allowed)}, {', '.join(_CT_CALIBRATION)}")
  for key, values in allowed.items():
    value = weights.get(key, _CT_DEFAULTS[key])
    if isinstance(value, str):
      value = value.lower()
    if value not in values or isinstance(value, bool) != isinstance(
        values[values.index(value)], bool):
      given = (_json(weights[key]) if key in weights else
               f"missing (compressed-tensors then takes {_json(value)})")
      raise ConvertError(
          f"{at}.{key} is {given}; format {fmt!r} is read only with "
          f"{' or '.join(_json(v) for v in values)}"
          + (" (or without the field)" if _CT_DEFAULTS[key] in values else ""))


def _undeclared(directory, config_path):
  """ConvertError when the weights of a checkpoint that declares no packed
  layout hold packed tensors (its config.json's quantization_config or its
  hf_quant_config.json was lost)."""
  names = hf.weight_files(directory)
  for suffix, missing in (
      (".weight_packed", f"{config_path} has no quantization_config"),
      (".weight_scale_2", f"{directory!r} has no {MODELOPT_CONFIG}")):
    packed = sorted(n for n in names if n.endswith(suffix))
    if packed:
      raise ConvertError(
          f"{missing}, yet its weights hold {len(packed)} packed FP4 modules "
          f"(e.g. {packed[0]!r}); the declaration of their layout is needed "
          "to read them: restore it from the export")


def _rotation(transform, where):
  """(Hadamard block, modules it skips) of a transform_config, or (None, ())."""
  groups = records.check(records.TransformConfig, transform, where).get(
      "config_groups") or {}
  if not groups:
    return None, ()
  name, scheme = next(iter(groups.items()))
  scheme = records.check(records.TransformScheme, scheme,
                         f"{where}.config_groups.{name}")
  apply = [records.check(records.TransformApply, a, f"{where}.config_groups."
                         f"{name}.apply[{i}]")
           for i, a in enumerate(scheme.get("apply") or [])]
  if (len(groups) != 1 or scheme["type"] != "hadamard"
      or scheme.get("randomize") or len(apply) != 1
      or apply[0].get("location") != "input" or apply[0].get("inverse")
      or apply[0].get("targets") != ["Linear"]):
    raise ConvertError(f"{where} is read only as one deterministic 'hadamard' "
                       "at the input of every Linear; got "
                       f"{json.dumps(transform)[:200]}")
  block = scheme["head_dim"]
  if block < 2 or block & (block - 1):
    raise ConvertError(f"{where}.config_groups.{name}.head_dim is {block}; a "
                       "Hadamard rotation's block is a power of two >= 2")
  return block, tuple(apply[0].get("ignore") or ())


class PackedCheckpoint(hf.HfCheckpoint):
  """A Hugging Face Llama directory with packed FP4 linear layers (module doc).

  `files` maps every dense weight name, packed modules' `.weight` included,
  to its file; the packed tensors stay in `packed_files`.
  """

  def __init__(self, directory, cfg):
    self.layout, self.group, self.rotation, self.rotation_ignore = _layout(
        directory)
    super().__init__(directory, cfg)
    if self.group == 16:  # NVFP4: a per-tensor scale per module (4 bytes)
      reader = _Reader(self, None)
      for module in self.packed_modules:
        reader.global_scale(module)

  @property
  def files(self):
    return self._files

  @files.setter
  def files(self, raw):
    """Set by HfCheckpoint from the directory's {tensor name: file}."""
    parts = _PARTS[self.layout]
    packed = {name.rsplit(".", 1)[0] for name, path in raw.items()
              if name.endswith("." + parts[0]) and (
                  self.layout != "modelopt"
                  or f"{name.rsplit('.', 1)[0]}.{parts[2]}" in raw)}
    self.packed_modules = sorted(packed)
    self.packed_files = {name: path for name, path in raw.items()
                         if name.rsplit(".", 1)[0] in packed}
    self._files = {name: path for name, path in raw.items()
                   if name not in self.packed_files}
    self._files.update({f"{module}.weight": raw[f"{module}.{parts[0]}"]
                        for module in packed})

  def _open(self, stack):
    reader = _Reader(self, super()._open(stack))
    return {path: reader for path in set(self.files.values())}


class _Reader:
  """One reader for all files: a packed module's `.weight` as a float32
  `_Packed` view, any other tensor from its safetensors file."""

  def __init__(self, ckpt, handles):
    self.ckpt, self.handles, self.cache = ckpt, handles, {}

  def get_slice(self, name):
    module = name[:-len(".weight")]
    if f"{module}.{_PARTS[self.ckpt.layout][1]}" not in self.ckpt.packed_files:
      return self.handles[self.ckpt.files[name]].get_slice(name)
    return _Packed(self, module)

  def dense(self, module):
    """float32 [out, in] of one packed module (the last one is kept)."""
    if module not in self.cache:
      self.cache = {module: self._dequantize(module)}
    return self.cache[module]

  def packed_shape(self, module):
    """[out, in] of a packed module, from its header."""
    name = f"{module}.{_PARTS[self.ckpt.layout][0]}"
    out, half = _header(self.ckpt.packed_files[name], name)["shape"]
    return [out, 2 * half]

  def global_scale(self, module):
    """float32 per-tensor scale of an NVFP4 module, as stored; ConvertError
    unless it is positive and finite."""
    name = f"{module}.{_PARTS[self.ckpt.layout][2]}"
    g = self._read(name, np.float32)
    where = f"{self.ckpt.packed_files[name]!r}: tensor {name!r}"
    if g.size != 1:
      raise ConvertError(f"{where} has shape {list(g.shape)}; a per-tensor "
                         "scale holds one number")
    g = g.reshape(())
    if not (np.isfinite(g) and g > 0):
      raise ConvertError(f"{where} is {g}; a per-tensor scale must be "
                         "positive and finite")
    if self.ckpt.layout == "compressed-tensors" and g < 1 / _F32_MAX:
      raise ConvertError(f"{where} is {float(g):.8g}: compressed-tensors "
                         f"divides the weights by it, and 1 / {float(g):.8g} "
                         f"overflows float32 (largest {_F32_MAX:.3g}); a "
                         f"per-tensor scale must be at least "
                         f"{1 / _F32_MAX:.3g}")
    return g

  def _dequantize(self, module):
    ckpt = self.ckpt
    packed_name, scale_name, global_name, _ = (
        f"{module}.{p}" for p in _PARTS[ckpt.layout])
    packed = self._read(packed_name, np.uint8)
    groups = (packed.shape[0], packed.shape[1] * 2 // ckpt.group)
    mx = ckpt.group == 32  # E8M0 bits; NVFP4: E4M3 and a per-tensor scale
    scales = self._read(scale_name, np.uint8 if mx else ml_dtypes.float8_e4m3fn,
                        groups)
    bad = fp4_weights.bad_scales(scales)
    if bad:
      raise ConvertError(f"{ckpt.packed_files[scale_name]!r}: tensor "
                         f"{scale_name!r}: {bad}; block scales must be finite "
                         "and >= 0")
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
      w = fp4_weights.Fp4Weight(packed, scales, None).dequantize()
    self._check_range(w, packed, scales, scale_name, None)
    if not mx:
      g = self.global_scale(module)
      # compressed-tensors divides by its global scale, ModelOpt multiplies.
      with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        scaled = w / g if ckpt.layout == "compressed-tensors" else w * g
      self._check_range(scaled, packed, scales, global_name, (w, g))
      w = scaled
    if ckpt.rotation and module not in ckpt.rotation_ignore:
      if w.shape[1] % ckpt.rotation:
        raise ConvertError(
            f"{ckpt.packed_files[packed_name]!r}: tensor {packed_name!r} has "
            f"{w.shape[1]} inputs, not a multiple of the Hadamard block "
            f"{ckpt.rotation} its transform_config declares")
      # Stored as W^T H (H symmetric, its own inverse): undo the rotation.
      rotated = np.asarray(fp4jax.rotate(jnp.asarray(w), ckpt.rotation, -1))
      if not np.isfinite(rotated).all():
        (r, c), = np.argwhere(~np.isfinite(rotated))[:1]
        raise ConvertError(
            f"{ckpt.packed_files[packed_name]!r}: tensor {packed_name!r}: "
            f"undoing the Hadamard rotation (block {ckpt.rotation}) that its "
            f"transform_config declares overflows float32 (largest "
            f"{_F32_MAX:.3g}) at [{r}, {c}]: its dequantized weights reach "
            f"{float(np.max(np.abs(w))):.3g}; block scales must keep them "
            "within float32 after the rotation")
      w = rotated
    return w

  def _check_range(self, w, packed, scales, name, per_tensor):
    """ConvertError naming tensor `name` when the dequantized weights `w` (code
    * block scale, then with per_tensor = (those, the per-tensor scale) applied)
    overflow float32, or the per-tensor scale takes a normal weight below
    float32's normal range (subnormal or 0: its precision lost, and flushed to
    0 where denormals are)."""
    ckpt = self.ckpt
    lost = ~np.isfinite(w)
    if per_tensor is not None:
      lost |= (np.abs(w) < _F32_TINY) & (np.abs(per_tensor[0]) >= _F32_TINY)
    if not lost.any():
      return
    (r, c), = np.argwhere(lost)[:1]
    code = float(np.asarray(fp4jax.unpack_fp4(jnp.asarray(
        packed[r:r + 1, c // 2:c // 2 + 1]), axis=-1), np.float32)[0, c % 2])
    raw = scales[r, c // ckpt.group]
    if scales.dtype == np.uint8:
      block = f"2^{int(raw) - 127} (E8M0 {int(raw)})"
    else:
      block = f"{float(raw.astype(np.float32)):g} (E4M3)"
    where = f"{ckpt.packed_files[name]!r}: tensor {name!r}"
    if per_tensor is None:
      raise ConvertError(
          f"{where}: the block scale {block} at [{r}, {c // ckpt.group}] times "
          f"the code {code:g} at [{r}, {c}] overflows float32 (largest "
          f"{_F32_MAX:.3g}); block scales must keep code x scale finite")
    before, g = per_tensor
    how = ("divided by" if ckpt.layout == "compressed-tensors" else "times")
    result = (f"overflows float32 (largest {_F32_MAX:.3g})" if not np.isfinite(
        w[r, c]) else f"underflows to {float(w[r, c]):.3g}, below float32's "
                  f"normal range (smallest {_F32_TINY:.3g})")
    raise ConvertError(
        f"{where} is {float(g):.8g}: the weight {float(before[r, c]):g} (code "
        f"{code:g} x block scale {block}) at [{r}, {c}] {how} it {result}; "
        "a per-tensor scale this far from 1 cannot be read in float32")

  def _read(self, name, dtype, shape=None):
    """The whole tensor `name` of a packed module (checked dtype and shape)."""
    path = self.ckpt.packed_files.get(name)
    if path is None:
      raise ConvertError(f"{self.ckpt.directory!r}: missing tensor {name!r} "
                         f"(a packed {self.ckpt.layout} module needs it)")
    x = _read_tensor(path, name)
    if x.dtype != dtype or (shape is not None and x.shape != shape):
      raise ConvertError(f"{path!r}: tensor {name!r} is {x.dtype}"
                         f"{list(x.shape)}; expected {np.dtype(dtype)}"
                         f"{list(shape) if shape is not None else ''}")
    return x


class _Packed:
  """A packed module's weight as HfCheckpoint reads a safetensors slice:
  float32, dequantized when first indexed."""

  def __init__(self, reader, module):
    self.reader, self.module = reader, module

  def get_shape(self):
    return self.reader.packed_shape(self.module)

  def get_dtype(self):
    return "F32"

  def __getitem__(self, index):
    return self.reader.dense(self.module)[index]


def _header(path, name):
  """(safetensors header entry of `name`, byte offset of the file's data)."""
  try:
    with open(path, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      entry = dict(json.loads(f.read(size))[name])
  except (OSError, ValueError, KeyError, struct.error) as e:
    raise ConvertError(f"safetensors file {path!r}: tensor {name!r} cannot be "
                       f"read: {e}") from e
  entry["data_start"] = 8 + size
  return entry


def _read_tensor(path, name):
  """One tensor of a safetensors file as NumPy, float8_e4m3fn included
  (which safetensors' NumPy reader does not read)."""
  entry = _header(path, name)
  start, end = entry["data_offsets"]
  try:
    with open(path, "rb") as f:
      f.seek(entry["data_start"] + start)
      data = f.read(end - start)
  except OSError as e:
    raise ConvertError(f"safetensors file {path!r}: tensor {name!r} cannot be "
                       f"read: {e}") from e
  dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
  if dtype is None or len(data) != np.dtype(dtype).itemsize * int(
      np.prod(entry["shape"])):
    raise ConvertError(f"safetensors file {path!r}: tensor {name!r} is "
                       f"{entry['dtype']}{entry['shape']} with {len(data)} "
                       "bytes; expected U8, F32 or F8_E4M3 data of that shape")
  return np.frombuffer(data, dtype).reshape(entry["shape"])
