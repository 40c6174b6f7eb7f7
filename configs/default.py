"""The default run: a tiny Llama on the Python standard library, MXFP4 + H16.

  python train.py --config=configs/default.py --workdir=runs/demo

Sized to finish within 5 minutes on a 2-core CPU (compile included) with the
validation loss clearly falling. Byte tokenizer, stdlib corpus (present
wherever Python is), recipe mxfp4-dh16 (all three GEMMs in MXFP4, each
operand rotated by a deterministic 16-point Hadamard).
"""

from fp4jax.train import config as train_config


def get_config():
  config = train_config.base_config()
  config.quant.name = "mxfp4-dh16"
  config.model = train_config.model_template("tiny")
  # Measured on the 2-core CPU (CPU seconds per step, same run): bfloat16
  # compute is 5-15% cheaper than float32 for this model, so it is used here.
  config.dtype = "bfloat16"
  config.steps = 300
  config.batch_size = 8
  config.micro_batch = 0
  config.seq_len = 128
  config.lr = 3e-3
  config.warmup_steps = 30
  config.eval_every = 50
  config.eval_batches = 4
  config.eval_batch_size = 16
  config.checkpoint_every = 100
  config.log_every = 10
  return config
