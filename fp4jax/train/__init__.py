"""The trainer of the study: config, step, loop, workdir safety and the tools around a run.

  config       the trainer's ConfigDict, its checks and the recipe it resolves
  step         loss, optimizer, learning-rate schedule, the jitted train / eval steps
  trainer      the loop: start or resume, train, evaluate, checkpoint, summarize
  workdir      the run folder: lock, resume-config check, history
  run_layout   the run folder's file names, spelled once, and their readers
  metrics_log  metrics.jsonl (and TensorBoard) writer and reader
  adaptive     switching a block's Wgrad to FP8/BF16 on its measured SNR
  init_from    initial weights from a Hugging Face directory or another run
  export       a run as a Hugging Face Llama directory (`python -m fp4jax.convert`)
export_fp4   the same with packed NVFP4 / MXFP4 block linears (`--quantize`)
export_gguf  a run as a GGUF file for llama.cpp (OUT ending in .gguf)
next_steps   the run's files and the commands to use them, printed at its end
  curves       validation curves of runs in one PNG (`python -m fp4jax.plot`)
  cli          command-line checks shared by train.py and the experiments
atomic       writes that leave the old file or the new one, never a part
stall        runs that stopped learning (flat loss, no gradient)
throughput   model FLOP/s per device and MFU
profile      a profiler window over a few steps (`config.profile`)
wandb_log    Weights & Biases logging beside TensorBoard (`config.wandb`)
"""
