"""Device mesh, logical axis rules and multi-host start-up.

Everything here is JAX's own machinery: a `Mesh` with axes ("data", "fsdp",
"tensor"), Flax logical axis rules (as MaxText uses them) that turn the model's
logical names into `NamedSharding`s, and `jax.distributed` for many hosts.

Mesh axes:
  data    pure data parallelism: the batch is split, parameters replicated.
  fsdp    the batch is split and so is the parameters' `embed` axis (and
          with it the optimizer state): ZeRO-3 style, each layer's weights
          are all-gathered where they are used and their gradients reduced
          back to shards.
  tensor  Megatron-style tensor parallelism: `mlp`, `heads`, `kv_heads` and
          `vocab` are split, activations stay whole in `embed`.
The devices are laid out data-major, tensor-minor: put `tensor` within a
host (fast links) and `data` across hosts.

`use_mesh(mesh)` activates the mesh and the rules, so the model's
`nn.with_logical_constraint`s take effect inside jit.
"""

import contextlib
import math

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or axes, or None = replicated). Names not listed
# are replicated. Order matters only when a name appears twice (it does not).
LOGICAL_AXIS_RULES = (
    # Parameters.
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
    # Activations.
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_vocab", "tensor"),
)


def mesh_config() -> ml_collections.ConfigDict:
  """Mesh sizes; exactly one may be -1, meaning all remaining devices."""
  return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))


def mesh_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Resolves the config's sizes (one may be -1) against `num_devices`."""
  sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
  given = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
  bad = [a for a, s in zip(MESH_AXES, sizes) if s == 0 or s < -1]
  if bad:
    raise ValueError(f"mesh sizes must be positive or -1 (the rest); got "
                     f"{given}")
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1; got {given}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f"mesh {given}: {num_devices} devices are not "
                       f"divisible by the fixed axes' product {fixed}")
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh {given} needs {math.prod(sizes)} devices, but "
                     f"{num_devices} are available")
  return tuple(sizes)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A Mesh over `devices` (default: all global devices) with MESH_AXES."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types, devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Context in which the model's logical constraints resolve on `mesh`."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    yield


def _is_spec_leaf(x):
  return isinstance(x, (PartitionSpec, nn.Partitioned))


def logical_to_sharding(logical_tree, mesh: Mesh):
  """Tree of NamedSharding from a tree of logical PartitionSpecs.

  `logical_tree` may hold PartitionSpecs of logical names (as
  `nn.get_partition_spec` returns) or the boxed `nn.LogicallyPartitioned`
  leaves of `jax.eval_shape(model.init, ...)` (then a dimension that the mesh
  cannot split evenly raises ValueError naming the parameter); other leaves
  are replicated.
  """
  def one(path, x):
    if isinstance(x, PartitionSpec):
      return nn.logical_to_mesh_sharding(x, mesh, LOGICAL_AXIS_RULES)
    if not isinstance(x, nn.Partitioned):
      return NamedSharding(mesh, PartitionSpec())
    sharding = nn.logical_to_mesh_sharding(
        PartitionSpec(*x.names), mesh, LOGICAL_AXIS_RULES)
    shape = getattr(x.value, "shape", None)
    if shape is not None:
      _check_divisible(jax.tree_util.keystr(path), shape, x.names, sharding)
    return sharding

  return jax.tree_util.tree_map_with_path(one, logical_tree,
                                          is_leaf=_is_spec_leaf)


def _check_divisible(name, shape, logical_names, sharding):
  for size, logical, axes in zip(shape, logical_names, sharding.spec):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    if size % n:
      raise ValueError(
          f"parameter {name}: axis {logical!r} of size {size} cannot be split "
          f"evenly over mesh axes {tuple(axes)} ({n} devices) of mesh "
          f"{dict(sharding.mesh.shape)}")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of [batch, seq] token arrays: batch over the batch axes."""
  spec = PartitionSpec("activation_batch", "activation_length")
  return logical_to_sharding(spec, mesh)


def global_batch(local_np, mesh: Mesh):
  """Global jax.Array(s) from this process's rows of the batch.

  local_np: array (or tree of arrays) [global_batch // process_count, ...],
  the rows this process reads; the result has the global leading size.
  """
  sharding = batch_sharding(mesh)

  def one(x):
    x = np.asarray(x)
    spec = PartitionSpec(*sharding.spec[:1], *([None] * (x.ndim - 1)))
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec), x)

  return jax.tree.map(one, local_np)


# ---------------------------------------------------------------------------
# How the rules split an axis (fp4jax.llama.block_check asks).


def _rule_axes(logical_name):
  for name, axes in LOGICAL_AXIS_RULES:
    if name == logical_name:
      if axes is None:
        return ()
      return (axes,) if isinstance(axes, str) else tuple(axes)
  return ()


def shards(mesh: Mesh, logical_name) -> int:
  """How many ways the rules split the logical axis `logical_name` on `mesh`."""
  return math.prod(mesh.shape[a] for a in _rule_axes(logical_name))


def batch_shards(mesh: Mesh) -> int:
  """How many ways the rules split the batch (data x fsdp)."""
  return shards(mesh, "activation_batch")


def activation_name(name):
  """The activations' logical name of a kernel axis' logical name ("embed" ->
  "activation_embed"; names without one are returned as they are)."""
  return {"embed": "activation_embed", "mlp": "activation_mlp",
          "heads": "activation_heads", "kv_heads": "activation_kv_heads",
          "vocab": "activation_vocab"}.get(name, name)


# ---------------------------------------------------------------------------
# Many hosts.


def distributed_config() -> ml_collections.ConfigDict:
  """jax.distributed settings; an empty coordinator means a single process.

  coordinator: "host:port" of process 0. local_device_ids: "" (all) or
  comma-separated ids. auto: let JAX detect a cluster (SLURM, Open MPI, ...)
  when no coordinator is given.
  """
  return ml_collections.ConfigDict(dict(
      coordinator="", num_processes=1, process_id=0, local_device_ids="",
      auto=False))


def initialize_distributed(dist_cfg) -> None:
  """Calls jax.distributed.initialize when configured (before any JAX use).

  A no-op for a single process, or when already initialized.
  """
  if jax.distributed.is_initialized():
    return
  n, pid = int(dist_cfg.num_processes), int(dist_cfg.process_id)
  if dist_cfg.coordinator:
    if n < 1 or not 0 <= pid < n:
      raise ValueError(
          f"distributed.process_id={pid} must lie in [0, num_processes={n})")
    ids = dist_cfg.local_device_ids
    try:
      ids = [int(i) for i in str(ids).split(",") if i.strip()] or None
    except ValueError:
      raise ValueError(f"distributed.local_device_ids={ids!r} must be '' (all "
                       f"local devices) or comma-separated ints") from None
    jax.distributed.initialize(coordinator_address=dist_cfg.coordinator,
                               num_processes=n, process_id=pid,
                               local_device_ids=ids)
  elif dist_cfg.auto:
    jax.distributed.initialize()
  elif n != 1:
    raise ValueError(
        f"distributed.num_processes={n} needs distributed.coordinator="
        f"host:port (or distributed.auto=True)")


def is_main_process() -> bool:
  """True on process 0, the one that writes logs, plots and summaries."""
  return jax.process_index() == 0
