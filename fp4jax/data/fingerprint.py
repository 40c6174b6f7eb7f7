"""The fingerprint of the training files: what a saved data position belongs to.

A saved data position (fp4jax.data.pipeline's iterator state) only means
something for the files it was saved with. `of_files` fingerprints them
({"source", "files": [[relative path, bytes], ...]}; a TFDS source's is its
name, split and record count); the iterator keeps that beside its position,
and restoring it into an iterator over other files raises `DataChanged`,
whose message says what changed (`changes`).
"""

import os


class DataChanged(ValueError):
  """A data position saved for other files than the iterator reads."""


def of_files(source, paths, rels):
  """The fingerprint of the files `paths` (shown by their `rels`)."""
  return dict(source=source, files=[[rel, os.path.getsize(path)]
                                    for path, rel in zip(paths, rels)])


def _some(names):
  return ", ".join(repr(n) for n in sorted(names)[:3]) + (
      ", ..." if len(names) > 3 else "")


def _files(n):
  return f"{n} file" + ("s" if n != 1 else "")


def changes(saved, now):
  """What differs between two fingerprints, in words ("" when nothing)."""
  if saved == now:
    return ""
  if "files" not in saved or "files" not in now:
    keys = sorted(k for k in saved.keys() | now.keys()
                  if saved.get(k) != now.get(k))
    return "; ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys)
  old, new = dict(saved["files"]), dict(now["files"])
  gone = old.keys() - new.keys()
  added = new.keys() - old.keys()
  resized = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
  parts = []
  if saved.get("source") != now.get("source"):
    parts.append(f"data.source {saved.get('source')!r} -> "
                 f"{now.get('source')!r}")
  if gone:
    parts.append(f"{len(gone)} of its {_files(len(old))} gone "
                 f"({_some(gone)})")
  if added:
    parts.append(f"{_files(len(added))} new ({_some(added)})")
  if resized:
    k = resized[0]
    parts.append(f"{_files(len(resized))} changed size ({k!r}: {old[k]:,} -> "
                 f"{new[k]:,} bytes" + (", ..." if len(resized) > 1 else "")
                 + ")")
  return "; ".join(parts) or "the files are listed in another order"
