"""Training throughput of one recipe: tokens/s, model FLOP utilisation, peak memory.

  python -m fp4jax.bench train_speed --config=configs/ablation_gpu.py \
      --recipe mxfp4-dh16 --backend pallas --steps 20 --out run.json

Runs fp4jax.train.trainer.train on the config (an ablation config loses its own
blocks, as in fp4jax.experiments.ablation) for `--steps` steps, evaluating
only at the start and the end (one batch). tokens/s is the trainer's: every
step after the first (the compile), data and host work included. Model FLOPs
per token follow PaLM (Chowdhery et al., 2022, appendix B): 6 x the
parameters of the matrices (blocks and head, not the embedding) + 12 x
layers x dim x sequence length for attention; MFU = tokens/s x that / the
card's bf16 dense rate (--peak_tflops). Peak memory is the device's
peak_bytes_in_use, so run one recipe per process. config_minutes projects the
untrimmed config's steps at this rate (training only: no evaluation,
checkpoints or diagnostics). `--tiny` swaps in the tiny model and 4 x 64
tokens (a CPU dry run).
"""

import argparse
import json
import tempfile
import types

import jax

from fp4jax.train import cli
from fp4jax.train import config as train_config
from fp4jax.train import run_layout
from fp4jax.train import throughput
from fp4jax.train import trainer
from fp4jax.experiments import ablation



def run_config(config, recipe, backend, steps, tiny=False, scan_layers=False):
  """The trainer config: `config` trimmed to `steps` steps of `recipe` on `backend`.

  scan_layers: nn.scan over the blocks (one block to compile, not n_layers), or not.
  """
  cfg = ablation.run_config(config, recipe, seed=0) if "ablation" in config else config
  cfg.quant.name = recipe
  cfg.quant.backend = backend
  cfg.steps = cfg.eval_every = cfg.checkpoint_every = cfg.log_every = steps
  cfg.eval_batches = 1
  if tiny:
    cfg.model = train_config.model_template("tiny")
    cfg.batch_size, cfg.seq_len, cfg.eval_batch_size = 4, 64, 4
  cfg.model.scan_layers = scan_layers
  return cfg


def measure(cfg, peak_tflops, config_steps=None):
  """Trains `cfg` in a temporary workdir; returns the measurements (dict).

  config_steps: the untrimmed config's steps, for a projection of its time.
  """
  with tempfile.TemporaryDirectory() as workdir:
    summary = trainer.train(cfg, workdir)
    resolved = run_layout.saved_config(workdir)[0]["resolved"]
  stats = jax.devices()[0].memory_stats() or {}
  fpt = throughput.flops_per_token(summary["n_params"],
                                   types.SimpleNamespace(**resolved["model"]), cfg.seq_len)
  tps = summary["tokens_per_s"]
  return dict(
      recipe=cfg.quant.name, backend=cfg.quant.backend, steps=summary["step"],
      status=summary["status"], tokens_per_step=cfg.batch_size * cfg.seq_len,
      n_params=summary["n_params"], flops_per_token=fpt, tokens_per_s=tps,
      step_s=cfg.batch_size * cfg.seq_len / tps if tps else None,
      first_step_s=summary["train_time_s"] - (summary["step"] - 1) * cfg.batch_size
      * cfg.seq_len / tps if tps else None,  # mostly compilation
      mfu=tps * fpt / (peak_tflops * 1e12) if tps else None,
      peak_gib=stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
      final_loss=summary["final_loss"], wall_s=summary["wall_time_s"],
      config_steps=config_steps,
      config_minutes=config_steps * cfg.batch_size * cfg.seq_len / tps / 60
      if tps and config_steps else None,
      device=jax.devices()[0].device_kind)


def parser():
  p = argparse.ArgumentParser(prog="python -m fp4jax.bench train_speed",
                              description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/ablation_gpu.py")
  p.add_argument("--recipe", default="bf16")
  p.add_argument("--backend", default="xla")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--peak_tflops", type=float, default=throughput.PEAK_BF16_TFLOPS["H200"])
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--scan_layers", action="store_true",
                 help="scan over the blocks (shorter compile, same model)")
  p.add_argument("--out", help="write the result (JSON) here")
  return p


def main(argv):
  args = parser().parse_args(argv)
  config = cli.load_config_file(args.config)
  config_steps = config.steps
  cfg = run_config(config, args.recipe, args.backend, args.steps, args.tiny, args.scan_layers)
  result = measure(cfg, args.peak_tflops, config_steps)
  print(json.dumps(result, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
