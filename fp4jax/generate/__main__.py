"""`python -m fp4jax.generate RUN --prompt TEXT ...`: fp4jax.generate.cli's command line."""

import sys

from fp4jax import errors

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals("python -m fp4jax.generate", "received: stopped.")

from fp4jax.generate import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

if __name__ == "__main__":
  sys.exit(cli.main())
