"""MLPerf Llama 3.1-8B pretraining on C4 (the setting of arXiv 2605.09825;
docs/ablation.md, "What the paper did and claimed").

  python train.py --config=configs/llama3_8b_c4.py --workdir=runs/llama8b \\
      --config.data.path='/data/c4/en/c4-train.*-of-01024.json.gz' \\
      --config.data.val_path='/data/c4/en/c4-validation.*.json.gz' \\
      --config.data.tokenizer=/models/Llama-3.1-8B/tokenizer.json

Two ways to feed C4 (en, 3.0.1):
  1. MLPerf's json.gz files (the default below), streamed as they are:
       --config.data.source=files --config.data.path='.../c4-train.*.json.gz'
       --config.data.val_path='.../c4-validation.*.json.gz'
  2. tensorflow-datasets' c4/en, prepared offline in the ArrayRecord format
     (an Apache Beam job over Common Crawl, run elsewhere:
     `tfds build c4/en:3.0.1 --file_format=array_record --data_dir=/data/tfds`,
     then copy /data/tfds/c4); reading it needs only
     `pip install 'fp4jax[tfds]'`, not TensorFlow:
       --config.data.source=tfds --config.data.path=c4/en:3.0.1
       --config.data.data_dir=/data/tfds
     (splits data.train_split='train', data.val_split='validation').

Global batch 32 x 8192 tokens, AdamW (0.9, 0.95, eps 1e-5, wd 0.1), peak lr
8e-4 with 64 warm-up steps and cosine decay to 8e-5, stop at eval loss 3.3
(a log-perplexity). The paths below are placeholders; the run fails at start
with a clear message until they point at real files.

The mesh: FSDP over the 8 GPUs of a host (fsdp=8: parameters, gradients and
Adam moments split 8 ways, ZeRO-3), data parallelism across hosts (data=-1:
2 hosts of 8 are data=2). Pure data parallelism (the base config's data=-1)
does not fit: every GPU would hold the whole model's float32 parameters and
moments (docs/sharding.md has the per-GPU memory of each recipe and backend on
8 x H200, B200 and H100, compiled without the GPUs by `python -m fp4jax.bench
gpu_fit`). micro_batch is global (sequences per accumulation step over all
devices): MLPerf's micro-batch of 2 per device on 8 devices is micro_batch=16,
i.e. two accumulation steps per global batch of 32; on 16 GPUs it is one
sequence per GPU (or micro_batch=32: two each, no accumulation).
Not given by the paper and chosen here: steps (the cosine horizon),
eval_every, the validation size (eval_batches x eval_batch_size sequences).
"""

from fp4jax.train import config as train_config


def get_config():
  config = train_config.base_config()
  config.quant.name = "mxfp4-dh16"
  config.model = train_config.model_template(
      "llama3.1-8b", scan_layers=True, remat="full")
  config.dtype = "bfloat16"
  config.data.source = "files"
  config.data.path = "/path/to/c4/en/c4-train.*-of-01024.json.gz"
  config.data.val_path = "/path/to/c4/en/c4-validation.*-of-00008.json.gz"
  config.data.tokenizer = "/path/to/Llama-3.1-8B/tokenizer.json"
  config.batch_size = 32
  config.micro_batch = 16          # 2 sequences per GPU on 8 GPUs
  config.mesh.data = -1            # across hosts
  config.mesh.fsdp = 8             # within a host
  config.mesh.tensor = 1
  config.seq_len = 8192
  config.lr = 8e-4
  config.min_lr_ratio = 0.1
  config.warmup_steps = 64
  config.steps = 20_000
  config.target_eval_loss = 3.3
  config.eval_every = 384          # every 12,288 sequences
  config.eval_batches = 64
  config.eval_batch_size = 16      # 1,024 validation sequences
  config.checkpoint_every = 500
  config.keep_checkpoints = 2
  config.log_every = 10
  config.max_bad_steps = 10
  return config
