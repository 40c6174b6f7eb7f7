"""Exports edited on disk, read back by init_from (fp4jax.llama.hf, hf_packed).

What a reader does not implement exactly as the files declare it is refused
in one line naming the field or tensor, its value and what is read: the
compressed-tensors and ModelOpt declarations field by field, a config that
ties the embeddings while storing a different head, and scales whose
weights leave float32 (named as the scale, not as a NaN kernel). The run
and its exports come from tests/helpers.py (the run of
tests/test_export_fp4.py); the cases call what train.py calls
(init_from.open_source, init_from.load) in this process, one as train.py.
"""

import importlib.util
import json
import os
import shutil
import struct

import jax
import numpy as np
import pytest

from fp4jax.llama import hf as hf_llama
from fp4jax.llama import hf_packed
from fp4jax.train import export
from fp4jax.train import init_from
from tests.helpers import edited_config
from tests.helpers import init_from_refused
from tests.helpers import poke
from tests.helpers import refused_in_process
from tests.helpers import run_with_recipe
from tests.helpers import train_export_run

pytestmark = pytest.mark.slow  # trains a run

DOWN = "model.layers.1.mlp.down_proj"
WEIGHTS = "quantization_config.config_groups.group_0.weights"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  """{name: directory}: the trained run ("run"), its dense export ("dense"),
  compressed-tensors exports "nvfp4", "mxfp4" and "mxfp4-dh16" (a declared
  Hadamard rotation), and a ModelOpt one ("modelopt")."""
  root = tmp_path_factory.mktemp("made")
  out = {"run": str(root / "run")}
  train_export_run(out["run"])
  out["dense"] = str(root / "dense")
  export.export(out["run"], out["dense"])
  for name, recipe, fmt, layout in (
      ("nvfp4", "nvfp4", "nvfp4", "compressed-tensors"),
      ("mxfp4", "mxfp4-fprop", "mxfp4", "compressed-tensors"),
      ("mxfp4-dh16", "mxfp4-dh16", "mxfp4", "compressed-tensors"),
      ("modelopt", "nvfp4", "nvfp4", "modelopt")):
    run = str(root / f"run-{name}")
    if not os.path.exists(run):
      run_with_recipe(out["run"], run, recipe)
    out[name] = str(root / name)
    export.export(run, out[name], quantize=fmt, layout=layout,
                  fused_scale="per-projection")
  return out


@pytest.fixture(scope="module")
def cfg(made):
  return export.run_config(made["run"])[1]


def _copy(made, name, tmp_path):
  bad = str(tmp_path / name)
  shutil.copytree(made[name], bad)
  return bad


def _load(path, cfg):
  """The parameters as train.py reads config.init_from=path (NumPy)."""
  source = init_from.open_source(path, cfg)
  params = init_from.load(source, hf_llama.abstract_params(cfg), path)
  return jax.tree.map(np.asarray, params)


def _refused(path, cfg, *names):
  """Reading `path` as init_from is refused in one line naming `names`."""
  return refused_in_process(lambda: _load(path, cfg), "config.init_from",
                            *names)


def _weights(edit):
  return lambda c: edit(c["quantization_config"]["config_groups"]["group_0"][
      "weights"])


# --- the compressed-tensors and ModelOpt declarations, field by field ---------


@pytest.mark.parametrize("name, edit, message", [
    ("nvfp4", _weights(lambda w: w.update(strategy="tensor")),
     f'{WEIGHTS}.strategy is "tensor"; format \'nvfp4-pack-quantized\' is read '
     'only with "tensor_group"'),
    ("nvfp4", _weights(lambda w: w.update(symmetric=False)),
     f"{WEIGHTS}.symmetric is false; format 'nvfp4-pack-quantized' is read "
     "only with true (or without the field)"),
    ("nvfp4", _weights(lambda w: w.pop("strategy")),
     f"{WEIGHTS}.strategy is missing (compressed-tensors then takes "
     '"group"); format \'nvfp4-pack-quantized\' is read only with '
     '"tensor_group"'),
    ("mxfp4", _weights(lambda w: w.update(strategy="channel")),
     f'{WEIGHTS}.strategy is "channel"; format \'mxfp4-pack-quantized\' is '
     'read only with "group" (or without the field)'),
    ("mxfp4", _weights(lambda w: w.update(dynamic=True)),
     f"{WEIGHTS}.dynamic is true; format 'mxfp4-pack-quantized' is read only "
     "with false"),
    ("nvfp4", _weights(lambda w: w.update(dynamic="local")),
     f'{WEIGHTS}.dynamic is "local"'),
    ("mxfp4", _weights(lambda w: w.update(scale_dtype="torch.float16")),
     f'{WEIGHTS}.scale_dtype is "torch.float16"; format '
     '\'mxfp4-pack-quantized\' is read only with null or "torch.uint8"'),
    ("nvfp4", _weights(lambda w: w.update(block_structure=[16, 16])),
     f"{WEIGHTS}.block_structure is [16, 16]; format 'nvfp4-pack-quantized' "
     "is read only with null"),
    ("nvfp4", _weights(lambda w: w.update(actorder="group")),
     f'{WEIGHTS}.actorder is "group"'),
    ("nvfp4", _weights(lambda w: w.update(zp_dtype="torch.int8")),
     f'{WEIGHTS}.zp_dtype is "torch.int8"'),
    ("nvfp4", _weights(lambda w: w.update(num_bits=8)),
     "weights: num_bits 8, type 'float', group_size 16 do not fit format "
     "'nvfp4-pack-quantized'"),
    ("mxfp4", _weights(lambda w: w.update(type="int")),
     "weights: num_bits 4, type 'int', group_size 32"),
    ("nvfp4", _weights(lambda w: w.update(zero_point=0)),
     f"{WEIGHTS}.zero_point is not a field compressed-tensors declares (it "
     "is 0)"),
    ("nvfp4", lambda c: c["quantization_config"]["config_groups"]["group_0"]
     .update(format="float-quantized"),
     "quantization_config.config_groups.group_0.format is "
     '"float-quantized"; it is read only as the checkpoint\'s format '
     '"nvfp4-pack-quantized" or null'),
    ("nvfp4", lambda c: c["quantization_config"]["config_groups"]["group_0"]
     .update(weight_observer="mse"),
     "quantization_config.config_groups.group_0.weight_observer is not read"),
    ("mxfp4", lambda c: c["quantization_config"].update(
        quantization_status="frozen"),
     'quantization_config.quantization_status is "frozen"; packed weights '
     'are read only as "compressed"'),
    ("mxfp4", lambda c: c["quantization_config"].update(
        sparsity_config={"format": "sparse-24-bitmask"}),
     "quantization_config.sparsity_config is {\"format\": "
     "\"sparse-24-bitmask\"}; sparse compression is not read"),
    ("mxfp4-dh16", lambda c: c["quantization_config"]["transform_config"][
        "config_groups"]["h16"].update(head_dim=12),
     "quantization_config.transform_config.config_groups.h16.head_dim is 12; "
     "a Hadamard rotation's block is a power of two >= 2"),
], ids=["strategy_tensor", "symmetric_false", "strategy_missing_nvfp4",
        "strategy_channel", "dynamic_true", "dynamic_local", "scale_dtype",
        "block_structure", "actorder_group", "zp_dtype", "num_bits", "type_int",
        "unknown_weights_field", "group_format", "unknown_group_field",
        "status_frozen", "sparsity", "hadamard_block"])
def test_a_declaration_the_reader_does_not_implement_is_refused(
    made, cfg, tmp_path, name, edit, message):
  bad = _copy(made, name, tmp_path)
  edited_config(bad, edit)
  _refused(bad, cfg, os.path.join(bad, "config.json"), message)


def test_declarations_that_read_the_same_are_accepted(made, cfg, tmp_path):
  """What compressed-tensors reads as the export wrote it: the defaults
  spelled out or left out, calibration-only fields, MXFP4's inferred
  strategy; the weights are those of the unedited export."""
  want = _load(made["mxfp4"], cfg)
  bad = _copy(made, "mxfp4", tmp_path)

  def edit(w):
    for key in ("strategy", "symmetric", "dynamic", "scale_dtype"):
      w.pop(key)
    w.update(observer="minmax", observer_kwargs={}, actorder="weight",
             block_structure=None, type="FLOAT")

  edited_config(bad, _weights(edit))
  got = _load(bad, cfg)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(pre_quant_scale=True),
     "quantization.pre_quant_scale is true; NVFP4 is read only without it "
     "(false)"),
    (lambda q: q.update(awq_block_size=128),
     "quantization.awq_block_size is not read (it is 128); fields read: "
     "quant_algo, group_size"),
], ids=["pre_quant_scale", "unknown_field"])
def test_a_modelopt_declaration_the_reader_does_not_implement_is_refused(
    made, cfg, tmp_path, edit, message):
  bad = _copy(made, "modelopt", tmp_path)
  edited_config(bad, lambda c: edit(c["quantization"]),
                name=hf_packed.MODELOPT_CONFIG)
  _refused(bad, cfg, hf_packed.MODELOPT_CONFIG, message)


def test_two_declared_layouts_are_refused(made, cfg, tmp_path):
  bad = _copy(made, "modelopt", tmp_path)
  with open(os.path.join(made["nvfp4"], "config.json")) as f:
    declared = json.load(f)["quantization_config"]
  edited_config(bad, lambda c: c.update(quantization_config=declared))
  _refused(bad, cfg, f"{bad!r} declares two layouts: hf_quant_config.json "
           "(ModelOpt) and config.json's quantization_config (quant_method "
           '"compressed-tensors")')


# --- tie_word_embeddings with a stored head -----------------------------------


def _tensor_bytes(path, name):
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    start, end = json.loads(f.read(size))[name]["data_offsets"]
    f.seek(8 + size + start)
    return f.read(end - start)


def test_a_tied_config_with_a_different_stored_head_is_refused(made, cfg,
                                                               tmp_path):
  bad = _copy(made, "dense", tmp_path)
  edited_config(bad, lambda c: c.update(tie_word_embeddings=True))
  _refused(bad, cfg, os.path.join(bad, "config.json"),
           "tie_word_embeddings is true, yet the stored lm_head.weight differs "
           "from model.embed_tokens.weight (first at [0, 0]",
           "set tie_word_embeddings to false to read the stored head, or "
           "remove lm_head.weight to tie them")


def test_a_tied_config_with_the_embedding_stored_as_head_is_read(made, cfg,
                                                                 tmp_path):
  """Both readings agree when the stored head is the embedding."""
  tied = _copy(made, "dense", tmp_path)
  edited_config(tied, lambda c: c.update(tie_word_embeddings=True))
  weights = os.path.join(tied, "model.safetensors")
  poke(weights, "lm_head.weight",
       _tensor_bytes(weights, "model.embed_tokens.weight"))
  params = _load(tied, cfg)
  np.testing.assert_array_equal(params["head"]["kernel"],
                                params["embed"]["embedding"].T)


def test_transformers_reads_a_contradictory_tie_as_the_refusal_says(made,
                                                                    tmp_path):
  """The refusal's claim, where transformers is installed: 5.x keeps the
  stored head of a tied config when it differs from the embedding (4.x ties
  it to the embedding)."""
  if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers not installed (pip install 'fp4jax[interop]')")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  bad = _copy(made, "dense", tmp_path)
  edited_config(bad, lambda c: c.update(tie_word_embeddings=True))
  stored = load_file(os.path.join(bad, "model.safetensors"))
  model = transformers.LlamaForCausalLM.from_pretrained(
      bad, torch_dtype=torch.float32)
  head = model.lm_head.weight.detach().numpy()
  want = "lm_head.weight" if int(transformers.__version__.split(".")[0]) >= 5 \
      else "model.embed_tokens.weight"
  np.testing.assert_array_equal(head, stored[want])


# --- scales whose weights leave float32 ----------------------------------------


def test_an_e8m0_scale_that_overflows_is_named_by_train_py(made, tmp_path):
  """E8M0 254 is 2^127: a code of 2 or more times it overflows float32. As
  train.py: one line, exit status 2, the scale named (not a NaN kernel)."""
  bad = _copy(made, "mxfp4", tmp_path)
  poke(os.path.join(bad, "model.safetensors"), f"{DOWN}.weight_scale",
       bytes([254]))
  init_from_refused(tmp_path, bad, f"tensor '{DOWN}.weight_scale': the block "
                    "scale 2^127 (E8M0 254) at [0, 0] times the code",
                    "overflows float32 (largest 3.4e+38)", process=True)


@pytest.mark.parametrize("name, tensor, raw, message", [
    ("mxfp4", "weight_scale", bytes([253]),
     "the block scale 2^126 (E8M0 253) at [0, "),
    ("nvfp4", "weight_global_scale", struct.pack("<f", 1e-45),
     "is 1.4012985e-45: compressed-tensors divides the weights by it, and 1 / "
     "1.4012985e-45 overflows float32 (largest 3.4e+38)"),
    ("nvfp4", "weight_global_scale", struct.pack("<f", 1e-39),
     "is 1.0000002e-39: compressed-tensors divides the weights by it"),
    ("modelopt", "weight_scale_2", struct.pack("<f", 1e-45),
     "is 1.4012985e-45: the weight "),
    ("modelopt", "weight_scale_2", struct.pack("<f", 3e38),
     "is 3e+38: the weight "),
], ids=["e8m0_253", "ct_global_1e-45", "ct_global_1e-39", "modelopt_tiny",
        "modelopt_huge"])
def test_a_scale_whose_weights_leave_float32_is_named(made, cfg, tmp_path, name,
                                                      tensor, raw, message):
  bad = _copy(made, name, tmp_path)
  poke(os.path.join(bad, "model.safetensors"), f"{DOWN}.{tensor}", raw)
  line = _refused(bad, cfg, f"tensor '{DOWN}.{tensor}'", message)
  assert "NaN or Inf" not in line
  if name == "modelopt":
    assert ("times it underflows to " if "e-45" in message else
            "times it overflows float32") in line, line
    assert "below float32's normal range (smallest 1.18e-38)" in line or (
        "e-45" not in message), line


def test_a_rotation_block_that_does_not_divide_the_inputs_is_named(
    made, cfg, tmp_path):
  bad = _copy(made, "mxfp4-dh16", tmp_path)
  edited_config(bad, lambda c: c["quantization_config"]["transform_config"][
      "config_groups"]["h16"].update(head_dim=128))
  _refused(bad, cfg, ".weight_packed' has 64 inputs, not a multiple of the "
           "Hadamard block 128 its transform_config declares")


def test_a_rotation_that_overflows_is_named(made, cfg, tmp_path):
  """Row 0 of a rotated MXFP4 layer as 3 x 2^125 everywhere (finite): undoing
  the declared 16-point Hadamard sums 16 of them / 4, which overflows."""
  bad = _copy(made, "mxfp4-dh16", tmp_path)
  weights = os.path.join(bad, "model.safetensors")
  poke(weights, f"{DOWN}.weight_packed", bytes([0x55]) * (cfg.mlp_dim // 2))
  poke(weights, f"{DOWN}.weight_scale", bytes([252]) * (cfg.mlp_dim // 32))
  _refused(bad, cfg, f"tensor '{DOWN}.weight_packed': undoing the Hadamard "
           "rotation (block 16) that its transform_config declares overflows "
           "float32 (largest 3.4e+38) at [0, 0]: its dequantized weights reach "
           "1.28e+38")
