"""`python -m fp4jax.convert export RUN_DIR OUT_DIR ...`: fp4jax.train.export's command line."""

import sys

from fp4jax.train import export

if __name__ == "__main__":
  sys.exit(export.main())
