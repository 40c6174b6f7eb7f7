"""`python -m fp4jax.bench NAME [flags]`: run one benchmark."""

import importlib
import sys

BENCHMARKS = ("dot_general", "kernels", "crosscheck", "train_speed", "gpu_check",
              "gpu_summary")


def main(argv):
  if len(argv) < 2 or argv[1] not in BENCHMARKS:
    sys.exit(f"usage: python -m fp4jax.bench {{{','.join(BENCHMARKS)}}} [flags]")
  module = importlib.import_module(f"fp4jax.bench.{argv[1]}")
  module.main(argv[2:])


if __name__ == "__main__":
  main(sys.argv)
