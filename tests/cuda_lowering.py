"""Lowering Pallas (Triton) kernels for CUDA on a machine without a GPU.

jax >= 0.11 asks the Triton lowering for the target GPU; off GPUs it must come
from an abstract mesh whose abstract device names one. jax 0.10 accepts the
same context and does not need it.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

TARGET = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def lower_for_cuda(fn, *args):
  """The StableHLO text of jit(fn) traced on `args` and lowered for CUDA."""
  mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=TARGET)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
