"""What the data makes: documents -> tokens -> packed windows -> batches (grain).

The global batch has `global_batch` rows. Row r is its own stream: it takes
every global_batch-th document of the (epoch-shuffled) corpus, starting at
document r, turns each into BOS + tokens + EOS, concatenates them and cuts
the result into windows of seq_len + 1 tokens (the trainer shifts inputs and
targets). A process builds only its rows, process_index * b .. + b with
b = global_batch // process_count, so the processes' shards are disjoint and,
stacked, are exactly the one-process global batch. The iterator state is the
rows' grain states (a dict of ints), so a restored run continues exactly.

What is read (data.source: the stdlib, files, tfds; decoding, start-up
checks, the hash split into train and validation) is fp4jax.data.sources;
here its documents become batches. Training epochs repeat endlessly, each
with a new shuffle; validation is read in order and is the same for every run
and recipe: `validation_windows` (what the trainer evaluates on) spreads its
windows evenly through the held-out stream, `validation_batches` packs it
from the start of each document.
"""

import functools
import hashlib
import math

import grain
import ml_collections
import numpy as np

from fp4jax.data import fingerprint as fingerprint_lib
from fp4jax.data import sources

_NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def data_config():
  """Defaults: the embedded stdlib corpus with the byte tokenizer."""
  return ml_collections.ConfigDict(dict(
      source="stdlib",      # one of sources.SOURCES
      path="",              # files: glob; tfds: dataset name
      val_path="",          # files: validation glob ("" = split by hash)
      tokenizer="bytes",    # "bytes", a .model or a tokenizer.json path
      text_key="text",      # JSON / TFDS field holding the document
      val_fraction=0.05,    # share of documents in validation (hash split)
      val_tokens=2**22,     # evaluation windows are spread over the first this
                            # many held-out tokens (validation_windows)
      train_split="train",  # tfds splits
      val_split="validation",
      data_dir="",          # tfds data_dir ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets)
      decode_errors="strict",  # invalid UTF-8: "strict" (error) or "replace"
  ))


def _grain_seed(seed):
  """A 32-bit shuffle seed derived from the run seed."""
  digest = hashlib.sha256(f"fp4jax.data/{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "big")


class _PackIterator(grain.DatasetIterator):
  """Concatenates tokens(text) of the parent's texts into windows int32[length].

  State: the parent's state before the current document, and the offset
  into its tokens.
  """

  def __init__(self, parent, tokens, length):
    super().__init__(parent)
    self._tokens, self._length = tokens, length
    self._doc_state = parent.get_state()
    self._doc, self._offset, self._skip = None, 0, 0

  def __next__(self):
    out = np.empty(self._length, np.int32)
    filled = 0
    while filled < self._length:
      if self._doc is None or self._offset == len(self._doc):
        self._doc_state = self._parent.get_state()
        self._doc = self._tokens(next(self._parent))
        self._offset, self._skip = self._skip, 0
      take = min(self._length - filled, len(self._doc) - self._offset)
      out[filled:filled + take] = self._doc[self._offset:self._offset + take]
      filled += take
      self._offset += take
    return out

  def get_state(self):
    offset = self._skip if self._doc is None else self._offset
    return dict(parent=self._doc_state, offset=offset)

  def set_state(self, state):
    """Restores lazily: the document is read again on the next window."""
    self._parent.set_state(state["parent"])
    self._doc_state = state["parent"]
    self._doc, self._offset, self._skip = None, 0, state["offset"]


class BatchIterator:
  """Endless (or, for validation, in-order) batches int32[rows, seq_len + 1].

  `get_state()` returns a JSON-serialisable dict (with "data", the
  fingerprint of the files read: fp4jax.data.fingerprint); `set_state`
  restores it into an iterator built with the same arguments, and raises
  fingerprint.DataChanged for a state saved with other files unless
  `other_data` (a state without "data", from before it was kept, is taken
  as it is).
  """

  def __init__(self, row_iterators, first_row, global_batch, fingerprint):
    self._rows = row_iterators
    self._key = dict(first_row=first_row, global_batch=global_batch)
    self.fingerprint = fingerprint

  def __iter__(self):
    return self

  def __next__(self):
    """The next batch; after an error, the position is the one before it."""
    state = self.get_state()
    try:
      return np.stack([next(r) for r in self._rows])
    except Exception:
      self.set_state(state)
      raise

  def get_state(self):
    return dict(self._key, rows=[r.get_state() for r in self._rows],
                data=self.fingerprint)

  def set_state(self, state, other_data=False):
    changed = fingerprint_lib.changes(state.get("data", self.fingerprint),
                                      self.fingerprint)
    if changed and not other_data:
      raise fingerprint_lib.DataChanged(changed)
    given = {k: state.get(k) for k in self._key}
    if given != self._key or len(state["rows"]) != len(self._rows):
      raise ValueError(f"data iterator state for {given} with "
                       f"{len(state['rows'])} rows does not fit this "
                       f"iterator ({self._key}, {len(self._rows)} rows).")
    for r, s in zip(self._rows, state["rows"]):
      r.set_state(s)


def _check_process_split(batch, process_index, process_count):
  """ValueError unless `batch` rows split evenly over the processes and
  process_index is one of them."""
  if batch % process_count or not 0 <= process_index < process_count:
    raise ValueError(
        f"batch size {batch} must divide evenly over {process_count} "
        f"processes, and process_index ({process_index}) lie in "
        f"[0, {process_count}).")


def _batches(cfg, tokenizer, split, seed, seq_len, global_batch,
             process_index, process_count):
  """A BatchIterator over this process's rows of `split`."""
  if seq_len < 1 or global_batch < 1:
    raise ValueError(f"seq_len ({seq_len}) and the batch size "
                     f"({global_batch}) must be positive.")
  _check_process_split(global_batch, process_index, process_count)
  documents, fingerprint = sources.open_corpus(cfg, split)
  per_process = global_batch // process_count
  first = process_index * per_process
  rows = range(first, first + per_process)
  texts = _row_texts(documents, None if seed is None else _grain_seed(seed),
                     rows, global_batch)
  tokens = functools.partial(_tokens, tokenizer)
  return BatchIterator([_PackIterator(t, tokens, seq_len + 1) for t in texts],
                       first, global_batch, fingerprint)


def _row_texts(documents, shuffle_seed, rows, global_batch):
  """Endless iterators of documents (str), one per row in `rows`: row r takes
  documents r, r + global_batch, ... of each epoch (shuffled from
  `shuffle_seed`, in order when None). documents: as sources.open_corpus."""
  if not isinstance(documents, grain.MapDataset):
    return documents.rows(shuffle_seed, rows, global_batch)
  if shuffle_seed is not None:
    documents = documents.shuffle(shuffle_seed)
  return [iter(documents.repeat()[r::global_batch].to_iter_dataset(_NO_THREADS))
          for r in rows]


def _tokens(tokenizer, text):
  """A document as BOS + tokenizer.encode(text) + EOS: int32[n + 2]."""
  return np.concatenate([[tokenizer.bos_id], tokenizer.encode(text),
                         [tokenizer.eos_id]]).astype(np.int32)


def train_iterator(data_cfg, tokenizer, *, seq_len, global_batch, seed,
                   process_index=0, process_count=1):
  """Endless shuffled batches int32[global_batch // process_count, seq_len+1].

  Epochs repeat with a new shuffle; same seed, same batches. The result has
  get_state() / set_state(state) (a JSON-serialisable dict).
  """
  return _batches(data_cfg, tokenizer, "train", seed, seq_len, global_batch,
                  process_index, process_count)


def validation_batches(data_cfg, tokenizer, *, seq_len, batch_size,
                       num_batches, process_index=0, process_count=1):
  """Validation documents packed from their starts: num_batches arrays int32[b, seq_len + 1].

  Row r packs documents r, r + batch_size, ... in order (repeating if the
  split is short), so the windows are the openings of the documents; the
  trainer evaluates on `validation_windows` instead, which samples all of them.
  """
  batches = _batches(data_cfg, tokenizer, "validation", None, seq_len,
                     batch_size, process_index, process_count)
  return [next(batches) for _ in range(num_batches)]


def _validation_stream(cfg, tokenizer, max_tokens):
  """(the held-out documents in order as one int32 stream BOS doc EOS BOS
  ..., the fingerprint of the files they are read from).

  Stops after `max_tokens` tokens or at the end of the split, whichever
  comes first (the split is read once, never repeated).
  """
  documents, fingerprint = sources.open_corpus(cfg, "validation")
  if isinstance(documents, grain.MapDataset):
    texts = (documents[i] for i in range(len(documents)))
  else:
    texts = documents.once()
  pieces, total = [], 0
  for text in texts:
    pieces.append(_tokens(tokenizer, text))
    total += pieces[-1].size
    if total >= max_tokens:
      break
  return np.concatenate(pieces)[:max_tokens], fingerprint


class TooManyBatches(ValueError):
  """validation_windows(disjoint=True) was asked for more batches than the
  held-out stream holds without overlapping windows."""


def validation_windows(data_cfg, tokenizer, *, seq_len, batch_size,
                       num_batches, process_index=0, process_count=1,
                       disjoint=False):
  """The evaluation set: num_batches arrays int32[b, seq_len + 1], b = batch_size // process_count.

  The held-out stream (documents in order, BOS doc EOS, at most
  data.val_tokens tokens) is cut into n = batch_size * num_batches windows
  whose starts are evenly spaced from its first to its last token, so the
  windows sample every part of the files, not their opening lines. Window j
  is row j // num_batches of batch j % num_batches: every batch spans the
  whole stream, so the batch means are alike and their spread gives the
  evaluation's standard error. A function of the config only: the same
  windows for every run, seed and recipe. Process p gets rows p*b .. p*b+b-1.
  Returns a Windows list, whose `fingerprint` is that of the validation
  files (fp4jax.data.fingerprint: what a run records of the text it
  evaluates on) and whose `overlap` says when windows overlap (a
  validation text shorter than the windows asked): then the batch means are
  not independent and give no standard error. disjoint: raise TooManyBatches
  instead when they would overlap (so the windows never outnumber the
  stream's tokens).
  """
  if seq_len < 1 or batch_size < 1 or num_batches < 1:
    raise ValueError(f"seq_len ({seq_len}), batch size ({batch_size}) and "
                     f"number of batches ({num_batches}) must be positive.")
  _check_process_split(batch_size, process_index, process_count)
  stream, fingerprint = _validation_stream(data_cfg, tokenizer,
                                          data_cfg.val_tokens)
  length, n = seq_len + 1, batch_size * num_batches
  if stream.size < length:
    raise ValueError(f"the validation split has {stream.size} tokens, fewer "
                     f"than one window of seq_len + 1 = {length}.")
  held = stream.size // length // batch_size
  if disjoint and num_batches > held:
    which = f"{held:,} batches" if held else "no batch"
    raise TooManyBatches(
        f"the validation set's {stream.size:,} tokens (at most "
        f"data.val_tokens) hold {which} of {batch_size} disjoint windows of "
        f"seq_len + 1 = {length} tokens" + (f"; give at most {held:,}" if held
                                            else ""))
  starts = np.round(np.linspace(0, stream.size - length, n)).astype(np.int64)
  windows_BxNxL = stream[starts[:, None] + np.arange(length)].reshape(
      batch_size, num_batches, length)
  per_process = batch_size // process_count
  mine = windows_BxNxL[process_index * per_process:
                       (process_index + 1) * per_process]
  out = Windows(np.ascontiguousarray(mine[:, i]) for i in range(num_batches))
  out.fingerprint = fingerprint
  spacing = (stream.size - length) / (n - 1) if n > 1 else math.inf
  if spacing < length:
    out.overlap = (
        f"the {n} evaluation windows (eval_batches {num_batches} x eval batch "
        f"size {batch_size}) of seq_len + 1 = {length} tokens overlap: the "
        f"validation text has {stream.size:,} tokens, so they start "
        f"{spacing:.1f} tokens apart and their losses are not independent")
  return out


class Windows(list):
  """validation_windows' batches; `fingerprint`: of the files they come
  from (None when unknown); `overlap`: "" when the windows are
  disjoint, else why their batch means give no standard error."""
  overlap = ""
  fingerprint = None
