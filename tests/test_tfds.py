"""data.source=tfds with the real tensorflow-datasets on a dataset built here.

A tiny text dataset is prepared in the ArrayRecord format by a local
builder (nothing is downloaded; no TensorFlow needed) and read back through
tfds.data_source like a prepared c4/en: packing, per-process rows and a
bitwise mid-epoch resume, as for the other sources.
"""

import json

import numpy as np
import pytest

from fp4jax.data import pipeline
from tests.helpers import expected_rows
from tests.helpers import TOK

tfds = pytest.importorskip(
    "tensorflow_datasets",
    reason="tensorflow-datasets not installed (pip install 'fp4jax[test]')")

N_TRAIN, N_VAL = 23, 5


class TinyText(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Documents 'train-007 xxx...' of varied lengths, in two splits."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {"train": self._generate_examples("train", N_TRAIN),
            "validation": self._generate_examples("val", N_VAL)}

  def _generate_examples(self, prefix, n):
    for i in range(n):
      yield i, {"text": f"{prefix}-{i:03d} " + "é" * (i % 3) + "x" * (4 * i)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tfds")
  TinyText(data_dir=str(directory), file_format="array_record"
           ).download_and_prepare()
  return str(directory)


def _cfg(data_dir, **overrides):
  cfg = pipeline.data_config()
  cfg.update(source="tfds", path="tiny_text:1.0.0", data_dir=data_dir)
  cfg.update(overrides)
  return cfg


def _texts(data_dir, split):
  """The split's documents in tfds' stored order (read without fp4jax)."""
  source = tfds.data_source("tiny_text", split=split, data_dir=data_dir)
  return [source[i]["text"].decode("utf-8") for i in range(len(source))]


def test_validation_is_the_split_in_order_packed(data_dir):
  texts = _texts(data_dir, "validation")
  assert len(texts) == N_VAL
  val = pipeline.validation_batches(_cfg(data_dir), TOK, seq_len=15, batch_size=2,
                                num_batches=4)
  np.testing.assert_array_equal(np.stack(val),
                                expected_rows(texts, 2, 15, 4))


def test_train_is_a_shuffle_of_the_train_split_sharded_per_process(data_dir):
  kw = dict(seq_len=63, global_batch=4, seed=3)
  one = pipeline.train_iterator(_cfg(data_dir), TOK, **kw)
  procs = [pipeline.train_iterator(_cfg(data_dir), TOK, process_index=i,
                               process_count=2, **kw) for i in range(2)]
  starts = set()
  for _ in range(12):
    batch = next(one)
    np.testing.assert_array_equal(
        batch, np.concatenate([next(p) for p in procs]))
    for row in batch:
      for s in np.flatnonzero(row[:-10] == TOK.bos_id):
        starts.add(TOK.decode(row[s + 1:s + 10]))
  # 12 x 4 windows of 64 tokens cover more than one epoch of 23 documents.
  assert starts == {f"train-{i:03d}" for i in range(N_TRAIN)}
  other_seed = pipeline.train_iterator(_cfg(data_dir), TOK, seq_len=63,
                                   global_batch=4, seed=4)
  assert not np.array_equal(next(other_seed), next(
      pipeline.train_iterator(_cfg(data_dir), TOK, **kw)))


def test_resume_mid_epoch_is_bitwise(data_dir):
  kw = dict(seq_len=31, global_batch=4, seed=0, process_index=1,
            process_count=2)
  first = pipeline.train_iterator(_cfg(data_dir), TOK, **kw)
  for _ in range(7):  # mid-epoch: 23 documents, 2 rows of this process
    next(first)
  state = json.loads(json.dumps(first.get_state()))  # as in a checkpoint
  want = [next(first) for _ in range(9)]  # crosses into the next epoch
  resumed = pipeline.train_iterator(_cfg(data_dir), TOK, **kw)
  resumed.set_state(state)
  np.testing.assert_array_equal(np.stack([next(resumed) for _ in range(9)]),
                                np.stack(want))


def test_missing_dataset_or_split_names_it(data_dir, tmp_path):
  kw = dict(seq_len=8, global_batch=2, seed=0)
  with pytest.raises(ValueError, match=r"tfds 'c4/en:3.0.1' split 'train' "
                     r"\(data.data_dir='.*'\) cannot be read: .*tfds build"):
    pipeline.train_iterator(_cfg(str(tmp_path), path="c4/en:3.0.1"), TOK, **kw)
  with pytest.raises(ValueError, match="split 'test'.*Unknown split 'test'"):
    pipeline.train_iterator(_cfg(data_dir, train_split="test"), TOK, **kw)
  with pytest.raises(ValueError, match="no field 'body'"):
    pipeline.train_iterator(_cfg(data_dir, text_key="body"), TOK, **kw)
