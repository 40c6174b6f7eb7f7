"""Every GEMM of a traced program and where its operands come from, read from its jaxpr.

`gemms(closed_jaxpr, input_names)` walks a jaxpr (jax.make_jaxpr of a train
step) and every jaxpr nested in it (jit, scan, while, cond, remat,
custom_jvp/custom_vjp calls, shard_map) and returns one `Gemm` per
dot_general that is not a Hadamard rotation, with its FLOPs (times the trip
count of the scans around it) and, per operand, what the dataflow says it is:

  quant     the QuantSpecs of the quantizers whose outputs reach the operand
            (every operation fp4jax.numerics.formats runs to quantize carries
            the name scope formats.QUANTIZE_SCOPE + repr(spec)), or a Kernel
            for a quantizer kernel (a pallas_call, whose format the trace
            does not show);
  raw       True when data also reaches it without passing a quantizer
            (an unquantized operand: quant empty, raw True);
  rotations the Hadamard rotations on its way: (block, signs) per rotation,
            signs "none" (a matrix without random bits), "per-step" (random
            signs whose key depends on the step counter), "per-layer" (a key
            that went through fold_in, as a Flax rng stream's per-module key
            does, but not the step) or "fixed" (neither: jax.random.key(seed));
  data      what it is computed from, quantizers and rotations seen through:
            parameters by name, other GEMMs by label (`role` matches the
            backward GEMMs to the forward one by it).

A rotation followed by its inverse (the same block and signs: QuEST's
trust mask is applied in the rotated layout and rotated back) cancels. A
boolean value (a comparison, a mask) and a scalar factor of a larger value
(NVFP4's global scale on a GEMM's output) carry no data.

A rotation is a dot_general contracting one axis of a power-of-two length of
at most MAX_ROTATION (GEMM_PRIMITIVES: the native backend's block-scaled
GEMMs count as GEMMs) against a [b, b] (or [p, b, b]) matrix built from
constants and keys only. Nothing here runs the program.
"""

import ast
import dataclasses
import functools
import math
import re

import jax.extend as jex

from fp4jax.numerics import formats

MAX_ROTATION = 256
# GEMM primitives: XLA's dot, and the block-scaled GEMMs of the native backend
# (operands [B, M, K] x [B, N, K]).
GEMM_PRIMITIVES = ("dot_general", "scaled_dot", "scaled_matmul_wrapper")
_SCALED_DIMS = (((2,), (2,)), ((0,), (0,)))
# A GEMM kernel's name (fp4jax.kernels.hopper_gemm: fp4jax_hopper_gemm_MxNxK).
_KERNEL_GEMM = re.compile(r"gemm_(\d+)x(\d+)x(\d+)")
# Primitives whose i-th output is their i-th input.
_PASS_THROUGH = ("optimization_barrier",)
# Primitives that draw or handle random bits: keys carry no data.
_PRNG = {"random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
         "random_split", "threefry2x32", "random_clone"}
_SPEC = re.compile(re.escape(formats.QUANTIZE_SCOPE) + r"QuantSpec\(([^()]*)\)")
_FIELD = re.compile(r"(\w+)=('[^']*'|[^,]+)")
_BLOCK = re.compile(r"block_(\d+)")


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A quantizer kernel (a pallas_call): its format is set inside the kernel, where
  the trace does not show it."""
  name: str


@dataclasses.dataclass(frozen=True)
class Operand:
  """What one operand of a GEMM is made of (module docstring)."""
  dtype: str
  quant: frozenset
  raw: bool
  rotations: frozenset
  data: frozenset


@dataclasses.dataclass
class Gemm:
  """One GEMM of the program.

  path: the Flax module path ("block_0/attn/q", "head", "block_1/attn": the
  scope the GEMM ran in, without the DotGeneral module); backward: it ran in
  the transposed (gradient) part; recomputed: a forward GEMM that remat runs
  again in the backward; flops: 2 * M * N * K times the enclosing scans'
  lengths (0 in a cond branch other than the first); label: path#shape, how
  the `data` of other operands name it; lhs, rhs: Operands; out_dtype; prim:
  the primitive; alternative: it lies in a cond branch other than the first
  (the adaptive Wgrad switch's).
  """
  path: str
  backward: bool
  recomputed: bool
  flops: int
  label: str
  lhs: Operand
  rhs: Operand
  out_dtype: str
  prim: str
  alternative: bool = False


@dataclasses.dataclass(frozen=True)
class _Value:
  """A value of the program: what reaches it through the dataflow."""
  quant: frozenset = frozenset()      # QuantSpecs whose quantizer outputs reach it
  raw: frozenset = frozenset()        # data reaching it outside quantizers
  data: frozenset = frozenset()       # data, quantizers seen through
  rotations: frozenset = frozenset()
  prng: bool = False                  # random bits reach it
  step: bool = False                  # the step-dependent inputs reach it
  folded: bool = False                # a key fold_in (a stream or layer key) reaches it


_CONST = _Value()


def _union(values):
  """The _Value of a result computed from `values`."""
  values = list(values)
  if len(values) == 1:
    return values[0]
  out = {}
  for field in ("quant", "raw", "data", "rotations"):
    sets = [getattr(v, field) for v in values]
    out[field] = frozenset().union(*sets) if any(sets) else frozenset()
  return _Value(**out, prng=any(v.prng for v in values), step=any(v.step for v in values),
                folded=any(v.folded for v in values))


def spec_of_scope(name_stack: str):
  """The QuantSpec named by the innermost quantizer scope of a name stack, or None."""
  found = _SPEC.findall(name_stack)
  return _spec(found[-1]) if found else None


@functools.lru_cache(maxsize=None)
def _spec(fields: str):
  """QuantSpec(**fields) of the text inside a QuantSpec repr."""
  return formats.QuantSpec(**{k: ast.literal_eval(v.strip()) for k, v in _FIELD.findall(fields)})


def _scopes(name_stack):
  """The scope names of a NameStack, transforms left out."""
  return [s.name for s in name_stack.stack if type(s).__name__ == "Scope"]


def module_path(name_stack) -> str:
  """The Flax module path of a GEMM's name stack: from the block (or "head")
  on, up to the DotGeneral module, without the quantizer scopes and remat's."""
  names = [n for n in _scopes(name_stack)
           if not n.startswith(formats.QUANTIZE_SCOPE) and n != "rematted_computation"]
  for i, n in enumerate(names):
    if _BLOCK.fullmatch(n) or n in ("blocks", "head", "embed"):
      names = names[i:]
      break
  else:
    names = [n for n in names if n not in ("Llama",)]
  for i, n in enumerate(names):  # the scopes inside the DotGeneral module are its own
    if n.startswith("DotGeneral"):
      names = names[:i]
      break
  return "/".join(names) or "(top level)"


def _dims(eqn):
  return eqn.params.get("dimension_numbers", _SCALED_DIMS)


def _is_rotation(eqn, values):
  """The Hadamard block b when the GEMM eqn is a rotation (module docstring)."""
  (lc, rc), _ = _dims(eqn)
  if len(lc) != 1:
    return None
  for m_index, contracted in ((0, lc[0]), (1, rc[0])):
    shape = eqn.invars[m_index].aval.shape
    b = shape[contracted]
    if (len(shape) >= 2 and shape[-1] == shape[-2] == b and b <= MAX_ROTATION
        and b & (b - 1) == 0 and not values[m_index].data and not values[m_index].quant):
      return b, m_index
  return None


def _flags_only(value):
  """A scalar input of an eqn with a larger output (a per-tensor factor such as
  NVFP4's global scale on a GEMM's output): it scales the data, it is not data."""
  return dataclasses.replace(value, quant=frozenset(), raw=frozenset(), data=frozenset(),
                             rotations=frozenset())


def _is_mask(var):
  """A boolean value (a comparison, a clip or causal mask) selects data; it is not data."""
  return str(getattr(var.aval, "dtype", "")) == "bool"


def _signs(matrix: _Value) -> str:
  if not matrix.prng:
    return "none"
  if matrix.step:
    return "per-step"
  return "per-layer" if matrix.folded else "fixed"


def _flops(eqn):
  (lc, rc), (lb, rb) = _dims(eqn)
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
  return 2 * math.prod(lhs) * math.prod(rhs_free)


def _operand(value, aval):
  return Operand(str(aval.dtype), value.quant, bool(value.raw), value.rotations, value.data)


class _Walker:
  """Walks a jaxpr and its sub-jaxprs, giving every value a _Value, collecting Gemms."""

  def __init__(self):
    self.gemms = []
    self._followed = {}

  def followed(self, jaxpr):
    """Whether a nested jaxpr holds a GEMM or a quantizer (then it is walked)."""
    key = id(jaxpr)
    if key not in self._followed:
      self._followed[key] = any(
          e.primitive.name in GEMM_PRIMITIVES
          or formats.QUANTIZE_SCOPE in str(e.source_info.name_stack)
          or any(self.followed(_open(j)) for j in jex.core.jaxprs_in_params(e.params))
          for e in jaxpr.eqns)
    return self._followed[key]

  def run(self, jaxpr, env, stack, weight, alternative=False):
    """Walks `jaxpr` with its invars (and constvars) bound in env; returns its outputs' values."""
    read = lambda v: env.get(v, _CONST) if not isinstance(v, jex.core.Literal) else _CONST
    for eqn in jaxpr.eqns:
      full = eqn.source_info.name_stack if stack is None else stack + eqn.source_info.name_stack
      ins = [read(v) for v in eqn.invars]
      if any(v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape")):
        ins = [_flags_only(x) if not getattr(v.aval, "shape", ()) else x
               for x, v in zip(ins, eqn.invars)]
      subs = [_open(j) for j in jex.core.jaxprs_in_params(eqn.params)]
      if eqn.primitive.name == "pallas_call":
        outs = [self._kernel(eqn, ins, full, weight, alternative)] * len(eqn.outvars)
      elif subs and any(self.followed(j) for j in subs) and not _quantizer(full):
        outs = self._nested(eqn, subs, ins, full, weight, alternative)
      elif eqn.primitive.name in _PASS_THROUGH:
        outs = ins
      else:
        outs = [self._value(eqn, ins, full, weight, alternative)] * len(eqn.outvars)
      for var, value in zip(eqn.outvars, outs):
        env[var] = _flags_only(value) if _is_mask(var) else value
    return [read(v) for v in jaxpr.outvars]

  def _nested(self, eqn, subs, ins, stack, weight, alternative):
    """The outputs of an eqn holding jaxprs with GEMMs or quantizers, walking them."""
    name, params = eqn.primitive.name, eqn.params
    if name == "cond":
      outs = [self.run(j, dict(zip(j.invars, ins[1:])), stack, weight if i == 0 else 0,
                       alternative or i > 0) for i, j in enumerate(subs)]
      return [_union(vs) for vs in zip(*outs)]
    if name == "while":
      body = _open(params["body_jaxpr"])
      carry = ins[params["cond_nconsts"]:]
      return self.run(body, dict(zip(body.invars, carry)), stack, weight, alternative)
    if len(subs) == 1 and len(subs[0].invars) == len(ins):
      inner = subs[0]
      times = params.get("length", 1) if name == "scan" else 1
      return self.run(inner, dict(zip(inner.invars, ins)), stack, weight * times, alternative)
    raise NotImplementedError(f"cannot follow the GEMMs or quantizers inside {name!r}")

  def _value(self, eqn, ins, stack, weight, alternative):
    name = eqn.primitive.name
    spec = _quantizer(stack)
    if spec is not None:  # inside a quantizer: its output is quantized data
      merged = _union(ins)
      return dataclasses.replace(merged, quant=frozenset({spec}), raw=frozenset())
    if name in _PRNG:
      return dataclasses.replace(_union(ins) if ins else _CONST, prng=True,
                                 folded=name == "random_fold_in" or any(v.folded for v in ins),
                                 raw=frozenset(), data=frozenset(), quant=frozenset())
    if name not in GEMM_PRIMITIVES:
      return _union(ins) if ins else _CONST
    rotation = _is_rotation(eqn, ins)
    if rotation is not None:
      block, m = rotation
      x = ins[1 - m]
      return dataclasses.replace(x, rotations=x.rotations ^ {(block, _signs(ins[m]))})
    return self._gemm(eqn, ins, stack, weight, alternative)

  def _kernel(self, eqn, ins, stack, weight, alternative):
    """A pallas_call: a GEMM kernel (named *_gemm_MxNxK, fp4jax.kernels.hopper_gemm)
    or a quantizer kernel (fp4jax.kernels.quantize)."""
    name = str(eqn.params.get("name") or eqn.params.get("name_and_src_info", "kernel"))
    gemm = _KERNEL_GEMM.search(name)
    if gemm:
      m, n, k = map(int, gemm.groups())
      return self._gemm(eqn, ins, stack, weight, alternative, flops=2 * m * n * k,
                        prim=f"pallas_call {name}")
    merged = _union(ins)
    return dataclasses.replace(merged, quant=frozenset({Kernel(name)}), raw=frozenset())

  def _gemm(self, eqn, ins, stack, weight, alternative, flops=None, prim=None):
    scopes = _scopes(stack)
    path = module_path(stack)
    label = f"{path}#{eqn.invars[0].aval.shape}x{eqn.invars[1].aval.shape}"
    recomputed = "rematted_computation" in scopes
    backward = not recomputed and any(type(s).__name__ == "Transform" and s.name == "transpose"
                                      for s in stack.stack)
    self.gemms.append(Gemm(
        path=path, backward=backward, recomputed=recomputed,
        flops=(_flops(eqn) if flops is None else flops) * weight,
        label=label, lhs=_operand(ins[0], eqn.invars[0].aval),
        rhs=_operand(ins[1], eqn.invars[1].aval), out_dtype=str(eqn.outvars[0].aval.dtype),
        prim=prim or eqn.primitive.name, alternative=alternative))
    # The output is new data: later operands name this GEMM (forward GEMMs by a
    # label that remat's recomputation shares).
    tag = frozenset({("gemm", label, backward)})
    return _Value(raw=tag, data=tag)


def _open(jaxpr):
  return getattr(jaxpr, "jaxpr", jaxpr)


def _quantizer(stack):
  """The QuantSpec of the quantizer scope `stack` lies in, or None."""
  text = str(stack)
  return spec_of_scope(text) if formats.QUANTIZE_SCOPE in text else None


def gemms(closed, input_names, step_inputs=()):
  """The Gemms of a ClosedJaxpr (module docstring), in program order.

  input_names: a name per invar (a parameter's path names it in `data`);
  step_inputs: the names of the inputs that change from step to step other
  than data (the step counter), whose reach marks per-step signs.
  """
  walker = _Walker()
  jaxpr = closed.jaxpr
  env = {}
  for var, name in zip(jaxpr.invars, input_names):
    if name in step_inputs:
      env[var] = _Value(step=True)
    else:
      tag = frozenset({("input", name)})
      env[var] = _Value(raw=tag, data=tag)
  walker.run(jaxpr, env, None, 1)
  return walker.gemms
