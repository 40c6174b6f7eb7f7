"""Tokenizers: bytes, and Hugging Face / SentencePiece files built here."""

import io
import json

import numpy as np
import pytest

from fp4jax import errors
from fp4jax.data import pipeline
from fp4jax.data import tokenizers as fp4tok
from fp4jax.train import workdir as workdir_lib
from tests.helpers import tiny_config

CORPUS = ["def f(x):\n  return x + 1\n", "héllo wörld, ∑ and 🙂",
          "the quick brown fox jumps over the lazy dog"] * 20


def test_bytes_round_trip_and_specials():
  tok = fp4tok.make_tokenizer("bytes")
  text = "héllo ∑ 🙂\n"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
  assert ids.max() < 256 and tok.decode(ids) == text
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text
  assert len({tok.bos_id, tok.eos_id}) == 2
  assert 256 <= min(tok.bos_id, tok.eos_id)
  assert max(tok.bos_id, tok.eos_id) < tok.vocab_size
  assert tok.vocab_size % 32 == 0


def test_bad_tokenizer_names(tmp_path):
  with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt2'.*'bytes'"):
    fp4tok.make_tokenizer("gpt2")
  with pytest.raises(FileNotFoundError, match="nope.model"):
    fp4tok.make_tokenizer(str(tmp_path / "nope.model"))
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    fp4tok.make_tokenizer(str(tmp_path))  # a directory without one


def _hf_tokenizer(directory, specials):
  """A tiny byte-level BPE (Llama 3's kind), saved as tokenizer.json."""
  tokenizers = pytest.importorskip("tokenizers")
  decoders, models = tokenizers.decoders, tokenizers.models
  pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  path = directory / "tokenizer.json"
  tok.save(str(path))
  return tok, path


def test_hugging_face_tokenizer_json(tmp_path):
  raw, path = _hf_tokenizer(tmp_path, ["<|begin_of_text|>", "<|end_of_text|>"])
  for name in (str(path), str(tmp_path)):
    tok = fp4tok.make_tokenizer(name)
    assert tok.bos_id == raw.token_to_id("<|begin_of_text|>")
    assert tok.eos_id == raw.token_to_id("<|end_of_text|>")
    assert tok.vocab_size == raw.get_vocab_size()
    text = CORPUS[1] + " " + CORPUS[0]
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) < len(text.encode("utf-8"))
    assert tok.bos_id not in ids and tok.decode(ids) == text


def test_hugging_face_specials_from_tokenizer_config(tmp_path):
  raw, path = _hf_tokenizer(tmp_path, ["<s>", "</s>", "<|begin_of_text|>",
                                       "<|eot|>"])
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot|>"}))
  tok = fp4tok.make_tokenizer(str(path))
  assert tok.bos_id == raw.token_to_id("<|begin_of_text|>")
  assert tok.eos_id == raw.token_to_id("<|eot|>")
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<bos>", "eos_token": "<|eot|>"}))
  with pytest.raises(ValueError, match=r"no BOS token; looked for \['<bos>'"):
    fp4tok.make_tokenizer(str(path))


def test_sentencepiece_model(tmp_path):
  spm = pytest.importorskip("sentencepiece")
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=40,
      character_coverage=1.0, minloglevel=2)
  path = tmp_path / "tiny.model"
  path.write_bytes(model.getvalue())
  tok = fp4tok.make_tokenizer(str(path))
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 40)
  ids = tok.encode(CORPUS[2])
  assert ids.dtype == np.int32 and tok.bos_id not in ids
  assert tok.decode(ids) == CORPUS[2]


def test_pipeline_packs_with_a_hugging_face_tokenizer(tmp_path):
  _, path = _hf_tokenizer(tmp_path, ["<|begin_of_text|>", "<|end_of_text|>"])
  tok = fp4tok.make_tokenizer(str(path))
  docs = tmp_path / "docs"
  docs.mkdir()
  for i, text in enumerate(CORPUS[:3]):
    (docs / f"{i}.txt").write_text(text, encoding="utf-8")
  cfg = pipeline.data_config()
  cfg.update(source="files", path=str(docs / "*.txt"),
             val_path=str(docs / "*.txt"))
  batches = pipeline.validation_batches(cfg, tok, seq_len=7, batch_size=1,
                                    num_batches=5)
  stream = []
  while len(stream) < 40:
    for text in CORPUS[:3]:
      stream += [tok.bos_id] + list(tok.encode(text)) + [tok.eos_id]
  np.testing.assert_array_equal(np.concatenate(batches, axis=1)[0],
                                stream[:40])


@pytest.mark.parametrize("name,cls", [("sentencepiece", fp4tok.SentencePieceTokenizer),
                                      ("tokenizers", fp4tok.HuggingFaceTokenizer)])
def test_missing_optional_package_names_the_extra(monkeypatch, name, cls):
  real_import = fp4tok.importlib.import_module

  def fake_import(module, *args):
    if module == name:
      raise ImportError(f"No module named {module!r}")
    return real_import(module, *args)

  monkeypatch.setattr(fp4tok.importlib, "import_module", fake_import)
  with pytest.raises(ImportError, match=rf"`{name}` is not installed.*fp4jax\[tokenizers\]"):
    cls("some/file")


def test_a_relative_tokenizer_from_another_directory_is_refused(tmp_path, monkeypatch):
  """A run with data.tokenizer "tok" records tok's absolute path and hash: a
  resume from another directory with another "tok" is refused, and export
  reads the recorded file (and refuses it once changed)."""
  for name, specials in (("a", ["<s>", "</s>"]), ("b", ["</s>", "<s>"])):
    (tmp_path / name / "tok").mkdir(parents=True)
    _hf_tokenizer(tmp_path / name / "tok", specials)
  monkeypatch.chdir(tmp_path / "a")
  record = fp4tok.identity("tok")
  assert record["path"] == str(tmp_path / "a" / "tok" / "tokenizer.json")
  config = tiny_config()
  config.data.tokenizer = "tok"
  run = tmp_path / "run"
  (run / "checkpoints" / "4" / "state").mkdir(parents=True)
  (run / "checkpoints" / "4" / "data").mkdir()
  resolved = dict(model={}, recipe={}, tokenizer=record)
  (run / "checkpoints" / "4" / "data" / "metadata").write_text(json.dumps(
      {"processes": [], "config": dict(config.to_dict(), resolved=resolved)}))
  assert workdir_lib.check_resume_config(str(run), config, resolved) == []
  monkeypatch.chdir(tmp_path / "b")
  now = dict(resolved, tokenizer=fp4tok.identity("tok"))
  with pytest.raises(errors.UserError, match=r"data.tokenizer: '/.*/a/tok/tokenizer.json "
                     r"\(sha256 \w+\)' -> '/.*/b/tok/tokenizer.json"):
    workdir_lib.check_resume_config(str(run), config, now)
  assert fp4tok.recorded("tok", record) == record["path"]  # export: the run's own
  (tmp_path / "a" / "tok" / "tokenizer_config.json").write_text('{"bos_token": "</s>"}')
  with pytest.raises(ValueError, match=r"a/tok/tokenizer.json changed since the run"):
    fp4tok.recorded("tok", record)
