"""The staged ablation on a 2-core CPU: 9 recipes x one tiny Llama.

  python -m fp4jax.experiments.ablation --config=configs/ablation_tiny.py \
      --workdir=runs/ablation_tiny

Same model (tiny: dim 128, 4 layers, 4 heads, 2 kv heads, MLP 384; 861K
parameters; bf16 compute), data (stdlib corpus, byte tokenizer) and seed for
every recipe: 300 steps of 16 x 64 tokens (307K tokens); 16 rows read 16
files side by side, to average the training data over more files per step.
Measured: 12 minutes for the 9 recipes at a load average of 2-5 (50-90 s a
recipe, mxfp4-sr 111 s: stochastic rounding draws random bits for every
backward operand); a pilot under a load average of 10-12 ran about 4x slower.

The target is fp8's validation loss at 75% of its tokens rather than its
final loss: with one fixed budget, a recipe slower than fp8 would never reach
fp8's final loss (in the paper, runs stop at the MLPerf target rather than
at a fixed budget). Diagnostics: the first block's q projection and the last
block's MLP down projection, on 4 consecutive steps every 50.
"""

from fp4jax import trainer
from fp4jax.experiments import ablation


def get_config():
  config = trainer.base_config()
  config.model = trainer.model_template("tiny")
  config.dtype = "bfloat16"
  config.steps = 300
  config.batch_size = 16
  config.seq_len = 64
  config.lr = 3e-3
  config.warmup_steps = 30
  config.eval_every = 20
  config.eval_batches = 4
  config.eval_batch_size = 32
  config.checkpoint_every = 100
  config.log_every = 25
  config.ablation = ablation.ablation_config()
  config.ablation.target_at = 0.75
  config.diagnostics = ablation.diagnostics_config()
  config.diagnostics.every = 50
  config.diagnostics.window = 4
  return config
