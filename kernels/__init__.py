"""Pallas kernels for the quantization hot path (imported as fp4jax.kernels)."""
