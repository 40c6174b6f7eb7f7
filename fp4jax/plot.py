"""`python -m fp4jax.plot RUN [RUN ...] -o OUT.png`: fp4jax.train.plot's command line."""

import sys

from fp4jax.train import plot

if __name__ == "__main__":
  sys.exit(plot.main())
