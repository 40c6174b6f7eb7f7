"""Quantization blocks must not straddle devices: the start-up check of a run.

`check_blocks(model_cfg, recipe, mesh, micro_batch=, seq_len=)` raises
ValueError, naming the layer, GEMM and operand, when a mesh would split an MX
block, a Hadamard block or a 2D tile of one of the model's quantized linears
(fp4jax.llama.linears) across devices.
"""

import math

from jax.sharding import Mesh

from fp4jax import sharding
from fp4jax.llama import linears


def _linear_layers(model_cfg):
  """(name, input axis, output axis) of the quantized linears to check.

  An axis is a list of (logical name, size), flattened in that order; the
  names are the kernels' (fp4jax.llama.linears), and the blocks run along
  the flattened contraction axes. The first quantized block stands for all
  of them (same shapes, same recipe).
  """
  layers = []
  quantized = [i for i in range(model_cfg.n_layers) if not model_cfg.is_bf16(i)]
  if quantized:
    block = "blocks" if model_cfg.scan_layers else f"block_{quantized[0]}"
    layers += [(f"{block}/{layer.path}", layer.fan_in(model_cfg), layer.fan_out(model_cfg))
               for layer in linears.BLOCK]
  if model_cfg.quantize_head and not model_cfg.is_bf16(None):
    head = linears.HEAD
    layers.append((head.path, head.fan_in(model_cfg), head.fan_out(model_cfg)))
  return layers


def _local(mesh, axis, *, layer, what):
  """Local size of a flattened axis [(logical, size), ...] on `mesh`."""
  total = 1
  for logical, size in axis:
    n = sharding.shards(mesh, logical)
    if size % n:
      raise ValueError(
          f"layer {layer}: {what} axis {logical!r} of size {size} cannot be "
          f"split evenly over {n} devices (mesh {dict(mesh.shape)})")
    total *= size // n
  return total


def check_blocks(model_cfg, recipe, mesh: Mesh, *, micro_batch: int,
                 seq_len: int) -> None:
  """Raises ValueError if an MX or Hadamard block would straddle devices.

  For each quantized linear layer and each of its GEMMs, each operand's
  contraction axis is sharded by the rules: Fprop contracts the input
  features, Dgrad the output features, Wgrad the tokens M = micro_batch x
  seq_len, whose batch part is split over data x fsdp (so a device holds
  micro_batch / (data * fsdp) x seq_len of them). That local size must be a
  multiple of the operand's MX block and of the GEMM's Hadamard block. An
  operand quantized in 2D tiles (`block_2d`) has a second tile side along its
  other axes (flattened: a weight's other features, an activation's tokens),
  whose local size must be a multiple of the tile too.
  (With `quantize_attention`, QK^T and PV contract head_dim and positions,
  which the rules never split, so they cannot straddle devices.)
  """
  n_batch = sharding.batch_shards(mesh)
  if micro_batch % n_batch:
    raise ValueError(
        f"micro_batch {micro_batch} is not divisible by the {n_batch} batch "
        f"shards (data x fsdp) of mesh {dict(mesh.shape)}")
  tokens = [("activation_batch", micro_batch), ("activation_length", seq_len)]
  for layer, fan_in, fan_out in _linear_layers(model_cfg):
    x_in = [(sharding.activation_name(n), s) for n, s in fan_in]
    dy_out = [(sharding.activation_name(n), s) for n, s in fan_out]
    gemms = {  # role: contraction, (lhs name, its axis, its other axes), (rhs ...)
        "fprop": ("input features", ("x", x_in, tokens), ("w", fan_in, fan_out)),
        "dgrad": ("output features", ("dy", dy_out, tokens), ("w", fan_out, fan_in)),
        "wgrad": ("tokens (micro_batch x seq_len)", ("x", tokens, x_in),
                  ("dy", tokens, dy_out)),
    }
    for role, (contracted, *operands) in gemms.items():
      gemm = getattr(recipe, role)
      for (operand, axis, other), spec in zip(operands, (gemm.lhs, gemm.rhs)):
        blocks = [("MX block", spec and spec.block, axis),
                  ("Hadamard block", gemm.hadamard and gemm.hadamard.block, axis)]
        if spec is not None and spec.block_2d:
          blocks.append(("2D tile", spec.block, other))
        for kind, block, along in blocks:
          if not block:
            continue
          local = _local(mesh, along, layer=layer, what=f"{role} {operand}")
          if local % block == 0:
            continue
          where = (f"{role} contracts the {contracted} axis; operand {operand}"
                   if along is axis else
                   f"{role} quantizes operand {operand} in {block}x{block} tiles; "
                   "along its other axes (the tiles' second side) it")
          if local == math.prod(size for _, size in along):  # not split
            raise ValueError(
                f"layer {layer}: {where} has size {local} along it, not a "
                f"multiple of the {kind} {block} (choose sizes divisible "
                f"by {block} or a recipe with a smaller block)")
          raise ValueError(
              f"layer {layer}: {where} has local size {local} per device on mesh "
              f"{dict(mesh.shape)}, not a multiple of the {kind} {block}, "
              f"so a block would straddle two devices")
