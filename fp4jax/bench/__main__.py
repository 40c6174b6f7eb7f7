"""`python -m fp4jax.bench NAME [flags]`: run one benchmark.

`python -m fp4jax.bench --help` lists the benchmarks and their flags.
"""

import importlib
import sys

BENCHMARKS = ("dot_general", "kernels", "memory", "train_step", "crosscheck", "train_speed",
              "gpu_check", "gpu_plan", "gpu_summary", "gemm_dtype", "gpu_compile",
              "study_throughput", "gpu_shards", "sass_loops", "gpu_fit")
_USAGE = f"usage: python -m fp4jax.bench {{{','.join(BENCHMARKS)}}} [flags]"


def _help():
  print(_USAGE + "\n\nBenchmarks (python -m fp4jax.bench NAME --help for one):")
  for name in BENCHMARKS:
    module = importlib.import_module(f"fp4jax.bench.{name}")
    print(f"\n{name}: {module.__doc__.splitlines()[0]}\n")
    print(module.parser().format_help())


def main(argv):
  if len(argv) > 1 and argv[1] in ("-h", "--help"):
    _help()
    return 0
  if len(argv) < 2 or argv[1] not in BENCHMARKS:
    given = f"unknown benchmark {argv[1]!r}; " if len(argv) > 1 else ""
    print(f"python -m fp4jax.bench: {given}{_USAGE} (--help lists the flags)",
          file=sys.stderr)
    return 2
  module = importlib.import_module(f"fp4jax.bench.{argv[1]}")
  module.main(argv[2:])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
