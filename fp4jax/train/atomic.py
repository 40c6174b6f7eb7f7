"""Writes that leave either the old file or the new one, never a part.

`resolved(path)` is a path to write as the OS resolves it (`link/..` is the
folder above the link's target). `write_text(path, text)` writes a temporary file in the same folder, fsyncs
it and renames it over `path` (over the file a symbolic link `path` points
to, so the link stays) (a rename within one folder is atomic on
POSIX), then fsyncs the folder so the rename itself survives a crash. A
full disk (ENOSPC) removes the temporary file and raises errors.DiskFull
naming `path` and the space the write needed; the old file is untouched.
`replace_dir(src, dst)` puts a complete folder in place of another (Linux:
one atomic exchange). `BEFORE_RENAME` is a test hook: called with the temporary path just before
the rename (a test kills the process there).

A folder a command fills before renaming it into place (an export's
OUT.partial) carries PARTIAL_MARK, written first (`mark_partial`): only a
folder with it is removed as one a killed command left (`is_marked_partial`),
never a folder of the same name that holds the user's files.
`OutputLock(path, what)` lets one command at a time write `path`: an OS lock
(fcntl.flock) on PATH.lock beside it, released on exit and on signals; a
second command is refused in one line while the first holds it.
"""

import ctypes
import errno
import fcntl
import os
import shutil
import tempfile

from fp4jax import errors

BEFORE_RENAME = []


def resolved(path):
  """`path` as the OS resolves it, for a path that is written: trailing
  separators dropped, and where it holds `..` its folder made real
  (os.path.realpath: after a symbolic link `..` goes up from the link's
  target, not from the link as os.path.normpath or abspath would), its last
  name as given. Other paths are returned as they are."""
  path = os.fspath(path)
  path = path.rstrip(os.sep) or os.sep if path else path
  if not path or os.pardir not in path.split(os.sep):
    return path
  name = os.path.basename(path)
  if name in (os.curdir, os.pardir):
    return os.path.realpath(path)
  return os.path.join(os.path.realpath(os.path.dirname(path) or os.curdir), name)


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
  one; elsewhere the old one is moved to a new hidden folder beside it
  (.NAME.old.XXXX) for the instant between two renames (and removed after).
  """
  for hook in BEFORE_RENAME:
    hook(src)
  if os.path.isdir(dst):
    if _exchange(src, dst):
      shutil.rmtree(src)  # now the old folder
      fsync_dir(os.path.realpath(os.path.dirname(dst) or os.curdir))
      return
    old = tempfile.mkdtemp(dir=os.path.realpath(os.path.dirname(src) or os.curdir),
                           prefix=f".{os.path.basename(dst)}.old.")
    os.rename(dst, old)  # over the new empty folder: no other folder is touched
    os.rename(src, dst)
    shutil.rmtree(old)
  else:
    os.rename(src, dst)
  fsync_dir(os.path.realpath(os.path.dirname(dst) or os.curdir))


# ---------------------------------------------------------------------------
# Partial folders and one writer per output.

PARTIAL_MARK = ".fp4jax-partial"


def mark_partial(folder):
  """Creates `folder` (it must not exist) and the mark inside it, first
  thing: the folder is this command's until it is renamed into place."""
  os.makedirs(folder)
  with open(os.path.join(folder, PARTIAL_MARK), "w", encoding="utf-8") as f:
    f.write("written by fp4jax; removed when the folder is complete\n")


def is_marked_partial(folder):
  """True when `folder` holds the mark of `mark_partial` (a plain file)."""
  mark = os.path.join(folder, PARTIAL_MARK)
  return os.path.isfile(mark) and not os.path.islink(mark)


def unmark(folder):
  """Removes the mark from `folder` (once it is complete and in place)."""
  try:
    os.remove(os.path.join(folder, PARTIAL_MARK))
  except FileNotFoundError:
    pass


_LOCK_HEADER = "fp4jax output lock"


class OutputLock:
  """PATH.lock: while held, no other command writes PATH (one writer per
  output). `acquire` raises errors.UserError (one line naming `what`) while
  another process holds it, or when PATH.lock is a link, a folder or a file
  this module did not write; `release` removes it (also at a signal that
  ends the command: errors.on_signal_exit)."""

  def __init__(self, path, what):
    self.path, self.what = path, what
    self.lock = path + ".lock"
    self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()

  def _refuse(self, why):
    raise errors.UserError(f"{self.what} {self.path!r}: {why}")

  def acquire(self):
    """Takes the lock (the folder of PATH must exist); returns self."""
    for _ in range(5):  # again when the file was replaced while we waited
      try:
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
      except OSError as e:
        if e.errno == errno.ELOOP:
          self._refuse(f"its lock {self.lock!r} is a symbolic link; remove it")
        if e.errno == errno.ENOSPC:
          raise errors.disk_full(self.lock, None) from None
        self._refuse(f"cannot create its lock {self.lock!r} ({e.strerror})")
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
          text = os.pread(fd, 200, 0).decode("utf-8", "replace")
          os.close(fd)
          who = text.split("pid ")[-1].split()[0] if "pid " in text else "?"
          self._refuse(f"another command (process {who}) is writing it now (it "
                       f"holds {self.lock!r}); wait for it to end, or give another "
                       "path")
        # else: no flock on this file system; the lock file alone marks it
      try:
        same = os.fstat(fd).st_ino == os.lstat(self.lock).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # released and removed meanwhile: lock the file there now
        os.close(fd)
        continue
      text = os.pread(fd, 200, 0).decode("utf-8", "replace")
      if text and not text.startswith(_LOCK_HEADER):
        os.close(fd)
        self._refuse(f"{self.lock!r} exists and is not a lock fp4jax wrote; it is "
                     "not replaced: move or remove it")
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{_LOCK_HEADER}: pid {os.getpid()}\n".encode(), 0)
      self._fd = fd
      errors.on_signal_exit(self.release)
      return self
    self._refuse(f"could not lock {self.lock!r}")

  def release(self):
    """Removes PATH.lock and releases it (safe to call twice)."""
    errors.forget_signal_exit(self.release)
    if self._fd is None:
      return
    try:
      if os.fstat(self._fd).st_ino == os.lstat(self.lock).st_ino:
        os.remove(self.lock)
    except OSError:
      pass
    finally:
      os.close(self._fd)  # closing releases the flock
      self._fd = None
