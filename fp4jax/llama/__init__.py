"""Llama 3.1 in Flax linen with fp4jax's quantized dot_general in every linear layer.

  model        LlamaConfig, the presets, the model and its blocks
  linears      the linear layers, named once: module path, kernel axes, Hugging Face weight
  block_check  start-up check that no quantization block straddles devices on a mesh
  hf           Hugging Face names, layouts and config fields; reading safetensors
fp4_weights  a linear layer's FP4 weights as a packed checkpoint stores them
hf_packed    packed FP4 Hugging Face checkpoints read back, dequantized
gguf         llama.cpp's GGUF names, FP4 block layouts, metadata and tokenizer
"""
