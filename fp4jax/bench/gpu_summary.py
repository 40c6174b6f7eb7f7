"""The closing summary of benchmarks/gpu_check.sh: stages, goals, key numbers.

  python -m fp4jax.bench gpu_summary --work DIR --out OUT

Reads what the stages left in DIR (stages.tsv from the script: name, exit
status, seconds, time box; pytest.xml; env, crosscheck, quantize, linear,
native and train_*.json) and writes OUT/summary.md and OUT/summary.json.
A stage that failed or never ran shows as such; nothing is filled in.

Goals (measured, not promised): the fused quantize at >= 70% of
copy bandwidth; mxfp4-dh16 linear fwd+bwd <= 1.25x bf16 at the 8B MLP
shape; the 125M train step with mxfp4-dh16 <= 1.3x bf16; pallas equal to
xla bit for bit; every GPU test passing.
"""

import argparse
import glob
import json
import os
import xml.etree.ElementTree as ElementTree

GOAL_QUANTIZE_FRACTION = 0.70
GOAL_LINEAR_RATIO = 1.25
GOAL_TRAIN_RATIO = 1.3


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


def _goal(name, value, limit, higher_is_better=False):
  if value is None:
    return {"goal": name, "value": None, "limit": limit, "met": None}
  met = value >= limit if higher_is_better else value <= limit
  return {"goal": name, "value": value, "limit": limit, "met": met}


def goals(work):
  """One dict per goal: goal, value, limit, met (None: not measured)."""
  out = []
  quant = _load(os.path.join(work, "quantize.json")) or {"rows": []}
  for r in quant["rows"]:
    if r["name"].startswith("pallas quantize"):
      out.append(_goal(f"{r['name']}: fraction of copy bandwidth", r.get("copy_fraction"),
                       GOAL_QUANTIZE_FRACTION, higher_is_better=True))
  linear = _load(os.path.join(work, "linear.json")) or {"tables": []}
  for table in linear["tables"][:1]:  # the first shape: the 8B MLP's on the GPU
    for r in table["rows"]:
      if r["name"].startswith("mxfp4-dh16 ("):
        out.append(_goal(f"linear {r['name']} at {table['shape']}: time / bf16",
                         r.get("vs_bf16"), GOAL_LINEAR_RATIO))
  runs = {(r["recipe"], r["backend"]): r for r in
          filter(None, map(_load, sorted(glob.glob(os.path.join(work, "train_*.json")))))}
  base = next((r for (name, _), r in runs.items() if name == "bf16"), None)
  for (name, backend), r in runs.items():
    if name != "bf16":
      ratio = (base["tokens_per_s"] / r["tokens_per_s"]
               if base and base.get("tokens_per_s") and r.get("tokens_per_s") else None)
      out.append(_goal(f"train step {name} ({backend}): time / bf16", ratio, GOAL_TRAIN_RATIO))
  cross = _load(os.path.join(work, "crosscheck.json"))
  if cross:
    bad = sum(r.get("pallas vs xla", {}).get("mismatched", 0) for r in cross["rows"])
    errors = sum("error" in r.get("pallas vs xla", {}) for r in cross["rows"])
    out.append(_goal("pallas vs xla, same device: differing elements (+ cases that failed)",
                     bad + errors, 0))
  env = _load(os.path.join(work, "env.json"))
  if env and env.get("backend") == "gpu":
    out.append(_goal("Pallas interprets on the GPU (1 = yes: nothing was compiled)",
                     int(bool(env.get("pallas_interprets"))), 0))
  tests = pytest_counts(work)
  if tests:  # none run (all skipped, or none collected) is not a pass
    ran = tests["tests"] - tests["skipped"]
    out.append(_goal("GPU tests failed or errored",
                     tests["failures"] + tests["errors"] if ran else None, 0))
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
  lines += ["", "| goal | measured | limit | met |", "|---|---|---|---|"]
  lines += [f"| {g['goal']} | {_fmt(g['value'])} | {g['limit']} | {_fmt(g['met'])} |"
            for g in result["goals"]]
  if runs:
    lines += ["", "| train (recipe, backend) | tokens/s | step (s) | MFU | peak GiB | "
              "final loss | the config's steps (min) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['recipe']} ({r['backend']}) | {_fmt(r['tokens_per_s'])} | "
              f"{_fmt(r['step_s'])} | {_fmt(r['mfu'])} | {_fmt(r['peak_gib'])} | "
              f"{_fmt(r['final_loss'])} | {_fmt(r.get('config_minutes'))} |" for r in runs]
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
