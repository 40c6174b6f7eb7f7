"""The quantized dot_general: a drop-in for jax.lax.dot_general.

`dot_general(recipe)` returns a function with lax.dot_general's signature plus
`key` and `layer_key`. Forward and backward are a jax.custom_vjp whose
residuals are the two original (high-precision) operands (with
Recipe.residuals="quantized": the Wgrad lhs already flattened, rotated and
quantized, packed by fp4jax.residuals, in its place). Each of the three GEMMs
(recipes.py) rotates and quantizes its operands along *its own* contraction
axes and multiplies them with float32 accumulation through a backend
(fp4jax.backends; a GEMM the chosen backend cannot take runs on `xla`).
Float32 per-tensor factors (NVFP4's global scale, stochastic_dither's 4/3)
multiply the float32 output, as a hardware epilogue does; per-tensor FP8
operands carry their scale in their values, in the input's dtype.

Layout: the contraction axes, in dot_general order, are flattened into one
blocked axis, alike in both operands; a GEMM's rhs is rotated and quantized
in place (a free reshape when its contraction axes are adjacent), its lhs in
place too when it is FP4 with nearest rounding on a backend that declares
LHS_IN_PLACE (`xla`: the Wgrad lhs X along its token axis; _lhs_last), else
as [other axes..., contraction] (the Wgrad lhs of a Dense layer transposed
once).
A rotated axis the Hadamard block does not divide is zero-padded in both
operands; so are quantization blocks that do not divide an axis.

Randomness: role r in (fprop, dgrad, wgrad) uses fold_in(key, r); within it
operand i in (lhs, rhs) quantizes with fold_in(role_key, i), and per-step
Hadamard signs come from fold_in(role_key, 2), shared by both operands.
Per-layer signs of role r come from fold_in(layer_key, r), the layer's own
key, the same on every step (fp4jax.flax.DotGeneral draws it from the
"hadamard" rng stream).

Plain GEMMs (a role that neither quantizes nor rotates; every GEMM of "bf16")
follow Recipe.plain_route: "lax" calls lax.dot_general with the caller's
arguments (bitwise an unquantized model, gradients included);
"float32_output" runs each forward and backward GEMM as a float32-output
lax.dot_general rounded once, the route every quantized GEMM takes (why and
how fast: docs/recipes.md, "Layout, padding, randomness" and the top).

Sharding: `specs=(lhs_spec, rhs_spec)` (PartitionSpecs over the mesh of
jax.set_mesh) says how the operands are laid out; a backend XLA cannot
partition (kernels: pallas, mosaic) then quantizes and multiplies each
device's shard (fp4jax.shard_local; dY is laid out as Fprop's output, and a
GEMM that would split a block is refused). Other backends ignore it.

Adaptive Wgrad (fp4jax.train.adaptive): `dot_general(recipe,
switch_wgrad_to=gemm)` takes a runtime boolean `wgrad_switched`; where it is
true the backward computes Wgrad with `gemm` (one lax.cond: only the chosen
GEMM runs).
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from fp4jax import backends, residuals, shard_local
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.numerics import operand
from fp4jax.recipes import Gemm, Hadamard, Recipe


def rotation_signs(rotation: Hadamard | None, key, layer_key=None):
  """The +-1 vector a rotation uses on this call, or None.

  key: fold_in(role_key, 2) (per-step signs); layer_key: fold_in(layer_key, r)
  of role r (per-layer signs); see the module docstring.
  """
  if rotation is None:
    return None
  return hadamard.policy_signs(rotation.signs, rotation.block, rotation.seed, key, layer_key)


def _flatten(x, axes, last=False):
  """x with `axes` merged into one axis (in the given order).

  The merged axis stays in place when `axes` are adjacent and increasing (a
  free reshape) unless `last`; otherwise x is transposed to put it last.
  Returns (x', axis, where): axis is the merged axis of x', where[d] the new
  index of every other dim d of x (their order is kept).
  """
  perm, shape, axis, where = _flat_layout(x.shape, axes, last)
  if perm is not None:
    x = jnp.transpose(x, perm)
  return x.reshape(shape), axis, where


def _flat_layout(shape, axes, last):
  """What _flatten does to an array of `shape`: (perm or None, shape', axis, where)."""
  ndim = len(shape)
  rest = [d for d in range(ndim) if d not in axes]
  n = math.prod(shape[d] for d in axes)
  adjacent = bool(axes) and tuple(axes) == tuple(range(axes[0], axes[0] + len(axes)))
  if adjacent and (not last or axes[-1] == ndim - 1):
    a = axes[0]
    where = {d: d if d < a else d - len(axes) + 1 for d in rest}
    return None, shape[:a] + (n,) + shape[a + len(axes):], a, where
  perm = rest + list(axes)
  if perm == list(range(ndim)):
    perm = None
  return perm, tuple(shape[d] for d in rest) + (n,), len(rest), {d: i for i, d in enumerate(rest)}


def _lhs_last(backend, spec) -> bool:
  """_flatten's `last` for a GEMM's lhs quantized with `spec` on `backend`: False
  (in place) where the backend declares LHS_IN_PLACE and `spec` is MXFP4 (E2M1
  elements, E8M0 scales) in 1D blocks with nearest rounding, True otherwise.
  Those operands quantize to the same values in either layout (random roundings
  draw their bits in the blocked layout's shape), and the GEMM's float32 sums
  of their few-bit products are exact in any order (docs/numerics.md, "The
  Wgrad lhs"); NVFP4's E4M3 scales add bits, and its Wgrad summed in place
  differed in the last bit from the transposed one."""
  return not (getattr(backend, "LHS_IN_PLACE", False) and spec is not None
              and spec.element_dtype == jnp.float4_e2m1fn
              and spec.scale_dtype == jnp.float8_e8m0fnu and not spec.block_2d
              and not spec.is_random)


def _operand_keys(gemm: Gemm, key, layer_key):
  """([lhs key, rhs key, signs key], rotation signs) of one GEMM (module docstring)."""
  keys = [None] * 3 if key is None else [jax.random.fold_in(key, i) for i in range(3)]
  return keys, rotation_signs(gemm.hadamard, keys[2], layer_key)


def _gemm(a, b, dims, gemm: Gemm, key, layer_key, recipe: Recipe, precision, out_dtype,
          out_sharding=None, saved_lhs=None, specs=None, role="gemm", out_spec=None):
  """One GEMM of the recipe: dot_general(a, b, dims) -> out_dtype, quantized as `gemm` says.

  saved_lhs: the lhs as _save_lhs stored it (a residuals.Saved; then `a` is
  only its shape, e.g. a jax.ShapeDtypeStruct), restored instead of
  quantizing `a`. specs: (a's Spec, b's Spec) (fp4jax.shard_local) or None; a
  backend that XLA cannot partition runs its kernels per shard of them (role
  names the GEMM in a refusal; out_spec: the Spec its output is wanted in, for
  Wgrad the weight's, shard_local.plan).
  """
  if gemm.is_plain:
    return _plain_gemm(a, b, dims, recipe.plain_route, precision, out_dtype, out_sharding)
  (ca, cb), (ba, bb) = dims
  keys, signs = _operand_keys(gemm, key, layer_key)
  backend = backends.for_gemm(recipe.backend, gemm)
  cdt = jnp.dtype(recipe.compute_dtype)
  plan = _shard_plan(backend, a, b, dims, gemm, specs, role, out_spec)
  a_last = _lhs_last(backend, gemm.lhs)
  a_layout = b_layout = None
  if plan is not None:
    a_layout = _flat_shards(plan.a, a.shape, ca, a_last)
    b_layout = _flat_shards(plan.b, b.shape, cb, False)
  if saved_lhs is None:
    a, ia, wa = _quantized(backend, a, ca, a_last, gemm.lhs, gemm.hadamard, signs, keys[0], cdt,
                           a_layout)
  else:
    _, _, ia, wa = _flat_layout(a.shape, ca, last=a_last)
    a = backend.from_qarray(residuals.restore(saved_lhs), saved_lhs.dtype, cdt)
  b, ib, wb = _quantized(backend, b, cb, False, gemm.rhs, gemm.hadamard, signs, keys[1], cdt,
                         b_layout)
  dims = (((ia,), (ib,)), (tuple(wa[d] for d in ba), tuple(wb[d] for d in bb)))
  if plan is not None and getattr(backend, "SHARD_LOCAL_MATMUL", False):
    y = backend.matmul(a, b, dims, precision, out_sharding, recipe.native_route,
                       plan=plan._replace(a=a_layout, b=b_layout))
  else:  # no mesh, or a GEMM XLA partitions (pallas': xla's)
    y = backend.matmul(a, b, dims, precision, out_sharding, recipe.native_route)
  return y.astype(out_dtype)


def _shard_plan(backend, a, b, dims, gemm, specs, role, out_spec=None):
  """The shard_local.Plan of a GEMM on a backend XLA cannot partition, under a mesh
  and with the operands' specs; else None."""
  if specs is None or backend.PARTITIONED_BY_XLA:
    return None
  mesh = shard_local.active_mesh()
  if mesh is None:
    return None
  blocks = ((gemm.lhs and gemm.lhs.block, gemm.rhs and gemm.rhs.block),
            gemm.hadamard and gemm.hadamard.block)
  return shard_local.plan(mesh, a.shape, b.shape, specs[0], specs[1], dims, role=role,
                          blocks=blocks, out_spec=out_spec)


def _flat_shards(layout, shape, axes, last):
  """The shard_local.Layout of an operand after _flatten(x, axes, last)."""
  perm, _, axis, _ = _flat_layout(tuple(shape), axes, last)
  return shard_local.flattened(layout, shape, perm, axes, axis)


def _quantized(backend, x, axes, last, spec, rotation, signs, key, compute_dtype, layout=None):
  """x flattened along `axes` (_flatten) and quantized by `backend`:
  (operand, axis, where) with _flatten's axis and where. layout: the flattened
  x's shard_local.Layout, for a backend whose kernels run per shard (or None).

  A per-tensor, deterministic, unrotated operand (FP8) is quantized before its
  layout changes on a backend that declares QUANTIZES_WHOLE_TENSOR_FIRST
  (fp4jax.backends): dY is read by Dgrad and Wgrad, X by Fprop and Wgrad, W
  by Fprop and Dgrad, and forward and backward are one computation.
  """
  if (backend.QUANTIZES_WHOLE_TENSOR_FIRST and spec is not None and spec.block is None
      and not spec.is_random and rotation is None and x.ndim):
    op = backend.quantize(x, spec, None, None, x.ndim - 1, key, compute_dtype)
    values, axis, where = _flatten(op.values, axes, last)
    return op._replace(values=values), axis, where
  x, axis, where = _flatten(x, axes, last)
  extra = {} if layout is None else {"layout": layout}
  return backend.quantize(x, spec, rotation, signs, axis, key, compute_dtype, **extra), axis, where


def _to_layout(y, owner):
  """y (axis j holds operand dim owner[j]) transposed to the operand's layout."""
  perm = [owner.index(d) for d in range(len(owner))]
  return y if perm == sorted(perm) else jnp.transpose(y, perm)


class _Static(NamedTuple):
  recipe: Recipe
  dims: tuple
  precision: object
  out_dtype: object
  out_sharding: object
  switch_wgrad_to: Gemm | None = None
  specs: tuple | None = None  # (lhs Spec, rhs Spec) (fp4jax.shard_local), or None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qdot(s: _Static, lhs, rhs, key, layer_key, wgrad_switched):
  return _fwd(s, lhs, rhs, key, layer_key, wgrad_switched)[0]


def _role_key(key, role):
  return None if key is None else jax.random.fold_in(key, role)


def _fwd(s, lhs, rhs, key, layer_key, wgrad_switched):
  y = _gemm(lhs, rhs, s.dims, s.recipe.fprop, _role_key(key, 0), _role_key(layer_key, 0),
            s.recipe, s.precision, s.out_dtype, s.out_sharding, specs=s.specs, role="fprop")
  if s.recipe.residuals == "quantized":
    return y, (_save_lhs(s, lhs, key, layer_key), rhs, key, layer_key, wgrad_switched)
  return y, (lhs, rhs, key, layer_key, wgrad_switched)


def _save_lhs(s, lhs, key, layer_key):
  """The Wgrad lhs flattened, padded and rotated as _gemm prepares it, quantized (_SavedLhs)."""
  gemm = s.recipe.wgrad
  keys, signs = _operand_keys(gemm, _role_key(key, 2), _role_key(layer_key, 2))
  (lc, _), (lb, _) = s.dims
  free = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
  a, ia, _ = _flatten(lhs, free,
                      last=_lhs_last(backends.for_gemm(s.recipe.backend, gemm), gemm.lhs))
  a = operand.rotate_padded(a, gemm.hadamard, signs, ia)
  return _SavedLhs(residuals.save(a, gemm.lhs, ia, keys[0]), lhs.shape, jnp.dtype(lhs.dtype))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["saved"],
                   meta_fields=["shape", "dtype"])
@dataclasses.dataclass(frozen=True)
class _SavedLhs:
  """The residual that replaces the lhs: its saved Wgrad operand, and its shape and dtype."""
  saved: residuals.Saved
  shape: tuple
  dtype: jnp.dtype


def _bwd(s, res, dy):
  """Dgrad dX = dY . W over W's free dims; Wgrad dW = X . dY over X's free dims."""
  lhs, rhs, key, layer_key, wgrad_switched = res
  saved_lhs = None
  if s.recipe.residuals == "quantized":
    saved_lhs, lhs = lhs.saved, jax.ShapeDtypeStruct(lhs.shape, lhs.dtype)
  (lc, rc), (lb, rb) = s.dims
  lf = [d for d in range(lhs.ndim) if d not in lc + lb]
  rf = [d for d in range(rhs.ndim) if d not in rc + rb]
  nb = len(lb)
  y_b = tuple(range(nb))
  y_lf = tuple(range(nb, nb + len(lf)))
  y_rf = tuple(range(nb + len(lf), dy.ndim))
  lhs_spec, rhs_spec, dy_spec = _backward_specs(s, lhs, rhs)
  # dW in Wgrad's output layout: rhs's batch dims, its contracted dims (as lhs orders
  # them), its free dims; wanted as the weight is split (FSDP: reduce-scattered).
  dw_spec = rhs_spec and tuple(rhs_spec[d] for d in list(rb) + [rc[lc.index(l)] for l in
                                                                sorted(lc)] + rf)
  dx = _gemm(dy, rhs, ((y_rf, tuple(rf)), (y_b, rb)), s.recipe.dgrad, _role_key(key, 1),
             _role_key(layer_key, 1), s.recipe, s.precision, lhs.dtype,
             specs=dy_spec and (dy_spec, rhs_spec), role="dgrad")
  # dx axes: batch (lb), lhs free (lf), then rhs's remaining dims (rc, by rhs index).
  dx = _to_layout(dx, list(lb) + lf + [lc[rc.index(r)] for r in sorted(rc)])
  wgrad = lambda gemm: _gemm(lhs, dy, ((tuple(lf), y_lf), (lb, y_b)), gemm, _role_key(key, 2),
                             _role_key(layer_key, 2), s.recipe, s.precision, rhs.dtype,
                             saved_lhs=saved_lhs, specs=dy_spec and (lhs_spec, dy_spec),
                             role="wgrad", out_spec=dw_spec)
  if wgrad_switched is None:
    dw = wgrad(s.recipe.wgrad)
  else:
    dw = lax.cond(wgrad_switched, lambda: wgrad(s.switch_wgrad_to), lambda: wgrad(s.recipe.wgrad))
  # dw axes: batch (rb), lhs's remaining dims (lc, by lhs index), rhs free (rf).
  dw = _to_layout(dw, list(rb) + [rc[lc.index(l)] for l in sorted(lc)] + rf)
  fprop = s.recipe.fprop
  if fprop.lhs is not None and fprop.lhs.has_trust_mask:
    dx = _trust_masked(dx, lhs, lc, _lhs_last(backends.for_gemm(s.recipe.backend, fprop),
                                              fprop.lhs),
                       fprop, fprop.lhs, key, layer_key)
  if fprop.rhs is not None and fprop.rhs.has_trust_mask:
    dw = _trust_masked(dw, rhs, rc, False, fprop, fprop.rhs, key, layer_key)
  return dx, dw, None, None, None


def _backward_specs(s, lhs, rhs):
  """(lhs Spec, rhs Spec, dY's Spec) of the backward GEMMs, or Nones without specs:
  dY is laid out as Fprop's output (shard_local.plan)."""
  if s.specs is None:
    return None, None, None
  lhs_spec, rhs_spec = s.specs
  mesh = shard_local.active_mesh()
  if mesh is None:
    return lhs_spec, rhs_spec, None
  out = shard_local.output_spec(mesh, lhs.shape, rhs.shape, lhs_spec, rhs_spec, s.dims)
  return lhs_spec, rhs_spec, out


def _trust_masked(grad, x, axes, last, gemm: Gemm, spec, key, layer_key):
  """QuEST's trust estimator (fp4jax.numerics.quest): grad (x's layout) with the
  gradient of every element that Fprop's quantization of x clipped zeroed, in
  the layout and rotation in which Fprop quantized x, i.e.
  P^T(clip_mask(P x) * P grad) with P = flatten `axes` (`last` as in _gemm),
  pad and rotate (orthonormal, so P^T undoes it)."""
  fkey = _role_key(key, 0)
  signs = rotation_signs(gemm.hadamard, None if fkey is None else jax.random.fold_in(fkey, 2),
                         _role_key(layer_key, 0))
  axis = _flatten(x, axes, last)[1]

  def to_quantized_layout(t):
    return operand.rotate_padded(_flatten(t, axes, last)[0], gemm.hadamard, signs, axis)

  xr, pull = jax.vjp(to_quantized_layout, x)
  mask = formats.clip_mask(xr, spec, axis)
  return pull(to_quantized_layout(grad) * mask.astype(grad.dtype))[0]


_qdot.defvjp(_fwd, _bwd)


def check(recipe: Recipe):
  """Raises ValueError (one line) when the installed jax cannot run the recipe's
  backend or native route (fp4jax.backends.check_recipe); dot_general asks it."""
  backends.check_recipe(recipe)


def dot_general(recipe: Recipe, switch_wgrad_to: Gemm | None = None):
  """The recipe's quantized drop-in for jax.lax.dot_general.

  Returns fn(lhs, rhs, dimension_numbers, precision=None,
  preferred_element_type=None, out_sharding=None, key=None, layer_key=None,
  wgrad_switched=None, specs=None) -> array with lax.dot_general's output shape and
  dtype.
  `key` (a PRNG key, fresh per call) is required when recipe.is_random and
  ignored otherwise; `layer_key` (a PRNG key, the layer's own, the same every
  step) is required when recipe.needs_layer_key (per-layer Hadamard signs)
  and ignored otherwise. `wgrad_switched` (a boolean scalar, may be traced)
  needs `switch_wgrad_to`, a deterministic Gemm: where true, Wgrad is
  computed with it instead of recipe.wgrad (None: recipe.wgrad, no
  lax.cond). `specs` (lhs PartitionSpec, rhs PartitionSpec) over the current
  mesh: how the operands are sharded, so that a kernel backend runs per shard
  (module docstring, "Sharding"; ignored without a mesh of several devices).
  A recipe that neither quantizes nor rotates (e.g. "bf16") is
  lax.dot_general with the caller's arguments (bitwise, gradients included;
  `key`, `layer_key`, `wgrad_switched` ignored), unless its plain_route is
  "float32_output" (module docstring, "Plain GEMMs").
  """
  if not isinstance(recipe, Recipe):
    raise TypeError(f"dot_general takes a Recipe, e.g. fp4jax.recipe('mxfp4-dh16'); "
                    f"got {recipe!r}")
  if switch_wgrad_to is not None and (switch_wgrad_to.is_random
                                      or switch_wgrad_to.needs_layer_key):
    raise ValueError(f"switch_wgrad_to must be a deterministic Gemm, got {switch_wgrad_to!r}")
  if switch_wgrad_to is not None and recipe.residuals == "quantized":
    raise ValueError(f"recipe {recipe.name!r} saves quantized residuals (the Wgrad lhs in "
                     "its FP4 form); switch_wgrad_to needs residuals='original'")
  check(recipe)
  if recipe.is_plain:
    return functools.partial(_plain, recipe)

  def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
         out_sharding=None, key=None, layer_key=None, wgrad_switched=None, specs=None):
    if recipe.is_random and key is None:
      raise ValueError(f"recipe {recipe.name!r} is random (stochastic rounding or per-step "
                       "Hadamard signs) and needs key=")
    if recipe.needs_layer_key and layer_key is None:
      raise ValueError(f"recipe {recipe.name!r} uses per-layer Hadamard signs and needs "
                       "layer_key= (the layer's key, the same every step)")
    if wgrad_switched is not None and switch_wgrad_to is None:
      raise ValueError("wgrad_switched= needs dot_general(recipe, switch_wgrad_to=gemm)")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    s = _static(recipe, lhs, rhs, dimension_numbers, precision, preferred_element_type,
                out_sharding, switch_wgrad_to, specs)
    if wgrad_switched is not None:
      wgrad_switched = jnp.asarray(wgrad_switched, jnp.bool_)
    return _qdot(s, lhs, rhs, key if recipe.is_random else None,
                 layer_key if recipe.needs_layer_key else None, wgrad_switched)

  return fn


def _static(recipe, lhs, rhs, dimension_numbers, precision, preferred_element_type,
            out_sharding, switch_wgrad_to=None, specs=None):
  """The _Static of one call: every dim non-negative (_axes), the output dtype
  preferred_element_type or the operands' result type, specs as shard_local Specs."""
  (lc, rc), (lb, rb) = dimension_numbers
  dims = ((_axes(lc, lhs, "lhs"), _axes(rc, rhs, "rhs")),
          (_axes(lb, lhs, "lhs"), _axes(rb, rhs, "rhs")))
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
  if specs is not None:
    if len(specs) != 2:
      raise ValueError(f"specs= takes (lhs spec, rhs spec), got {specs!r}")
    specs = (shard_local.normalize(specs[0], lhs.ndim, "lhs"),
             shard_local.normalize(specs[1], rhs.ndim, "rhs"))
  return _Static(recipe, dims, precision, out_dtype, out_sharding, switch_wgrad_to, specs)


def _axes(dims, x, name):
  """dims of x as non-negative ints; an out-of-range dim raises ValueError."""
  if any(not -x.ndim <= d < x.ndim for d in dims):
    raise ValueError(f"dimension numbers {tuple(dims)} out of range for {name} of shape "
                     f"{x.shape}")
  return tuple(d % x.ndim for d in dims)


def _plain_gemm(a, b, dims, route, precision, out_dtype, out_sharding):
  """An unquantized GEMM lax.dot_general(a, b, dims) -> out_dtype, by Recipe.plain_route:
  directly ("lax") or as a float32-output dot rounded once ("float32_output")."""
  if route == "lax":
    return lax.dot_general(a, b, dims, precision, out_dtype, out_sharding=out_sharding)
  y = lax.dot_general(a, b, dims, precision, jnp.float32, out_sharding=out_sharding)
  return backends.fence_dot_output(y, jnp.result_type(a, b)).astype(out_dtype)


def _plain(recipe, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
           out_sharding=None, key=None, layer_key=None, wgrad_switched=None, specs=None):
  """dot_general of a recipe that neither quantizes nor rotates: lax.dot_general with
  the caller's arguments (plain_route "lax"), or its three GEMMs through
  _plain_gemm in the custom_vjp. `key`, `layer_key`, `wgrad_switched`, `specs` are
  accepted and unused (XLA partitions these GEMMs)."""
  del key, layer_key, wgrad_switched, specs
  if recipe.plain_route == "lax":
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                           out_sharding=out_sharding)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  s = _static(recipe, lhs, rhs, dimension_numbers, precision, preferred_element_type,
              out_sharding)
  return _qdot(s, lhs, rhs, None, None, None)


def xla_bf16_gemm():
  """The dtype the xla backend's GEMMs of bf16 values run in on this process's
  device, and why (fp4jax.backends.xla.bf16_gemm): what a run records."""
  return backends.module("xla").bf16_gemm()
