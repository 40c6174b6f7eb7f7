"""GGUF exports (`export RUN OUT.gguf --quantize`), read back by gguf-py.

One tiny run (2 layers, block 0 kept in bf16, bfloat16 compute) is trained
once; the recipes are copies of it whose config.json records that recipe.
Every tensor gguf-py reads back is decoded here by a NumPy decoder written
from ggml's block layouts (ggml-common.h: block_mxfp4, block_nvfp4;
ggml-quants.c: dequantize_row_*) and compared with the trained forward's
Fprop weight operand, taken from the model itself: its DotGeneral modules
sow the kernel they receive, and fp4jax.dot's own operand preparation gives
what Fprop multiplies (tests/helpers.forward_weight_operands). llama.cpp
itself loads the files in tests/test_llamacpp.py.
"""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.llama import hf as hf_llama
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax.train import export
from fp4jax.train import export_gguf
from tests.helpers import EXPORT_STEPS as STEPS
from tests.helpers import cli
from tests.helpers import export_run
from tests.helpers import forward_weight_operands
from tests.helpers import main_in_process
from tests.helpers import refused
from tests.helpers import refused_in_process
from tests.helpers import run_with_recipe
from tests.helpers import train_export_run

gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install "
                           "'fp4jax[test]'): GGUF files are not read back")
pytestmark = pytest.mark.slow  # trains a run

# recipe -> the format its Fprop weight operand is in.
EXACT = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "nvfp4-4over6": "nvfp4"}
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """recipe name -> a copy of one trained run whose config.json records that recipe."""
  trained = str(tmp_path_factory.mktemp("trained"))
  train_export_run(trained)
  return {name: run_with_recipe(trained, str(tmp_path_factory.mktemp(name) / "run"), name)
          for name in [*EXACT, "mxfp4-dh16", "bf16"]}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
  """recipe name -> (its GGUF file, the report's lines)."""
  folder = tmp_path_factory.mktemp("gguf")
  out = {}
  for name, fmt in (EXACT | {"mxfp4-dh16": "mxfp4", "bf16": "nvfp4"}).items():
    path = str(folder / f"{name}.gguf")
    out[name] = path, export_gguf.export_gguf(runs[name], path, quantize=fmt)
  return out


def _forward_weights(run_dir):
  """{"attn_q", ...: (block 1's Fprop weight operand values, float32 [out, in]
  in Hugging Face's order, its per-tensor factor or None)}."""
  return {GGUF_NAMES[module.split(".", 3)[-1]]: operand
          for module, operand in forward_weight_operands(run_dir).items()}


# --- an independent decoder of ggml's blocks ----------------------------------

def _decode_mxfp4(raw):
  """block_mxfp4 rows uint8 [rows, n * 17] -> float64 [rows, n * 32]: byte 0
  the E8M0 exponent e, bytes 1-16 element j low and j + 16 high, value
  E2M1 * 2^(e - 127)."""
  blocks = raw.reshape(raw.shape[0], -1, 17)
  qs = blocks[..., 1:]
  values = np.concatenate([E2M1[qs & 15], E2M1[qs >> 4]], axis=-1)
  return (values * 2.0 ** (blocks[..., :1].astype(np.int64) - 127)).reshape(raw.shape[0], -1)


def _ue4m3(bits):
  """UE4M3 bits -> float64: 4 exponent bits (bias 7), 3 mantissa bits."""
  exp, man = (bits >> 3) & 15, (bits & 7).astype(np.float64)
  return np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8) * 2.0 ** (exp.astype(np.int64) - 7))


def _decode_nvfp4(raw):
  """block_nvfp4 rows uint8 [rows, n * 36] -> float64 [rows, n * 64]: four
  UE4M3 scales, then per 16 elements 8 bytes, element j low and j + 8 high."""
  rows = raw.shape[0]
  blocks = raw.reshape(rows, -1, 36)
  assert not np.any(blocks[..., :4] & 0x80) and not np.any(blocks[..., :4] == 0x7F)
  qs = blocks[..., 4:].reshape(rows, -1, 4, 8)
  values = np.concatenate([E2M1[qs & 15], E2M1[qs >> 4]], axis=-1)
  return (values * _ue4m3(blocks[..., :4])[..., None]).reshape(rows, -1)


def _hf_rows(x, n_heads):
  """Rows of a q/k weight in llama.cpp's rotary order (head h's pair i at
  rows 2i, 2i + 1) back in Hugging Face's (rows i, i + d/2)."""
  d = x.shape[0] // n_heads
  return x.reshape(n_heads, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(x.shape)


def _tensors(path):
  return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _fields(path):
  return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


def _decoded(tensor):
  """A GGUF tensor as float64 [rows, columns] (F32, BF16, MXFP4, NVFP4)."""
  kind = tensor.tensor_type.name
  data = np.asarray(tensor.data)
  if kind == "MXFP4":
    return _decode_mxfp4(data)
  if kind == "NVFP4":
    return _decode_nvfp4(data)
  if kind == "BF16":
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
  assert kind == "F32", kind
  return data.astype(np.float64)


def _llama_order(cfg, name, w):
  heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(name)
  return w if heads is None else _hf_rows(w, heads)


# --- tests ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(EXACT))
def test_gguf_holds_the_trained_forwards_weights_bit_for_bit(runs, exports, name):
  path, lines = exports[name]
  assert lines[1].startswith("weights: the trained forward's"), lines
  cfg = export.run_config(runs[name])[1]
  tensors = _tensors(path)
  for short, (values, factor) in _forward_weights(runs[name]).items():
    tensor = tensors[f"blk.1.{short}.weight"]
    assert tensor.tensor_type.name == EXACT[name].upper()
    assert [int(n) for n in tensor.shape] == [values.shape[1], values.shape[0]]  # [in, out]
    decoded = _llama_order(cfg, short, _decoded(tensor))
    np.testing.assert_array_equal(decoded, values.astype(np.float64))
    if factor is None:
      assert f"blk.1.{short}.scale" not in tensors
    else:  # llama.cpp multiplies the GEMM's output by it, as fp4jax does
      scale = np.asarray(tensors[f"blk.1.{short}.scale"].data)
      assert scale.dtype == np.float32 and scale.tolist() == [factor]


def test_dense_tensors_are_the_forwards_own(runs, exports):
  """Block 0 (kept in bf16), the embedding and the head in the run's compute
  dtype (bfloat16: its forward read them so), norms and rope_freqs float32."""
  cfg, _, params = export_run(runs["mxfp4"])
  tensors = _tensors(exports["mxfp4"][0])
  bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
  q0 = tensors["blk.0.attn_q.weight"]
  assert q0.tensor_type.name == "BF16"
  np.testing.assert_array_equal(
      _llama_order(cfg, "attn_q", _decoded(q0)),
      bf16(params["block_0"]["attn"]["q"]["kernel"].reshape(cfg.dim, -1).T))
  np.testing.assert_array_equal(_decoded(tensors["token_embd.weight"]),
                                bf16(params["embed"]["embedding"]))
  np.testing.assert_array_equal(_decoded(tensors["output.weight"]),
                                bf16(params["head"]["kernel"].T))
  norm = tensors["blk.1.ffn_norm.weight"]
  assert norm.tensor_type.name == "F32"
  np.testing.assert_array_equal(norm.data, params["block_1"]["mlp_norm"]["scale"])
  # llama.cpp divides each unscaled rotary frequency by its factor.
  unscaled = 1 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
  np.testing.assert_allclose(unscaled / np.asarray(tensors["rope_freqs.weight"].data),
                             model_lib.rope_frequencies(cfg), rtol=1e-6)
  assert len(tensors) == len(hf_llama.tensor_table(cfg)) + 1


def test_metadata_names_the_model_and_the_byte_tokenizer(runs, exports):
  cfg = export.run_config(runs["mxfp4"])[1]
  fields = _fields(exports["mxfp4"][0])
  assert fields["general.architecture"] == "llama"
  assert {k: fields[f"llama.{k}"] for k in (
      "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
      "attention.head_count_kv", "rope.dimension_count", "vocab_size")} == {
          "embedding_length": cfg.dim, "block_count": cfg.n_layers,
          "feed_forward_length": cfg.mlp_dim, "attention.head_count": cfg.n_heads,
          "attention.head_count_kv": cfg.n_kv_heads, "rope.dimension_count": cfg.head_dim,
          "vocab_size": cfg.vocab_size}
  assert fields["llama.rope.freq_base"] == np.float32(cfg.rope_theta)
  assert fields["llama.attention.layer_norm_rms_epsilon"] == np.float32(cfg.norm_eps)
  assert fields["llama.context_length"] == cfg.rope_original_context * cfg.rope_factor
  # gguf-py's own name table for llama agrees with ours.
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.n_layers)
  for hf_name, *_ in hf_llama.tensor_table(cfg):
    assert (names.get_name(hf_name, try_suffixes=(".weight",)) in _tensors(
        exports["mxfp4"][0]))
  # Byte b is GPT-2's printable symbol of b, as llama.cpp's byte-level BPE decodes it.
  tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
  assert len(tokens) == cfg.vocab_size and fields["tokenizer.ggml.model"] == "gpt2"
  decoded = bytes(_gpt2_byte(t) for t in tokens[:256])
  assert decoded == bytes(range(256)) and set(types[:256]) == {gguf.TokenType.NORMAL}
  assert tokens[256:258] == ["<|begin_of_text|>", "<|end_of_text|>"]
  assert types[256:258] == [gguf.TokenType.CONTROL] * 2
  assert set(types[258:]) == {gguf.TokenType.UNUSED}
  assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
          fields["tokenizer.ggml.add_bos_token"]) == (256, 257, True)
  assert fields["fp4jax.recipe"] == "mxfp4" and fields["fp4jax.step"] == str(STEPS)


def _gpt2_byte(symbol):
  """GPT-2's byte-level symbol -> its byte (printable Latin-1 bytes are
  themselves; the others, in order, U+0100 on)."""
  printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
  others = [b for b in range(256) if b not in printable]
  (code,) = [ord(c) for c in symbol]
  return code if code in printable else others[code - 256]


def test_rotated_fprop_is_requantized_unrotated_and_says_so(runs, exports):
  """llama.cpp rotates no input: mxfp4-dh16's weights are the unrotated
  kernel (bfloat16) quantized with Fprop's own spec, said in the output and
  in the file."""
  path, lines = exports["mxfp4-dh16"]
  assert "rotates Fprop (Hadamard block 16" in lines[1] and "after training" in lines[1]
  assert _fields(path)["fp4jax.weights"] == lines[1]
  cfg, recipe, params = export_run(runs["mxfp4-dh16"])
  kernel = params["block_1"]["mlp"]["up"]["kernel"].astype(jnp.bfloat16)
  want = fp4jax.quantize(kernel, recipe.fprop.rhs, axis=0).dequantize(jnp.float32)
  np.testing.assert_array_equal(_decoded(_tensors(path)["blk.1.ffn_up.weight"]),
                                np.asarray(want, np.float64).T)
  # bf16's forward quantizes no weight: NVFP4 after training, said so.
  assert "leaves Fprop's weight unquantized" in exports["bf16"][1][1]


def test_cli_writes_through_convert_and_refuses_bad_input(runs, tmp_path):
  out = str(tmp_path / "m.gguf")
  rc, log = cli("-m", "fp4jax.convert", "export", runs["mxfp4"], out, "--quantize", "mxfp4",
                "--step", str(STEPS))
  assert rc == 0 and log.startswith(f"wrote {out}"), log
  assert sorted(os.listdir(tmp_path)) == ["m.gguf"]  # no temporary file, no lock
  rc, log = cli("-m", "fp4jax.convert", "export", runs["mxfp4"], out, "--quantize", "mxfp4")
  refused(rc, log, "OUT", "exists", "--overwrite")
  for argv, names in [
      (["--quantize", "q8_0"], ["--quantize", "'q8_0'", "mxfp4"]),
      ([], ["needs --quantize", "mxfp4", "nvfp4"]),
      (["--quantize", "nvfp4", "--layout", "modelopt"], ["--layout", "Hugging Face"]),
      (["--quantize", "mxfp4", "--dtype", "float16"], ["--dtype", "float16", "bfloat16"])]:
    rc, log = main_in_process(export_gguf.main, ["export", runs["mxfp4"],
                                                 str(tmp_path / "n.gguf"), *argv])
    refused(rc, log, *names)
  assert not os.path.exists(tmp_path / "n.gguf")


def test_what_an_export_must_not_replace_is_refused(runs, tmp_path):
  run = runs["mxfp4"]
  not_gguf = tmp_path / "notes.gguf"
  not_gguf.write_text("mine")
  refused_in_process(lambda: export_gguf.export_gguf(
      run, str(not_gguf), quantize="mxfp4", overwrite=True), "not a GGUF file")
  assert not_gguf.read_text() == "mine"
  refused_in_process(lambda: export_gguf.export_gguf(
      run, os.path.join(run, "m.gguf"), quantize="mxfp4"), "inside the run")
  refused_in_process(lambda: export_gguf.export_gguf(
      run, str(tmp_path), quantize="mxfp4"), "is a folder")


def test_a_failed_write_leaves_the_old_file(runs, exports, tmp_path, monkeypatch):
  out = tmp_path / "m.gguf"
  shutil.copyfile(exports["mxfp4"][0], out)
  before = out.read_bytes()

  def fail(path, *args):
    with open(path, "wb") as f:
      f.write(b"GGUF half")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(export_gguf.gguf, "write", fail)
  refused_in_process(lambda: export_gguf.export_gguf(
      runs["nvfp4"], str(out), quantize="nvfp4", overwrite=True), "m.gguf")
  assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_nvfp4_needs_rows_of_whole_super_blocks(runs):
  """llama.cpp's NVFP4 packs 64 inputs a block: 48 inputs are refused."""
  cfg, recipe, _ = export_run(runs["nvfp4"])
  p = export_gguf.plan(recipe, "nvfp4")
  refused_in_process(lambda: export_gguf._fp4_tensors(  # pylint: disable=protected-access
      cfg, "blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight",
      np.ones((48, cfg.dim), np.float32), linears.linear("mlp/down"), p),
                     "blk.1.ffn_down.weight", "48 inputs", "64")


@pytest.mark.parametrize("argv,gguf_out", [
    (["export", "run", "m.gguf", "--quantize", "mxfp4"], True),
    (["export", "--step", "3", "run", "M.GGUF"], True),
    (["export", "--quantize=mxfp4", "run", "m.gguf"], True),
    (["export", "run", "out", "--quantize", "mxfp4"], False),
    (["export", "--step", "m.gguf", "run", "out"], False),
    (["export", "run.gguf", "out"], False),
    (["export", "--help"], False)])
def test_the_gguf_route_is_taken_for_an_out_ending_in_gguf(argv, gguf_out):
  assert export_gguf.is_gguf(argv) == gguf_out


def test_without_the_gguf_package_the_export_says_which_extra(runs, tmp_path, monkeypatch):
  find_spec = export_gguf.gguf.importlib.util.find_spec
  monkeypatch.setattr(export_gguf.gguf.importlib.util, "find_spec",
                      lambda name: None if name == "gguf" else find_spec(name))
  refused_in_process(lambda: export_gguf.export_gguf(
      runs["mxfp4"], str(tmp_path / "m.gguf"), quantize="mxfp4"), "fp4jax[gguf]")
  assert not os.listdir(tmp_path)


def _tokenizer_json(pre, merges, added=((3, "<s>"), (4, "</s>"))):
  return {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": merges},
          "added_tokens": [{"id": i, "content": c} for i, c in added], "pre_tokenizer": pre}


LLAMA3_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": export_gguf.gguf.LLAMA3_SPLIT}},
    {"type": "ByteLevel", "use_regex": False}]}


@pytest.mark.parametrize("pre,merges,want", [
    (LLAMA3_PRE, ["a b"], "llama-bpe"),
    ({"type": "ByteLevel", "use_regex": True}, [["a", "b"]], "gpt-2"),
    ({"type": "ByteLevel", "use_regex": False}, [], "default")])
def test_a_byte_level_bpe_tokenizer_json_becomes_llama_cpps_vocabulary(pre, merges, want):
  tokens, types, written, name = export_gguf.gguf.bpe_vocab(
      _tokenizer_json(pre, merges), vocab_size=8, bos_id=3, eos_id=4)
  assert name == want
  assert tokens[:5] == ["a", "b", "ab", "<s>", "</s>"] and len(tokens) == 8
  assert types == [1, 1, 1, 3, 3, 5, 5, 5]  # normal, control, unused padding
  assert written == (["a b"] if merges else [export_gguf.gguf.NO_MERGE])


@pytest.mark.parametrize("tokenizer,vocab_size,names", [
    (_tokenizer_json({"type": "ByteLevel", "use_regex": False}, ["a b"]), 8,
     ["neither Llama 3's nor GPT-2's"]),
    (_tokenizer_json({"type": "Whitespace"}, []), 8, ["not byte-level"]),
    (_tokenizer_json({"type": "ByteLevel"}, [], added=((3, "<s>"),)), 8,
     ["special token 4"]),
    (_tokenizer_json({"type": "ByteLevel"}, []), 4, ["token id 4", "4 rows"]),
    ({"model": {"type": "Unigram"}}, 8, ["'Unigram'", "byte-level BPE"])])
def test_tokenizers_llama_cpp_would_split_otherwise_are_refused(tokenizer, vocab_size, names):
  refused_in_process(lambda: export_gguf.gguf.bpe_vocab(tokenizer, vocab_size, 3, 4), *names)
