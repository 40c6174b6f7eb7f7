"""Tokenizers: UTF-8 bytes (the default), SentencePiece and Hugging Face files.

Every tokenizer has `.vocab_size`, `.bos_id`, `.eos_id`, `.encode(text) ->
int32[n]` (no special tokens added) and `.decode(ids) -> str`. The data
pipeline adds BOS/EOS itself.

`identity(name_or_path)` is the absolute path and content hash a run
records, so that a resume or an export can tell when a relative path now
names another tokenizer. `make_tokenizer(name_or_path)` accepts:
  "bytes"                 UTF-8 bytes 0..255, BOS 256, EOS 257; vocab_size 288
                          (padded to a multiple of 32, so the vocab axis fills
                          whole MX blocks and shards evenly).
  PATH.model              a SentencePiece model (needs `sentencepiece`).
  PATH/tokenizer.json     a Hugging Face tokenizer file (needs `tokenizers`),
  or a directory holding  e.g. Llama 3's; BOS/EOS are read from a
  one                     tokenizer_config.json beside it when present, else
                          found among the usual special-token names.
"""

import hashlib
import importlib
import os

import numpy as np

from fp4jax import errors
from fp4jax import records

_EXTRAS_HINT = "pip install 'fp4jax[tokenizers]'"
# Files beside a tokenizer file that are part of it (special tokens).
FILES_BESIDE = ("tokenizer_config.json", "special_tokens_map.json")
# Special-token names tried, in order, when no tokenizer_config.json says.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]")


class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255; BOS = 256, EOS = 257."""

  vocab_size = 288
  bos_id = 256
  eos_id = 257

  def encode(self, text):
    """str -> int32[n_bytes]."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids):
    """int[n] -> str; ids outside 0..255 (specials) are dropped."""
    ids = np.asarray(ids)
    data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


def _import_optional(module, path, what):
  """Imports an optional tokenizer package, or says which extra provides it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"tokenizer {path!r} is {what}, but `{module}` is not installed "
                      f"({_EXTRAS_HINT}).") from e


class SentencePieceTokenizer:
  """A SentencePiece `.model` file."""

  def __init__(self, path):
    sentencepiece = _import_optional("sentencepiece", path, "a SentencePiece model")
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
    if self.bos_id < 0 or self.eos_id < 0:
      raise ValueError(
          f"SentencePiece model {path!r} defines no BOS or EOS piece "
          f"(bos_id={self.bos_id}, eos_id={self.eos_id}).")

  def encode(self, text):
    """str -> int32[n]."""
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids):
    return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
  """A Hugging Face `tokenizer.json` (e.g. Llama 3's)."""

  def __init__(self, path):
    tokenizers = _import_optional("tokenizers", path, "a Hugging Face tokenizer file")
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    bos_name, eos_name = _special_names(os.path.dirname(path))
    self.bos_id = self._token_id(path, "BOS", bos_name or _BOS_NAMES)
    self.eos_id = self._token_id(path, "EOS", eos_name or _EOS_NAMES)

  def _token_id(self, path, what, names):
    names = (names,) if isinstance(names, str) else names
    for name in names:
      token_id = self._tok.token_to_id(name)
      if token_id is not None:
        return token_id
    raise ValueError(
        f"tokenizer {path!r} has no {what} token; looked for {list(names)}.")

  def encode(self, text):
    """str -> int32[n] (no special tokens added)."""
    return np.asarray(
        self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids):
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _special_names(directory):
  """(bos, eos) token strings from tokenizer_config.json, or (None, None)."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(config_path):
    return None, None
  config = records.read(records.TokenizerConfig, config_path)

  def name(key):
    token = config.get(key)
    return token.get("content") if isinstance(token, dict) else token

  return name("bos_token"), name("eos_token")


def _file_of(name_or_path):
  """The tokenizer file a data.tokenizer other than "bytes" names."""
  path = str(name_or_path)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not (path.endswith(".model") or path.endswith(".json")):
    raise ValueError(
        f"unknown tokenizer {name_or_path!r}; allowed: 'bytes', a path to a "
        "SentencePiece '.model' file, or a Hugging Face 'tokenizer.json' "
        "(or a directory holding one).")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file {path!r} does not exist.")
  return path


def identity(name_or_path):
  """What a run's tokenizer is: {"path": the tokenizer file's absolute path
  ("bytes" for the byte tokenizer), "sha256": of its bytes and (Hugging
  Face) those of the files beside it that set its special tokens (None for
  "bytes")}."""
  if name_or_path == "bytes":
    return dict(path="bytes", sha256=None)
  path = os.path.abspath(_file_of(name_or_path))
  digest = hashlib.sha256()
  beside = FILES_BESIDE if path.endswith(".json") else ()
  for file in [path] + [os.path.join(os.path.dirname(path), name)
                        for name in beside]:
    if os.path.isfile(file):
      with open(file, "rb") as f:
        digest.update(os.path.basename(file).encode() + b"\0" + f.read())
  return dict(path=path, sha256=digest.hexdigest())


def recorded(name_or_path, record):
  """The tokenizer a run used: `record` (its identity() as the run recorded
  it, or None for runs from before) names the file by its absolute path,
  wherever the reader runs; ValueError when that file is gone or its
  content changed. Without a record, `name_or_path` itself."""
  if not isinstance(record, dict) or record.get("path") in (None, "bytes"):
    return name_or_path
  path = record["path"]
  try:
    now = identity(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"the run's tokenizer {path} is gone ({e})") from None
  if now != record:
    raise ValueError(
        f"the run's tokenizer {path} changed since the run (sha256 "
        f"{str(record.get('sha256'))[:12]} -> {now['sha256'][:12]}); restore "
        "the files it was trained with")
  return path


def make_tokenizer(name_or_path):
  """"bytes", a SentencePiece .model path, or a tokenizer.json (or its dir)."""
  if name_or_path == "bytes":
    return ByteTokenizer()
  path = _file_of(name_or_path)
  kind = SentencePieceTokenizer if path.endswith(".model") else (
      HuggingFaceTokenizer)
  try:
    return kind(path)
  except (ImportError, errors.UserError):
    raise  # a missing package, or a file beside it named (records)
  except Exception as e:  # pylint: disable=broad-except
    # sentencepiece and tokenizers raise RuntimeError / Exception on bad files.
    raise ValueError(f"tokenizer file {path!r} cannot be read as a "
                     f"{kind.__name__[:-len('Tokenizer')]} tokenizer: "
                     f"{str(e).splitlines()[0][:200]}") from None
