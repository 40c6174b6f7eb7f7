"""`python -m fp4jax.convert export RUN_DIR OUT_DIR ...`: fp4jax.train.export's command line."""

import sys

from fp4jax import errors

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals("python -m fp4jax.convert", "received: the export stopped "
                         "and wrote nothing (OUT_DIR is as it was).")

from fp4jax.train import export  # pylint: disable=g-import-not-at-top,wrong-import-position

if __name__ == "__main__":
  sys.exit(export.main())
