"""Command lines built on absl and ml_collections config files.

`check_config_overrides(argv)` checks, before absl parses anything, that the
config file exists and that every `--config.KEY=VALUE` names a key of it
(UserError with a "did you mean" hint otherwise), so those mistakes are one
line instead of a traceback. `flags_parser(prog)` is an absl flags parser
that reports a bad flag as one line with exit status 2. `expand_quant_flag(argv)`
rewrites the `--config.quant=NAME` shorthand for them.
"""

import importlib.util
import os
import re
import sys

from absl import flags
import ml_collections

from fp4jax import errors


def _config_path(argv, flag, default):
  for i, arg in enumerate(argv):
    for prefix in (f"--{flag}=", f"-{flag}="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
    if arg in (f"--{flag}", f"-{flag}") and i + 1 < len(argv):
      return argv[i + 1]
  return default


def load_config_file(path):
  """get_config() of the config file `path` ("file.py" or "file.py:arg")."""
  file, _, arg = path.partition(":")
  if not os.path.isfile(file):
    raise errors.UserError(
        f"config file {file!r} does not exist" + (
            " (it is a directory)" if os.path.isdir(file) else "")
        + "; give a .py file with get_config(), e.g. configs/default.py")
  spec = importlib.util.spec_from_file_location("_fp4jax_config_check", file)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise errors.UserError(f"config file {file!r} cannot be loaded: "
                           f"{type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise errors.UserError(f"config file {file!r} defines no get_config()")
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # pylint: disable=broad-except
    raise errors.UserError(f"config file {file!r}: get_config() raised "
                           f"{type(e).__name__}: {e}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise errors.UserError(
        f"config file {file!r}: get_config() returned {config!r:.40}, not an "
        "ml_collections.ConfigDict (a missing `return`?)")
  return config


def _check_key(config, dotted, flag):
  node, done = config, flag
  for name in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict):
      return  # below a leaf or a None placeholder: absl decides
    if name not in node:
      prefix = f"{done}." if done else ""
      hint = errors.did_you_mean(name, list(node.keys()), f"--{prefix}")
      raise errors.UserError(
          f"unknown config key --{prefix}{name}{hint}; the keys of "
          f"{done or 'the config'} are: {', '.join(sorted(node.keys()))}")
    node, done = node[name], f"{done}.{name}"


def check_config_overrides(argv, flag="config", default=None):
  """UserError if the config file is missing or an override names no key."""
  overrides = [a.lstrip("-").split("=", 1)[0] for a in argv[1:]
               if a.lstrip("-").startswith(f"{flag}.")]
  path = _config_path(argv, flag, default)
  if path is None:
    return
  config = load_config_file(path)
  for override in overrides:
    _check_key(config, override[len(flag) + 1:], flag)


def flags_parser(prog):
  """An absl `flags_parser`: a bad flag is one line, exit status 2."""

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      sys.exit(errors.report(prog, e))

  return parse


_QUANT_SHORTHAND = re.compile(r"^(--?config\.quant)(=.*)?$")


def expand_quant_flag(argv):
  """Rewrites `--config.quant=NAME` (or `--config.quant NAME`) in a command
  line to `--config.quant.name=NAME`, for CLIs built on ml_collections.

  config_flags only overrides leaves and `quant` is a ConfigDict; it also
  reads sys.argv itself, so a CLI must assign the result to sys.argv before
  absl parses it.
  """
  out = []
  for arg in argv:
    match = _QUANT_SHORTHAND.match(arg)
    out.append(match.group(1) + ".name" + (match.group(2) or "")
               if match else arg)
  return out
