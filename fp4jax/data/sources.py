"""What the data reads: one function per data.source, the files' decoding and start-up checks.

Every source is one function of one signature (SOURCES maps data.source to it):

  open_<source>(cfg, split) -> (documents, fingerprint)
      cfg: the data config (fp4jax.data.pipeline.data_config); split: "train"
      or "validation".
      documents: the split's documents (str), one of
        grain.MapDataset[str]  random access (stdlib, .txt files, tfds), or
        JsonLines              streamed in order (JSON-lines files):
                               rows(seed, rows, global_batch) -> one
                               grain.DatasetIterator[str] per row (states:
                               JSON-serialisable dicts); once() -> each
                               document in order, once.
      fingerprint: a JSON-serialisable dict of what is read
        (fp4jax.data.fingerprint).
      The cheap start-up checks run here: a bad setting is a one-line
      ValueError, a bad file a DataError naming it.

`open_corpus(cfg, split)` calls the source data.source names. A new source
is one function here plus its name in SOURCES.

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
data.val_fraction.

Paths: a relative data.path, data.val_path or data.data_dir is read from the
current directory; a run records them made absolute (`absolute_paths`) with
the fingerprint of its validation files (fp4jax.data.fingerprint), so what
reads its data later reads the same files or says that they changed.

Bad files: a file that cannot be read or decoded, a malformed JSON line, a
record without the text field, or a corpus without any text raises DataError
naming the file (and line), at start-up where it is cheap to see (every
.json.gz is gzip, every file's first record parses and has the field, the
corpus has text), else when the reader reaches it. data.decode_errors sets
what invalid UTF-8 becomes: "strict" (default: DataError naming the file and
byte) or "replace" (U+FFFD, counted in a warning per file).
"""

import codecs
import collections
import glob
import gzip
import hashlib
import json
import os
import sys
import sysconfig

import grain
import numpy as np

from fp4jax import errors
from fp4jax.data import fingerprint

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DECODE_ERRORS = ("strict", "replace")
_STDLIB_SKIP = ("site-packages", "dist-packages", "__pycache__", "test",
                "tests", "idle_test")
# Bytes of text files read at start-up to find some text in a corpus.
_TEXT_PROBE_BYTES = 8 << 20


class DataError(errors.UserError):
  """A data file that cannot be used (named, with the line where known)."""


class Replacements:
  """The codec error handler "fp4jax.replace": U+FFFD, counted."""
  count = 0

  @classmethod
  def handle(cls, error):
    cls.count += error.end - error.start
    return "\ufffd", error.end


codecs.register_error("fp4jax.replace", Replacements.handle)
_WARNED = set()


def warn_replaced(path, before):
  """Warns once per file when reading it replaced invalid UTF-8 bytes."""
  n = Replacements.count - before
  if n and path not in _WARNED:
    _WARNED.add(path)
    print(f"fp4jax.data: {path}: replaced {n} invalid UTF-8 bytes with U+FFFD "
          "(data.decode_errors='replace')", file=sys.stderr, flush=True)


def decode_errors_of(cfg):
  """The codec error handler of data.decode_errors ("strict" or "replace")."""
  policy = cfg.get("decode_errors", "strict")
  if policy not in DECODE_ERRORS:
    raise ValueError(f"data.decode_errors {policy!r} is not one of "
                     f"{DECODE_ERRORS}")
  return "fp4jax.replace" if policy == "replace" else "strict"


def read_text(path, decode_errors="strict"):
  """The text of a .txt file; DataError naming it if unreadable."""
  before = Replacements.count
  try:
    with open(path, "rb") as f:
      text = f.read().decode("utf-8", errors=decode_errors)
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: invalid UTF-8 at byte {e.start} ({e.reason}); "
                    "fix the file or set data.decode_errors='replace'") from None
  except OSError as e:
    raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
  warn_replaced(path, before)
  return text


def open_lines(path, decode_errors="strict"):
  """Text lines of a JSON-lines file, gzipped or not."""
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8", errors=decode_errors)
  return open(path, encoding="utf-8", errors=decode_errors)


def _first_undecodable_line(path):
  """1-based number of the first line of `path` (as open_lines counts them)
  that is not UTF-8, or None."""
  try:
    with open_lines(path, "surrogateescape") as lines:
      for number, line in enumerate(lines, 1):
        if any("\udc80" <= c <= "\udcff" for c in line):
          return number
  except (OSError, EOFError, gzip.BadGzipFile):
    pass
  return None


def read_error(path, line, error):
  """DataError for an exception raised reading `line` (1-based) of `path`
  (for invalid UTF-8, the line that holds it: decoding reads ahead)."""
  if isinstance(error, UnicodeDecodeError):
    line = _first_undecodable_line(path) or line
    why = (f"invalid UTF-8 ({error.reason}); fix the file or set "
           "data.decode_errors='replace'")
  elif isinstance(error, (EOFError, gzip.BadGzipFile)) or "gzip" in str(
      error).lower() or "compressed" in str(error).lower():
    why = f"not a complete gzip file ({error})"
  else:
    why = f"cannot be read ({error})"
  return DataError(f"{path} line {line}: {why}")


def parse_json(raw, where):
  """The JSON value of the line `raw`; DataError naming `where` if malformed."""
  try:
    return json.loads(raw)
  except ValueError as e:
    raise DataError(f"{where}: malformed JSON ({e})") from None


def text_of(record, text_key, where):
  """The document (str) in field `text_key` of `record`; DataError if absent."""
  text = record.get(text_key) if isinstance(record, dict) else None
  if text is None:
    fields = (sorted(record) if isinstance(record, dict)
              else type(record).__name__)
    raise DataError(f"{where}: no field {text_key!r} (data.text_key); "
                    f"found {fields}.")
  return text.decode("utf-8") if isinstance(text, bytes) else text


def check_json_files(files, text_key, decode_errors):
  """Start-up checks of JSON-lines files (DataError naming file and line).

  Every .gz file starts with the gzip magic bytes and every file's first
  record parses and has `text_key`. Files are then read in order until one
  record has text (at most _TEXT_PROBE_BYTES of lines): a corpus read to the
  end without text is refused.
  """
  for path in files:
    if path.endswith(".gz"):
      _check_gzip_magic(path)
    _json_records(path, text_key, decode_errors, first_only=True)
  probed = 0
  for path in files:
    for text, size in _json_records(path, text_key, decode_errors):
      if text.strip():
        return
      probed += size
      if probed > _TEXT_PROBE_BYTES:
        return  # too much to read at start-up; assume text follows
  raise DataError(f"no text in the {len(files)} files of data.path: every "
                  f"record's {text_key!r} field is empty, e.g. {files[0]}.")


def _check_gzip_magic(path):
  """DataError unless the file `path` (named .gz) starts like a gzip file."""
  try:
    with open(path, "rb") as f:
      magic = f.read(2)
  except OSError as e:
    raise DataError(f"{path}: cannot be read ({e.strerror})") from None
  if magic != b"\x1f\x8b":
    raise DataError(f"{path}: not a gzip file (it ends in .gz); "
                    "compress it or drop the .gz suffix.")


def _json_records(path, text_key, decode_errors, first_only=False):
  """Yields (text, line bytes) of the records of a JSON-lines file."""
  number = 0
  try:
    with open_lines(path, decode_errors) as lines:
      for number, raw in enumerate(lines, 1):
        if raw.strip():
          where = f"{path} line {number}"
          yield text_of(parse_json(raw, where), text_key, where), len(raw)
          if first_only:
            return
  except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as e:
    raise read_error(path, number + 1, e) from None


def check_text_files(files):
  """Refuses a .txt corpus whose files are all empty."""
  if not any(os.path.getsize(f) for f in files):
    raise DataError(f"no text in the {len(files)} files of data.path: all are "
                    f"empty, e.g. {files[0]}.")


def _in_validation(key, fraction):
  """Stable split: sha256 of `key` as a number in [0, 1) below `fraction`."""
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < fraction * 2**64


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


def _glob(pattern, what):
  """(files, their paths relative to the folder above all) of the glob `pattern`."""
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


class JsonLines:
  """The documents of JSON-lines `files` (shown by their `relpaths`), streamed.

  keep(relpath, line): whether the document on `line` (0-based) of a file is
  in the split; its text is field `text_key`, decoded with `decode_errors`.
  """

  def __init__(self, files, relpaths, text_key, keep, decode_errors):
    self.files, self.relpaths, self.text_key = files, relpaths, text_key
    self.keep, self.decode_errors = keep, decode_errors

  def rows(self, seed, rows, global_batch):
    """One grain iterator of documents (str) per row in `rows`: document c
    goes to row c % global_batch, epochs shuffle the file order from `seed`
    (None: as given); the files are read once for all the rows."""
    reader = _JsonLinesReader(self, seed, rows, global_batch)
    return [_JsonLinesRow(reader, r) for r in rows]

  def once(self):
    """The documents (str) in order, each once."""
    reader = _JsonLinesReader(self, None, [0], 1)
    while True:
      text = reader.next_text(0)
      if reader.after[0]["epoch"] > 0:  # wrapped around to the first document
        return
      yield text


class _JsonLinesReader:
  """Streams a JsonLines corpus once per process for all its rows.

  Epoch e visits the files in an order shuffled from (seed, e) (as given when
  seed is None), each file line by line. The documents `keep(relpath, line)`
  selects are counted over all epochs; document c belongs to row
  c % global_batch. Documents of this process's rows are queued (unparsed)
  until their row asks; the others are skipped. A position is a dict
  (epoch, file: index into the epoch's order, line, count), taken after a
  document; each row's state is the position after its last document.
  """

  def __init__(self, corpus, seed, rows, global_batch):
    self.files, self.relpaths, self.text_key = (corpus.files, corpus.relpaths,
                                                corpus.text_key)
    self.decode_errors = corpus.decode_errors
    self.keep, self.seed, self.global_batch = corpus.keep, seed, global_batch
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


def open_stdlib(cfg, split):
  """The stdlib corpus: a grain.MapDataset of the split's files' texts."""
  if cfg.path or cfg.val_path:
    raise ValueError("data.source='stdlib' takes no data.path / val_path "
                     f"(got {cfg.path!r}, {cfg.val_path!r}); use "
                     "data.source='files' for your own files.")
  root, train, val = stdlib_files(cfg.val_fraction)
  rels = val if split == "validation" else train
  if not rels:
    raise ValueError(f"the stdlib corpus under {root!r} has no {split} "
                     f"files (data.val_fraction={cfg.val_fraction}).")
  return grain.MapDataset.source(rels).map(
      lambda rel: read_text(os.path.join(root, rel))), fingerprint.of_files(
          "stdlib", [os.path.join(root, rel) for rel in rels], rels)


def open_files(cfg, split):
  """data.path's (or data.val_path's) files: .txt as a grain.MapDataset of
  their texts, JSON lines as a JsonLines."""
  if not cfg.path:
    raise ValueError("data.source='files' needs data.path, a glob such as "
                     "'/data/c4/en/c4-train.*.json.gz'.")
  validation, by_hash = split == "validation", not cfg.val_path
  decode_errors = decode_errors_of(cfg)
  pattern, what = ((cfg.val_path, "data.val_path") if validation and
                   not by_hash else (cfg.path, "data.path"))
  files, rels = _glob(pattern, what)
  wanted = validation if by_hash else None  # None: every document
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
        lambda path: read_text(path, decode_errors)), fingerprint.of_files(
            "files", chosen, chosen_rels)
  check_json_files(files, cfg.text_key, decode_errors)
  fraction = cfg.val_fraction

  def keep(rel, line):
    return wanted is None or _in_validation(f"{rel}:{line}", fraction) == wanted

  return (JsonLines(files, rels, cfg.text_key, keep, decode_errors),
          fingerprint.of_files("files", files, rels))


def open_tfds(cfg, split):
  """A TFDS dataset prepared as ArrayRecord: a grain.MapDataset of its texts."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "data.source='tfds' needs tensorflow-datasets, which is not "
        "installed (pip install 'fp4jax[tfds]').") from e
  if not cfg.path:
    raise ValueError("data.source='tfds' needs data.path, a TFDS name such "
                     "as 'c4/en:3.0.1'.")
  name = cfg.val_split if split == "validation" else cfg.train_split
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


SOURCES = dict(stdlib=open_stdlib, files=open_files, tfds=open_tfds)
# The keys of each source that name places on disk (absolute_paths).
PATH_KEYS = dict(stdlib=(), files=("path", "val_path"), tfds=("data_dir",))


def absolute_paths(cfg):
  """{key: absolute path} of the data config's keys that name files or
  folders (PATH_KEYS: data.path and data.val_path of "files", data.data_dir
  of "tfds"): "~" expanded, a relative one joined to the current directory
  ("" stays ""). A run records them, so a later reader of its data (an
  export's calibration) reads the same files from any directory."""
  return {k: os.path.abspath(os.path.expanduser(cfg[k])) if cfg[k] else ""
          for k in PATH_KEYS.get(cfg.source, ())}


def open_corpus(cfg, split):
  """(documents, fingerprint) of `split` from the source data.source names."""
  if cfg.source not in SOURCES:
    raise ValueError(f"unknown data.source {cfg.source!r}; allowed: "
                     f"{tuple(SOURCES)}.")
  decode_errors_of(cfg)  # checked for every source, not only those that decode
  return SOURCES[cfg.source](cfg, split)
