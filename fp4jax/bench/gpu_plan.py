"""The GPU check's plan: its stages in priority order, each in a time box that fits the budget.

  python -m fp4jax.bench gpu_plan [--cc 9.0] [--budget 500] [--stages NAME,...]

Prints the plan of benchmarks/gpu_check.sh, one stage a line (NAME TAB BOX
seconds) on stdout, and on stderr each stage's box, their sum against the
budget, and every stage or arm left out with the reason. The order is what a
short call must answer first: correctness, the layer's speed, the train
step, then the rest. Over the budget, train arms are left out from the last
(bf16 stays), then stages from the last; exits 1 when even one stage does not
fit. --cc is MAJOR.MINOR (9.0, 10.0), --budget a positive number of
seconds, --stages each stage once; anything else exits 2 naming what was
given and what is allowed.

  env          the machine
  crosscheck   the quantizers and recipes on the GPU against XLA:CPU, pallas = xla
  linear       one layer's fwd+bwd per recipe and backend, ratios to the bf16 recipe
  train_R_B    the 125M train step (blocks scanned) of recipe R on backend B: bf16,
               then mxfp4-dh16 and fp8 on each backend, the newest first (train_arms)
  tests        the kernels' and backends' tests on the GPU
  quantize     the fused quantize kernels on a 1 GiB tensor against a copy
  native       (compute capability >= 10: block-scaled FP4 units; jax >= 0.11,
               fp4jax.backends.MIN_JAX) the native backend
  compile      (compute capability >= 10) the deviceless report against the device

Backends: every name of fp4jax.backends.NAMES but `native` (its own stage)
that the installed jax runs (fp4jax.backends.check_jax) on this GPU (a
backend module's CAPABILITY_MAJOR: `mosaic` is for Hopper, 9.x). Boxes (BOXES,
seconds on the GPU machine) come from the first check on an H200
(2026-12-04: 16 host cores) with a margin: a stage that outlasts its box is
stopped and the next one starts.
"""

import argparse
import importlib
import re
import sys

from fp4jax import backends

BUDGET_S = 500
PRIORITY = ("env", "crosscheck", "linear", "train", "tests", "quantize", "native", "compile")
OPTIONAL = ("ablation_short",)  # a stage that needs the whole call: only when named
NEEDS_FP4_UNITS = ("native", "compile")  # run only on compute capability >= 10
# fp8 on pallas is xla's program (per-tensor operands take xla's code), so it is not trained.
SAME_AS_XLA = {("fp8", "pallas")}
TRAIN_RECIPES = ("mxfp4-dh16", "fp8")  # besides bf16, which runs on xla only
# Seconds per stage on the GPU machine. Measured 2026-12-04 on an H200: env 3, crosscheck
# 45 (two backends), linear 39 (two backends), quantize 13 at 128 MiB, the tests > 150 (cut
# while failing), the unscanned bf16 train arm 79 (24.6 s of it the first step's compile).
BOXES = {"env": 20, "crosscheck": 40, "crosscheck_per_backend": 10, "linear": 25,
         "linear_per_backend": 15, "tests": 80, "quantize": 25, "native": 60, "compile": 60,
         "ablation_short": 480}
# A train arm, scanned: start-up, data, the first step's compile, 20 steps, two evaluations,
# a checkpoint. Compiled for an H200 without it (docs/performance.md), the scanned step
# takes 1.4x bf16's time for fp8, about 2x for mxfp4-dh16 and more on mosaic.
TRAIN_BOXES = {"bf16": 55, "fp8": 60, "mxfp4-dh16": 65}
TRAIN_BOXES_ON = {"mosaic": 15}  # extra seconds per arm on that backend


def train_backends(cc=None):
  """([backend names the check runs], {left-out backend: why}) for compute capability cc
  (None: any); a backend module's CAPABILITY_MAJOR, where it has one, names its GPUs.
  `native` is never among the names (its own stage); it is in `why` when the
  installed jax cannot run it."""
  names, why = [], {}
  for name in backends.NAMES:
    try:
      backends.check_jax(name)
    except ValueError as e:
      why[name] = str(e)
      continue
    if name == "native":
      continue
    major = getattr(importlib.import_module(f"fp4jax.backends.{name}"), "CAPABILITY_MAJOR", None)
    if cc is not None and major is not None and int(float(cc)) != major:
      why[name] = f"runs on compute capability {major}.x only, this GPU's is {cc}"
      continue
    names.append(name)
  return names, why


def train_arms(backend_names):
  """[(recipe, backend)] in priority order: bf16 on xla, then each backend's
  TRAIN_RECIPES, the newest backend first (the reference `xla` last)."""
  return [("bf16", "xla")] + [(r, b) for b in reversed(backend_names) for r in TRAIN_RECIPES
                              if (r, b) not in SAME_AS_XLA]


def plan(cc, stages=PRIORITY, budget=BUDGET_S, backend_names=None):
  """([(stage name, box seconds)], [left-out item and why]) for compute capability cc.

  Over the budget, train arms are left out from the last (never bf16), then
  stages from the last, until the boxes fit. backend_names: the train
  backends (default: those the installed jax runs on this GPU, train_backends;
  given, the native stage is planned whatever the installed jax). Raises
  ValueError (one line) for a compute capability, a stage list or a budget
  that `check_args` refuses.
  """
  check_args(cc, stages, budget)
  if backend_names is None:
    backend_names, why = train_backends(cc)
  else:
    why = {}
  native_why = why.pop("native", None)
  out, left = [], [f"backend {b}: {w}" for b, w in why.items()]
  left += [f"train_{r}_{b}: the same program as train_{r}_xla" for r, b in sorted(SAME_AS_XLA)
           if b in backend_names and "train" in stages]
  n = len(backend_names)
  for name in stages:
    if name in NEEDS_FP4_UNITS and cc < 10:
      left.append(f"{name}: compute capability {cc} < 10 (no block-scaled FP4 units)")
    elif name == "native" and native_why:
      left.append(f"native: {native_why}")
    elif name == "train":
      out += [(f"train_{r}_{b}", TRAIN_BOXES[r] + TRAIN_BOXES_ON.get(b, 0))
              for r, b in train_arms(backend_names)]
    elif name in ("crosscheck", "linear"):
      out.append((name, BOXES[name] + n * BOXES[f"{name}_per_backend"]))
    else:
      out.append((name, BOXES[name]))
  while sum(box for _, box in out) > budget and len(out) > 1:
    arms = [i for i, (name, _) in enumerate(out) if name.startswith("train_")][1:]
    name, box = out.pop(arms[-1] if arms else -1)
    again = "train" if name.startswith("train_") else name
    left.append(f"{name}: over the {budget} s budget (a call with "
                f"GPU_CHECK_STAGES=\"env {again}\" runs it)")
  return out, left


def describe(stages, left, budget):
  """Lines: each stage's box, the sum against the budget, what is left out."""
  total = sum(box for _, box in stages)
  lines = [f"  {name:<26} {box:>4} s" for name, box in stages]
  lines.append(f"  {'sum of the boxes':<26} {total:>4} s of the {budget} s budget: "
               + ("fits" if total <= budget else f"over by {total - budget} s"))
  lines += [f"  left out: {item}" for item in left]
  return lines


_CC = re.compile(r"[0-9]{1,3}(\.[0-9]{1,2})?")


def check_args(cc, stages, budget):
  """Raises ValueError (one line naming the value and what is allowed) unless cc
  is a compute capability (a number >= 1), stages names stages of PRIORITY +
  OPTIONAL each once (at least one) and budget is a positive number of seconds."""
  if isinstance(cc, bool) or not isinstance(cc, (int, float)) or not 1 <= cc < 1000:
    raise ValueError(f"compute capability {cc!r}: want MAJOR.MINOR, e.g. 9.0 or 10.0")
  allowed = ", ".join(PRIORITY + OPTIONAL)
  if isinstance(stages, str) or not stages:
    raise ValueError(f"no stage named; want at least one of {allowed}")
  for i, name in enumerate(stages):
    if name not in PRIORITY + OPTIONAL:
      raise ValueError(f"unknown stage {name!r}; allowed: {allowed}")
    if name in stages[:i]:
      raise ValueError(f"stage {name!r} is named twice; each stage runs once")
  if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
    raise ValueError(f"budget {budget!r}: want a positive number of seconds")


def _cc(text):
  """--cc: MAJOR.MINOR as nvidia-smi prints it (9.0, 10.0, 12.0)."""
  if not _CC.fullmatch(text.strip()) or float(text) < 1:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a compute capability; want MAJOR.MINOR, e.g. 9.0 or 10.0")
  return float(text)


def _budget(text):
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: want a positive whole number of seconds")
  return value


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gpu_plan",
                              description=__doc__.splitlines()[0])
  p.add_argument("--cc", type=_cc, default=9.0,
                 help="the GPU's compute capability, MAJOR.MINOR (9.0, 10.0)")
  p.add_argument("--budget", type=_budget, default=BUDGET_S,
                 help="seconds for all stages (> 0)")
  p.add_argument("--stages", default=",".join(PRIORITY),
                 help=f"comma- or space-separated, each once, in the order to run: "
                      f"{', '.join(PRIORITY + OPTIONAL)}")
  return p


def main(argv):
  args = parser().parse_args(argv)
  stages = args.stages.replace(",", " ").split()
  try:
    check_args(args.cc, stages, args.budget)
  except ValueError as e:
    print(f"gpu_plan: --stages {args.stages!r}: {e}", file=sys.stderr)
    sys.exit(2)
  out, left = plan(args.cc, stages, args.budget)
  print("\n".join(f"{name}\t{box}" for name, box in out))
  print(f"gpu_plan: compute capability {args.cc}, in this order:", file=sys.stderr)
  print("\n".join(describe(out, left, args.budget)), file=sys.stderr)
  if sum(box for _, box in out) > args.budget:
    sys.exit(1)
