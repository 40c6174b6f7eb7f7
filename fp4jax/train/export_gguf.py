"""Export an fp4jax run as one GGUF file for llama.cpp (CLI).

  python -m fp4jax.convert export RUN_DIR OUT.gguf --quantize mxfp4|nvfp4 \\
      [--step N] [--dtype float32|bfloat16] [--overwrite]

writes llama.cpp's `llama` architecture (fp4jax.llama.gguf: names, layouts,
metadata) with the block linears (and the head, when the run quantized it)
as GGML_TYPE_MXFP4 or GGML_TYPE_NVFP4: the codes and scales of the trained
forward's Fprop weight operand, bit for bit, when that operand is the
format (fp4jax.llama.fp4_weights.plan), else the weights quantized after
training (round to nearest), said in the output and in the file's
`fp4jax.weights`. llama.cpp rotates no input, so a recipe whose Fprop
rotates (the H16 recipes) has its unrotated weights quantized after
training with Fprop's own spec. Embeddings, the dense linears (the head,
blocks kept in bf16) are written in --dtype, by default the run's compute
dtype, in which its forward read them (float32 F32, bfloat16 BF16); norms
and rope_freqs in F32. The tokenizer is the run's (fp4jax.llama.gguf.bpe_vocab:
the byte tokenizer, or a byte-level BPE tokenizer.json).

OUT.gguf is written to a temporary file beside it and renamed into place
when complete (a killed export leaves OUT.gguf as it was); an existing
OUT.gguf is replaced only with --overwrite and only when it is a GGUF file;
one export at a time writes it (OUT.gguf.lock, atomic.OutputLock). The
Hugging Face export's options --layout, --fused_scale, --activations,
--calibration_batches and --max_shard_gb are refused: llama.cpp reads its
NVFP4 per-tensor scales layer by layer, and quantizes inputs itself. Bad
input: one line, exit code 2.
"""

import argparse
import dataclasses
import os
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax.llama import fp4_weights
from fp4jax.llama import gguf
from fp4jax.llama import linears
from fp4jax.llama import model as model_lib
from fp4jax.llama.hf import abstract_params
from fp4jax.llama.hf import ConvertError
from fp4jax.llama.hf import read_json
from fp4jax.llama.hf import tensor_table
from fp4jax.llama.hf import to_hf
from fp4jax.train import atomic
from fp4jax.train import export
from fp4jax.train import export_fp4
from fp4jax.train import run_layout

SUFFIX = ".gguf"
DENSE = {"float32": None, "bfloat16": "BF16"}  # --dtype -> GGML type of its raw bytes
HF_ONLY = ("layout", "fused_scale", "activations", "calibration_batches", "max_shard_gb")
_LINEARS = {layer.hf_name: layer for layer in linears.BLOCK + (linears.HEAD,)}
_ROPE_HEADS = {"self_attn.q_proj.weight": "n_heads", "self_attn.k_proj.weight": "n_kv_heads"}


def plan(recipe, fmt):
  """The fp4_weights.Plan of a run's recipe for llama.cpp: the trained
  forward's own when its Fprop does not rotate, else the unrotated weights
  quantized after training with Fprop's spec (or the format's default)."""
  rotation = recipe.fprop.hadamard
  if rotation is None:
    return fp4_weights.plan(recipe, fmt)
  unrotated = fp4_weights.plan(dataclasses.replace(
      recipe, fprop=dataclasses.replace(recipe.fprop, hadamard=None)), fmt)
  why = (f"rotates Fprop (Hadamard block {rotation.block}, signs {rotation.signs!r}), "
         "which llama.cpp does not apply")
  return dataclasses.replace(unrotated, exact=False,
                             why=why + ("; " + unrotated.why if unrotated.why else ""))


def notice(recipe, p):
  """One line saying how the weights were quantized."""
  if p.exact:
    return (f"weights: the trained forward's {p.fmt} codes and scales (recipe "
            f"{recipe.name!r}), bit for bit")
  which = "its unrotated weights" if recipe.fprop.hadamard else "the weights"
  return (f"quantize: recipe {recipe.name!r} {p.why}, so {which} are quantized "
          f"to {p.fmt} after training (round to nearest), not as the forward computed")


def export_gguf(run_dir, out, *, quantize=None, step=None, dtype=None, overwrite=False):
  """Writes the run's checkpoint `step` (default newest) as the GGUF file
  `out`, its block linears in `quantize` ("mxfp4" or "nvfp4"), the dense
  tensors in `dtype` (default the run's compute dtype). Returns the lines
  of a short report."""
  if quantize is None:
    raise ConvertError(f"a GGUF export needs --quantize, one of {list(gguf.BLOCKS)}")
  if quantize not in gguf.BLOCKS:
    raise ConvertError(f"--quantize {quantize!r}; a GGUF export needs one of "
                       f"{list(gguf.BLOCKS)}")
  if dtype is not None and dtype not in DENSE:
    raise ConvertError(f"--dtype {dtype!r}; allowed: {list(DENSE)}")
  gguf.check_writer()
  out = run_layout.output_path(out, "OUT")
  _check_target(out, overwrite)
  try:
    os.makedirs(os.path.dirname(out) or os.curdir, exist_ok=True)
  except OSError as e:
    raise ConvertError(f"cannot create the folder of OUT {out!r}: {e.strerror}") from None
  with atomic.OutputLock(out, "OUT"):
    _check_target(out, overwrite)  # again: it may have changed
    return _export(run_dir, out, quantize, step, dtype)


def _check_target(out, overwrite):
  """ConvertError / errors.UserError for an OUT that must not be written."""
  run_layout.check_output_file(out, "OUT")
  if not os.path.exists(out):
    return
  if not overwrite:
    raise ConvertError(f"OUT {out!r} exists; pass --overwrite to replace it (once the "
                       "new export is complete) or give another file")
  with open(out, "rb") as f:
    if f.read(4) != b"GGUF":
      raise ConvertError(f"OUT {out!r} is not a GGUF file; it is not replaced: move "
                         "it, or give another file")


def _export(run_dir, out, fmt, step, dtype):
  """`export_gguf` once OUT is checked and locked."""
  config, cfg = export.run_config(run_dir)
  step, params = checkpointing.restore_params_newest(
      run_layout.checkpoints(run_dir), export.run_step(run_dir, step),
      abstract_params(cfg), fall_back=step is None)
  bad = checkpointing.non_finite(params)
  if bad:
    raise ConvertError(f"the checkpoint at step {step} of {run_dir!r} {bad}; "
                       "export a step whose weights are finite (--step)")
  recipe = export_fp4.run_recipe(config, step)
  p = plan(recipe, fmt)
  dtype = dtype or cfg.dtype
  context = max(int(config.get("seq_len", 0)),
                int(cfg.rope_original_context * cfg.rope_factor))
  vocab, tokenizer_line = _vocab(config, cfg, context)
  tensors = _tensors(cfg, params, p, dtype)
  extra = {"fp4jax.recipe": recipe.name, "fp4jax.step": str(step),
           "fp4jax.weights": notice(recipe, p)}
  _write_atomically(out, lambda path: gguf.write(
      path, os.path.basename(os.path.abspath(run_dir)), gguf.hyperparameters(cfg, context),
      vocab, tensors, extra))
  packed = sum(t == fmt.upper() for _, _, t in tensors)
  return [f"wrote {out}: step {step} of {run_dir}, {len(tensors)} tensors, "
          f"{os.path.getsize(out):,} bytes ({packed} linears in {fmt}, the other "
          f"matrices {dtype}, norms float32)", notice(recipe, p), tokenizer_line]


def _tensors(cfg, params, p, dtype):
  """[(GGUF name, array, ggml type or None)] of every tensor, in Hugging Face order."""
  out = []
  for hf_name, path, layer, layout in tensor_table(cfg):
    name = gguf.tensor_name(hf_name)
    x = export._kernel(params, path, layer)  # pylint: disable=protected-access
    linear = _packed(cfg, hf_name)
    if linear is not None:
      out += _fp4_tensors(cfg, name, hf_name, x, linear, p)
    elif x.ndim == 1:  # a norm's scale
      out.append((name, x.astype(np.float32), None))
    else:
      w = _rope_rows(cfg, hf_name, to_hf(layout, x))
      out.append((name, *_dense(w, dtype)))
  factors = gguf.rope_factors(cfg, model_lib.rope_frequencies(cfg))
  if np.any(factors != 1):
    out.append((gguf.ROPE_FREQS, factors, None))
  return out


def _packed(cfg, hf_name):
  """The linears.Linear of a tensor the trained forward quantized, or None."""
  if hf_name == linears.HEAD.hf_name:
    return linears.HEAD if cfg.quantize_head and not cfg.is_bf16(None) else None
  parts = hf_name.split(".", 3)  # model.layers.<i>.<rest>
  linear = _LINEARS.get(parts[-1])
  return None if linear is None or cfg.is_bf16(int(parts[2])) else linear


def _fp4_tensors(cfg, name, hf_name, kernel, linear, p):
  """The GGML blocks of one quantized linear (and NVFP4's per-tensor scale)."""
  k = int(np.prod(kernel.shape[:linear.n_in]))
  block = gguf.BLOCKS[p.fmt][0]
  if k % block:
    raise ConvertError(f"{name} contracts {k} inputs, not a multiple of {block}: "
                       f"llama.cpp's {p.fmt} packs rows in blocks of {block}")
  w = fp4_weights.fp4_weight(kernel, linear.n_in, cfg.dtype, p)
  packed, scales = (_rope_rows(cfg, hf_name, a) for a in (w.packed, w.scales))
  if p.fmt == "mxfp4":
    return [(name, gguf.mxfp4_blocks(packed, scales), "MXFP4")]
  return [(name, gguf.nvfp4_blocks(packed, scales), "NVFP4"),
          (gguf.scale_name(name), np.asarray([w.global_scale], np.float32), None)]


def _rope_rows(cfg, hf_name, x):
  """x's rows in llama.cpp's rotary order when x is a q or k weight."""
  heads = _ROPE_HEADS.get(hf_name.split(".", 3)[-1])
  return x if heads is None else gguf.rope_rows(x, getattr(cfg, heads))


def _dense(w, dtype):
  """(array, ggml type) of a dense matrix in --dtype."""
  if DENSE[dtype] is None:
    return np.ascontiguousarray(w, np.float32), None
  raw = np.ascontiguousarray(w.astype(jnp.bfloat16)).view(np.uint8)
  return raw, DENSE[dtype]


def _vocab(config, cfg, context):
  """(gguf.write's vocab, a line for the user) of the run's tokenizer."""
  name = config.get("data", {}).get("tokenizer", "bytes")
  path, tok = export._run_tokenizer(  # pylint: disable=protected-access
      name, config.get("resolved", {}).get("tokenizer"))
  if path == "bytes":
    tokenizer = export.byte_tokenizer_files(tok, context)[0]
    line = ("tokenizer: the run used fp4jax's byte tokenizer (ids 0-255 are UTF-8 "
            "bytes, BOS 256, EOS 257); wrote it as llama.cpp's byte-level BPE "
            "vocabulary without merges, same ids")
  else:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not file.endswith(".json"):
      raise ConvertError(f"the run's tokenizer {path!r} is SentencePiece; the GGUF "
                         "export writes byte-level BPE tokenizers (tokenizer.json) "
                         "and the byte tokenizer")
    tokenizer = read_json(file, "tokenizer")
    line = f"tokenizer: {file!r} as llama.cpp's byte-level BPE vocabulary"
  tokens, types, merges, pre = gguf.bpe_vocab(tokenizer, cfg.vocab_size, tok.bos_id,
                                              tok.eos_id)
  return (tokens, types, merges, pre, tok.bos_id, tok.eos_id), f"{line} (pre-tokenizer {pre!r})"


def _write_atomically(out, write):
  """write(path) fills a temporary file beside `out`, renamed to `out` once
  complete; a failure or a signal removes it (a full disk: errors.DiskFull)."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out) or os.curdir,
                             prefix=f".{os.path.basename(out)}.", suffix=".tmp")
  os.close(fd)
  remove = lambda: os.path.exists(tmp) and os.remove(tmp)
  errors.on_signal_exit(remove)
  try:
    write(tmp)
    os.chmod(tmp, 0o666 & ~atomic.umask())  # mkstemp creates 0600
    os.replace(tmp, out)
    atomic.fsync_dir(os.path.dirname(out) or os.curdir)
  except BaseException as e:
    remove()
    if isinstance(e, Exception) and errors.is_disk_full(e):
      raise errors.disk_full(out, None) from None
    raise
  finally:
    errors.forget_signal_exit(remove)


def parser():
  """The argument parser of `python -m fp4jax.convert export RUN_DIR OUT.gguf`."""
  parse = argparse.ArgumentParser(
      prog="python -m fp4jax.convert",
      description="Export an fp4jax run as a GGUF file for llama.cpp.")
  commands = parse.add_subparsers(dest="command", required=True)
  exp = commands.add_parser("export", help="RUN_DIR -> OUT.gguf")
  exp.add_argument("run_dir")
  exp.add_argument("out", help="the GGUF file to write (ends in .gguf)")
  exp.add_argument("--quantize", default=None,
                   help="the block linears' type: mxfp4 or nvfp4 (required)")
  exp.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the newest)")
  exp.add_argument("--dtype", default=None,
                   help="embeddings and dense linears: float32 or bfloat16 "
                   "(default: the run's compute dtype)")
  exp.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT.gguf (once the new one is complete)")
  for option in HF_ONLY:  # accepted to be refused in one line
    exp.add_argument(f"--{option}", default=None, help=argparse.SUPPRESS)
  return parse


def is_gguf(argv):
  """Whether `argv` (without the program) is `export RUN_DIR OUT` with OUT
  ending in .gguf (read without parsing, so that either command's parser
  reports its own errors)."""
  positional, value_next = [], False
  for arg in argv[1:] if argv[:1] == ["export"] else []:
    if value_next or arg.startswith("-"):
      value_next = not value_next and arg.startswith("--") and "=" not in arg and (
          arg not in ("--overwrite", "--help"))
      continue
    positional.append(arg)
  return len(positional) > 1 and positional[1].lower().endswith(SUFFIX)


def main(argv=None):
  parse = parser()
  args = parse.parse_args(argv)
  try:
    given = [f"--{o}" for o in HF_ONLY if getattr(args, o) is not None]
    if given:
      raise ConvertError(f"{', '.join(given)} applies to a Hugging Face export, not "
                         "to a GGUF file (llama.cpp scales and quantizes the inputs itself)")
    lines = export_gguf(args.run_dir, args.out, quantize=args.quantize, step=args.step,
                        dtype=args.dtype, overwrite=args.overwrite)
  except (ConvertError, errors.UserError, OSError) as e:
    print(f"{parse.prog}: error: {e}", file=sys.stderr)
    return 2
  print("\n".join(lines))
  return 0
