"""The tensor-core instructions of a compiled GPU program, read from its own binary.

XLA compiles a GPU program to one cubin per kernel; jax's serialized
executable (jax.experimental.serialize_executable) carries them inside a
Riegeli record file (64 KiB blocks, each opened by a 24-byte header) whose
records hold Snappy-compressed protos. `cubins` unpacks them; `sass_mma`
disassembles one with CUDA's nvdisasm (the nvidia-cuda-nvdisasm wheel) and
counts its SASS matrix instructions, with " block-scaled" added where the
instruction reads block scales from tensor memory (a tensor-memory operand
after its instruction descriptor). What ptxas (CUDA 13.5,
sm_100a) makes of each tcgen05.mma kind, checked in tests/test_gpu_compile.py:
kind::f16 -> UTCHMMA, kind::f8f6f4 -> UTCQMMA, kind::mxf8f6f4.block_scale ->
UTCQMMA block-scaled, kind::mxf4.block_scale -> UTCOMMA block-scaled,
kind::mxf4nvf4 (scale_vec::4X) -> UTCOMMA.4X block-scaled. On Hopper HGMMA /
QGMMA are wgmma with 16-bit / FP8 inputs; HMMA is the warp-level mma.sync.
Library kernels (cuBLAS, cuDNN) are not in the program and are not seen.
"""

import collections
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

from jax.experimental import serialize_executable

_RIEGELI = b"\x83\xaf\x70\xd1\x0d\x88\x4a\x3f"
_BLOCK, _BLOCK_HEADER, _CHUNK_HEADER = 1 << 16, 24, 40
_ELF = b"\x7fELF"
MMA = re.compile(r"\b(UTC[A-Z]*MMA(?:\.\w+)*|[A-Z]GMMA|[A-Z]MMA)\b([^;]*)")
# A block-scaled tcgen05 MMA names its scales' tensor memory after the instruction
# descriptor (an A operand read from tensor memory comes first, as in UTCHMMA's).
_SCALES_AFTER_IDESC = re.compile(r"idesc\[[^\]]*\],\s*tmem\[")
_RESOURCE_ATTRS = {0x2f: "registers", 0x11: "stack_bytes"}  # EIATTR_REGCOUNT, _FRAME_SIZE


def _varint(data, i):
  value = shift = 0
  while True:
    byte = data[i]
    i += 1
    value |= (byte & 127) << shift
    shift += 7
    if byte < 128:
      return value, i


def _riegeli_records(data):
  """The records of the Riegeli file starting at data[0], nested files flattened.

  Takes simple uncompressed chunks (chunk type 'r', compression 0), which is
  what jax writes."""
  body = b"".join(data[p + _BLOCK_HEADER:p + _BLOCK] for p in range(0, len(data), _BLOCK))
  records, p = [], _CHUNK_HEADER  # after the file signature's chunk header
  while p + _CHUNK_HEADER <= len(body) and body[p + 24:p + 25] == b"r":
    size = struct.unpack_from("<Q", body, p + 8)[0]
    chunk = body[p + _CHUNK_HEADER:p + _CHUNK_HEADER + size]
    sizes_length, i = _varint(chunk, 1)
    record = chunk[i + sizes_length:]
    records += _riegeli_records(record) if record.startswith(_RIEGELI) else [record]
    p += _CHUNK_HEADER + size
  return records


def _snappy(data, i):
  """The raw Snappy stream at data[i:], decoded, or None where it is not one."""
  n, i = _varint(data, i)
  out = bytearray()
  while len(out) < n and i < len(data):
    tag = data[i]
    i += 1
    if tag & 3 == 0:  # a literal of length + 1 bytes; 60-63: the length follows in 1-4 bytes
      length = tag >> 2
      if length >= 60:
        width = length - 59
        length = int.from_bytes(data[i:i + width], "little")
        i += width
      out += data[i:i + length + 1]
      i += length + 1
      continue
    if tag & 3 == 1:
      length, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[i]
      i += 1
    else:
      width = 2 if tag & 3 == 2 else 4
      length, offset = (tag >> 2) + 1, int.from_bytes(data[i:i + width], "little")
      i += width
    if not 0 < offset <= len(out):
      return None
    while length > 0:  # a copy may overlap its own output: at most `offset` bytes at a time
      piece = out[len(out) - offset:len(out) - offset + min(length, offset)]
      out += piece
      length -= len(piece)
  return bytes(out) if len(out) == n else None


def cubins(compiled):
  """The cubins (ELF images) of a compiled GPU program; [] if none are found."""
  blob = serialize_executable.serialize(compiled)[0]
  start = blob.find(_RIEGELI)
  images = []
  for record in _riegeli_records(blob[start:]) if start >= 0 else []:
    for i in range(min(len(record), 64)):  # the stream follows the record's field header
      try:
        proto = _snappy(record, i)
      except IndexError:
        continue
      if proto and _ELF in proto:
        starts = [m.start() for m in re.finditer(re.escape(_ELF), proto)]
        images += [proto[a:b] for a, b in zip(starts, starts[1:] + [len(proto)])]
        break
  return images


def kernel_name(image):
  """The kernel a cubin holds: its `.text.NAME` section that is not a CUDA helper."""
  names = [m.group(1).decode() for m in re.finditer(rb"\.text\.([\w.$]+)", image)]
  names = [n for n in names if not n.startswith("__cuda_")]
  return names[0] if names else None


def _nvdisasm():
  """The nvdisasm of the nvidia-cuda-nvdisasm wheel (any sys.path entry), or on PATH."""
  for entry in sys.path:
    found = sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin", "nvdisasm")))
    if found:
      return found[-1]
  found = shutil.which("nvdisasm")
  if found is None:
    raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
  return found


def disassemble(image):
  """nvdisasm's SASS text of one cubin (about 1 s)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
      f.write(image)
    return subprocess.run([_nvdisasm(), path], capture_output=True, text=True,
                          check=True).stdout


def resources(image):
  """{kernel: {"registers": per thread, "stack_bytes": its stack frame (spills and
  local arrays)}} of a cubin, from the EIATTR_REGCOUNT and EIATTR_FRAME_SIZE records
  of its `.nv.info` section (64-bit little-endian ELF, as ptxas writes it)."""
  shoff, = struct.unpack_from("<Q", image, 0x28)
  entsize, count, names_index = struct.unpack_from("<HHH", image, 0x3a)
  sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * entsize)
              for i in range(count)]
  text = lambda table, at: image[table + at:image.index(b"\0", table + at)].decode()
  names = {text(sections[names_index][4], s[0]): s for s in sections}
  if ".nv.info" not in names:  # not a cubin (a host object) or one without kernels
    return {}
  symtab, strtab = names[".symtab"], names[".strtab"]
  symbol = lambda index: text(strtab[4], struct.unpack_from("<I", image, symtab[4] + 24 * index)[0])
  info = names[".nv.info"]
  out, at, end = {}, info[4], info[4] + info[5]
  while at < end:  # records: format byte, attribute byte, then by format a value or a size
    fmt, attr, size = image[at], image[at + 1], struct.unpack_from("<H", image, at + 2)[0]
    if fmt == 4 and attr in _RESOURCE_ATTRS:  # (symbol index, value)
      index, value = struct.unpack_from("<II", image, at + 4)
      out.setdefault(symbol(index), {})[_RESOURCE_ATTRS[attr]] = value
    at += 4 + (size if fmt == 4 else 0)
  return out


def sass_mma(image):
  """Counter of the SASS matrix mnemonics in one cubin (nvdisasm, about 1 s)."""
  sass = disassemble(image)
  return collections.Counter(
      op + (" block-scaled" if _SCALES_AFTER_IDESC.search(operands) else "")
      for op, operands in MMA.findall(sass))
