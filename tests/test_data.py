"""Data pipeline: packing, determinism, splits, sharding, resume, errors."""

import gzip
import json
import os
import re
import sys

import numpy as np
import pytest

from fp4jax.data import pipeline
from fp4jax.data import sources
from fp4jax.train import trainer
from tests.helpers import BOS, EOS, expected_rows, TOK


def _cfg(**overrides):
  cfg = pipeline.data_config()
  cfg.update(overrides)
  return cfg


def _write_txt(directory, n):
  """n .txt documents 'doc-007 ...' of varied lengths; returns their texts."""
  texts = [f"doc-{i:03d} " + "é" * (i % 5) + "x" * (3 * i) for i in range(n)]
  for i, text in enumerate(texts):
    (directory / f"d{i:03d}.txt").write_text(text, encoding="utf-8")
  return texts


def _corpus(directory, kind, n):
  """n documents 'doc-007 ...' as .txt files ("txt") or one .jsonl file ("jsonl");
  returns (their texts, the data.path that reads them)."""
  if kind == "txt":
    return _write_txt(directory, n), str(directory / "*.txt")
  texts = [f"doc-{i:03d} " + "z" * (2 * i) for i in range(n)]
  _write_jsonl(directory / "all.jsonl", texts)
  return texts, str(directory / "all.jsonl")


def _write_jsonl(path, texts, key="text"):
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "wt", encoding="utf-8") as f:
    for text in texts:
      f.write(json.dumps({key: text, "url": "u"}) + "\n")


def _doc_ids(batches):
  """The 'doc-NNN' ids whose BOS appears in any row of the batches."""
  ids = set()
  for b in batches:
    for row in b:
      starts = np.flatnonzero(row[:-8] == BOS)
      ids |= {TOK.decode(row[s + 1:s + 8]) for s in starts}
  return ids


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json.gz"])
def test_packing_is_exact_concatenation(tmp_path, kind):
  if kind == "txt":
    texts = _write_txt(tmp_path, 7)
    cfg = _cfg(source="files", path=str(tmp_path / "*.txt"),
               val_path=str(tmp_path / "*.txt"))
  else:
    texts = [f"doc {i} " + "ab" * i for i in range(7)]
    _write_jsonl(tmp_path / f"a.{kind}", texts[:4])
    _write_jsonl(tmp_path / f"b.{kind}", texts[4:])
    cfg = _cfg(source="files", path=str(tmp_path / f"*.{kind}"),
               val_path=str(tmp_path / f"*.{kind}"))
  batches = pipeline.validation_batches(cfg, TOK, seq_len=9, batch_size=2,
                                    num_batches=6)
  assert all(b.shape == (2, 10) and b.dtype == np.int32 for b in batches)
  np.testing.assert_array_equal(np.stack(batches),
                                expected_rows(texts, 2, 9, 6))


def test_train_windows_bos_eos_and_determinism():
  cfg = _cfg()
  take = lambda seed: [next(it) for it in [pipeline.train_iterator(
      cfg, TOK, seq_len=255, global_batch=4, seed=seed)] for _ in range(200)]
  first, again, other = take(0), take(0), take(1)
  assert all(b.shape == (4, 256) and b.dtype == np.int32 for b in first)
  np.testing.assert_array_equal(np.stack(first), np.stack(again))
  assert not np.array_equal(np.stack(first), np.stack(other))
  stream_R = np.concatenate(first, axis=1)  # each row is one token stream
  assert np.all(stream_R[:, 0] == BOS)
  for row in stream_R:
    bos, eos = np.flatnonzero(row == BOS), np.flatnonzero(row == EOS)
    assert len(bos) >= 2 and np.all(row[bos[1:] - 1] == EOS)
    assert np.all(row[eos[eos < len(row) - 1] + 1] == BOS)
    assert row.min() >= 0 and row.max() < TOK.vocab_size


def test_train_is_endless_and_reshuffles_each_epoch(tmp_path):
  _write_txt(tmp_path, 8)
  cfg = _cfg(source="files", path=str(tmp_path / "*.txt"),
             val_path=str(tmp_path / "d000.txt"))
  it = pipeline.train_iterator(cfg, TOK, seq_len=15, global_batch=1, seed=3)
  row = np.concatenate([next(it)[0] for _ in range(60)])  # ~4 epochs
  starts = np.flatnonzero(row[:-8] == BOS)
  order = [TOK.decode(row[s + 1:s + 8]) for s in starts]
  epochs = [order[i:i + 8] for i in range(0, 24, 8)]
  assert all(sorted(e) == [f"doc-{i:03d}" for i in range(8)] for e in epochs)
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_stdlib_split_is_disjoint_by_file():
  root, train, val = sources.stdlib_files()
  assert os.path.isdir(root) and len(val) > 10 and len(train) > 10 * len(val)
  assert not set(train) & set(val)
  skipped = {"site-packages", "dist-packages", "test", "tests"}
  assert not any(skipped & set(p.split(os.sep)) for p in train + val)
  assert all(p.endswith(".py") for p in train + val)


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_train_and_validation_are_disjoint(tmp_path, kind):
  texts, path = _corpus(tmp_path, kind, 40)
  cfg = _cfg(source="files", path=path, val_fraction=0.3)
  train = pipeline.train_iterator(cfg, TOK, seq_len=31, global_batch=2, seed=0)
  train_ids = _doc_ids([next(train) for _ in range(80)])
  val_ids = _doc_ids(pipeline.validation_batches(
      cfg, TOK, seq_len=31, batch_size=2, num_batches=40))
  assert train_ids and val_ids and not train_ids & val_ids
  assert train_ids | val_ids == {t[:7] for t in texts}


@pytest.mark.parametrize("source", ["stdlib", "jsonl"])
def test_process_shards_stack_to_the_global_batch(tmp_path, source):
  cfg = _cfg()
  if source == "jsonl":
    _write_jsonl(tmp_path / "c.jsonl.gz",
                 [f"document {i} " * (i % 7 + 1) for i in range(50)])
    cfg = _cfg(source="files", path=str(tmp_path / "*.jsonl.gz"))
  make = lambda p, n: pipeline.train_iterator(
      cfg, TOK, seq_len=31, global_batch=4, seed=5, process_index=p,
      process_count=n)
  whole, first, second = make(0, 1), make(0, 2), make(1, 2)
  for _ in range(20):
    a, b = next(first), next(second)
    assert a.shape == b.shape == (2, 32) and not np.array_equal(a, b)
    np.testing.assert_array_equal(np.concatenate([a, b]), next(whole))
  v = lambda p, n: pipeline.validation_batches(
      cfg, TOK, seq_len=31, batch_size=4, num_batches=3, process_index=p,
      process_count=n)
  np.testing.assert_array_equal(
      np.concatenate([np.stack(v(0, 2)), np.stack(v(1, 2))], axis=1),
      np.stack(v(0, 1)))


@pytest.mark.parametrize("source", ["stdlib", "json.gz"])
def test_resume_from_state_sees_the_same_batches(tmp_path, source):
  cfg = _cfg()
  if source == "json.gz":
    for k in range(3):
      _write_jsonl(tmp_path / f"c4-train.{k:05d}-of-00003.json.gz",
                   [f"shard {k} doc {i} " * (1 + i % 7)**2 for i in range(20)])
    cfg = _cfg(source="files",
               path=str(tmp_path / "c4-train.*-of-00003.json.gz"))
  make = lambda: pipeline.train_iterator(cfg, TOK, seq_len=31, global_batch=4,
                                     seed=11, process_index=1,
                                     process_count=2)
  it = make()
  for _ in range(200):  # into the second epoch of the json.gz corpus
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(100)]
  restored = make()
  restored.set_state(state)
  np.testing.assert_array_equal(np.stack([next(restored) for _ in range(100)]),
                                np.stack(expected))
  other = pipeline.train_iterator(cfg, TOK, seq_len=31, global_batch=4, seed=11)
  with pytest.raises(ValueError, match="does not fit"):
    other.set_state(state)


def test_validation_is_fixed_and_independent_of_train_seed():
  kw = dict(seq_len=31, batch_size=4, num_batches=3)
  a = pipeline.validation_batches(_cfg(), TOK, **kw)
  b = pipeline.validation_batches(_cfg(), TOK, **kw)
  np.testing.assert_array_equal(np.stack(a), np.stack(b))


def test_bad_configs_fail_at_start(tmp_path):
  kw = dict(seq_len=8, global_batch=2, seed=0)
  with pytest.raises(ValueError, match=r"unknown data.source 'c5'.*stdlib"):
    pipeline.train_iterator(_cfg(source="c5"), TOK, **kw)
  with pytest.raises(ValueError, match="needs data.path"):
    pipeline.train_iterator(_cfg(source="files"), TOK, **kw)
  with pytest.raises(ValueError, match=r"data.decode_errors 'ignore' is not one of"):
    pipeline.train_iterator(_cfg(decode_errors="ignore"), TOK, **kw)  # stdlib decodes nothing
  with pytest.raises(ValueError, match="'stdlib' takes no data.path"):
    pipeline.train_iterator(_cfg(path="/data/*.txt"), TOK, **kw)
  missing = str(tmp_path / "c4-train.*.json.gz")
  with pytest.raises(FileNotFoundError, match=r"c4-train\.\*\.json\.gz"):
    pipeline.train_iterator(_cfg(source="files", path=missing), TOK, **kw)
  _write_jsonl(tmp_path / "a.jsonl", ["x"], key="content")
  with pytest.raises(ValueError, match=r"no field 'text'.*'content'"):
    pipeline.train_iterator(_cfg(source="files", path=str(tmp_path / "a.jsonl")),
                        TOK, **kw)
  _write_jsonl(tmp_path / "one.jsonl", ["only document"])
  with pytest.raises(ValueError, match="no documents in"):
    pipeline.validation_batches(
        _cfg(source="files", path=str(tmp_path / "one.jsonl"),
             val_fraction=1e-9), TOK, seq_len=8, batch_size=2, num_batches=1)
  (tmp_path / "b.txt").write_text("y")
  with pytest.raises(ValueError, match="only .txt files or only JSON"):
    pipeline.train_iterator(_cfg(source="files", path=str(tmp_path / "*")),
                        TOK, **kw)
  with pytest.raises(ValueError, match="divide evenly over 3 processes"):
    pipeline.train_iterator(_cfg(), TOK, seq_len=8, global_batch=4, seed=0,
                        process_count=3)


def test_tfds_source_without_tfds_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # not installed
  with pytest.raises(ImportError, match=r"fp4jax\[tfds\]"):
    pipeline.train_iterator(_cfg(source="tfds", path="c4/en:3.0.1"), TOK,
                        seq_len=8, global_batch=2, seed=0)


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_validation_windows_are_spread_through_the_held_out_stream(tmp_path, kind):
  texts, pattern = _corpus(tmp_path, kind, 9)
  stream = []
  for text in texts:  # read once, in order: no wrap-around to the first document
    stream += [BOS] + list(TOK.encode(text)) + [EOS]
  cfg = _cfg(source="files", path=pattern, val_path=pattern)
  got = pipeline.validation_windows(cfg, TOK, seq_len=7, batch_size=3, num_batches=2)
  assert [b.shape for b in got] == [(3, 8), (3, 8)]
  # 6 windows with evenly spaced starts from 0 to len - 8; window j is row
  # j // 2 of batch j % 2.
  starts = [round(j * (len(stream) - 8) / 5) for j in range(6)]
  for j, start in enumerate(starts):
    np.testing.assert_array_equal(got[j % 2][j // 2], stream[start:start + 8])
  assert starts[-1] + 8 == len(stream)  # the last window ends with the last document
  # Shards of two processes stack to the one-process batches.
  halves = [pipeline.validation_windows(cfg, TOK, seq_len=7, batch_size=4, num_batches=2,
                                    process_index=p, process_count=2) for p in (0, 1)]
  whole = pipeline.validation_windows(cfg, TOK, seq_len=7, batch_size=4, num_batches=2)
  for i in range(2):
    np.testing.assert_array_equal(np.concatenate([halves[0][i], halves[1][i]]), whole[i])
  # data.val_tokens caps the stream the windows are spread over.
  cfg.val_tokens = 20
  capped = pipeline.validation_windows(cfg, TOK, seq_len=7, batch_size=1, num_batches=2)
  np.testing.assert_array_equal(capped[1][0], stream[12:20])
  cfg.val_tokens = 5
  with pytest.raises(ValueError, match="fewer than one window"):
    pipeline.validation_windows(cfg, TOK, seq_len=7, batch_size=1, num_batches=1)


def test_overlapping_validation_windows_give_no_standard_error(tmp_path):
  """About two windows of text with 64 windows asked: said, and the standard
  error of the batch means is unknown (None) instead of 64 windows' worth."""
  (tmp_path / "v.txt").write_text("x" * 150)  # 152 tokens: two windows of 65
  cfg = _cfg(source="files", path=str(tmp_path / "v.txt"), val_path=str(tmp_path / "v.txt"))
  got = pipeline.validation_windows(cfg, TOK, seq_len=64, batch_size=8, num_batches=8)
  assert re.search(r"the 64 evaluation windows \(eval_batches 8 x eval batch size 8\) "
                   r"of seq_len \+ 1 = 65 tokens overlap: the validation text has 152 "
                   r"tokens, so they start 1\.4 tokens apart", got.overlap), got.overlap
  losses = lambda params, batch, i: np.float32(i % 3)
  assert trainer._evaluate(losses, None, got)["eval_loss_se"] is None
  disjoint = pipeline.validation_windows(cfg, TOK, seq_len=64, batch_size=1, num_batches=2)
  assert disjoint.overlap == ""
  assert trainer._evaluate(losses, None, disjoint)["eval_loss_se"] > 0


def test_stdlib_validation_windows_do_not_start_at_file_openings():
  cfg = _cfg()
  got = np.stack(pipeline.validation_windows(cfg, TOK, seq_len=63, batch_size=8,
                                         num_batches=4))
  again = np.stack(pipeline.validation_windows(cfg, TOK, seq_len=63, batch_size=8,
                                           num_batches=4))
  np.testing.assert_array_equal(got, again)
  first = np.stack(pipeline.validation_batches(cfg, TOK, seq_len=63, batch_size=8,
                                           num_batches=4))
  assert (first[0, :, 0] == BOS).all()  # the old set: every row opens a file
  assert (got[:, :, 0] == BOS).mean() < 0.1


@pytest.mark.parametrize("name", ["a.jsonl", "a.json.gz"])
def test_invalid_utf8_names_the_line_that_holds_it(tmp_path, name):
  """Decoding reads ahead of the line asked for; the error names the bad line."""
  lines = [json.dumps({"text": f"document {i} " * 8}).encode() + b"\n" for i in range(200)]
  lines[150] = b'{"text": "caf\xe9"}\r\n'
  lines[3] = lines[3].replace(b"\n", b"\r\n")
  data = b"".join(lines)
  (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
  cfg = _cfg(source="files", path=str(tmp_path / name), val_fraction=1e-9)
  with pytest.raises(ValueError, match=rf"{name} line 151: invalid UTF-8"):
    batches = pipeline.train_iterator(cfg, TOK, seq_len=8, global_batch=2, seed=None)
    for _ in range(2000):
      next(batches)
