"""Writes that leave either the old file or the new one, never a part.

`write_text(path, text)` writes a temporary file in the same folder, fsyncs
it and renames it over `path` (over the file a symbolic link `path` points
to, so the link stays) (a rename within one folder is atomic on
POSIX), then fsyncs the folder so the rename itself survives a crash. A
full disk (ENOSPC) removes the temporary file and raises errors.DiskFull
naming `path` and the space the write needed; the old file is untouched.
`replace_dir(src, dst)` puts a complete folder in place of another (Linux:
one atomic exchange). `BEFORE_RENAME` is a test hook: called with the temporary path just before
the rename (a test kills the process there).
"""

import ctypes
import errno
import os
import shutil
import tempfile

from fp4jax import errors

BEFORE_RENAME = []


def fsync_dir(directory):
  """fsync of a folder (makes a rename or a new entry in it durable)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return  # not supported here (e.g. some network file systems)
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_text(path, text):
  """Replaces (or creates) `path` with `text` (str or bytes) atomically."""
  data = text.encode("utf-8") if isinstance(text, str) else text
  path = os.path.realpath(path)  # a symbolic link stays one: its target is written
  directory = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(dir=directory,
                             prefix=f".{os.path.basename(path)}.",
                             suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~umask())  # mkstemp creates 0600
    for hook in BEFORE_RENAME:
      hook(tmp)
    os.replace(tmp, path)
  except BaseException as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      raise errors.disk_full(path, len(data)) from None
    raise
  fsync_dir(directory)


def _read_umask():
  mask = os.umask(0)
  os.umask(mask)
  return mask


_UMASK = _read_umask()  # at import: setting it later races with threads


def umask():
  """The process umask (as it was when this module was imported)."""
  return _UMASK


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a, b):
  """Swaps the paths a and b in one step (Linux renameat2); False where
  that is not available."""
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError):
    return False
  if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
               _RENAME_EXCHANGE) == 0:
    return True
  if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False  # this file system cannot exchange
  err = ctypes.get_errno()
  raise OSError(err, os.strerror(err), b)


def replace_dir(src, dst):
  """Moves the folder `src` to `dst`, replacing a folder there.

  `src` and `dst` must be on one file system (siblings). Where the kernel
  can exchange two paths, `dst` is at every moment the old folder or the new
  one; elsewhere the old one is moved to `dst`.old for the instant between
  two renames (and removed after).
  """
  for hook in BEFORE_RENAME:
    hook(src)
  if os.path.isdir(dst):
    if _exchange(src, dst):
      shutil.rmtree(src)  # now the old folder
      fsync_dir(os.path.dirname(os.path.abspath(dst)))
      return
    old = dst + ".old"
    if os.path.isdir(old):
      shutil.rmtree(old)
    os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old)
  else:
    os.rename(src, dst)
  fsync_dir(os.path.dirname(os.path.abspath(dst)))
