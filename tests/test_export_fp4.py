"""Packed FP4 exports (`export --quantize`), read back by compressed-tensors and transformers.

One tiny run (2 layers, block 0 kept in bf16, bfloat16 compute) is trained
once, on one device with the bf16 recipe (the quickest to compile). The
recipes are copies of it whose config.json records that recipe (as its
trainer writes it): what is checked is that the export holds the weights the
recorded recipe's forward multiplies, which depends on the weights and the
recipe, not on how the weights were reached. The forward's weight operand is
taken from the model itself: its DotGeneral modules sow the kernel they
receive, and fp4jax.dot's own operand preparation (flatten, rotate,
quantize; the xla backend) gives what Fprop multiplies.
"""

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.llama import fp4_weights
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import hf_packed
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax.train import export
from fp4jax.train import export_fp4
from fp4jax.train import init_from
from tests.helpers import EXPORT_STEPS as STEPS
from tests.helpers import cli as _cli
from tests.helpers import edited_config as _edited_config
from tests.helpers import export_config as _config
from tests.helpers import export_run as _run
from tests.helpers import forward_weight_operands as _forward_operands
from tests.helpers import init_from_refused as _init_from_refused
from tests.helpers import poke as _poke
from tests.helpers import refused as _refused
from tests.helpers import refused_in_process as _refused_in_process
from tests.helpers import run_with_recipe
from tests.helpers import train_export_run

pytestmark = pytest.mark.slow  # trains a run; loads torch and transformers

# recipe -> the format its Fprop weight operand is in.
EXACT = {"nvfp4": "nvfp4", "mxfp4-fprop": "mxfp4", "mxfp4-dh16": "mxfp4",
         "nvfp4-4over6": "nvfp4"}


def _interop():
  """(torch, transformers, compressed_tensors), or a skip naming the extra."""
  missing = [m for m in ("torch", "transformers", "compressed_tensors")
             if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{' and '.join(missing)} not installed (pip install "
                "'fp4jax[interop]'): the packed export is not read back")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import compressed_tensors  # pylint: disable=g-import-not-at-top
  return torch, transformers, compressed_tensors


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("run"))
  train_export_run(run_dir)
  return run_dir


@pytest.fixture(scope="module")
def runs(trained, tmp_path_factory):
  """recipe name -> a run directory whose config.json records that recipe."""
  out = {}
  for name in EXACT | {"bf16": None, "mxfp4-rh16": None}:
    run_dir = str(tmp_path_factory.mktemp(name))
    shutil.rmtree(run_dir)
    out[name] = run_with_recipe(trained, run_dir, name)
  return out


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
  """recipe name -> (its compressed-tensors export, the report's lines), each
  layer with its own NVFP4 per-tensor scale (exactly the trained forward)."""
  out = {}
  for name, fmt in EXACT.items():
    directory = str(tmp_path_factory.mktemp("ct") / name)
    out[name] = directory, export.export(runs[name], directory, quantize=fmt,
                                         fused_scale="per-projection")
  return out


def _tensors(directory):
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  return load_file(os.path.join(directory, "model.safetensors"))


def _quantization_config(directory):
  with open(os.path.join(directory, "config.json")) as f:
    return json.load(f)["quantization_config"]


def _release(version):
  """'0.20.1' or '0.20.1.dev3' -> (0, 20, 1)."""
  return tuple(int(part) for part in version.split(".")[:3])


def _bf16(x):
  import torch  # pylint: disable=g-import-not-at-top
  return torch.tensor(x).bfloat16()


@pytest.mark.parametrize("name", list(EXACT))
def test_compressed_tensors_decompresses_the_trained_forwards_weights(
    exports, runs, name):
  torch, _, ct = _interop()
  from compressed_tensors.compressors.base import BaseCompressor  # pylint: disable=g-import-not-at-top
  from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # pylint: disable=g-import-not-at-top
  directory, lines = exports[name]
  assert not any(line.startswith("quantize:") for line in lines)  # exact
  config = ct.quantization.QuantizationConfig.model_validate(
      _quantization_config(directory))
  scheme = config.config_groups["group_0"]
  compressor = BaseCompressor.get_value_from_registry(config.format)
  tensors = _tensors(directory)
  nvfp4 = EXACT[name] == "nvfp4"
  for module, (values, factor) in _forward_operands(runs[name]).items():
    state = {k[len(module) + 1:]: v for k, v in tensors.items()
             if k.startswith(module + ".")}
    assert sorted(state) == (["weight_global_scale"] if nvfp4 else []) + [
        "weight_packed", "weight_scale"]
    # Codes times block scales, as the library unpacks them: the forward's
    # block-dequantized values, bit for bit.
    packed = state["weight_packed"]
    codes = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2)
    scales = compressor._decompress_scale(state["weight_scale"], codes.dtype)  # pylint: disable=protected-access
    block = scheme.weights.group_size
    torch.testing.assert_close(
        codes * scales.repeat_interleave(block, dim=1), _bf16(values),
        rtol=0, atol=0)
    if nvfp4:
      assert state["weight_global_scale"].item() == np.float32(1) / factor
    # The library's whole decompression: for MXFP4 exactly the forward's
    # weight; for NVFP4 it divides by 1/factor where fp4jax multiplies by
    # factor, so a bf16 weight may differ in its last bit where the float32
    # products round on either side of a bf16 tie (3.5e-6 of random
    # weights; none of these).
    weight = compressor.decompress(state, scheme)["weight"]
    want = _bf16(values if factor is None else values * factor)
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight, want, rtol=0, atol=0)
  # Block 0 is kept in bf16, the head dense: written as dense weights, ignored.
  ignored = config.ignore
  assert "lm_head" in ignored and "model.layers.0.mlp.down_proj" in ignored
  assert len(ignored) == 1 + len(linears.BLOCK)
  assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4-dh16"])
def test_quantization_config_is_the_block_compressed_tensors_writes(
    exports, name):
  _, _, ct = _interop()
  ours = _quantization_config(exports[name][0])
  config = ct.quantization.QuantizationConfig.model_validate(ours)
  dumped = json.loads(json.dumps(config.model_dump(exclude=["quant_method"])))
  assert {k: ours[k] for k in dumped} == dumped
  assert ours["quant_method"] == "compressed-tensors"
  # The block names the compressed-tensors release whose layout it follows;
  # a later release must still read it (validated above).
  assert ours["version"] == export_fp4.CT_VERSION and ours["sparsity_config"] == {}
  assert _release(ct.__version__) >= _release(export_fp4.CT_VERSION)
  transform = ours["transform_config"]
  if name == "nvfp4":
    assert transform == {}
    return
  parsed = ct.transform.TransformConfig.model_validate(transform)
  assert json.loads(json.dumps(parsed.model_dump(), default=str)) == transform
  (scheme,) = parsed.config_groups.values()
  assert (scheme.type, scheme.head_dim, scheme.randomize) == ("hadamard", 16,
                                                             False)
  (args,) = scheme.apply
  assert args.location == "input" and args.ignore == config.ignore


def _reference_logits(run_dir, operands, tokens):
  """fp4jax's unquantized float32 model with block 1's weights replaced by
  the forward's weight operands (dequantized, bf16 as the library returns
  them, unrotated)."""
  cfg, recipe, params = _run(run_dir)
  params = jax.tree.map(np.asarray, params)
  rotation = recipe.fprop.hadamard
  for layer in linears.BLOCK:
    values, factor = operands[f"model.layers.1.{layer.hf_name[:-7]}"]
    w = _bf16(values if factor is None else values * factor).float().numpy()
    if rotation is not None:  # H16 is symmetric and its own inverse
      w = np.asarray(fp4jax.rotate(jnp.asarray(w), rotation.block, axis=-1))
    node = params["block_1"]
    for key in layer.path.split("/"):
      node = node[key]
    node["kernel"] = w.T.reshape(node["kernel"].shape)
  llama = model_lib.Llama(dataclasses.replace(cfg, dtype="float32"),
                          fp4jax.recipe("bf16"))
  return np.asarray(llama.apply({"params": params}, tokens))


@pytest.mark.parametrize("name", ["mxfp4-dh16", "nvfp4"])
def test_transformers_gives_fp4jax_logits_with_the_exported_weights(
    exports, runs, name):
  torch, transformers, ct = _interop()
  directory = exports[name][0]
  tokens = np.random.default_rng(0).integers(0, 258, (2, 16)).astype(np.int32)
  want = _reference_logits(runs[name], _forward_operands(runs[name]), tokens)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, quantization_config=transformers.CompressedTensorsConfig(
          dequantize=True))
  transform = _quantization_config(directory)["transform_config"]
  with torch.no_grad():
    unrotated = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    if transform:
      ct.transform.apply_transform_config(
          model, ct.transform.TransformConfig.model_validate(transform))
    got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
  if transform:  # the declared rotation is what makes them agree
    assert np.abs(unrotated - want).max() > 1e-2


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-4over6"])
def test_modelopt_layout_converts_to_compressed_tensors_byte_for_byte(
    exports, runs, tmp_path, name):
  torch, _, _ = _interop()
  from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # pylint: disable=g-import-not-at-top
  out, ct_out = str(tmp_path / "modelopt"), str(tmp_path / "ct")
  for directory, layout in ((out, "modelopt"), (ct_out, "compressed-tensors")):
    export.export(runs[name], directory, quantize="nvfp4", layout=layout,
                  fused_scale="per-projection", activations="fp4")
  with open(os.path.join(out, hf_packed.MODELOPT_CONFIG)) as f:
    quantization = json.load(f)["quantization"]
  assert (quantization["quant_algo"], quantization["group_size"]) == ("NVFP4",
                                                                      16)
  modelopt = _tensors(out)
  scale_2 = modelopt["model.layers.1.self_attn.q_proj.weight_scale_2"]
  assert scale_2.dtype == torch.float32 and scale_2.shape == ()
  converted = ModelOptNvfp4Converter(
      ignore=quantization["exclude_modules"], targets=["Linear"]).validate(
          dict(modelopt))
  ours = _tensors(ct_out)
  assert sorted(converted) == sorted(ours)
  assert "model.layers.1.mlp.up_proj.input_global_scale" in ours
  for key, want in ours.items():
    got = converted[key]
    if key.endswith("global_scale"):  # a scalar in ModelOpt's layout
      got = got.reshape(1)
    assert got.dtype == want.dtype and got.shape == want.shape, key
    assert got.contiguous().view(torch.uint8).numpy().tobytes() == (
        want.contiguous().view(torch.uint8).numpy().tobytes()), key
  with open(os.path.join(out, "config.json")) as f:
    assert "quantization_config" not in json.load(f)


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-4over6"])
def test_fused_projections_share_one_scale_and_count_what_changes(
    runs, tmp_path, name):
  torch, _, _ = _interop()
  out = str(tmp_path / "shared")
  lines = export.export(runs[name], out, quantize="nvfp4")  # shared: default
  (line,) = [l for l in lines if l.startswith("fused projections share")]
  tensors = _tensors(out)
  operands = _forward_operands(runs[name])
  changed = {}
  for group in (("q", "k", "v"), ("gate", "up")):
    modules = [m for p in group for m in operands if m.endswith(f".{p}_proj")]
    factors = [operands[m][1] for m in modules]
    for module in modules:  # the group's largest per-tensor scale, inverted
      assert tensors[module + ".weight_global_scale"].item() == (
          np.float32(1) / max(factors))
    for module in modules:
      values, factor = operands[module]
      w = fp4_weights.Fp4Weight(
          tensors[module + ".weight_packed"].numpy(),
          tensors[module + ".weight_scale"].view(torch.uint8).numpy().view(
              np.dtype(jnp.float8_e4m3fn)), max(factors))
      n = int(np.sum(w.dequantize() != values * factor))
      changed[module.rsplit(".", 1)[1][:-len("_proj")]] = (n, values.size)
      if factor == max(factors):  # its own scale: the forward's weights
        assert n == 0, module
  assert any(n for n, _ in changed.values())
  counts = ", ".join(f"{p} {n:,} of {size:,}" for p, (n, size) in
                     changed.items())
  assert line.endswith("weights changed from the trained forward: " + counts)


def test_fp4_activations_calibrate_nvfp4_input_scales(runs, tmp_path):
  torch, _, _ = _interop()
  from fp4jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  out = str(tmp_path / "w4a4")
  lines = export.export(runs["nvfp4"], out, quantize="nvfp4",
                        activations="fp4", calibration_batches=2)
  assert "NVFP4 input scales calibrated on 2 validation batch(es)" in (
      " ".join(lines))
  config = _quantization_config(out)["config_groups"]["group_0"]
  assert config["input_activations"]["dynamic"] == "local"
  # max |input| of each layer over the run's first two validation batches.
  cfg, recipe, params = _run(runs["nvfp4"])
  windows = pipeline.validation_windows(
      pipeline.data_config(), tokenizers.make_tokenizer("bytes"), seq_len=32,
      batch_size=8, num_batches=2)
  llama = model_lib.Llama(dataclasses.replace(cfg, capture_dots=True), recipe)
  # Compiled, as the trained forward is: run op by op, XLA rounds the bf16
  # attention output after each op and its max moves by a few bf16 steps.
  forward = jax.jit(lambda tokens: llama.apply(
      {"params": params}, tokens, mutable=["intermediates", "perturbations"],
      rngs={"quant": jax.random.key(0)})[1])
  amax = {}
  for window in windows:
    sown = forward(window[:, :-1])
    for name, node in sown["intermediates"]["block_1"]["attn"].items():
      x = np.abs(np.asarray(node["DotGeneral_0"]["lhs"][0], np.float32))
      amax[name] = max(amax.get(name, 0), x.max())
  tensors = _tensors(out)
  for name in ("q", "k", "v", "o"):
    scale = tensors[f"model.layers.1.self_attn.{name}_proj.input_global_scale"]
    want = np.float32(1) / (np.float32(amax[name]) * np.float32(1 / 2688))
    assert scale.item() == want, name
  assert "model.layers.0.self_attn.q_proj.input_global_scale" not in tensors


@pytest.mark.parametrize("name, layout", [
    ("nvfp4", "compressed-tensors"), ("mxfp4-dh16", "compressed-tensors"),
    ("nvfp4-4over6", "modelopt")])
def test_init_from_reads_a_packed_export_dequantized(runs, tmp_path, name,
                                                     layout):
  out = str(tmp_path / "export")
  export.export(runs[name], out, quantize=EXACT[name], layout=layout,
                fused_scale="per-projection")
  cfg, recipe, params = _run(runs[name])
  source = init_from.open_source(out, cfg)
  assert isinstance(source, hf_packed.PackedCheckpoint)
  loaded = jax.tree.map(np.asarray, source.load(hf_llama.abstract_params(cfg)))
  rotation = recipe.fprop.hadamard
  for module, (values, factor) in _forward_operands(runs[name]).items():
    want = values if factor is None else values * factor
    if rotation is not None:
      want = np.asarray(fp4jax.rotate(jnp.asarray(want), rotation.block, -1))
    layer = next(l for l in linears.BLOCK if module.endswith(l.hf_name[:-7]))
    node = loaded["block_1"]
    for key in layer.path.split("/"):
      node = node[key]
    got = node["kernel"].reshape(want.shape[1], -1).T
    # The per-tensor scale is applied as the layout stores it (one float32
    # rounding apart); MXFP4 codes times E8M0 scales are exact.
    np.testing.assert_allclose(got, want, rtol=2**-22 if factor else 0,
                               atol=1e-7 if rotation else 0)
  for path in (("embed", "embedding"), ("head", "kernel"),
               ("block_0", "mlp", "down", "kernel")):  # dense: as trained
    got, want = loaded, params
    for key in path:
      got, want = got[key], want[key]
    np.testing.assert_array_equal(got, np.asarray(want))


def test_packed_checkpoints_that_cannot_be_read_are_named(exports, runs,
                                                          tmp_path):
  cfg = _run(runs["mxfp4-dh16"])[0]
  bad = str(tmp_path / "bad")
  shutil.copytree(exports["mxfp4-dh16"][0], bad)
  path = os.path.join(bad, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["quantization_config"]["transform_config"]["config_groups"]["h16"][
      "randomize"] = True
  with open(path, "w") as f:
    json.dump(config, f)
  with pytest.raises(hf_llama.ConvertError, match="transform_config is read "
                     "only as one deterministic 'hadamard'"):
    hf_packed.checkpoint(bad, cfg)
  config["quantization_config"]["format"] = "int-quantized"
  with open(path, "w") as f:
    json.dump(config, f)
  with pytest.raises(hf_llama.ConvertError, match="format 'int-quantized' is "
                     "not read"):
    hf_packed.checkpoint(bad, cfg)


def test_scanned_and_sharded_packed_exports_hold_the_same_tensors(runs,
                                                                  tmp_path):
  torch, _, _ = _interop()
  config, cfg = export.run_config(runs["nvfp4"])
  cfg = dataclasses.replace(cfg, bf16_layers=())  # scanned blocks share one recipe
  params = jax.tree.map(np.asarray, _run(runs["nvfp4"])[2])
  scanned_cfg = dataclasses.replace(cfg, scan_layers=True)
  scanned = {k: v for k, v in params.items() if not k.startswith("block_")}
  scanned["blocks"] = jax.tree.map(lambda *x: np.stack(x), params["block_0"],
                                   params["block_1"])
  written = []
  for c, p, max_bytes in ((cfg, params, 1e9), (scanned_cfg, scanned, 1e9),
                          (cfg, params, 3e4)):
    out = str(tmp_path / str(len(written)))
    os.makedirs(out)
    packed = export_fp4.PackedExport(config, c, STEPS, "nvfp4",
                                     "compressed-tensors")
    n_files, _ = export.write_weights(p, c, out, np.float32, max_bytes, packed)
    written.append((out, n_files))
  (single, _), (from_scan, _), (sharded, n_files) = written
  assert n_files > 2
  want = _tensors(single)
  got = _tensors(from_scan)
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  for name in os.listdir(sharded):
    if name.endswith(".safetensors"):
      for key, value in load_file(os.path.join(sharded, name)).items():
        assert torch.equal(value.view(torch.uint8),
                           want[key].view(torch.uint8)), key
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
  with open(os.path.join(sharded, hf_llama.INDEX_FILE)) as f:
    assert sorted(json.load(f)["weight_map"]) == sorted(want)


def test_the_recipe_of_the_last_step_is_exported(runs):
  with open(os.path.join(runs["mxfp4-dh16"], "config.json")) as f:
    config = json.load(f)
  assert export_fp4.run_recipe(config, STEPS).name == "mxfp4-dh16"
  config["quant_schedule"] = [[1, "bf16"]]  # bf16 from the second step on
  assert export_fp4.run_recipe(config, 1).name == "mxfp4-dh16"
  assert export_fp4.run_recipe(config, 2).name == "bf16"
  p = fp4_weights.plan(export_fp4.run_recipe(config, 2), "mxfp4")
  assert not p.exact and p.rotation is None


def test_packed_weights_take_028x_of_bf16(exports):
  _interop()
  for name, ratio in (("nvfp4", 4.5 / 16), ("mxfp4-fprop", 4.25 / 16)):
    tensors = _tensors(exports[name][0])
    for layer in linears.BLOCK:
      module = f"model.layers.1.{layer.hf_name[:-7]}"
      nbytes = sum(v.numel() * v.element_size() for k, v in tensors.items()
                   if k.startswith(module + "."))
      packed = tensors[module + ".weight_packed"]
      bf16_bytes = packed.numel() * 2 * 2
      global_bytes = 4 if name == "nvfp4" else 0
      assert (nbytes - global_bytes) / bf16_bytes == ratio, (name, module)


def test_a_run_in_another_format_is_quantized_after_training(runs, tmp_path):
  torch, _, _ = _interop()
  _, _, params = _run(runs["bf16"])
  lines = export.export(runs["bf16"], str(tmp_path / "ptq"), quantize="nvfp4")
  (notice,) = [line for line in lines if line.startswith("quantize:")]
  assert "leaves Fprop's weight unquantized" in notice
  assert "after training (round to nearest)" in notice
  # Round to nearest of the bf16 weight (1D blocks of 16 along `in`).
  w = np.asarray(params["block_1"]["mlp"]["down"]["kernel"])
  q = fp4jax.quantize(jnp.asarray(w.T).astype(jnp.bfloat16),
                      fp4jax.QuantSpec("nvfp4"), axis=-1)
  tensors = _tensors(str(tmp_path / "ptq"))
  module = "model.layers.1.mlp.down_proj"
  np.testing.assert_array_equal(
      tensors[module + ".weight_packed"].numpy(),
      np.asarray(fp4jax.pack_fp4(q.values)))
  assert torch.equal(tensors[module + ".weight_scale"].view(torch.uint8),
                     torch.from_numpy(np.array(q.scales).view(np.uint8)))


def test_bad_input_is_one_line_with_exit_code_2(runs, tmp_path, capsys):
  for run, args, message in (
      ("nvfp4", ["--quantize", "fp8"], "--quantize 'fp8'; allowed: "
       "['nvfp4', 'mxfp4']"),
      ("nvfp4", ["--quantize", "mxfp4", "--layout", "modelopt"],
       "--layout modelopt holds ['nvfp4'] only, not --quantize 'mxfp4'"),
      ("nvfp4", ["--quantize", "nvfp4", "--layout", "gguf"],
       "--layout 'gguf'; allowed: ['compressed-tensors', 'modelopt']"),
      ("nvfp4", ["--layout", "modelopt"], "--layout 'modelopt' needs "
       "--quantize"),
      ("nvfp4", ["--quantize", "nvfp4", "--activations", "int8"],
       "--activations 'int8'; allowed: ['none', 'fp4']"),
      ("nvfp4", ["--quantize", "nvfp4", "--layout", "modelopt",
                 "--activations", "none"], "--layout modelopt is NVFP4 with "
       "FP4 activations (W4A4) only"),
      ("nvfp4", ["--quantize", "nvfp4", "--fused_scale", "max"],
       "--fused_scale 'max'; allowed: ['shared', 'per-projection']"),
      ("mxfp4-rh16", ["--quantize", "mxfp4"], "rotates Fprop with Hadamard "
       "signs 'per-step'")):
    out = tmp_path / "out"
    assert export.main(["export", runs[run], str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()
  p = fp4_weights.plan(fp4jax.recipe("mxfp4-dh16"), "mxfp4")
  with pytest.raises(hf_llama.ConvertError, match=r"a kernel of shape \[48, 64\] "
                     "contracts 48 inputs, not a multiple of 32"):
    fp4_weights.fp4_weight(np.zeros((48, 64), np.float32), 1, "bfloat16", p)


def test_w4a4_input_scales_fit_the_inputs_the_served_model_quantizes(
    runs, tmp_path):
  """An H16-rotated run exported as NVFP4 W4A4: its weights go out quantized
  after training, unrotated, with no transform declared, so an engine
  quantizes unrotated inputs; the static input scales are fp4jax's
  per-tensor scales of those inputs in the W4A4 forward of the export."""
  torch, transformers, _ = _interop()
  from fp4jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  run, out = runs["mxfp4-dh16"], str(tmp_path / "w4a4")
  # The ModelOpt layout's input_scale is the same calibration
  # (test_modelopt_layout_converts_to_compressed_tensors_byte_for_byte).
  export.export(run, out, quantize="nvfp4", fused_scale="per-projection",
                activations="fp4", calibration_batches=2)
  assert _quantization_config(out)["transform_config"] == {}
  tensors = _tensors(out)
  modules = [f"model.layers.1.{layer.hf_name[:-7]}" for layer in linears.BLOCK]
  exported = {  # module -> the amax its input scale stands for
      m: np.float32(2688) / np.float32(tensors[m + ".input_global_scale"].item())
      for m in modules}
  # fp4jax's W4A4 forward of the export on the calibration batches: the
  # weights as exported (NVFP4 round to nearest, unrotated) times NVFP4 inputs.
  cfg, recipe, params = _run(run)
  nvfp4 = fp4jax.QuantSpec("nvfp4")
  w4a4 = dataclasses.replace(recipe, fprop=recipes.Gemm(nvfp4, nvfp4))
  llama = model_lib.Llama(dataclasses.replace(cfg, capture_dots=True), w4a4)
  forward = jax.jit(lambda tokens: llama.apply(
      {"params": params}, tokens, mutable=["intermediates", "perturbations"]))
  windows = [w[:, :-1] for w in pipeline.validation_windows(
      pipeline.data_config(), tokenizers.make_tokenizer("bytes"), seq_len=32,
      batch_size=8, num_batches=2)]
  want, amax = [], {}
  for tokens in windows:
    logits, sown = forward(tokens)
    want.append(np.asarray(logits, np.float32))
    for layer, module in zip(linears.BLOCK, modules):
      node = sown["intermediates"]["block_1"]
      for key in layer.path.split("/"):
        node = node[key]
      x = np.abs(np.asarray(node["DotGeneral_0"]["lhs"][0], np.float32))
      amax[module] = max(amax.get(module, 0), x.max())
  for module in modules:  # one compiled program each: within a bf16 step
    np.testing.assert_allclose(exported[module], amax[module], rtol=2**-7,
                               err_msg=module)
  # Served: transformers through compressed-tensors, W4A4 in the run's
  # compute dtype (inputs quantized with the static scales).
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.bfloat16)
  served = {}
  for name, module in model.named_modules():
    if name in exported:
      module.register_forward_pre_hook(
          lambda m, args, name=name: served.__setitem__(name, max(
              served.get(name, 0), args[0].float().abs().max().item())))

  def logits():
    with torch.no_grad():
      return [model(torch.tensor(t, dtype=torch.long)).logits.float().numpy()
              for t in windows]

  got = logits()
  # What the engine quantizes fits its scale, up to the two frameworks' bf16
  # numerics (torch's silu and compressed-tensors' bf16 input quantization).
  for module in modules:
    assert 0.9 < served[module] / exported[module] < 1.1, (
        module, served[module], exported[module])
  err = max(np.abs(g - w).max() for g, w in zip(got, want))
  # The calibration on H16-rotated inputs of the trained forward (before):
  # down_proj's largest inputs clip, and the logits move away from fp4jax's.
  rotated = export_fp4.input_amax(export.run_config(run)[0], cfg, recipe,
                                  params, 2, False)
  for name, module in model.named_modules():
    if name in exported:
      module.input_global_scale.data[:] = float(
          np.float32(1) / (np.float32(rotated[name]) * np.float32(1 / 2688)))
  down = "model.layers.1.mlp.down_proj"
  assert served[down] > 2 * rotated[down]
  rotated_err = max(np.abs(g - w).max() for g, w in zip(logits(), want))
  assert rotated_err > 1.5 * err


def test_calibration_flags_are_refused_where_they_do_not_apply(runs, tmp_path,
                                                               capsys):
  """The command line: --calibration_batches within the validation set and
  only where NVFP4 input scales are calibrated, --activations only with
  --quantize, no rotation the ModelOpt layout cannot declare."""
  from fp4jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  rotated = str(tmp_path / "nvfp4-h16")  # an NVFP4 run whose Fprop rotates
  shutil.copytree(runs["nvfp4"], rotated)
  path = os.path.join(rotated, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["resolved"]["recipe"]["fprop"]["hadamard"].update(block=16,
                                                           signs="none")
  with open(path, "w") as f:
    json.dump(config, f)
  w4a4 = ["--quantize", "nvfp4", "--activations", "fp4"]
  nvfp4 = runs["nvfp4"]
  bound = (r"--calibration_batches 1000000: the validation set's [\d,]+ tokens "
           r"\(at most data.val_tokens\) hold ([\d,]+) batches of 8 disjoint "
           r"windows of seq_len \+ 1 = 33 tokens; give at most \1$")
  # As a user types it: the command in its own process.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
  proc = subprocess.run(
      [sys.executable, "-m", "fp4jax.convert", "export", nvfp4,
       str(tmp_path / "out"), *w4a4, "--calibration_batches", "1000000"],
      cwd=root, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 2 and not proc.stdout, (proc.stdout, proc.stderr)
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
  match = re.search(bound, proc.stderr.strip())
  assert match, proc.stderr
  assert not (tmp_path / "out").exists()
  for run, args, message in (  # the same checks, in this process
      (nvfp4, [*w4a4, "--calibration_batches", "0"],
       "--calibration_batches must be >= 1, got 0$"),
      (nvfp4, ["--quantize", "nvfp4", "--calibration_batches", "2"],
       "--calibration_batches 2 calibrates NVFP4 input scales, so it needs "
       "--quantize nvfp4 with --activations fp4 \\(or --layout modelopt\\); "
       "this export is W4A16 \\(--activations none\\)$"),
      (nvfp4, ["--activations", "fp4"], "--activations 'fp4' needs --quantize "
       "\\(nvfp4 or mxfp4\\); a dense export quantizes nothing$"),
      (runs["mxfp4-dh16"], ["--quantize", "mxfp4", "--activations", "fp4",
                            "--calibration_batches", "2"],
       re.escape("this export is MXFP4, whose inputs the engine scales "
                 "itself") + "$"),
      (nvfp4, ["--calibration_batches", "2"], "this export is dense$"),
      (rotated, ["--quantize", "nvfp4", "--layout", "modelopt"],
       re.escape("rotates Fprop (Hadamard block 16), which the modelopt "
                 "layout cannot declare"))):
    assert export.main(["export", run, str(tmp_path / "out"), *args]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()
  # The bound: the validation set's batches of disjoint windows.
  held = int(match.group(1).replace(",", ""))
  data = dict(data_cfg=pipeline.data_config(), seq_len=32, batch_size=8,
              tokenizer=tokenizers.make_tokenizer("bytes"), disjoint=True)
  assert not pipeline.validation_windows(num_batches=held, **data).overlap
  with pytest.raises(pipeline.TooManyBatches):
    pipeline.validation_windows(num_batches=held + 1, **data)


# ---------------------------------------------------------------------------
# What the export and init_from refuse: real files edited on disk. Each
# refusal is a one-line UserError (what the CLIs print, exiting with status 2);
# one case of each CLI runs as a process (one CPU device, as a user's laptop),
# the others in this process (on one device): what they check is the file, not
# the process (the helpers: tests/helpers.py).

DOWN = "model.layers.1.mlp.down_proj"


def test_weights_with_nan_are_refused_before_anything_is_written(trained,
                                                                 tmp_path):
  run = str(tmp_path / "run")
  shutil.copytree(trained, run)
  state = os.path.join(run, "checkpoints", str(STEPS), "state")
  tree = jax.tree.map(np.array, ocp.StandardCheckpointer().restore(state))
  tree["params"]["block_1"]["mlp"]["down"]["kernel"][0, 0] = np.nan
  shutil.rmtree(state)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(state, tree)
  out = tmp_path / "out"
  names = (f"the checkpoint at step {STEPS} of {run!r} holds NaN or Inf in 1 "
           "tensor(s): block_1/mlp/down/kernel", "--step")
  # The dense export in this process, the packed one as the command.
  _refused_in_process(lambda: export.export(run, str(out)), *names)
  assert not out.exists() and not (tmp_path / "out.partial").exists()
  rc, log = _cli("-m", "fp4jax.convert", "export", run, str(out), "--quantize",
                 "nvfp4")
  _refused(rc, log, *names)
  assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("name, tensor, raw, message, process", [
    ("nvfp4", "weight_global_scale", struct.pack("<f", -2.0**20),
     "is -1048576.0; a per-tensor scale must be positive and finite", False),
    ("nvfp4", "weight_global_scale", struct.pack("<f", 0.0),
     "is 0.0; a per-tensor scale must be positive and finite", False),
    # As train.py: found as the weights are read, after start-up compiled.
    ("nvfp4", "weight_scale", b"\x7f", "1 of its 256 block scales are "
     "negative or NaN (the first nan at [0, 0]); block scales must be finite "
     "and >= 0", True),
    ("mxfp4-fprop", "weight_scale", b"\xff", "1 of its 128 block scales are "
     "negative or NaN (the first NaN at [0, 0])", False)],
    ids=["negative_global", "zero_global", "nan_e4m3_block", "nan_e8m0_block"])
def test_init_from_refuses_a_packed_scale_that_is_not_positive(
    exports, tmp_path, name, tensor, raw, message, process):
  bad = str(tmp_path / "export")
  shutil.copytree(exports[name][0], bad)
  _poke(os.path.join(bad, "model.safetensors"), f"{DOWN}.{tensor}", raw)
  _init_from_refused(tmp_path, bad, f"{DOWN}.{tensor}", message,
                     process=process)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(quantization_config="nvfp4"),
     "field 'quantization_config' must be an object or null, got \"nvfp4\""),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"][
        "weights"].update(group_size=32),
     "num_bits 4, type 'float', group_size 32 do not fit format "
     "'nvfp4-pack-quantized', whose tensors hold 4-bit floats (E2M1) in "
     "groups of 16"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"][
        "weights"].update(num_bits=8), "num_bits 8, type 'float'"),
    (lambda c: c.pop("quantization_config"),
     "config.json has no quantization_config, yet its weights hold 7 packed "
     f"FP4 modules (e.g. '{DOWN}.weight_packed')"),
], ids=["string", "group_size", "num_bits", "deleted"])
def test_init_from_checks_the_declaration_against_the_tensors(
    exports, tmp_path, edit, message):
  bad = str(tmp_path / "export")
  shutil.copytree(exports["nvfp4"][0], bad)
  _edited_config(bad, edit)
  _init_from_refused(tmp_path, bad, message)


def test_init_from_a_modelopt_export_checks_its_file_and_scales(runs, tmp_path):
  good = str(tmp_path / "modelopt")
  export.export(runs["nvfp4"], good, quantize="nvfp4", layout="modelopt",
                calibration_batches=1)
  for case in ("deleted", "negative"):
    bad = str(tmp_path / case)
    shutil.copytree(good, bad)
    if case == "deleted":
      os.remove(os.path.join(bad, hf_packed.MODELOPT_CONFIG))
      message = (f"{bad!r} has no hf_quant_config.json, yet its weights hold 7 "
                 f"packed FP4 modules (e.g. '{DOWN}.weight_scale_2')")
    else:
      _poke(os.path.join(bad, "model.safetensors"), f"{DOWN}.weight_scale_2",
            struct.pack("<f", -1.0))
      message = (f"tensor '{DOWN}.weight_scale_2' is -1.0; a per-tensor scale "
                 "must be positive and finite")
    _init_from_refused(tmp_path / f"{case}_run", bad, message)
