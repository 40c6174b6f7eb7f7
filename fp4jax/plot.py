"""`python -m fp4jax.plot RUN [RUN ...] -o OUT.png`: fp4jax.train.curves' command line."""

import sys

from fp4jax.train import curves

if __name__ == "__main__":
  sys.exit(curves.main())
