"""Training data: corpora -> documents -> tokens -> packed windows (grain).

The global batch has `global_batch` rows. Row r is its own stream: it takes
every global_batch-th document of the (epoch-shuffled) corpus, starting at
document r, turns each into BOS + tokens + EOS, concatenates them and cuts
the result into windows of seq_len + 1 tokens (the trainer shifts inputs and
targets). A process builds only its rows, process_index * b .. + b with
b = global_batch // process_count, so the processes' shards are disjoint and,
stacked, are exactly the one-process global batch. The iterator state is the
rows' grain states (a dict of ints), so a restored run continues exactly.

Sources (data.source):
  stdlib  the .py files of the running Python's standard library
          (sysconfig "stdlib"), without site-packages, dist-packages and the
          test suites (test/, tests/, idle_test/): for CPython 3.11, 734
          files, 12.1 MB. One file is one document; files in sorted order.
  files   data.path: a glob of .txt files (one file = one document) or of
          .jsonl / .json / .jsonl.gz / .json.gz files (one line = one
          document, its `data.text_key` field), e.g. MLPerf's C4
          `c4-train.*.json.gz`. JSON lines are streamed, never loaded whole,
          and read once per process (lines of other processes' rows are
          skipped unparsed).
          data.val_path: a glob for validation (C4: `c4-validation.*.json.gz`);
          when empty, documents are split by hash.
  tfds    data.path: a TFDS name (e.g. "c4/en:3.0.1") read with
          tfds.data_source(name, split=data.train_split / data.val_split,
          data_dir=data.data_dir): random access to a dataset prepared
          offline in the ArrayRecord format (`tfds build c4/en
          --file_format=array_record`); reading needs tensorflow-datasets
          and array_record, not TensorFlow.
Without a separate validation set, a document is in validation when a stable
hash (sha256) of its file path (and line number, for JSON lines) falls below
data.val_fraction. Training epochs repeat endlessly, each with a new shuffle;
validation is read in order and is the same for every run and recipe:
`validation_windows` (what the trainer evaluates on) spreads its windows
evenly through the held-out stream, `validation_batches` packs it from the
start of each document.

Bad files: a file that cannot be read or decoded, a malformed JSON line, a
record without the text field, or a corpus without any text raises DataError
naming the file (and line), at start-up where it is cheap to see (every
.json.gz is gzip, every file's first record parses and has the field, the
corpus has text), else when the reader reaches it. data.decode_errors sets
what invalid UTF-8 becomes: "strict" (default: DataError naming the file and
byte) or "replace" (U+FFFD, counted in a warning per file).
"""

import collections
import glob
import gzip
import hashlib
import math
import os
import sysconfig

import grain
import ml_collections
import numpy as np

from fp4jax.data import fingerprint as fingerprint_lib
from fp4jax.data.files import DataError
from fp4jax.data.files import Replacements
from fp4jax.data.files import check_json_files
from fp4jax.data.files import check_text_files
from fp4jax.data.files import decode_errors_of
from fp4jax.data.files import open_lines
from fp4jax.data.files import parse_json
from fp4jax.data.files import read_error
from fp4jax.data.files import read_text
from fp4jax.data.files import text_of
from fp4jax.data.files import warn_replaced

SOURCES = ("stdlib", "files", "tfds")
TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_STDLIB_SKIP = ("site-packages", "dist-packages", "__pycache__", "test",
                "tests", "idle_test")
_NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def data_config():
  """Defaults: the embedded stdlib corpus with the byte tokenizer."""
  return ml_collections.ConfigDict(dict(
      source="stdlib",      # one of SOURCES
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


def _in_validation(key, fraction):
  """Stable split: sha256 of `key` as a number in [0, 1) below `fraction`."""
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2**64


def _grain_seed(seed):
  """A 32-bit shuffle seed derived from the run seed."""
  digest = hashlib.sha256(f"fp4jax.data/{seed}".encode()).digest()
  return int.from_bytes(digest[:4], "big")


def stdlib_files(val_fraction=0.05):
  """(root, train relpaths, validation relpaths) of the stdlib corpus."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for directory, subdirs, names in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIP)
    rel = os.path.relpath(directory, root)
    paths += [os.path.normpath(os.path.join(rel, n)) for n in names
              if n.endswith(".py")]
  paths.sort()
  val = [p for p in paths if _in_validation(p, val_fraction)]
  train = [p for p in paths if not _in_validation(p, val_fraction)]
  return root, train, val


class _JsonLinesReader:
  """Streams JSON-lines files once per process for all its rows.

  Epoch e visits `files` in an order shuffled from (seed, e) (as given when
  seed is None), each file line by line. The documents `keep(relpath, line)`
  selects are counted over all epochs; document c belongs to row
  c % global_batch. Documents of this process's rows are queued (unparsed)
  until their row asks; the others are skipped. A position is a dict
  (epoch, file: index into the epoch's order, line, count), taken after a
  document; each row's state is the position after its last document.
  """

  def __init__(self, files, relpaths, text_key, keep, seed, rows,
               global_batch, decode_errors="strict"):
    self.files, self.relpaths, self.text_key = files, relpaths, text_key
    self.decode_errors = decode_errors
    self.keep, self.seed, self.global_batch = keep, seed, global_batch
    start = dict(epoch=0, file=0, line=0, count=0)
    self.after = {r: dict(start) for r in rows}
    self.queues = {r: collections.deque() for r in rows}
    self._pos, self._lines, self._epoch_count = None, None, -1

  def next_text(self, row):
    """The next document (str) of `row`."""
    while not self.queues[row]:
      self._read_line()
    raw, where, after = self.queues[row].popleft()
    self.after[row] = after
    return text_of(parse_json(raw, where), self.text_key, where)

  def restore(self, row, after):
    """Puts `row` back to position `after`; rereads from the earliest row."""
    self.after[row] = dict(after)
    self._close()
    self._pos = None
    for queue in self.queues.values():
      queue.clear()

  def _file_index(self):
    if self.seed is None:
      return self._pos["file"]
    order = np.random.default_rng([self.seed, self._pos["epoch"]]).permutation(
        len(self.files))
    return int(order[self._pos["file"]])

  def _read_line(self):
    if self._pos is None:  # start, or restart after a restore
      pos = dict(min(self.after.values(), key=lambda p: p["count"]))
      at_epoch_start = (pos["file"], pos["line"]) == (0, 0)
      # Count at the epoch's start; unknown (-1) when restarting mid-epoch.
      self._pos, self._epoch_count = pos, pos["count"] if at_epoch_start else -1
    pos, index = self._pos, self._file_index()
    path = self.files[index]
    before = Replacements.count
    try:
      if self._lines is None:
        self._lines = open_lines(path, self.decode_errors)
        for _ in range(pos["line"]):
          self._lines.readline()
      raw = self._lines.readline()
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as e:
      self._close()
      raise read_error(path, pos["line"] + 1, e) from None
    warn_replaced(path, before)
    if not raw:
      self._close()
      pos["file"], pos["line"] = pos["file"] + 1, 0
      if pos["file"] == len(self.files):
        if pos["count"] == self._epoch_count:
          raise DataError(f"no documents in {self.files} for this split "
                          "(see data.val_fraction, data.val_path).")
        pos["epoch"], pos["file"] = pos["epoch"] + 1, 0
        self._epoch_count = pos["count"]
      return
    line = pos["line"]
    pos["line"] += 1
    if not raw.strip() or not self.keep(self.relpaths[index], line):
      return
    count = pos["count"]
    pos["count"] += 1
    row = count % self.global_batch
    if row in self.queues and count >= self.after[row]["count"]:
      self.queues[row].append(
          (raw, f"{self.files[index]} line {line + 1}", dict(pos)))

  def _close(self):
    if self._lines is not None:
      self._lines.close()
      self._lines = None


class _JsonLinesRow(grain.DatasetIterator):
  """The documents (str) of one row, from a shared _JsonLinesReader."""

  def __init__(self, reader, row):
    super().__init__()
    self._reader, self._row = reader, row

  def __next__(self):
    return self._reader.next_text(self._row)

  def get_state(self):
    return dict(self._reader.after[self._row])

  def set_state(self, state):
    self._reader.restore(self._row, state)


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


def _glob(pattern, what):
  files = sorted(f for f in glob.glob(os.path.expanduser(pattern),
                                      recursive=True) if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(
        f"{what} {pattern!r} matches no files; give a glob of "
        f"{TEXT_SUFFIXES + JSON_SUFFIXES} files, e.g. "
        "'/data/c4/en/c4-train.*.json.gz'.")
  kinds = {f.endswith(TEXT_SUFFIXES) + 2 * f.endswith(JSON_SUFFIXES)
           for f in files}
  if kinds not in ({1}, {2}):
    raise ValueError(
        f"{what} {pattern!r} must match only .txt files or only JSON-lines "
        f"files {JSON_SUFFIXES}; got e.g. {files[:3]}.")
  root = os.path.commonpath([os.path.dirname(os.path.abspath(f))
                             for f in files])
  return files, [os.path.relpath(os.path.abspath(f), root) for f in files]


def _corpus(cfg, split):
  """The documents (str) of split "train" or "validation".

  Returns (a grain.MapDataset (random access) or a function
  (seed, rows, global_batch) -> _JsonLinesReader (streamed), the
  fingerprint of what it reads: fp4jax.data.fingerprint).
  """
  validation = split == "validation"
  if cfg.source == "stdlib" and (cfg.path or cfg.val_path):
    raise ValueError("data.source='stdlib' takes no data.path / val_path "
                     f"(got {cfg.path!r}, {cfg.val_path!r}); use "
                     "data.source='files' for your own files.")
  if cfg.source == "stdlib":
    root, train, val = stdlib_files(cfg.val_fraction)
    rels = val if validation else train
    if not rels:
      raise ValueError(f"the stdlib corpus under {root!r} has no {split} "
                       f"files (data.val_fraction={cfg.val_fraction}).")
    return grain.MapDataset.source(rels).map(
        lambda rel: read_text(os.path.join(root, rel))), fingerprint_lib.of_files(
            "stdlib", [os.path.join(root, rel) for rel in rels], rels)
  if cfg.source == "files":
    if not cfg.path:
      raise ValueError("data.source='files' needs data.path, a glob such as "
                       "'/data/c4/en/c4-train.*.json.gz'.")
    by_hash = not cfg.val_path
    decode_errors = decode_errors_of(cfg)
    pattern, what = ((cfg.val_path, "data.val_path") if validation and
                     not by_hash else (cfg.path, "data.path"))
    files, rels = _glob(pattern, what)
    wanted = validation if by_hash else None
    if files[0].endswith(TEXT_SUFFIXES):
      chosen = [(f, r) for f, r in zip(files, rels) if wanted is None
                or _in_validation(r, cfg.val_fraction) == wanted]
      if not chosen:
        raise ValueError(f"{what} {pattern!r}: none of its {len(files)} "
                         f"files falls in {split} (data.val_fraction="
                         f"{cfg.val_fraction}); add files or set "
                         "data.val_path.")
      chosen, chosen_rels = [f for f, _ in chosen], [r for _, r in chosen]
      check_text_files(chosen)
      return grain.MapDataset.source(chosen).map(
          lambda path: read_text(path, decode_errors)), fingerprint_lib.of_files(
              "files", chosen, chosen_rels)
    check_json_files(files, cfg.text_key, decode_errors)
    fraction = cfg.val_fraction

    def keep(rel, line):
      return wanted is None or _in_validation(f"{rel}:{line}",
                                              fraction) == wanted

    return (lambda seed, rows, global_batch: _JsonLinesReader(
        files, rels, cfg.text_key, keep, seed, rows, global_batch,
        decode_errors)), fingerprint_lib.of_files("files", files, rels)
  if cfg.source == "tfds":
    try:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          "data.source='tfds' needs tensorflow-datasets, which is not "
          "installed (pip install 'fp4jax[tfds]').") from e
    if not cfg.path:
      raise ValueError("data.source='tfds' needs data.path, a TFDS name such "
                       "as 'c4/en:3.0.1'.")
    name = cfg.val_split if validation else cfg.train_split
    try:
      source = tfds.data_source(cfg.path, split=name,
                                data_dir=cfg.data_dir or None)
    except ValueError as e:  # also tfds' DatasetNotFoundError
      raise ValueError(
          f"tfds {cfg.path!r} split {name!r} (data.data_dir="
          f"{cfg.data_dir!r}) cannot be read: {str(e).splitlines()[0]} "
          "Prepare it offline as ArrayRecord, e.g. `tfds build c4/en "
          "--file_format=array_record --data_dir=DIR`.") from e
    text_of(source[0], cfg.text_key, f"tfds {cfg.path!r} split {name!r}")
    return grain.MapDataset.source(source).map(
        lambda record: text_of(record, cfg.text_key, cfg.path)), dict(
            source="tfds", name=cfg.path, split=name, records=len(source))
  raise ValueError(f"unknown data.source {cfg.source!r}; allowed: "
                   f"{SOURCES}.")


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
  corpus, fingerprint = _corpus(cfg, split)
  bos, eos = np.int32(tokenizer.bos_id), np.int32(tokenizer.eos_id)

  def tokens(text):
    return np.concatenate([[bos], tokenizer.encode(text), [eos]]).astype(
        np.int32)

  per_process = global_batch // process_count
  first = process_index * per_process
  rows = range(first, first + per_process)
  shuffle_seed = None if seed is None else _grain_seed(seed)
  if isinstance(corpus, grain.MapDataset):
    docs = corpus if seed is None else corpus.shuffle(shuffle_seed)
    texts = [iter(docs.repeat()[r::global_batch].to_iter_dataset(_NO_THREADS))
             for r in rows]
  else:
    reader = corpus(shuffle_seed, rows, global_batch)
    texts = [_JsonLinesRow(reader, r) for r in rows]
  return BatchIterator([_PackIterator(t, tokens, seq_len + 1) for t in texts],
                       first, global_batch, fingerprint)


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
  """The held-out documents in order as one int32 stream BOS doc EOS BOS ...

  Stops after `max_tokens` tokens or at the end of the split, whichever
  comes first (the split is read once, never repeated).
  """
  corpus, _ = _corpus(cfg, "validation")
  if isinstance(corpus, grain.MapDataset):
    texts = (corpus[i] for i in range(len(corpus)))
  else:
    reader = corpus(None, [0], 1)

    def read_once():
      while True:
        text = reader.next_text(0)
        if reader.after[0]["epoch"] > 0:  # wrapped around to the first document
          return
        yield text

    texts = read_once()
  pieces, total = [], 0
  for text in texts:
    pieces.append(np.concatenate([[tokenizer.bos_id], tokenizer.encode(text),
                                  [tokenizer.eos_id]]).astype(np.int32))
    total += pieces[-1].size
    if total >= max_tokens:
      break
  return np.concatenate(pieces)[:max_tokens]


def validation_windows(data_cfg, tokenizer, *, seq_len, batch_size,
                       num_batches, process_index=0, process_count=1):
  """The evaluation set: num_batches arrays int32[b, seq_len + 1], b = batch_size // process_count.

  The held-out stream (documents in order, BOS doc EOS, at most
  data.val_tokens tokens) is cut into n = batch_size * num_batches windows
  whose starts are evenly spaced from its first to its last token, so the
  windows sample every part of the files, not their opening lines. Window j
  is row j // num_batches of batch j % num_batches: every batch spans the
  whole stream, so the batch means are alike and their spread gives the
  evaluation's standard error. A function of the config only: the same
  windows for every run, seed and recipe. Process p gets rows p*b .. p*b+b-1.
  Returns a Windows list, whose `overlap` says when windows overlap (a
  validation text shorter than the windows asked): then the batch means are
  not independent and give no standard error.
  """
  if seq_len < 1 or batch_size < 1 or num_batches < 1:
    raise ValueError(f"seq_len ({seq_len}), batch size ({batch_size}) and "
                     f"number of batches ({num_batches}) must be positive.")
  _check_process_split(batch_size, process_index, process_count)
  stream = _validation_stream(data_cfg, tokenizer, data_cfg.val_tokens)
  length, n = seq_len + 1, batch_size * num_batches
  if stream.size < length:
    raise ValueError(f"the validation split has {stream.size} tokens, fewer "
                     f"than one window of seq_len + 1 = {length}.")
  starts = np.round(np.linspace(0, stream.size - length, n)).astype(np.int64)
  windows_BxNxL = stream[starts[:, None] + np.arange(length)].reshape(
      batch_size, num_batches, length)
  per_process = batch_size // process_count
  mine = windows_BxNxL[process_index * per_process:
                       (process_index + 1) * per_process]
  out = Windows(np.ascontiguousarray(mine[:, i]) for i in range(num_batches))
  spacing = (stream.size - length) / (n - 1) if n > 1 else math.inf
  if spacing < length:
    out.overlap = (
        f"the {n} evaluation windows (eval_batches {num_batches} x eval batch "
        f"size {batch_size}) of seq_len + 1 = {length} tokens overlap: the "
        f"validation text has {stream.size:,} tokens, so they start "
        f"{spacing:.1f} tokens apart and their losses are not independent")
  return out


class Windows(list):
  """validation_windows' batches; `overlap`: "" when the windows are
  disjoint, else why their batch means give no standard error."""
  overlap = ""
