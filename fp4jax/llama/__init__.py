"""Llama 3.1 in Flax linen with fp4jax's quantized dot_general in every linear layer.

  model    LlamaConfig, the presets, the model and its blocks
  hf       Hugging Face names, layouts and config fields; reading safetensors
"""
