"""Reading corpus files: decoding, start-up checks, errors that name the file.

Used by fp4jax.data. `DataError` names the file (and line) at fault.
`decode_errors_of(cfg)` is the codec policy of data.decode_errors: "strict"
(invalid UTF-8 is a DataError) or "replace" (U+FFFD; `warn_replaced` prints
the count per file once). `check_json_files` / `check_text_files` are the
cheap start-up checks.
"""

import codecs
import gzip
import json
import os
import sys

from fp4jax import errors

DECODE_ERRORS = ("strict", "replace")
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


def read_error(path, line, error):
  """DataError for an exception raised reading `line` (1-based) of `path`."""
  if isinstance(error, UnicodeDecodeError):
    why = (f"invalid UTF-8 ({error.reason}); fix the file or set "
           "data.decode_errors='replace'")
  elif isinstance(error, (EOFError, gzip.BadGzipFile)) or "gzip" in str(
      error).lower() or "compressed" in str(error).lower():
    why = f"not a complete gzip file ({error})"
  else:
    why = f"cannot be read ({error})"
  return DataError(f"{path} line {line}: {why}")


def parse_json(raw, where):
  try:
    return json.loads(raw)
  except ValueError as e:
    raise DataError(f"{where}: malformed JSON ({e})") from None


def text_of(record, text_key, where):
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
      try:
        with open(path, "rb") as f:
          magic = f.read(2)
      except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
      if magic != b"\x1f\x8b":
        raise DataError(f"{path}: not a gzip file (it ends in .gz); "
                        "compress it or drop the .gz suffix.")
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

