"""The staged ablation on one H200: a ~125M-shape Llama, 9 recipes.

  python -m fp4jax.experiments.ablation --config=configs/ablation_gpu.py \
      --workdir=runs/ablation_gpu

llama-125m shape (dim 768, 12 layers, 12 heads, 4 kv heads, MLP 2048) with
the tokenizer's vocabulary: 76M parameters with the byte tokenizer (288
tokens), ~125M with a 32K-token tokenizer. bf16 compute; 1,500 steps of
32 x 1024 tokens (49M tokens, about 4 passes over the embedded stdlib corpus
with the byte tokenizer). For a real corpus, point data at C4 as in
configs/llama3_8b_c4.py (--config.data.source=files --config.data.path=...
--config.data.tokenizer=...). Not run yet (no GPU was available when this was
written); the size is an estimate (~10 minutes a recipe). The train stages of
benchmarks/gpu_check.sh measure this config's tokens/s, peak memory and the
time of its 1,500 steps (docs/performance.md); adjust steps from those.
"""

from fp4jax.train import config as train_config
from fp4jax.experiments import ablation


def get_config():
  config = train_config.base_config()
  config.model = train_config.model_template("llama-125m")
  config.model.scan_layers = False  # the diagnostics read each block's module path
  config.dtype = "bfloat16"
  config.steps = 1500
  config.batch_size = 32
  config.seq_len = 1024
  config.lr = 1e-3
  config.warmup_steps = 150
  config.eval_every = 100
  config.eval_batches = 8
  config.eval_batch_size = 32
  config.checkpoint_every = 500
  config.keep_checkpoints = 2
  config.log_every = 50
  config.ablation = ablation.ablation_config()
  config.diagnostics = ablation.diagnostics_config()
  config.ablation.cpus_per_run = 0  # one run at a time, on the accelerator
  config.diagnostics.every = 250
  config.diagnostics.window = 4
  config.diagnostics.ref_batch_size = 8
  return config
