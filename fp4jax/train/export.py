"""Export an fp4jax run as a Hugging Face Llama directory (CLI).

  python -m fp4jax.convert export RUN_DIR OUT_DIR [--step N] \\
      [--dtype float32|bfloat16] [--max_shard_gb 5] [--overwrite] \\
      [--quantize nvfp4|mxfp4 [--layout compressed-tensors|modelopt]
       [--fused_scale shared|per-projection] [--activations none|fp4]
       [--calibration_batches N]]

writes a directory that `transformers.AutoModelForCausalLM.from_pretrained`
loads as a `LlamaForCausalLM` (no custom code): config.json, the weights as
model.safetensors (or model-0000i-of-0000n.safetensors with
model.safetensors.index.json above --max_shard_gb) and the run's tokenizer:
a Hugging Face tokenizer's files are copied, fp4jax's byte tokenizer is
written as a byte-level tokenizer.json with the same ids. The names and
layouts are those of fp4jax.llama.hf; the other way is
`--config.init_from` (fp4jax.train.init_from). With --quantize, the block
linears are written packed in FP4 (fp4jax.train.export_fp4: the trained
forward's codes and scales when it computed in that format), the other
tensors in --dtype. Bad input (a checkpoint whose weights hold NaN or Inf
included): one line, exit code 2.

The export is written into OUT_DIR.partial beside OUT_DIR, marked as this
command's first thing (atomic.mark_partial), and renamed to OUT_DIR once
complete, so a killed export leaves no OUT_DIR (only the marked .partial
folder, removed by the next export; an OUT_DIR.partial without the mark is
refused, never removed). An existing OUT_DIR is refused unless --overwrite,
which replaces it only then, in one atomic exchange, and only when it is an
export (`is_export`); a full disk removes the partial folder and names the
space needed (exit 2). An OUT_DIR that is, holds or lies inside RUN_DIR or
any run or checkpoint, is a symbolic link, the current folder or one above
it, is refused before anything is read or written (run_layout.check_output;
OUT_DIR is taken as the OS resolves it: `link/..` is the folder above the
link's target). One export at a time writes an OUT_DIR: it holds
OUT_DIR.lock (atomic.OutputLock) while it runs, and a second is refused.
"""

import argparse
import functools
import json
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from fp4jax import checkpointing
from fp4jax import errors
from fp4jax import records
from fp4jax.train import atomic
from fp4jax.train import export_fp4
from fp4jax.train import run_layout
from fp4jax.llama import hf_packed
from fp4jax.llama import model as model_lib
from fp4jax.llama.hf import abstract_params
from fp4jax.llama.hf import CONFIG_FILE
from fp4jax.llama.hf import ConvertError
from fp4jax.llama.hf import hf_config
from fp4jax.llama.hf import INDEX_FILE
from fp4jax.llama.hf import param_shapes
from fp4jax.llama.hf import read_json
from fp4jax.llama.hf import SINGLE_FILE
from fp4jax.llama.hf import tensor_table
from fp4jax.llama.hf import to_hf

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json")

# ---------------------------------------------------------------------------
# fp4jax runs.


def run_config(run_dir):
  """(resolved config dict, LlamaConfig) of an fp4jax run directory."""
  path = run_layout.config_file(run_dir)
  if not os.path.isfile(path):
    raise ConvertError(f"{run_dir!r} is not an fp4jax run directory (no "
                       "config.json)")
  config = run_layout.check_config(read_json(path, "run config"), path)
  fields = records.check(records.Resolved, config["resolved"], f"{path}: resolved")["model"]
  fields = {k: tuple(v) if isinstance(v, list) else v
            for k, v in fields.items()}
  try:
    return config, model_lib.LlamaConfig(**fields)
  except (TypeError, ValueError) as e:
    raise ConvertError(f"{path!r}: resolved.model: {e}") from e


def run_step(run_dir, step=None):
  """The checkpoint step to read: `step`, or the run's newest."""
  directory = run_layout.checkpoints(run_dir)
  steps = checkpointing.committed_steps(directory)
  if not steps:
    raise ConvertError(f"{run_dir!r} has no checkpoint under {directory!r}")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ConvertError(f"no checkpoint at step {step}: {run_dir!r} has "
                       f"checkpoints at steps {steps}")
  return step


# ---------------------------------------------------------------------------
# Export.


def _shards(table, cfg, dtype, max_bytes, packed=None):
  """Splits the table's rows into files of at most max_bytes (>= 1 row each)."""
  shapes, itemsize = param_shapes(cfg), np.dtype(dtype).itemsize
  files, size = [[]], 0
  for row in table:
    shape = shapes[row[1]][1:] if row[2] is not None else shapes[row[1]]
    nbytes = (packed.nbytes(shape) if packed and packed.is_packed(row) else
              math.prod(shape) * itemsize)
    if files[-1] and size + nbytes > max_bytes:
      files.append([])
      size = 0
    files[-1].append(row)
    size += nbytes
  return files


def _byte_symbols():
  """The byte -> printable character map of byte-level BPE (GPT-2's).

  Printable Latin-1 bytes stand for themselves; the others, in order, take
  the characters from U+0100 on.
  """
  keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC
          or 0xAE <= b <= 0xFF]
  others = [b for b in range(256) if b not in keep]
  symbols = {b: chr(b) for b in keep}
  symbols.update({b: chr(256 + i) for i, b in enumerate(others)})
  return symbols


BYTE_SPECIAL_NAMES = ("<|begin_of_text|>", "<|end_of_text|>")


def byte_tokenizer_files(tok, max_length):
  """(tokenizer.json, tokenizer_config.json) dicts for fp4jax's ByteTokenizer.

  A byte-level BPE without merges, so token i is byte i; BOS and EOS are
  added tokens with the ids of `tok`, and BOS is prepended when special
  tokens are requested (as Llama 3's tokenizer does).
  """
  bos, eos = BYTE_SPECIAL_NAMES
  special = lambda i, name: dict(id=i, content=name, single_word=False,
                                 lstrip=False, rstrip=False, normalized=False,
                                 special=True)
  tokenizer = {
      "version": "1.0", "truncation": None, "padding": None,
      "added_tokens": [special(tok.bos_id, bos), special(tok.eos_id, eos)],
      "normalizer": None,
      "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                        "trim_offsets": True, "use_regex": False},
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id],
                                   "tokens": [bos]}}},
      "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": False},
      "model": {"type": "BPE", "dropout": None, "unk_token": None,
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": False, "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {c: b for b, c in _byte_symbols().items()},
                "merges": []},
  }
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
            "eos_token": eos, "model_max_length": max_length}
  return tokenizer, config


def _write_tokenizer(tokenizer, tok, out_dir, max_length):
  """Writes or copies a run's tokenizer files; returns a line for the user."""
  if tokenizer == "bytes":
    files = byte_tokenizer_files(tok, max_length)
    for name, content in zip(TOKENIZER_FILES[:2], files):
      with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)
    return ("tokenizer: the run used fp4jax's byte tokenizer (ids 0-255 are "
            "UTF-8 bytes, BOS 256, EOS 257); wrote it as a byte-level "
            "tokenizer.json (no merges) with the same ids")
  path = tokenizer
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  directory = os.path.dirname(path)
  if path.endswith(".model"):
    shutil.copyfile(path, os.path.join(out_dir, "tokenizer.model"))
    copied = ["tokenizer.model"]
  else:
    copied = []
  for name in TOKENIZER_FILES:
    source = os.path.join(directory, name)
    if os.path.isfile(source):
      shutil.copyfile(source, os.path.join(out_dir, name))
      copied.append(name)
  return f"tokenizer: copied {copied} from {directory!r}"


def write_weights(params, cfg, out_dir, dtype, max_bytes, packed=None):
  """Writes `params` (of LlamaConfig cfg) as Hugging Face safetensors.

  One model.safetensors, or model-0000i-of-0000n.safetensors files of at most
  `max_bytes` each (one tensor may exceed it) with model.safetensors.index.json.
  packed: an export_fp4.PackedExport whose layers are written packed (the
  others in `dtype`), or None. Returns (number of files, bytes of tensor data).
  """
  files = _shards(tensor_table(cfg), cfg, dtype, max_bytes, packed)
  names = ([SINGLE_FILE] if len(files) == 1 else
           [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            for i in range(len(files))])
  weight_map, total = {}, 0
  for file_name, rows in zip(names, files):
    tensors = {}
    for name, path, layer, layout in rows:
      x = _kernel(params, path, layer)
      if packed and packed.is_packed((name, path, layer, layout)):
        kernel_of = lambda sub, path=path, layer=layer: _kernel(
            params, (path[0], *sub.split("/"), "kernel"), layer)
        written = packed.tensors((name, path, layer, layout), x, kernel_of)
      else:
        written = {name: np.ascontiguousarray(to_hf(layout, x).astype(dtype))}
      for key, value in written.items():
        tensors[key] = value
        weight_map[key] = file_name
        total += value.nbytes
    target = os.path.join(out_dir, file_name)
    safetensors.numpy.save_file(tensors, target, metadata={"format": "pt"})
    os.chmod(target, 0o666 & ~atomic.umask())  # safetensors writes 0600
  if len(files) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                f, indent=2)
  return len(files), total


def _kernel(params, path, layer):
  """The NumPy array at `path` of params (one layer of a scanned leaf)."""
  leaf = params
  for key in path:
    leaf = leaf[key]
  return np.asarray(jax.device_get(leaf if layer is None else leaf[layer]))


def is_export(path):
  """True for a folder an export wrote: config.json and the weights
  (model.safetensors or its index), files only."""
  names = os.listdir(path)
  return (CONFIG_FILE in names and (SINGLE_FILE in names or INDEX_FILE in names)
          and run_layout.holds_no_folder(path))


def _is_partial_export(path):
  """True for the OUT_DIR.partial of an export (its mark, files only)."""
  return atomic.is_marked_partial(path) and run_layout.holds_no_folder(path)


def _check_target(run_dir, out_dir, overwrite):
  """ConvertError if `out_dir` is a file, or an export to keep (no
  --overwrite); errors.UserError if it, or the OUT_DIR.partial a killed
  export left, is a folder the export must not replace
  (run_layout.check_output)."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConvertError(f"OUT_DIR {out_dir!r} is a file, not a folder; give "
                       "the folder to write the export into (it is created)")
  run_layout.check_output(out_dir, "OUT_DIR", reads=[run_dir], is_own=is_export,
                          own="an export (config.json and model weights, no folder)")
  run_layout.check_output(
      out_dir + ".partial", "OUT_DIR.partial", reads=[run_dir], is_own=_is_partial_export,
      own=f"a partial export (files only, with the mark {atomic.PARTIAL_MARK} an "
      "export writes first): the export writes its partial folder there")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise ConvertError(f"OUT_DIR {out_dir!r} exists and is not empty; pass "
                       "--overwrite to replace it (once the new export is "
                       "complete) or give another folder")


def export(run_dir, out_dir, *, step=None, dtype="float32", max_shard_gb=5.0,
           overwrite=False, quantize=None, layout=None, fused_scale="shared",
           activations=None, calibration_batches=None):
  """Writes the run's checkpoint `step` (default newest) as a HF Llama.

  Written into `out_dir`.partial and renamed to `out_dir` when complete; an
  existing `out_dir` is refused unless `overwrite` (see the module doc).
  quantize: None (dense) or "nvfp4" / "mxfp4", written in `layout` (default
  "compressed-tensors"; fp4jax.train.export_fp4), with NVFP4 per-tensor
  scales shared by fused projections (`fused_scale` "shared") or each
  layer's own ("per-projection"), and `activations` "none" (W4A16) or "fp4"
  (W4A4; NVFP4 input scales from `calibration_batches` validation batches,
  default the run's eval_batches; None: the layout's default). Returns the
  lines of a short report (files written, a post-training quantization
  notice, the weights the shared scales change, the calibration,
  tokenizer).
  """
  if dtype not in EXPORT_DTYPES:
    raise ConvertError(f"--dtype {dtype!r}; allowed: {list(EXPORT_DTYPES)}")
  if not max_shard_gb > 0:
    raise ConvertError(f"--max_shard_gb must be > 0, got {max_shard_gb}")
  out_dir = run_layout.output_path(out_dir, "OUT_DIR")
  _check_target(run_dir, out_dir, overwrite)
  if layout is not None and quantize is None:
    raise ConvertError(f"--layout {layout!r} needs --quantize (nvfp4 or "
                       "mxfp4); a dense export has one layout")
  if activations is not None and quantize is None:
    raise ConvertError(f"--activations {activations!r} needs --quantize "
                       "(nvfp4 or mxfp4); a dense export quantizes nothing")
  if calibration_batches is not None and calibration_batches < 1:
    raise ConvertError(f"--calibration_batches must be >= 1, got "
                       f"{calibration_batches}")
  try:
    os.makedirs(os.path.dirname(out_dir) or os.curdir, exist_ok=True)
  except OSError as e:
    raise ConvertError(f"cannot create the folder of OUT_DIR {out_dir!r}: "
                       f"{e.strerror}") from None
  with atomic.OutputLock(out_dir, "OUT_DIR"):  # one export at a time writes it
    _check_target(run_dir, out_dir, overwrite)  # again: it may have changed
    return _export(run_dir, out_dir, step, dtype, max_shard_gb, quantize, layout,
                   fused_scale, activations, calibration_batches)


def _export(run_dir, out_dir, step, dtype, max_shard_gb, quantize, layout,
            fused_scale, activations, calibration_batches):
  """`export` once OUT_DIR is checked and locked."""
  config, cfg = run_config(run_dir)
  # A damaged newest checkpoint: the newest readable one (unless --step).
  step, params = checkpointing.restore_params_newest(
      run_layout.checkpoints(run_dir), run_step(run_dir, step),
      abstract_params(cfg), fall_back=step is None)
  bad = checkpointing.non_finite(params)
  if bad:
    raise ConvertError(f"the checkpoint at step {step} of {run_dir!r} {bad}; "
                       "export a step whose weights are finite (--step)")
  packed = None if quantize is None else export_fp4.PackedExport(
      config, cfg, step, quantize, layout or "compressed-tensors", fused_scale,
      activations)
  calibrated = None
  if calibration_batches is not None and not (packed and packed.calibrates):
    this = ("is dense" if packed is None else "is MXFP4, whose inputs the "
            "engine scales itself" if packed.fmt == "mxfp4" else
            "is W4A16 (--activations none)")
    raise ConvertError(
        f"--calibration_batches {calibration_batches} calibrates NVFP4 input "
        "scales, so it needs --quantize nvfp4 with --activations fp4 (or "
        f"--layout modelopt); this export {this}")
  if packed is not None and packed.calibrates:
    calibrated = calibration_batches or int(config.get("eval_batches", 1))
    packed.calibrate(config, params, calibrated,
                     given=calibration_batches is not None)
  tokenizer = config.get("data", {}).get("tokenizer", "bytes")
  tokenizer, tok = _run_tokenizer(tokenizer, config.get("resolved", {}).get("tokenizer"))
  partial = out_dir + ".partial"
  if os.path.isdir(partial):  # left by a killed export (_check_target: marked)
    shutil.rmtree(partial)
  remove_partial = functools.partial(_remove_partial, partial)
  errors.on_signal_exit(remove_partial)  # a signal ends the CLI at once
  try:
    atomic.mark_partial(partial)
    n_files, total, tokenizer_line = _write_export(
        partial, config, cfg, params, tokenizer, tok, dtype, max_shard_gb,
        packed)
    atomic.replace_dir(partial, out_dir)
    atomic.unmark(out_dir)
  except BaseException as e:
    _remove_partial(partial)
    if isinstance(e, Exception) and errors.is_disk_full(e):
      needed = sum(math.prod(s) for s in param_shapes(cfg).values())
      raise errors.disk_full(out_dir, needed * np.dtype(
          EXPORT_DTYPES[dtype]).itemsize) from None
    raise
  finally:
    errors.forget_signal_exit(remove_partial)
  kind = dtype if packed is None else (
      f"{quantize} in the {packed.layout} layout, the rest {dtype}")
  notices = [] if packed is None else [
      line for line in (packed.notice(), packed.fused_line()) if line]
  if calibrated:
    notices.append(f"activations: FP4 (W4A4), NVFP4 input scales calibrated "
                   f"on {calibrated} validation batch(es) of the run")
  return [f"wrote {out_dir}: step {step} of {run_dir}, "
          f"{len(tensor_table(cfg))} tensors, "
          f"{total:,} bytes ({kind}) in {n_files} file(s)", *notices,
          tokenizer_line]


def _remove_partial(partial):
  """Removes OUT_DIR.partial when it is this export's (it holds the mark)."""
  if os.path.isdir(partial) and atomic.is_marked_partial(partial):
    shutil.rmtree(partial, ignore_errors=True)


def _write_export(out_dir, config, cfg, params, tokenizer, tok, dtype,
                  max_shard_gb, packed):
  """Writes weights, config.json (and a packed layout's config) and tokenizer
  into `out_dir`; returns (number of weight files, bytes of tensor data, the
  tokenizer's line)."""
  n_files, total = write_weights(params, cfg, out_dir, EXPORT_DTYPES[dtype],
                                 max_shard_gb * 1e9, packed)
  # The context RoPE scaling extends to (or the run's, when longer).
  max_positions = max(int(config.get("seq_len", 0)),
                      int(cfg.rope_original_context * cfg.rope_factor))
  hf = hf_config(cfg, bos_id=tok.bos_id, eos_id=tok.eos_id, dtype=dtype,
                 max_positions=max_positions)
  table = tensor_table(cfg)
  if packed and packed.quantization_config(table):
    hf["quantization_config"] = packed.quantization_config(table)
  with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(hf, f, indent=2)
  if packed and packed.modelopt_config(table):
    with open(os.path.join(out_dir, hf_packed.MODELOPT_CONFIG), "w",
              encoding="utf-8") as f:
      json.dump(packed.modelopt_config(table), f, indent=2)
  return n_files, total, _write_tokenizer(tokenizer, tok, out_dir,
                                          max_positions)


def _run_tokenizer(tokenizer, record):
  """(path, tokenizer) of the run's data.tokenizer, found by the identity it
  recorded (tokenizers.recorded)."""
  from fp4jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  try:
    path = tokenizers.recorded(tokenizer, record)
    return path, tokenizers.make_tokenizer(path)
  except (ValueError, OSError, ImportError) as e:
    raise ConvertError(f"the run's data.tokenizer {tokenizer!r}: {e}") from e


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m fp4jax.convert",
      description="Export an fp4jax run as a Hugging Face Llama directory.")
  commands = parser.add_subparsers(dest="command", required=True)
  exp = commands.add_parser("export", help="RUN_DIR -> Hugging Face OUT_DIR")
  exp.add_argument("run_dir")
  exp.add_argument("out_dir")
  exp.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: the newest)")
  exp.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                   help="weight dtype (float32: the master weights exactly)")
  exp.add_argument("--max_shard_gb", type=float, default=5.0,
                   help="largest safetensors file before sharding, in GB")
  exp.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT_DIR (once the new export "
                   "is complete)")
  exp.add_argument("--quantize", default=None,
                   help="write the block linears packed: nvfp4 or mxfp4")
  exp.add_argument("--layout", default=None,
                   help="of a packed export: compressed-tensors (default; "
                   "vLLM, SGLang) or modelopt (NVFP4; TensorRT-LLM)")
  exp.add_argument("--fused_scale", default="shared",
                   help="NVFP4 per-tensor scales of q/k/v and gate/up: "
                   "shared (what fusing engines need; the weights this "
                   "changes are counted) or per-projection (each layer's "
                   "own, exactly the trained forward)")
  exp.add_argument("--activations", default=None,
                   help="none (W4A16; compressed-tensors' default) or fp4 "
                   "(W4A4; modelopt's only)")
  exp.add_argument("--calibration_batches", type=int, default=None,
                   help="validation batches the NVFP4 input scales are "
                   "calibrated on (default: the run's eval_batches)")
  args = parser.parse_args(argv)
  try:
    lines = export(args.run_dir, args.out_dir, step=args.step,
                   dtype=args.dtype, max_shard_gb=args.max_shard_gb,
                   overwrite=args.overwrite, quantize=args.quantize,
                   layout=args.layout, fused_scale=args.fused_scale,
                   activations=args.activations,
                   calibration_batches=args.calibration_batches)
  except (ConvertError, errors.UserError, OSError) as e:
    print(f"{parser.prog}: error: {e}", file=sys.stderr)
    return 2
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
