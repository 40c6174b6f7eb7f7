"""Kernel backends on sharded operands: each device quantizes and multiplies its own shard.

XLA's SPMD partitioner splits jnp programs (the `xla` backend's fake
quantization and GEMM) but not custom calls: a Triton quantize kernel
(`pallas`, `mosaic`) or a Mosaic GPU GEMM (`mosaic`) is run on the whole array,
so XLA all-gathers its operands first and every device quantizes and
multiplies every token. A backend that declares PARTITIONED_BY_XLA = False
(fp4jax.backends) gets each of its kernel calls wrapped in `jax.shard_map`
over the current mesh (`jax.set_mesh`, fp4jax.sharding.use_mesh) when the
caller says how its operands are sharded (fp4jax.dot_general's `specs`,
which fp4jax.flax.DotGeneral fills in from the model's logical axis names):

- `plan` picks one layout per GEMM from the operands' specs, as XLA lays out
  the bf16 program: the output keeps the batch dims' and the lhs's free dims'
  mesh axes, then the rhs's free dims' (a mesh axis splits one dim at most);
  the contraction takes the lhs's axes that are left (so a weight sharded
  along the contraction over `fsdp`, which also splits the tokens, is
  all-gathered, as in bf16). A contraction split over devices is reduced
  after the GEMM (psum), as bf16's partial products are; where the caller
  wants the output split over such an axis (a weight's gradient under FSDP),
  that sum is reduce-scattered (psum_scatter). dY is laid out as Fprop's output.
- A quantization block (MX / NVFP4 block, Hadamard block) runs along the
  GEMM's contraction axis; where that axis is split, every device's part must
  be a whole number of blocks, else `plan` raises ValueError naming the GEMM,
  the operand, the mesh axes and the sizes (before anything compiles).
- Per-tensor scales (FP8's amax, NVFP4's global scale) are computed outside
  the per-shard calls, in jnp, which XLA partitions with an all-reduce (max)
  of the shards' amax: sharded and unsharded give the same scale.
- Stochastic rounding draws its bits from the caller's key over the whole
  array, outside the per-shard call, and each device reads its shard of them:
  the bits are those of the unsharded program.

`Layout` is one array's (mesh, spec); `each_shard(fn, args, specs, out_specs,
mesh)` runs fn per shard.
"""

import math
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec

Spec = tuple  # per dim, the tuple of mesh axis names splitting it ((): whole)


class Layout(NamedTuple):
  """How one array is split: `spec` per dim (a Spec) over `mesh` (an AbstractMesh)."""
  mesh: object
  spec: Spec

  def partition_spec(self):
    return partition_spec(self.spec)


class Plan(NamedTuple):
  """One GEMM's per-shard layout: a, b (Layouts of the operands as the caller
  passes them, before flattening), out (the output's Spec, dot_general's
  layout), reduce (mesh axes the contraction is split over), scatter ((output
  dim, mesh axes) whose sums are reduce-scattered along that dim: psum_scatter;
  the rest of `reduce` is summed whole: psum)."""
  a: Layout
  b: Layout
  out: Spec
  reduce: tuple
  scatter: tuple = ()

  def sum_partials(self, y):
    """y, one device's partial product, summed over the devices that split the
    contraction (inside the per-shard call)."""
    scattered = set()
    for dim, axes in self.scatter:
      y = jax.lax.psum_scatter(y, axes, scatter_dimension=dim, tiled=True)
      scattered.update(axes)
    rest = tuple(x for x in self.reduce if x not in scattered)
    return jax.lax.psum(y, rest) if rest else y


def partition_spec(spec: Spec) -> PartitionSpec:
  return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes
                         for axes in spec))


def normalize(spec, ndim, name="operand") -> Spec:
  """A PartitionSpec (or tuple of None / axis / axes) as a Spec of `ndim` dims."""
  entries = tuple(spec)
  if len(entries) > ndim:
    raise ValueError(f"{name}: sharding spec {spec} has {len(entries)} entries for "
                     f"{ndim} dims")
  out = []
  for entry in entries + (None,) * (ndim - len(entries)):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    else:
      out.append(tuple(entry))
  return tuple(out)


def active_mesh():
  """The mesh a jitted program is traced under (jax.set_mesh), or None when there
  is none, it has one device, or some of its axes are already manual (inside a
  shard_map: the caller's shards are local already)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
    return None
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  if any(t == manual for t in getattr(mesh, "axis_types", ())):
    return None
  return mesh


def _split(mesh, axes):
  return math.prod(mesh.shape[a] for a in axes)


def plan(mesh, a_shape, b_shape, a_spec: Spec, b_spec: Spec, dims, *, role, blocks,
         out_spec=None):
  """The Plan of one GEMM dot_general(a, b, dims) (module docstring).

  blocks: ((lhs MX block or None, rhs MX block or None), Hadamard block or None),
  the blocks that run along the contraction axis. A mesh axis missing from
  `mesh` or one that does not divide its dim is dropped (that dim is gathered);
  a contraction whose split is not a whole number of blocks per device raises
  ValueError. None when no operand dim is split. out_spec: the Spec the output
  is wanted in (a weight's gradient: the weight's), or None; an output dim it
  splits over mesh axes that split the contraction gets its sum reduce-scattered
  over them (as XLA does for a bf16 gradient under FSDP) instead of summed whole.
  """
  new_a, new_b, out, n = _assign(mesh, a_shape, b_shape, a_spec, b_spec, dims)
  if not any(new_a + new_b):  # nothing split: the kernels run on whole arrays
    return None
  (ca, _), _ = dims
  reduce = tuple(x for d in ca for x in new_a[d])
  shards = _split(mesh, reduce)
  if shards > 1:
    _check_blocks(role, n, shards, reduce, mesh, blocks)
  scatter = []
  if out_spec is not None and reduce:
    out = list(out)
    sizes = _output_sizes(a_shape, b_shape, dims)
    for d, want in enumerate(out_spec):
      left = {x for _, axes in scatter for x in axes}
      extra = tuple(x for x in want if x in reduce and x not in left and x not in out[d])
      if extra and sizes[d] % _split(mesh, out[d] + extra) == 0:
        scatter.append((d, extra))
        out[d] = out[d] + extra
    out = tuple(out)
  return Plan(Layout(mesh, new_a), Layout(mesh, new_b), out, reduce, tuple(scatter))


def _output_sizes(a_shape, b_shape, dims):
  (ca, cb), (ba, bb) = dims
  return ([a_shape[d] for d in ba] + [a_shape[d] for d in range(len(a_shape)) if d not in ca + ba]
          + [b_shape[d] for d in range(len(b_shape)) if d not in cb + bb])


def output_spec(mesh, a_shape, b_shape, a_spec: Spec, b_spec: Spec, dims) -> Spec:
  """The Spec plan gives dot_general(a, b, dims)'s output (how its cotangent is laid out)."""
  return _assign(mesh, a_shape, b_shape, a_spec, b_spec, dims)[2]


def _assign(mesh, a_shape, b_shape, a_spec, b_spec, dims):
  """(a's Spec, b's Spec, the output's Spec, the contraction's flattened size)."""
  (ca, cb), (ba, bb) = dims
  fa = [d for d in range(len(a_shape)) if d not in ca + ba]
  fb = [d for d in range(len(b_shape)) if d not in cb + bb]
  used = set()

  def take(axes, size):
    keep = tuple(x for x in axes if x in mesh.shape and x not in used)
    if size % _split(mesh, keep):  # an uneven split: that dim stays whole per shard
      keep = ()
    used.update(keep)
    return keep

  new_a, new_b = [()] * len(a_shape), [()] * len(b_shape)
  out = []
  for da, db in zip(ba, bb):
    new_a[da] = new_b[db] = take(a_spec[da], a_shape[da])
    out.append(new_a[da])
  for d in fa:
    new_a[d] = take(a_spec[d], a_shape[d])
    out.append(new_a[d])
  for d in fb:
    new_b[d] = take(b_spec[d], b_shape[d])
    out.append(new_b[d])
  # The contraction: the lhs's axes left over, flattened (dot's layout) into one
  # axis, which a split can only cut along its major-most split dim.
  contract = [tuple(x for x in a_spec[d] if x in mesh.shape and x not in used) for d in ca]
  sizes = [a_shape[d] for d in ca]
  split_at = [i for i, axes in enumerate(contract) if axes]
  if len(split_at) > 1 or (split_at and math.prod(sizes[:split_at[0]]) != 1):
    contract = [()] * len(ca)  # not one block of the flattened axis per device: gathered
  for da, db, axes in zip(ca, cb, contract):
    new_a[da] = new_b[db] = axes
  return tuple(new_a), tuple(new_b), tuple(out), math.prod(sizes)


def _check_blocks(role, n, shards, reduce, mesh, blocks):
  (lhs_block, rhs_block), hadamard_block = blocks
  where = (f"{role}: the contraction axis of size {n} is split over mesh axes "
           f"{reduce} ({shards} devices) of mesh {dict(mesh.shape)}")
  if n % shards:
    raise ValueError(f"{where}, which does not divide it")
  local = n // shards
  for operand, kind, block in (("lhs", "MX block", lhs_block), ("rhs", "MX block", rhs_block),
                               ("both operands", "Hadamard block", hadamard_block)):
    if block and local % block:
      raise ValueError(f"{where}: {local} per device, not a multiple of the {kind} "
                       f"{block} of the {operand}, so a block would straddle two devices")


def flattened(layout: Layout, shape, perm, axes, axis):
  """The Layout of an array of `shape` and `layout` after fp4jax.dot's _flatten
  (perm or None, then `axes` merged into `axis`); the merged axis takes the
  split of its one split dim (plan makes sure there is at most one, major-most)."""
  spec = layout.spec
  merged = tuple(x for d in axes for x in spec[d])
  rest = [d for d in range(len(shape)) if d not in axes]
  if perm is None:  # merged in place
    new = [spec[d] for d in rest]
    new.insert(axis, merged)
  else:
    new = [spec[d] for d in rest] + [merged]
  return Layout(layout.mesh, tuple(new))


def each_shard(fn, args, in_specs, out_specs, mesh):
  """jax.shard_map(fn) over `mesh` with Specs (None: a replicated arg); args that
  are None are passed through as None. out_specs: a Spec, or a list of Specs for
  a tuple of outputs."""
  present = [i for i, a in enumerate(args) if a is not None]

  def local(*xs):
    full = [None] * len(args)
    for i, x in zip(present, xs):
      full[i] = x
    return fn(*full)

  specs = tuple(PartitionSpec() if in_specs[i] is None else partition_spec(in_specs[i])
                for i in present)
  outs = (partition_spec(out_specs) if isinstance(out_specs, tuple)
          else tuple(partition_spec(s) for s in out_specs))
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=outs,
                       check_vma=False)(*(args[i] for i in present))
