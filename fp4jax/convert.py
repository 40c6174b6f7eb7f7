"""`python -m fp4jax.convert export RUN_DIR OUT ...`: the export's command line.

OUT ending in .gguf writes one GGUF file for llama.cpp (fp4jax.train.export_gguf);
any other OUT a Hugging Face directory (fp4jax.train.export).
"""

import sys

from fp4jax import errors

if __name__ == "__main__":  # before the heavy imports: see errors.exit_on_signals
  errors.exit_on_signals("python -m fp4jax.convert", "received: the export stopped "
                         "and wrote nothing (OUT is as it was).")

from fp4jax.train import export  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.train import export_gguf  # pylint: disable=g-import-not-at-top,wrong-import-position

GGUF_HINT = ("OUT ending in .gguf writes one GGUF file for llama.cpp instead: "
             "python -m fp4jax.convert export RUN_DIR OUT.gguf --help")


def main(argv=None):
  """Runs the export that OUT names; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  if export_gguf.is_gguf(argv):
    return export_gguf.main(argv)
  try:
    return export.main(argv)
  except SystemExit:
    if "-h" in argv or "--help" in argv:
      print(GGUF_HINT)
    raise


if __name__ == "__main__":
  sys.exit(main())
