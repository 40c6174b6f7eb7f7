"""Hugging Face's LlamaForCausalLM format: names, layouts, config, reading.

fp4jax's Llama is Hugging Face's LlamaForCausalLM (same half-split RoPE with
Llama 3 scaling, GQA, RMSNorm, SwiGLU, untied head), so a conversion only
renames tensors and changes layouts (HF weights are [out, in]):
  embed/embedding [V, D]          model.embed_tokens.weight [V, D]
  block_i/attn/q/kernel [D, H, d] model.layers.i.self_attn.q_proj.weight [H*d, D]
    (k, v likewise with the kv heads)
  block_i/attn/o/kernel [H, d, D] model.layers.i.self_attn.o_proj.weight [D, H*d]
  block_i/mlp/gate|up/kernel [D, F], down/kernel [F, D]
                                  model.layers.i.mlp.*_proj.weight (transposed)
  block_i/attn_norm, mlp_norm     model.layers.i.input_layernorm,
                                  post_attention_layernorm (.weight [D])
  final_norm/scale, head/kernel   model.norm.weight, lm_head.weight [V, D]
With scan_layers the blocks are one `blocks/...` tree with a leading layer
axis. `HfCheckpoint(directory, cfg)` checks a directory (ours or a published
Llama) against a LlamaConfig and `.load(abstract_params)` puts it on a mesh,
each process reading only the blocks its devices hold. Bad input raises
ConvertError, one line naming the tensor or field; so does a config.json
that ties the embeddings (tie_word_embeddings) while the lm_head.weight it
stores differs from the embedding, which readers take differently
(transformers 4 the embedding, transformers 5 the stored head).
"""

import contextlib
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from fp4jax import errors
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax import recipes
from fp4jax import records
from fp4jax import sharding as sharding_lib

# safetensors dtype codes we read (converted exactly to float32).
READ_DTYPES = ("F32", "BF16", "F16")
TIED_ROWS = 4096  # rows of lm_head compared with the embedding at a time
CONFIG_FILE = "config.json"  # a Hugging Face model directory's (not a run's)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SCALING_FIELDS = ("rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_context")
# LlamaConfig fields that fix the parameters' shapes and the forward pass.
MODEL_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                "mlp_dim", "rope_theta", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_context", "norm_eps")

# Layouts: how an fp4jax kernel sits in a Hugging Face [out, in] weight.
#   same       identical array
#   t          fp4jax [a, b] = hf[b, a]
#   in_heads   fp4jax [D, N, d] = hf[N*d, D]   (q, k, v)
#   out_heads  fp4jax [H, d, D] = hf[D, H*d]   (o)


def _kernels(prefix):
  """(fp4jax path, hf name, layout) of the linears (fp4jax.llama.linears) under `prefix`."""
  return tuple(((*layer.path.split("/"), "kernel"), layer.hf_name, layer.hf_layout)
               for layer in linears.BLOCK + (linears.HEAD,) if layer.path.startswith(prefix))


_BLOCK = (  # in Hugging Face's order
    (("attn_norm", "scale"), "input_layernorm.weight", "same"),
    *_kernels("attn/"),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", "same"),
    *_kernels("mlp/"),
)
_EMBED = (("embed", "embedding"), "model.embed_tokens.weight", "same")
_TOP = ((("final_norm", "scale"), "model.norm.weight", "same"), *_kernels("head"))


class ConvertError(errors.UserError):
  """A checkpoint, config field or argument that cannot be converted."""


def tensor_table(cfg):
  """[(hf name, fp4jax path, layer or None, layout)] in Hugging Face order.

  layer is the index into the leading axis of a scanned `blocks/...` leaf
  (None when the leaf holds one layer).
  """
  rows = [(_EMBED[1], _EMBED[0], None, _EMBED[2])]
  for i in range(cfg.n_layers):
    for sub, hf, layout in _BLOCK:
      path = ("blocks",) + sub if cfg.scan_layers else (f"block_{i}",) + sub
      rows.append((f"model.layers.{i}.{hf}", path,
                   i if cfg.scan_layers else None, layout))
  rows += [(hf, path, None, layout) for path, hf, layout in _TOP]
  return rows


def to_hf(layout, x):
  """One fp4jax array (one layer) in the Hugging Face layout."""
  if layout == "same":
    return x
  if layout == "t":
    return x.T
  if layout == "in_heads":
    return x.reshape(x.shape[0], -1).T
  return x.reshape(-1, x.shape[-1]).T  # out_heads


def _hf_shape(layout, shape):
  return to_hf(layout, np.empty(shape, np.bool_)).shape


def _read_region(view, layout, index, head_dim):
  """The fp4jax-layout block `index` (slices) of a safetensors slice `view`.

  Reads only the rows and columns the block needs (whole heads).
  """
  if layout == "same":
    return view[index]
  if layout == "t":
    return view[index[1], index[0]].T
  if layout == "in_heads":
    embed, heads, dims = index
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    block = view[rows, embed]
    return block.reshape(-1, head_dim, block.shape[-1])[:, dims].transpose(
        2, 0, 1)
  heads, dims, embed = index  # out_heads
  cols = slice(heads.start * head_dim, heads.stop * head_dim)
  block = view[embed, cols].T
  return block.reshape(-1, head_dim, block.shape[-1])[:, dims]


# ---------------------------------------------------------------------------
# Configs.


def hf_config(cfg, *, bos_id, eos_id, dtype, max_positions):
  """config.json of a LlamaForCausalLM with the sizes of LlamaConfig `cfg`."""
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": max_positions,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      # Llama 3 scaling with factor 1 is plain RoPE.
      "rope_scaling": None if cfg.rope_factor == 1 else {
          "rope_type": "llama3",
          "factor": cfg.rope_factor,
          "low_freq_factor": cfg.rope_low_freq_factor,
          "high_freq_factor": cfg.rope_high_freq_factor,
          "original_max_position_embeddings": cfg.rope_original_context,
      },
      "attention_bias": False,
      "mlp_bias": False,
      "tie_word_embeddings": False,
      "bos_token_id": bos_id,
      "eos_token_id": eos_id,
      "torch_dtype": dtype,
      "use_cache": True,
  }


def _field(hf, key, where, kind=int):
  value = hf.get(key)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kind) or isinstance(value, bool):
    raise ConvertError(f"{where}: field {key!r} must be a {kind.__name__}, "
                       f"got {value!r}")
  return value


def _rope_fields(hf, where):
  """rope_theta and the Llama 3 scaling of a config (v4 or v5 spelling)."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict):  # transformers >= 5: theta inside
    theta_src, scaling, key = params, params, "rope_parameters"
  else:
    theta_src, scaling, key = hf, hf.get("rope_scaling"), "rope_scaling"
  out = {"rope_theta": _field(theta_src, "rope_theta", where, float)}
  kind = None if scaling is None else scaling.get(
      "rope_type", scaling.get("type"))
  if kind in (None, "default"):
    out.update(rope_factor=1.0)  # Llama 3 scaling with factor 1 is the identity
    return out
  if kind != "llama3":
    raise ConvertError(f"{where}: {key}.rope_type {kind!r} is not "
                       "implemented; allowed: 'llama3', 'default' or none")
  sub = f"{where}: {key}"
  out.update(
      rope_factor=_field(scaling, "factor", sub, float),
      rope_low_freq_factor=_field(scaling, "low_freq_factor", sub, float),
      rope_high_freq_factor=_field(scaling, "high_freq_factor", sub, float),
      rope_original_context=_field(
          scaling, "original_max_position_embeddings", sub))
  return out


def llama_fields(hf, where):
  """(LlamaConfig fields, tied embeddings?) of a Hugging Face config dict."""
  if hf.get("model_type") != "llama":
    raise ConvertError(f"{where}: not a Llama checkpoint (model_type "
                       f"{hf.get('model_type')!r}, allowed: 'llama')")
  fields = dict(
      vocab_size=_field(hf, "vocab_size", where),
      dim=_field(hf, "hidden_size", where),
      mlp_dim=_field(hf, "intermediate_size", where),
      n_layers=_field(hf, "num_hidden_layers", where),
      n_heads=_field(hf, "num_attention_heads", where),
      n_kv_heads=hf.get("num_key_value_heads",
                        hf.get("num_attention_heads")),
      norm_eps=_field(hf, "rms_norm_eps", where, float))
  fields.update(_rope_fields(hf, where))
  try:
    cfg = model_lib.LlamaConfig(**fields)
  except ValueError as e:
    raise ConvertError(f"{where}: {e}") from e
  unsupported = (
      ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
      ("attention_bias", hf.get("attention_bias", False), False),
      ("mlp_bias", hf.get("mlp_bias", False), False),
      ("head_dim", hf.get("head_dim") or cfg.head_dim, cfg.head_dim))
  for key, value, allowed in unsupported:
    if value != allowed:
      raise ConvertError(f"{where}: {key}={value!r} is not supported; "
                         f"fp4jax's Llama needs {allowed!r}")
  return fields, bool(hf.get("tie_word_embeddings", False))


def check_model_fields(cfg, fields, where):
  """Refuses a checkpoint whose sizes differ from LlamaConfig `cfg`.

  `fields` holds the checkpoint's MODEL_FIELDS (missing rope fields take
  the LlamaConfig defaults); the first differing field is named. The Llama 3
  scaling fields are not compared when both sides have rope_factor 1 (plain
  RoPE).
  """
  defaults = model_lib.LlamaConfig(**{
      k: fields[k] for k in ("vocab_size", "dim", "n_layers", "n_heads",
                             "n_kv_heads", "mlp_dim")})
  plain = cfg.rope_factor == 1 and fields.get("rope_factor") == 1
  for key in MODEL_FIELDS:
    if plain and key in _SCALING_FIELDS:
      continue
    theirs = fields.get(key, getattr(defaults, key))
    if getattr(cfg, key) != theirs:
      raise ConvertError(
          f"{where}: model.{key} is {getattr(cfg, key)!r} in this config but "
          f"{theirs!r} in the checkpoint; set --config.model.{key}={theirs!r}")


# ---------------------------------------------------------------------------
# Reading Hugging Face safetensors onto a mesh.


def read_json(path, what):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConvertError(f"{what} {path!r} cannot be read: {e}") from e


def weight_files(directory):
  """{tensor name: safetensors file} of a Hugging Face model directory."""
  index = os.path.join(directory, INDEX_FILE)
  if os.path.exists(index):
    weight_map = records.check(records.HfIndex, read_json(index, "index"),
                               index)["weight_map"]
    outside = [f for f in weight_map.values() if not records.inside(directory, f)]
    if outside:
      raise ConvertError(f"{index}: weight_map names the file {outside[0]!r}, "
                         f"which is not inside {directory!r}")
    return {name: os.path.join(directory, f) for name, f in weight_map.items()}
  single = os.path.join(directory, SINGLE_FILE)
  if not os.path.exists(single):
    raise ConvertError(
        f"{directory!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; "
        "give a Hugging Face model directory with safetensors weights")
  with _safe_open(single) as f:
    return {name: single for name in f.keys()}


def _safe_open(path):
  """safetensors' NumPy reader of `path` (headers are read here)."""
  try:
    return safe_open(path, framework="np")
  except Exception as e:  # pylint: disable=broad-except
    # safetensors raises its own SafetensorError as well as OSError.
    raise ConvertError(f"safetensors file {path!r} cannot be read: "
                       f"{str(e).splitlines()[0]}") from e


class HfCheckpoint:
  """A Hugging Face Llama directory, checked against LlamaConfig `cfg`.

  Construction reads only config.json and the safetensors headers and raises
  ConvertError for a size, tensor name, shape or dtype that does not fit.
  """

  def __init__(self, directory, cfg):
    self.directory, self.cfg = directory, cfg
    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(config_path):
      raise ConvertError(f"{directory!r} is not a Hugging Face checkpoint "
                         "(no config.json)")
    fields, tied = llama_fields(records.check(
        records.HfConfig, read_json(config_path, "config"), config_path), config_path)
    check_model_fields(cfg, fields, config_path)
    self.files = weight_files(directory)
    tensors = 1 + len(_BLOCK) * cfg.n_layers + len(_TOP)  # tensor_table's rows
    if len(self.files) < tensors - 1:  # - 1: a tied lm_head; the rest named below
      raise ConvertError(
          f"{config_path}: its {cfg.n_layers} layers make {tensors:,} tensors, but "
          f"the weights of {directory!r} hold {len(self.files):,}")
    table = tensor_table(cfg)
    expected = [row[0] for row in table]
    if tied and "lm_head.weight" not in self.files:
      # Tied embeddings: the head is the embedding, transposed.
      table = [(_EMBED[1],) + row[1:] if row[0] == "lm_head.weight" else row
               for row in table]
      expected.remove("lm_head.weight")
    missing = [n for n in expected if n not in self.files]
    extra = sorted(set(self.files) - set(expected))
    if missing or extra:
      which, name = (("missing", missing[0]) if missing
                     else ("unexpected", extra[0]))
      raise ConvertError(f"{directory!r}: {which} tensor {name!r} "
                         f"({len(missing)} missing, {len(extra)} unexpected "
                         f"for a {cfg.n_layers}-layer Llama)")
    self.table = table
    self._check_headers(config_path if tied and "lm_head.weight" in self.files
                        else None)

  def _check_headers(self, tied_config=None):
    """Checks each tensor's shape and dtype; with tied_config (the path of a
    config.json that ties the embeddings while lm_head.weight is stored), that
    the stored head equals the embedding (_check_tied_head)."""
    shapes = param_shapes(self.cfg)
    with contextlib.ExitStack() as stack:
      handles = self._open(stack)
      self._check_shapes(handles, shapes)
      if tied_config:
        self._check_tied_head(handles, tied_config)

  def _check_tied_head(self, handles, config_path):
    """ConvertError unless the stored lm_head.weight equals the embedding.

    With tie_word_embeddings true and both tensors stored, readers disagree
    when they differ: transformers 4 ties the head to the embedding (the
    stored head is dropped), transformers 5 keeps the stored head. Equal
    tensors read the same either way; read TIED_ROWS rows at a time.
    """
    head, embed = (handles[self.files[n]].get_slice(n)
                   for n in ("lm_head.weight", _EMBED[1]))
    rows = head.get_shape()[0]
    for start in range(0, rows, TIED_ROWS):
      stop = min(start + TIED_ROWS, rows)
      a = np.asarray(head[start:stop], np.float32)
      b = np.asarray(embed[start:stop], np.float32)
      differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
      if differ.any():
        r, c = (int(i) for i in np.argwhere(differ)[0])
        raise ConvertError(
            f"{config_path}: tie_word_embeddings is true, yet the stored "
            f"lm_head.weight differs from {_EMBED[1]} (first at [{start + r}, "
            f"{c}]: {a[r, c]:g} against {b[r, c]:g}), and readers disagree on "
            "such a checkpoint (transformers 4 uses the embedding as the head, "
            "transformers 5 the stored head); set tie_word_embeddings to "
            "false to read the stored head, or remove lm_head.weight to tie "
            "them")

  def _check_shapes(self, handles, shapes):
    for name, path, layer, layout in self.table:
      try:
        view = handles[self.files[name]].get_slice(name)
      except Exception as e:  # pylint: disable=broad-except
        raise ConvertError(f"{self.files[name]!r}: tensor {name!r} cannot "
                           f"be read: {e}") from e
      shape = shapes[path] if layer is None else shapes[path][1:]
      want = _hf_shape(layout, shape)
      if tuple(view.get_shape()) != want or view.get_dtype() not in (
          READ_DTYPES):
        raise ConvertError(
            f"{self.files[name]!r}: tensor {name!r} is "
            f"{view.get_dtype()}{list(view.get_shape())}; expected shape "
            f"{list(want)} and a dtype in {READ_DTYPES}")

  def _open(self, stack):
    return {path: stack.enter_context(_safe_open(path))
            for path in sorted(set(self.files.values()))}

  def load(self, abstract_params):
    """The parameters as jax.Arrays with the shardings of `abstract_params`.

    abstract_params: the model's params pytree of jax.ShapeDtypeStruct with
    shardings. Each process reads from the files only the blocks of its own
    devices (jax.make_array_from_callback), converted to float32.
    """
    rows = {}
    for name, path, layer, layout in self.table:
      rows.setdefault(path, []).append((name, layer, layout))
    head_dim = self.cfg.head_dim
    with contextlib.ExitStack() as stack:
      handles = self._open(stack)

      def one(key_path, leaf):
        entries = rows[_path_names(key_path)]

        def block(index):
          index = tuple(slice(*s.indices(n)) for s, n in zip(index,
                                                             leaf.shape))
          if entries[0][1] is None:  # one layer
            name, _, layout = entries[0]
            view = handles[self.files[name]].get_slice(name)
            out = _read_region(view, layout, index, head_dim)
          else:  # scanned: stack the layers of this block
            out = np.stack([
                _read_region(handles[self.files[name]].get_slice(name),
                             layout, index[1:], head_dim)
                for name, _, layout in entries[index[0]]])
          return np.ascontiguousarray(out, dtype=leaf.dtype)

        return jax.make_array_from_callback(leaf.shape, leaf.sharding, block)

      return jax.tree_util.tree_map_with_path(one, abstract_params)


def _path_names(key_path):
  return tuple(k.key for k in key_path)


def abstract_params(cfg, mesh=None):
  """The params pytree of LlamaConfig `cfg` as jax.ShapeDtypeStruct.

  With a mesh, each leaf has the trainer's sharding (from its logical axis
  names); without, it lives on the first device.
  """
  llama = model_lib.Llama(cfg, recipes.recipe("bf16"))
  tokens = jnp.zeros((1, 1), jnp.int32)
  boxed = jax.eval_shape(
      lambda key: llama.init({"params": key}, tokens)["params"],
      jax.random.key(0))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, nn.unbox(boxed))
  else:
    shardings = sharding_lib.logical_to_sharding(boxed, mesh)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nn.unbox(boxed), shardings)


def param_shapes(cfg):
  flat = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
  return {_path_names(k): tuple(v.shape) for k, v in flat}
