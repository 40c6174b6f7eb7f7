"""Model FLOP/s per device and model FLOP utilisation (MFU) of a run.

Model FLOPs per token are PaLM's count (Chowdhery et al. 2022, appendix B):

  6 N + 12 L H Q T

N: the parameters that take part in a matmul, i.e. every parameter but the
input embedding table (a lookup; the untied output head is counted; the
RMSNorm scales are counted too, a negligible excess). L: layers, H: query
heads, Q: head dim, T: sequence length; 12 L H Q T is QK^T and PV over the
full T x T square (no halving for the causal mask), forward and backward.
This is the work of the model, not of the implementation: quantization,
rematerialisation and the backward's recompute do not change it, so the
number compares across recipes and machines.

MFU = model FLOP/s per device / the device's dense bf16 peak. The peak comes
from `peak_tflops` (config key; 0 = look the device up in PEAK_BF16_TFLOPS);
devices not in the table (the CPU among them) get no MFU. `Meter` is what
the trainer uses.
"""

import jax

# Dense (no sparsity) bf16 matrix peaks of the SXM / OAM parts, TFLOP/s.
# Matched as a case-insensitive substring of jax's device_kind.
PEAK_BF16_TFLOPS = {
    # https://www.nvidia.com/en-us/data-center/h100/ (1,979 with sparsity)
    "H100": 989.0,
    # https://www.nvidia.com/en-us/data-center/h200/ (1,979 with sparsity)
    "H200": 989.0,
    # NVIDIA Blackwell datasheet, HGX B200 per GPU (4.5 PF with sparsity)
    "B200": 2250.0,
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html
    "MI300X": 1307.4,
    # https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html
    "MI355X": 2500.0,
}


def matmul_params(n_params, model_cfg):
  """N of the count: all parameters less the input embedding table."""
  return n_params - model_cfg.vocab_size * model_cfg.dim


def flops_per_token(n_params, model_cfg, seq_len):
  """Model FLOPs of one training token (forward and backward): 6N + 12 L H Q T."""
  head_dim = model_cfg.dim // model_cfg.n_heads
  attention = 12 * model_cfg.n_layers * model_cfg.n_heads * head_dim * seq_len
  return 6 * matmul_params(n_params, model_cfg) + attention


def peak_tflops(device_kind, override=0.0):
  """The dense bf16 peak of one device in TFLOP/s: `override` when > 0, else
  the table's entry whose name is in `device_kind`, else None."""
  if override > 0:
    return float(override)
  kind = device_kind.upper()
  for name, tflops in PEAK_BF16_TFLOPS.items():
    if name in kind:
      return tflops
  return None


def metrics(tokens_per_s, flops_per_token_, n_devices, peak):
  """{"model_tflops_per_device": ..., "mfu": ...} of a measured token rate
  (mfu only where `peak`, TFLOP/s per device, is known)."""
  tflops = tokens_per_s * flops_per_token_ / n_devices / 1e12
  out = {"model_tflops_per_device": tflops}
  if peak:
    out["mfu"] = tflops / peak
  return out


class Meter:
  """meter(tokens_per_s) -> `metrics` of a run's model on this process's devices."""

  def __init__(self, n_params, model_cfg, seq_len, peak_override=0.0):
    self.flops_per_token = flops_per_token(n_params, model_cfg, seq_len)
    self.peak = peak_tflops(jax.devices()[0].device_kind, peak_override)
    self.n_devices = jax.device_count()

  def __call__(self, tokens_per_s):
    return metrics(tokens_per_s, self.flops_per_token, self.n_devices, self.peak)
