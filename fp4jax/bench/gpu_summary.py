"""The closing summary of benchmarks/gpu_check.sh: stages, goals, key numbers.

  python -m fp4jax.bench gpu_summary --work DIR --out OUT

Reads what the stages left in DIR (plan.tsv and plan.txt: the plan;
stages.tsv from the script: name, exit status, seconds, time box;
pytest.xml; env, crosscheck, quantize, linear, native and train_*.json) and
writes OUT/summary.md and OUT/summary.json. A stage that failed or never ran
shows as such; nothing is filled in.

Goals (measured, not promised), in the order the check answers them, each
measured or with the reason it was not (the stage that should have measured
it, and how that stage ended):
  1. correctness: every GPU test passing; pallas equal to xla bit for bit on
     the device; Pallas compiled, not interpreted
  2. the layer at the 8B MLP shape, fwd+bwd: mxfp4-dh16 <= 1.25x the bf16
     recipe on xla and pallas; on any other backend (the FP8 tensor cores')
     mxfp4 and mxfp4-dh16 <= 0.8x and fp8 <= 0.7x
  3. the 125M train step: each quantized arm <= 1.3x bf16's step time, and
     mxfp4-dh16 on another backend <= 1.0x (tokens/s at least bf16's)
  4. the fused quantize at >= 70% of copy bandwidth
"""

import argparse
import glob
import json
import os
import xml.etree.ElementTree as ElementTree

from fp4jax.bench import gpu_plan

GOAL_QUANTIZE_FRACTION = 0.70
GOAL_LINEAR_RATIO = 1.25
GOAL_TRAIN_RATIO = 1.3
EMULATING_BACKENDS = ("xla", "pallas")  # GEMMs in bf16: the goals above
# Backends with FP8 tensor-core GEMMs: recipe -> linear time / bf16 at the 8B MLP shape.
GOAL_FAST_LINEAR = {"fp8": 0.7, "mxfp4": 0.8, "mxfp4-dh16": 0.8}
GOAL_FAST_TRAIN = {"mxfp4-dh16": 1.0}
QUANTIZE_ROWS = ("pallas quantize row", "pallas quantize row +H16", "pallas quantize col",
                 "pallas quantize col +H16")


def _load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def stages(work):
  """[(name, exit status, seconds, box)] from the script's stages.tsv."""
  try:
    with open(os.path.join(work, "stages.tsv")) as f:
      return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]
  except OSError:
    return []


def pytest_counts(work):
  """{tests, failures, errors, skipped} of pytest.xml, or None."""
  try:
    root = ElementTree.parse(os.path.join(work, "pytest.xml")).getroot()
  except (OSError, ElementTree.ParseError):
    return None
  suite = root if root.tag == "testsuite" else root.find("testsuite")
  return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _goal(name, value, limit, why, higher_is_better=False):
  """One goal: measured (met or not) or not, with `why` (None where measured)."""
  if value is None:
    return {"goal": name, "value": None, "limit": limit, "met": None, "why": why}
  met = value >= limit if higher_is_better else value <= limit
  return {"goal": name, "value": value, "limit": limit, "met": met, "why": None}


def _why(work, stage):
  """Why `stage` measured nothing: how it ended (stages.tsv), or that it did not run."""
  for name, status, seconds, box in stages(work):
    if name == stage:
      if status == "0":
        return f"stage {stage} ended (0) without this number: see its log"
      if status == "not run":
        return f"stage {stage} not run: {box}"
      return f"stage {stage} exited {status} after {seconds} s of its {box} s box"
  return f"stage {stage} is not in this call's plan"


def _planned_train_arms(work):
  """[(recipe, backend)] of the plan's train stages (plan.tsv), or [] without a plan."""
  try:
    with open(os.path.join(work, "plan.tsv")) as f:
      names = [line.split("\t")[0] for line in f if line.startswith("train_")]
  except OSError:
    return []
  return [tuple(n[len("train_"):].rsplit("_", 1)) for n in names]


def goals(work, backend_names=None):
  """One dict per goal: goal, value, limit, met (None: not measured), why (the reason)."""
  if backend_names is None:  # those the check ran on this GPU
    env = _load(os.path.join(work, "env.json")) or {}
    cc = ((env.get("devices") or [{}])[0]).get("compute_capability")
    backend_names = gpu_plan.train_backends(cc)[0]
  out = []
  # 1. correctness
  tests = pytest_counts(work)
  ran = tests and tests["tests"] - tests["skipped"]  # none run (all skipped) is not a pass
  out.append(_goal("GPU tests failed or errored",
                   tests["failures"] + tests["errors"] if ran else None, 0,
                   _why(work, "tests") if tests is None else "no test ran (all skipped)"))
  cross = _load(os.path.join(work, "crosscheck.json"))
  value = None
  if cross:
    value = (sum(r.get("pallas vs xla", {}).get("mismatched", 0) for r in cross["rows"])
             + sum("error" in r.get("pallas vs xla", {}) for r in cross["rows"]))
  out.append(_goal("pallas vs xla, same device: differing elements (+ cases that failed)",
                   value, 0, _why(work, "crosscheck")))
  env = _load(os.path.join(work, "env.json"))
  if env is None or env.get("backend") == "gpu":
    out.append(_goal("Pallas interprets on the GPU (1 = yes: nothing was compiled)",
                     int(bool(env.get("pallas_interprets"))) if env else None, 0,
                     _why(work, "env")))
  # 2. the layer
  linear = _load(os.path.join(work, "linear.json")) or {"tables": []}
  table = linear["tables"][0] if linear["tables"] else {"shape": "the 8B MLP shape", "rows": []}
  rows = {r["name"]: r for r in table["rows"]}
  for backend in backend_names:
    limits = ({"mxfp4-dh16": GOAL_LINEAR_RATIO} if backend in EMULATING_BACKENDS
              else GOAL_FAST_LINEAR)
    for recipe, limit in limits.items():
      name = f"{recipe} ({backend})"
      out.append(_goal(f"linear {name} at {table['shape']}: time / bf16",
                       rows.get(name, {}).get("vs_bf16"), limit, _why(work, "linear")))
  # 3. the train step
  runs = {(r["recipe"], r["backend"]): r for r in
          filter(None, map(_load, sorted(glob.glob(os.path.join(work, "train_*.json")))))}
  base = runs.get(("bf16", "xla"))
  for recipe, backend in _planned_train_arms(work) or [k for k in runs if k[0] != "bf16"]:
    if recipe == "bf16":
      continue
    r = runs.get((recipe, backend), {})
    ratio = (base["tokens_per_s"] / r["tokens_per_s"]
             if base and base.get("tokens_per_s") and r.get("tokens_per_s") else None)
    why = _why(work, "train_bf16_xla" if r and not base else f"train_{recipe}_{backend}")
    limit = (GOAL_TRAIN_RATIO if backend in EMULATING_BACKENDS
             else GOAL_FAST_TRAIN.get(recipe, GOAL_TRAIN_RATIO))
    out.append(_goal(f"train step {recipe} ({backend}): time / bf16", ratio, limit, why))
  # 4. the quantize kernels
  quant = _load(os.path.join(work, "quantize.json")) or {"rows": []}
  quant = {r["name"]: r for r in quant["rows"]}
  for name in QUANTIZE_ROWS:
    out.append(_goal(f"{name}: fraction of copy bandwidth",
                     quant.get(name, {}).get("copy_fraction"), GOAL_QUANTIZE_FRACTION,
                     quant.get(name, {}).get("error") or _why(work, "quantize"),
                     higher_is_better=True))
  return out


def _fmt(v):
  if isinstance(v, float):
    return f"{v:.3g}"
  return "n/a" if v is None else str(v)


def summarize(work):
  """(summary dict, markdown)."""
  env = _load(os.path.join(work, "env.json")) or {}
  runs = [r for r in map(_load, sorted(glob.glob(os.path.join(work, "train_*.json")))) if r]
  result = {"stages": stages(work), "tests": pytest_counts(work), "goals": goals(work),
            "train": runs, "env": {k: env.get(k) for k in (
                "devices", "jax", "python", "pallas_interprets", "missing", "backends")}}
  lines = ["# fp4jax GPU check", ""]
  dev = (env.get("devices") or [{}])[0]
  lines.append(f"device: {dev.get('kind')} (compute capability "
               f"{dev.get('compute_capability')}), jax {env.get('jax')}, python "
               f"{env.get('python')}; Pallas interprets: {env.get('pallas_interprets')}; "
               f"missing packages: {env.get('missing')}")
  lines += ["", "| stage | exit status | seconds | time box |", "|---|---|---|---|"]
  lines += ["| " + " | ".join(s) + " |" for s in result["stages"]]
  if result["tests"]:
    lines += ["", "tests: " + ", ".join(f"{k} {v}" for k, v in result["tests"].items())]
  try:
    with open(os.path.join(work, "plan.txt")) as f:
      lines += ["", "plan:", "", "```", f.read().rstrip(), "```"]
  except OSError:
    pass
  lines += ["", "| goal | measured | limit | met |", "|---|---|---|---|"]
  lines += [f"| {g['goal']} | "
            + (_fmt(g["value"]) if g["why"] is None else f"not measured: {g['why']}")
            + f" | {g['limit']} | {_fmt(g['met'])} |" for g in result["goals"]]
  if runs:
    lines += ["", "| train (recipe, backend) | tokens/s | step (s) | first step (s), mostly "
              "its compile | MFU | peak GiB | final loss | the config's steps (min) |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['recipe']} ({r['backend']}) | {_fmt(r.get('tokens_per_s'))} | "
              f"{_fmt(r.get('step_s'))} | {_fmt(r.get('first_step_s'))} | {_fmt(r.get('mfu'))} | "
              f"{_fmt(r.get('peak_gib'))} | {_fmt(r.get('final_loss'))} | "
              f"{_fmt(r.get('config_minutes'))} |" for r in runs]
  for name in ("crosscheck", "quantize", "linear", "native"):
    path = os.path.join(work, f"{name}.md")
    if os.path.exists(path):
      with open(path) as f:
        lines += ["", f"## {name}", "", f.read().rstrip()]
  return result, "\n".join(lines) + "\n"


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench gpu_summary",
                              description=__doc__.splitlines()[0])
  p.add_argument("--work", required=True)
  p.add_argument("--out", required=True)
  return p


def main(argv):
  args = parser().parse_args(argv)
  result, md = summarize(args.work)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(md)
  print(md)
