"""Benchmarks that print ratios measured in one run: `python -m fp4jax.bench NAME`."""
