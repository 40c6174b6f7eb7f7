"""llama.cpp's GGUF format for fp4jax's Llama: tensor names, block layouts, metadata.

llama.cpp's `llama` architecture computes fp4jax's Llama (fp4jax.llama.hf's
Hugging Face layout) with these differences of form:
  names   token_embd, blk.<i>.{attn_norm, attn_q, attn_k, attn_v, attn_output,
          ffn_norm, ffn_gate, ffn_up, ffn_down}, output_norm, output (each
          `.weight`), and rope_freqs.weight: Llama 3's frequency divisors,
          float32 [head_dim / 2] (llama.cpp divides each rotary frequency by
          its factor)
  shapes  a matrix is the Hugging Face [out, in] array, row by row (GGUF lists
          the dimensions fastest first: [in, out])
  RoPE    llama.cpp rotates adjacent pairs (2i, 2i + 1) where fp4jax rotates
          (i, i + d/2): the rows of q and k are permuted within each head
          (`rope_rows`), as llama.cpp's own converter does
  MXFP4   GGML_TYPE_MXFP4: each 32 inputs of a row are 17 bytes, the E8M0 scale
          byte, then byte j holding the E2M1 code of element j (low nibble)
          and of element j + 16 (high nibble); value = E2M1 * 2^(e - 127)
  NVFP4   GGML_TYPE_NVFP4: each 64 inputs of a row are 36 bytes, the four
          UE4M3 scales of its 16-input blocks (E4M3's bits, sign 0), then 8
          bytes per block holding element j low and j + 8 high; the float32
          per-tensor scale is the tensor `<name>.scale` (F32 [1]), which
          llama.cpp multiplies the GEMM's output by (fp4jax's QArray
          global_scale, applied where fp4jax applies it)
Tokenizers: a byte-level BPE tokenizer.json (fp4jax's byte tokenizer as
the Hugging Face export writes it, or Llama 3's / GPT-2's) becomes
llama.cpp's "gpt2" vocabulary (`bpe_vocab`). `write` puts tensors and
metadata into a GGUF file with the `gguf` package (pure Python; imported
only there), the block bytes given raw. Bad input raises ConvertError (one
line).
"""

import importlib.util

import numpy as np

from fp4jax.llama.hf import ConvertError

ARCH = "llama"
# Hugging Face name -> GGUF name, outside the blocks and in block i.
_TOP = {"model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm.weight": "attn_norm",
          "self_attn.q_proj.weight": "attn_q",
          "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v",
          "self_attn.o_proj.weight": "attn_output",
          "post_attention_layernorm.weight": "ffn_norm",
          "mlp.gate_proj.weight": "ffn_gate",
          "mlp.up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down"}
ROPE_FREQS = "rope_freqs.weight"
# Export format -> (inputs per GGML block, bytes per GGML block).
BLOCKS = {"mxfp4": (32, 17), "nvfp4": (64, 36)}
NVFP4_SUB = 16  # inputs per UE4M3 scale


def tensor_name(hf_name):
  """The GGUF name of a Hugging Face Llama weight ("model.layers.3.mlp.up_proj.weight"
  -> "blk.3.ffn_up.weight")."""
  if hf_name in _TOP:
    return _TOP[hf_name]
  _, _, block, rest = hf_name.split(".", 3)  # model.layers.<i>.<rest>
  return f"blk.{block}.{_BLOCK[rest]}.weight"


def scale_name(name):
  """The GGUF name of an NVFP4 tensor's per-tensor scale ("blk.0.attn_q.scale")."""
  return name[:-len(".weight")] + ".scale"


def rope_rows(x, n_heads):
  """Rows [n_heads * d, ...] of q or k with each head's rows (i, i + d/2)
  made adjacent (2i, 2i + 1): llama.cpp's rotary pairing."""
  d = x.shape[0] // n_heads
  return (x.reshape(n_heads, 2, d // 2, *x.shape[1:]).swapaxes(1, 2)
          .reshape(x.shape))


def codes(packed):
  """uint8 [out, in/2] with element 2j low and 2j + 1 high (fp4jax.pack_fp4)
  -> the 4-bit codes uint8 [out, in]."""
  return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def _halves(c, block):
  """Codes [out, n, block] -> bytes [out, n, block/2]: element j low, j + block/2 high."""
  return c[..., :block // 2] | (c[..., block // 2:] << 4)


def mxfp4_blocks(packed, e8m0):
  """GGML_TYPE_MXFP4 rows, uint8 [out, in/32 * 17], of a weight given as
  packed codes uint8 [out, in/2] (fp4jax.pack_fp4's order) and the E8M0
  scale bits uint8 [out, in/32]."""
  out, n = e8m0.shape
  qs = _halves(codes(packed).reshape(out, n, 32), 32)
  return np.concatenate([e8m0[..., None], qs], axis=-1).reshape(out, -1)


def nvfp4_blocks(packed, e4m3):
  """GGML_TYPE_NVFP4 rows, uint8 [out, in/64 * 36], of a weight given as
  packed codes uint8 [out, in/2] and its E4M3 block scales [out, in/16]
  (float8_e4m3fn, >= 0; in a multiple of 64)."""
  out, n = e4m3.shape
  scales = np.ascontiguousarray(e4m3).view(np.uint8).reshape(out, n // 4, 4)
  qs = _halves(codes(packed).reshape(out, n, NVFP4_SUB), NVFP4_SUB)
  return np.concatenate([scales, qs.reshape(out, n // 4, 32)], axis=-1).reshape(out, -1)


def rope_factors(cfg, inv_freq):
  """Llama 3's rope_freqs, float32 [head_dim / 2]: each unscaled rotary
  frequency of LlamaConfig cfg divided by fp4jax's (`inv_freq`,
  model.rope_frequencies), which llama.cpp divides the unscaled one by."""
  d = cfg.head_dim
  unscaled = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  return (unscaled / np.asarray(inv_freq, np.float64)).astype(np.float32)


def hyperparameters(cfg, context):
  """{key: value} of llama.cpp's `llama` hyper-parameters for LlamaConfig
  cfg, trained or scaled to `context` tokens."""
  return {"context_length": int(context), "embedding_length": cfg.dim,
          "block_count": cfg.n_layers, "feed_forward_length": cfg.mlp_dim,
          "attention.head_count": cfg.n_heads,
          "attention.head_count_kv": cfg.n_kv_heads,
          "rope.dimension_count": cfg.head_dim,
          "rope.freq_base": float(cfg.rope_theta),
          "attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
          "vocab_size": cfg.vocab_size}


# GGUF token types (gguf.TokenType).
NORMAL, CONTROL, UNUSED = 1, 3, 5
# Llama 3's pre-tokenizer split (its tokenizer.json), llama.cpp's "llama-bpe".
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp needs a merges list and gguf-py writes no empty array: a
# vocabulary without merges gets this one, which never applies (BPE starts
# from single characters and no rule makes its two-character parts).
NO_MERGE = "<| |>"


def bpe_vocab(tokenizer, vocab_size, bos_id, eos_id):
  """(tokens, token types, merges, pre-tokenizer) of a byte-level BPE
  tokenizer.json dict `tokenizer` for a model of `vocab_size` rows: ids
  beyond the tokenizer's are unused padding; added tokens are control
  tokens. The pre-tokenizer must be one llama.cpp names: Llama 3's split,
  GPT-2's byte-level regex, or none (then without merges: no split changes
  a token)."""
  model = tokenizer.get("model") or {}
  if model.get("type") != "BPE":
    raise ConvertError(f"the tokenizer is a {model.get('type')!r} model; the GGUF "
                       "export writes byte-level BPE tokenizers")
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  pre = _pre_tokenizer(tokenizer.get("pre_tokenizer"), bool(merges))
  tokens = {i: (t, NORMAL) for t, i in model["vocab"].items()}
  tokens.update({t["id"]: (t["content"], CONTROL) for t in tokenizer.get("added_tokens", [])})
  for i in (bos_id, eos_id):
    if tokens.get(i, (None, None))[1] != CONTROL:
      raise ConvertError(f"the tokenizer's special token {i} is not one of its added tokens")
  if max(tokens) >= vocab_size:
    raise ConvertError(f"the tokenizer has token id {max(tokens)}, beyond the "
                       f"model's {vocab_size} rows")
  rows = [tokens.get(i, (f"<|unused_{i}|>", UNUSED)) for i in range(vocab_size)]
  return [t for t, _ in rows], [k for _, k in rows], merges or [NO_MERGE], pre


def _pre_tokenizer(pre, has_merges):
  """llama.cpp's pre-tokenizer name for a tokenizer.json pre_tokenizer."""
  steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
  kinds = [s.get("type") for s in steps]
  level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else None
  if level is None:
    raise ConvertError(f"the tokenizer's pre-tokenizer is {kinds}, not byte-level")
  if kinds == ["ByteLevel"] and level.get("use_regex", True):
    return "gpt-2"
  if kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == LLAMA3_SPLIT:
    return "llama-bpe"
  if kinds == ["ByteLevel"] and not has_merges:
    return "default"
  raise ConvertError(f"the tokenizer's pre-tokenizer {kinds} is neither Llama 3's "
                     "nor GPT-2's, which llama.cpp would split differently")


def check_writer():
  """ConvertError (one line) when the `gguf` package is not installed."""
  if importlib.util.find_spec("gguf") is None:
    raise ConvertError("writing a GGUF file needs the gguf package: pip install "
                       "'fp4jax[gguf]'")


def write(path, model_name, hparams, vocab, tensors, extra):
  """Writes a GGUF file at `path` (the whole file; the caller makes it atomic).

  model_name: general.name; hparams: `hyperparameters`; vocab: (tokens [str],
  token types [gguf.TokenType], merges [str], pre-tokenizer name, bos id,
  eos id); tensors: [(GGUF name, array, ggml type name or None)]: float32
  arrays are F32, a type name ("MXFP4", "NVFP4", "BF16") takes the array's
  bytes as that type's raw data, uint8 [rows, row bytes]; extra: {key: str}
  of further string metadata (fp4jax.*).
  """
  import gguf  # pylint: disable=import-outside-toplevel

  writer = gguf.GGUFWriter(path, ARCH)
  writer.add_name(model_name)
  for key, value in hparams.items():
    add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
    add(f"{ARCH}.{key}", value)
  tokens, types, merges, pre, bos, eos = vocab
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(bos)
  writer.add_eos_token_id(eos)
  writer.add_add_bos_token(True)
  writer.add_add_eos_token(False)
  for key, value in extra.items():
    writer.add_string(key, value)
  for name, array, ggml_type in tensors:
    raw = None if ggml_type is None else gguf.GGMLQuantizationType[ggml_type]
    writer.add_tensor(name, array, raw_dtype=raw)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
