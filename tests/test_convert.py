"""Hugging Face export and import: config, layouts, sharded loading, errors.

One tiny run (2 layers, Llama 3 RoPE scaling that matters within 32
positions) is trained once and exported; the logits of the export are
checked against fp4jax with an independent NumPy forward that reads only the
safetensors file and config.json, and with transformers when installed.
"""

import collections
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
import safetensors.numpy

import fp4jax
from fp4jax import checkpointing
from fp4jax.train import export
from fp4jax.llama import hf as hf_llama
from fp4jax.train import init_from
from fp4jax.llama import model as model_lib
from fp4jax import sharding
from fp4jax.train import config as train_config
from fp4jax.train import trainer
from multihost_load import CountingFile
from tests.helpers import numpy_llama

# Every test but one reads the module's trained run; some start processes or
# load the export with transformers.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


def _config(**overrides):
  c = train_config.base_config()
  c.model.n_layers = 2
  c.model.rope_theta = 10000.0
  c.model.rope_original_context = 64  # scaling changes most frequencies
  c.steps, c.batch_size, c.seq_len = STEPS, 8, 32
  c.eval_every, c.eval_batches, c.checkpoint_every = STEPS, 1, STEPS
  c.async_checkpointing = False
  c.mesh.data, c.mesh.fsdp = 1, 8  # the 8 virtual devices, FSDP
  c.update(overrides)
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(run dir, its LlamaConfig, its final params as NumPy, summary)."""
  run_dir = str(tmp_path_factory.mktemp("run"))
  summary = trainer.train(_config(), run_dir)
  _, cfg = export.run_config(run_dir)
  params = checkpointing.restore_params(
      os.path.join(run_dir, "checkpoints"), STEPS, hf_llama.abstract_params(cfg))
  return run_dir, cfg, jax.tree.map(np.asarray, params), summary


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("hf"))
  export.export(run[0], out)
  return out


def _tokens(shape=(2, 32)):
  return np.random.default_rng(1).integers(0, 288, shape).astype(np.int32)


def _fp4jax_logits(cfg, params, tokens):
  llama = model_lib.Llama(cfg, fp4jax.recipe("bf16"))
  return np.asarray(jax.jit(llama.apply)({"params": params}, tokens))  # op by op: 4x the time


def _mesh_abstract(cfg, **mesh):
  """Abstract params sharded like the trainer's on a data/fsdp/tensor mesh."""
  mesh_cfg = sharding.mesh_config()
  mesh_cfg.update(mesh)
  return hf_llama.abstract_params(cfg, sharding.make_mesh(mesh_cfg))


def test_export_writes_a_llama_config(run, exported):
  run_dir, cfg, _, _ = run
  with open(os.path.join(exported, "config.json")) as f:
    hf = json.load(f)
  assert hf["architectures"] == ["LlamaForCausalLM"]
  assert (hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"],
          hf["num_hidden_layers"], hf["num_attention_heads"],
          hf["num_key_value_heads"], hf["head_dim"]) == (288, 128, 384, 2, 4,
                                                         2, 32)
  assert hf["rope_theta"] == 10000.0 and hf["rms_norm_eps"] == 1e-5
  assert hf["rope_scaling"] == dict(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=64)
  assert (hf["bos_token_id"], hf["eos_token_id"]) == (256, 257)
  assert hf["tie_word_embeddings"] is False and hf["torch_dtype"] == "float32"
  assert hf["max_position_embeddings"] == 64 * 8  # the context RoPE reaches
  assert sorted(os.listdir(exported)) == [
      "config.json", "model.safetensors", "tokenizer.json",
      "tokenizer_config.json"]
  fields, tied = hf_llama.llama_fields(hf, "config.json")
  assert not tied and fields == {k: getattr(cfg, k)
                                 for k in hf_llama.MODEL_FIELDS}
  # transformers >= 5 writes rope_parameters (theta inside): same fields.
  v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = dict(hf["rope_scaling"], rope_theta=10000.0)
  assert hf_llama.llama_fields(v5, "config.json")[0] == fields


# Fields of the config.json published with Meta's Llama-3.1-8B.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256}


def test_llama31_8b_config_is_the_8b_preset():
  fields, tied = hf_llama.llama_fields(LLAMA31_8B, "config.json")
  preset = model_lib.model_config("llama3.1-8b")
  assert not tied
  hf_llama.check_model_fields(preset, fields, "config.json")
  names = [row[0] for row in hf_llama.tensor_table(preset)]
  assert len(names) == len(set(names)) == 291  # as in its safetensors index


def test_plain_rope_exports_no_scaling_and_reads_back(run):
  cfg = dataclasses.replace(run[1], rope_factor=1.0)
  hf = hf_llama.hf_config(cfg, bos_id=1, eos_id=2, dtype="float32",
                         max_positions=32)
  assert hf["rope_scaling"] is None
  fields, _ = hf_llama.llama_fields(hf, "config.json")
  assert fields["rope_factor"] == 1.0
  hf_llama.check_model_fields(cfg, fields, "config.json")  # 64 vs 8192: unused
  with pytest.raises(hf_llama.ConvertError, match="model.rope_factor is 8.0"):
    hf_llama.check_model_fields(run[1], fields, "config.json")


TEXT = "héllo  wörld\n\tdef f(x):\r\n  return x ~ \U0001f642 \x00\x7f"


def test_byte_tokenizer_export_gives_the_same_ids(exported):
  pytest.importorskip("tokenizers", reason="tokenizers not installed (pip "
                      "install 'fp4jax[test]')")
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  byte = tokenizers.ByteTokenizer()
  hf = tokenizers.make_tokenizer(os.path.join(exported, "tokenizer.json"))
  assert (hf.bos_id, hf.eos_id) == (byte.bos_id, byte.eos_id)
  np.testing.assert_array_equal(hf.encode(TEXT), byte.encode(TEXT))
  assert hf.decode(byte.encode(TEXT)) == TEXT


def _reference_params(tensors, c):
  """The NumPy reference's tree from HF tensors, re-laid out independently."""
  d, h, kv, hd = c.dim, c.n_heads, c.n_kv_heads, c.head_dim
  out = {"embed": {"embedding": tensors["model.embed_tokens.weight"]},
         "final_norm": {"scale": tensors["model.norm.weight"]},
         "head": {"kernel": tensors["lm_head.weight"].T}}
  for i in range(c.n_layers):
    t = lambda name: tensors[f"model.layers.{i}.{name}.weight"]  # pylint: disable=cell-var-from-loop
    out[f"block_{i}"] = {
        "attn_norm": {"scale": t("input_layernorm")},
        "mlp_norm": {"scale": t("post_attention_layernorm")},
        "attn": {"q": {"kernel": t("self_attn.q_proj").T.reshape(d, h, hd)},
                 "k": {"kernel": t("self_attn.k_proj").T.reshape(d, kv, hd)},
                 "v": {"kernel": t("self_attn.v_proj").T.reshape(d, kv, hd)},
                 "o": {"kernel": t("self_attn.o_proj").T.reshape(h, hd, d)}},
        "mlp": {"gate": {"kernel": t("mlp.gate_proj").T},
                "up": {"kernel": t("mlp.up_proj").T},
                "down": {"kernel": t("mlp.down_proj").T}}}
  return out


def test_numpy_forward_of_the_safetensors_file_gives_fp4jax_logits(
    run, exported):
  _, cfg, params, _ = run
  with open(os.path.join(exported, "config.json")) as f:
    hf = json.load(f)
  rope = hf["rope_scaling"]
  c = types.SimpleNamespace(
      dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"],
      head_dim=hf["head_dim"], norm_eps=hf["rms_norm_eps"],
      rope_theta=hf["rope_theta"], rope_factor=rope["factor"],
      rope_low_freq_factor=rope["low_freq_factor"],
      rope_high_freq_factor=rope["high_freq_factor"],
      rope_original_context=rope["original_max_position_embeddings"])
  tensors = safetensors.numpy.load_file(
      os.path.join(exported, "model.safetensors"))
  tokens = _tokens()
  want = _fp4jax_logits(cfg, params, tokens)
  got = numpy_llama(_reference_params(tensors, c), tokens, c)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
  # Without the Llama 3 scaling the logits differ: the check sees the RoPE.
  plain = numpy_llama(_reference_params(tensors, c), tokens,
                       types.SimpleNamespace(**{**vars(c), "rope_factor": 1.0}))
  assert np.abs(plain - want).max() > 1e-2


@pytest.mark.parametrize("mesh", [dict(data=1, fsdp=8),
                                  dict(data=1, fsdp=4, tensor=2)])
def test_round_trip_is_bitwise_and_reads_only_local_shards(
    run, exported, mesh, monkeypatch):
  _, cfg, params, _ = run
  abstract = _mesh_abstract(cfg, **mesh)
  checkpoint = hf_llama.HfCheckpoint(exported, cfg)
  monkeypatch.setattr(hf_llama, "safe_open", CountingFile)
  monkeypatch.setattr(CountingFile, "reads", collections.Counter())
  loaded = checkpoint.load(abstract)
  flat_want = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(loaded)[0],
                             jax.tree.leaves(abstract)):
    assert x.sharding == spec.sharding and x.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), flat_want[path])
  # Each device reads exactly its own block: what was read of a tensor is the
  # sum of its 8 devices' blocks (the tensor once when it is split 8 ways).
  for name, path, _, _ in hf_llama.tensor_table(cfg):
    x = loaded
    for key in path:
      x = x[key]
    assert CountingFile.reads[name] == sum(
        s.data.size for s in x.addressable_shards), name
  assert CountingFile.reads["model.layers.0.self_attn.q_proj.weight"] == (
      128 * 4 * 32)  # [embed, heads, head_dim] split 8 ways


def test_scanned_layers_load_and_write_the_same_tensors(run, exported,
                                                       tmp_path):
  _, cfg, params, _ = run
  scanned = dataclasses.replace(cfg, scan_layers=True)
  loaded = hf_llama.HfCheckpoint(exported, scanned).load(
      _mesh_abstract(scanned, data=1, fsdp=8))
  export.write_weights(loaded, scanned, str(tmp_path), np.float32, 1e9)
  again = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
  first = safetensors.numpy.load_file(os.path.join(exported,
                                                   "model.safetensors"))
  assert sorted(again) == sorted(first)
  for name, x in first.items():
    np.testing.assert_array_equal(again[name], x)
  for sub in (("attn", "q", "kernel"), ("attn", "o", "kernel"),
              ("mlp", "down", "kernel"), ("attn_norm", "scale")):
    got = loaded["blocks"]
    for key in sub:
      got = got[key]
    want = [params[f"block_{i}"] for i in range(2)]
    for key in sub:
      want = [w[key] for w in want]
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_sharded_export_with_index_and_bfloat16(run, tmp_path):
  run_dir, cfg, params, _ = run
  out = str(tmp_path / "sharded")
  export.export(run_dir, out)  # overwritten below, stale files removed
  lines = export.export(run_dir, out, dtype="bfloat16", max_shard_gb=2e-4,
                        overwrite=True)
  files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}" \
      ".safetensors" and "in %d file(s)" % len(files) in lines[0]
  with open(os.path.join(out, hf_llama.INDEX_FILE)) as f:
    index = json.load(f)
  assert sorted(set(index["weight_map"].values())) == files
  umask = os.umask(0)
  os.umask(umask)
  mode = os.stat(os.path.join(out, files[0])).st_mode & 0o777
  assert mode == 0o666 & ~umask  # as any file written here
  assert len(index["weight_map"]) == 3 + 9 * cfg.n_layers
  loaded = hf_llama.HfCheckpoint(out, cfg).load(hf_llama.abstract_params(cfg))
  rounded = jax.tree.map(
      lambda x: np.asarray(x).astype(jax.numpy.bfloat16).astype(np.float32),
      params)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded),
               rounded)


def _transformers():
  missing = [m for m in ("torch", "transformers")
             if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"{' and '.join(missing)} not installed (pip install "
                "'fp4jax[interop]'): the export is not loaded with transformers")
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  return torch, transformers


def test_transformers_loads_the_export_with_the_same_logits(run, exported,
                                                           tmp_path):
  torch, transformers = _transformers()
  run_dir, cfg, params, _ = run
  sharded = str(tmp_path / "sharded")
  export.export(run_dir, sharded, max_shard_gb=5e-4)
  assert os.path.exists(os.path.join(sharded, hf_llama.INDEX_FILE))
  tokens = _tokens()
  want = _fp4jax_logits(cfg, params, tokens)
  for directory in (exported, sharded):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
      got = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
  tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
  ids = tokenizer(TEXT).input_ids
  assert ids[0] == 256 and ids[1:] == list(TEXT.encode("utf-8"))


def test_init_from_an_export_or_a_run_continues_from_its_parameters(
    run, exported, tmp_path):
  run_dir, _, _, summary = run
  for source in (exported, run_dir, os.path.join(run_dir, "checkpoints",
                                                 str(STEPS))):
    workdir = str(tmp_path / os.path.basename(source))
    resumed = trainer.train(_config(init_from=source), workdir)  # compiled
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      first = json.loads(f.readline())
    # Step 0 evaluates the loaded parameters: the source run's final eval.
    assert first["step"] == 0
    assert first["eval_loss"] == summary["final_eval_loss"]
    assert resumed["status"] == "completed" and np.isfinite(
        resumed["final_loss"])


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
  shutil.copytree(src, dst)
  if edit_tensors:
    path = os.path.join(dst, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    edit_tensors(tensors)
    safetensors.numpy.save_file(tensors, path)
  if edit_config:
    path = os.path.join(dst, "config.json")
    with open(path) as f:
      hf = json.load(f)
    edit_config(hf)
    with open(path, "w") as f:
      json.dump(hf, f)
  return str(dst)


UP1 = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("edit_tensors, edit_config, message", [
    (lambda t: t.pop(UP1), None, f"missing tensor '{UP1}'"),
    (lambda t: t.update(extra=np.zeros(3, np.float32)), None,
     "unexpected tensor 'extra'"),
    (lambda t: t.update({UP1: t[UP1][:, :64]}), None,
     rf"tensor '{UP1}' is F32\[384, 64\]; expected shape \[384, 128\]"),
    (lambda t: t.update({UP1: t[UP1].astype(np.int32)}), None,
     rf"tensor '{UP1}' is I32\[384, 128\]"),
    (None, lambda c: c.update(model_type="mistral"),
     "not a Llama checkpoint .model_type 'mistral'"),
    (None, lambda c: c["rope_scaling"].update(rope_type="yarn"),
     "rope_scaling.rope_type 'yarn' is not implemented"),
    (None, lambda c: c.update(num_hidden_layers=3),
     "model.n_layers is 2 in this config but 3 in the checkpoint"),
    (None, lambda c: c.update(attention_bias=True),
     "attention_bias=True is not supported"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor_or_field(
    run, exported, tmp_path, edit_tensors, edit_config, message):
  cfg = run[1]
  bad = _rewrite(exported, tmp_path / "bad", edit_tensors, edit_config)
  with pytest.raises(hf_llama.ConvertError, match=message) as e:
    hf_llama.HfCheckpoint(bad, cfg)
  assert "\n" not in str(e.value)


def test_unreadable_weight_files_are_named(run, exported, tmp_path):
  cfg = run[1]
  bad = _rewrite(exported, tmp_path / "bad")
  with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
    f.truncate(100)
  with pytest.raises(hf_llama.ConvertError,
                     match="safetensors file .*model.safetensors' cannot be "
                     "read"):
    hf_llama.HfCheckpoint(bad, cfg)
  os.remove(os.path.join(bad, "model.safetensors"))
  with pytest.raises(hf_llama.ConvertError, match="has neither "
                     "model.safetensors nor model.safetensors.index.json"):
    hf_llama.HfCheckpoint(bad, cfg)


def test_tied_embeddings_give_the_head(run, exported, tmp_path):
  cfg = run[1]
  tied = _rewrite(exported, tmp_path / "tied", lambda t: t.pop(
      "lm_head.weight"), lambda c: c.update(tie_word_embeddings=True))
  loaded = hf_llama.HfCheckpoint(tied, cfg).load(hf_llama.abstract_params(cfg))
  np.testing.assert_array_equal(np.asarray(loaded["head"]["kernel"]),
                                np.asarray(loaded["embed"]["embedding"]).T)


def test_init_from_refuses_other_sizes_at_start(run, exported, tmp_path):
  config = _config(init_from=exported)
  config.model.mlp_dim = 256
  with pytest.raises(train_config.ConfigError,
                     match="init_from: .* model.mlp_dim is 256 in this config "
                     "but 384 in the checkpoint"):
    trainer.train(config, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_init_from_names_what_does_not_fit(run, tmp_path):
  run_dir, cfg, _, _ = run
  for path, c, message in (
      (str(tmp_path / "none"), cfg, "'.*none' is not a directory"),
      (str(tmp_path), cfg, "is not a Hugging Face checkpoint .no config.json."),
      (run_dir, dataclasses.replace(cfg, scan_layers=True),
       "model.scan_layers is True in this config but False in the checkpoint"),
      (run_dir, dataclasses.replace(cfg, rope_theta=5e5),
       "model.rope_theta is 500000.0 in this config but 10000.0"),
      (os.path.join(run_dir, "checkpoints", "9"), cfg, "is not a directory")):
    with pytest.raises(train_config.ConfigError,
                       match="bad config: config.init_from: .*" + message):
      init_from.open_source(path, c)


@pytest.mark.parametrize("edit, first", [
    (dict(n_layers=1), "9 arrays of it are not asked, e.g. params/block_1/"),
    (dict(n_layers=3), "9 arrays are not in it, e.g. params/block_2/"),
    (dict(scan_layers=True), "9 arrays are not in it, e.g. params/blocks/")],
                         ids=["fewer_layers", "more_layers", "scan_layers"])
def test_a_config_json_that_does_not_describe_the_checkpoint_is_one_line(
    run, tmp_path, capsys, edit, first):
  """The run's config.json edited to another model than its 2-layer
  (unscanned) checkpoint holds: export and init_from refuse in one line
  naming the first array that differs, and nothing is written."""
  src = tmp_path / "run"
  shutil.copytree(run[0], src)
  config = json.loads((src / "config.json").read_text())
  config["model"].update(edit)
  config["resolved"]["model"].update(edit)
  (src / "config.json").write_text(json.dumps(config))
  assert export.main(["export", str(src), str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert f"the checkpoint at step {STEPS} in {src}/checkpoints does not hold " \
      "the model asked" in err and first in err, err
  assert not os.path.exists(tmp_path / "hf")
  _, cfg = export.run_config(str(src))
  with pytest.raises(train_config.ConfigError, match="^bad config: "
                     "config.init_from: the checkpoint at step .* does not "
                     "hold the model asked .*" + re.escape(first)):
    init_from.load(init_from.open_source(str(src), cfg),
                   hf_llama.abstract_params(cfg), str(src))


def test_cli_errors_are_one_line_with_exit_code_2(run, tmp_path, capsys):
  proc = subprocess.run(
      [sys.executable, "-m", "fp4jax.train.export", "export",
       str(tmp_path / "nothing"), str(tmp_path / "o")],
      capture_output=True, text=True, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT), check=False)
  assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
  assert "is not an fp4jax run directory (no config.json)" in proc.stderr
  run_dir = run[0]
  for args, message in (
      (["--step", "7"], f"no checkpoint at step 7: '{run_dir}' has "
       f"checkpoints at steps [{STEPS}]"),
      (["--max_shard_gb", "0"], "--max_shard_gb must be > 0")):
    assert export.main(["export", run_dir, str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_two_processes_each_read_only_their_devices_blocks(run, exported,
                                                          tmp_path):
  """Two JAX processes (4 CPU devices each) load onto one FSDP mesh of 8."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    coordinator = f"127.0.0.1:{s.getsockname()[1]}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  script = os.path.join(ROOT, "tests", "multihost_load.py")
  outs = [str(tmp_path / f"process_{i}.npz") for i in range(2)]
  procs = [subprocess.Popen([sys.executable, script, coordinator, str(i),
                             exported, outs[i]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = [p.communicate(timeout=300)[0].decode()[-2000:] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(logs)
  params = {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_flatten_with_path(run[2])[0]}
  covered = {k: np.zeros(v.shape, bool) for k, v in params.items()}
  loads = [np.load(out) for out in outs]
  # A NaN that one process holds is named by both (they agree on whether to start).
  assert sorted(bool(s["holds_the_nan"]) for s in loads) == [False, True]
  assert [str(s["non_finite"]) for s in loads] == [
      "holds NaN or Inf in 1 tensor(s): planted"] * 2
  for saved in loads:
    # Half the devices, half of every split tensor (the norms are replicated).
    assert saved["read|model.layers.1.mlp.down_proj.weight"] == 384 * 128 // 2
    assert saved["read|lm_head.weight"] == 288 * 128 // 2
    assert saved["read|model.embed_tokens.weight"] == 288 * 128 // 2
    for key in saved.files:
      if "|" not in key or key.startswith("read|"):
        continue
      path, where = key.split("|")
      index = tuple(slice(*map(int, w.split(":"))) for w in where.split(","))
      np.testing.assert_array_equal(saved[key], params[path][index])
      covered[path][index] = True
  assert all(c.all() for c in covered.values())
