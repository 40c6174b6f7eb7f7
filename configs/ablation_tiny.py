"""The staged ablation on a 2-core CPU: 13 recipes x one tiny Llama, paired over seeds.

  python -m fp4jax.experiments.ablation --config=configs/ablation_tiny.py \
      --workdir=runs/ablation_tiny

Same model (tiny: dim 128, 4 layers, 4 heads, 2 kv heads, MLP 384; 861K
parameters; bf16 compute) and data (stdlib corpus, byte tokenizer) for every
recipe; seed s fixes the initialisation and data order of every recipe's run
s, so recipes are compared seed by seed. 300 steps of 16 x 64 tokens (307K
tokens); 16 rows read 16 files side by side.

Seeds: 5 for the recipes of the paper's contrasts (fp8, mxfp4-fprop,
mxfp4-fprop-dgrad, mxfp4, mxfp4-sr, mxfp4-rh16, mxfp4-dh16, mxfp4-floor,
mxfp4-dh16-floor), 3 for mxfp4-wdh16 and mxfp4-lh16, 1 for bf16 and
mxfp4-dh32 (ablation.recipe_seeds): 53 runs.

Evaluation: every 50 steps on 512 windows of 65 tokens (16 batches of 32)
spread evenly through the 1.2M held-out tokens
(fp4jax.data.pipeline.validation_windows).

Diagnostics: the first block's q projection and the last block's MLP down
projection, on 3 consecutive steps every 100 (bias, step cosine, SNR).
Checkpoints: at the end only (and on a stop signal); finished runs are skipped.
"""

from fp4jax.train import config as train_config
from fp4jax.experiments import ablation


def get_config():
  config = train_config.base_config()
  config.model = train_config.model_template("tiny")
  config.dtype = "bfloat16"
  config.steps = 300
  config.batch_size = 16
  config.seq_len = 64
  config.lr = 3e-3
  config.warmup_steps = 30
  config.eval_every = 50
  config.eval_batches = 16
  config.eval_batch_size = 32
  config.checkpoint_every = 300
  config.log_every = 50
  config.ablation = ablation.ablation_config()
  config.ablation.seeds = 5
  config.ablation.recipe_seeds = "bf16:1,mxfp4-wdh16:3,mxfp4-lh16:3,mxfp4-dh32:1"
  config.ablation.target_at = 0.75
  config.diagnostics = ablation.diagnostics_config()
  config.diagnostics.every = 100
  config.diagnostics.window = 3
  return config
