"""The cast rules: one function per category and per special case, in one ``RuleSet``.

Every rule takes ``(eqn, env, ctx)`` and returns an ``Applied``: the eqn's outputs, the
``Ruling`` that says which rule decided (``explain`` reads it as data), and the values the
primitive was bound on. ``rule_set`` gathers them; ``RuleSet.dispatch`` picks an eqn's:

* ``kept`` for eqns in kept regions (an inner autocast, ``autocast_disabled()``);
* the higher-order rules (``higher_order.py``), which rewrite bodies, made rules by ``rewriting``;
* ``traced_dtypes`` for dtype-sensitive and unknown primitives (``keeps_dtypes``);
* inside an op call (``env.call``), ``IN_OP_RULES`` by primitive or ``op_entry``: the values
  entering the call are cast by the op's category, and inside it everything runs natively;
* outside, ``PRIMITIVE_RULES`` by primitive or ``by_category``, casting by the category the
  policy table gives the primitive (``CAST_TARGETS``).

What the rules learn about values (a low-precision matmul's output, a weak scalar) is recorded
after the bind, in one place: ``record_facts``.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import compat
from jaxamp._src.autocast import casting, dataflow, fp8, op_calls, weight_grads
from jaxamp._src.autocast.context import Context, Env, Rule, RuleSet
from jaxamp._src.policies.policy import Policy
from jaxamp._src.policies.table import LOW_DTYPES, NO_16_BIT_KERNELS, Category

prims = compat.primitives


FLOAT32 = jnp.dtype(jnp.float32)


class Decider(enum.Enum):
  """The rule that decided an eqn's dtypes (``explain`` reads it as data)."""

  KEPT = "kept"
  TRACED_DTYPES = "traced dtypes (unknown or dtype-sensitive primitive)"
  HIGHER_ORDER = "higher-order: body rewritten"
  WEAK_SCALAR = "native: a Python scalar follows the other operand"
  PROMOTION = "native: jnp's promotion to the traced common dtype, redone by its consumer"
  BIAS_ADD = "lower: bias add of a low-precision dot/conv"
  EXPLICIT_PRECISION = "explicit precision=: runs in the traced dtypes"
  FP8 = "float8: operands quantized with dynamic scales"
  CATEGORY = "the category of the primitive"
  OP = "the category of the op region"


class Ruling(NamedTuple):
  """Which rule decided an eqn's dtypes.

  Attributes:
    rule: the rule.
    category: the category applied, where one was.
    op: the op region the eqn belongs to, for eqns inside an op call.
  """

  rule: Decider
  category: Category | None = None
  op: str | None = None

  def describe(self) -> str:
    """One line for ``explain``'s table: "lower", "op softmax: float32", "kept", ..."""
    if self.rule is Decider.CATEGORY:
      return self.category.value
    if self.rule is Decider.OP:
      return f"op {self.op}: {self.category.value}"
    return self.rule.value


class Applied(NamedTuple):
  """What a rule did: the outputs, its ruling and the values the primitive was bound on."""

  outs: list[Any]
  ruling: Ruling
  ran_on: list[Any]


# --- which primitives keep their traced dtypes ---------------------------------------------------

# Primitives whose meaning depends on their input dtypes: they always get the traced ones back.
KEEP_DTYPES = frozenset(
  {
    prims.bitcast_convert_type_p,
    prims.reduce_p,
    prims.reduce_window_p,
    prims.select_and_scatter_p,
    prims.select_and_gather_add_p,
    prims.pure_callback_p,
    prims.io_callback_p,
    prims.ffi_call_p,
    prims.run_state_p,
    prims.random_gamma_p,  # jax.random.gamma samples in float32 whatever dtype alpha has
  }
)
# The same for primitives of optional backends JAX exports no object for (Pallas, Mosaic).
KEEP_DTYPES_BY_NAME = frozenset({"pallas_call", "mosaic_gpu_call", "tpu_custom_call"})

# Primitives with a scalar combiner jaxpr typed like the operand, re-typed after a cast.
COMBINER_PARAM = {
  prims.scatter_add_p: "update_jaxpr",
  prims.scatter_mul_p: "update_jaxpr",
  prims.scatter_min_p: "update_jaxpr",
  prims.scatter_max_p: "update_jaxpr",
  prims.scatter_p: "update_jaxpr",
}

# Primitives that compute in the low dtype: their outputs are ``lowered`` (a bias added to them
# stays low), and inside a LOWER op everything they read is cast.
MATMULS = frozenset({prims.dot_general_p, prims.conv_general_dilated_p, prims.ragged_dot_general_p})
# Matmuls whose jaxpr records no ``preferred_element_type`` unless the caller passed one.
RESULT_TYPE_UNSET_BY_DEFAULT = frozenset({prims.conv_general_dilated_p, prims.ragged_dot_general_p})


# Arithmetic and comparisons with a Python scalar: torch computes them in float32 ("opmath")
# and rounds the result to the 16-bit dtype. A scalar that fits the 16-bit dtype gives the same
# answer in it; one that does not (``x * 1e5`` in float16) makes the op compute in float32.
SCALAR_OPMATH = frozenset(
  {
    prims.add_p,
    prims.sub_p,
    prims.mul_p,
    prims.div_p,
    prims.rem_p,
    prims.pow_p,
    prims.max_p,
    prims.min_p,
    prims.clamp_p,
    prims.atan2_p,
    prims.nextafter_p,
    prims.lt_p,
    prims.le_p,
    prims.gt_p,
    prims.ge_p,
    prims.eq_p,
    prims.ne_p,
  }
)


# Primitives that map each operand to its own result (sorting keys and values together, or a
# barrier, or a transfer): an operand that shared a dtype with another when traced need not now.
# Every other primitive gets operands equal-typed when traced equal-typed again.
INDEPENDENT_OPERANDS = frozenset({prims.optimization_barrier_p, prims.sort_p, prims.device_put_p})


def keeps_dtypes(eqn) -> bool:
  """Listed primitives, and unknown ones carrying jaxprs, callables or avals, keep their dtypes
  (the higher-order primitives with rules of their own are dispatched before this is asked)."""
  if eqn.primitive in KEEP_DTYPES or eqn.primitive.name in KEEP_DTYPES_BY_NAME:
    return True
  if eqn.primitive in COMBINER_PARAM:
    return False
  return any(
    compat.is_typed_param(item)
    for value in eqn.params.values()
    for item in (value if isinstance(value, tuple | list) else (value,))
  )


# --- the categories ------------------------------------------------------------------------------

# A category's cast target: (the eqn, which of its inputs to cast, env, policy) -> the dtype
# the selected eligible floats are cast to, or None to run on the incoming dtypes.
CastTarget = Callable[[Any, Sequence[bool], "Env", Policy], np.dtype | None]


def _lower_target(eqn, floats, env, policy) -> np.dtype | None:
  if any(
    not casting.is_eligible(env.dtype(a)) and jnp.issubdtype(env.dtype(a), jnp.inexact)
    for a in eqn.invars
  ):
    return None  # float64 or complex operands: not eligible, as in torch; the op runs as written
  return policy.dtype


def _float32_target(eqn, floats, env, policy) -> np.dtype:
  return jnp.dtype(jnp.float32)


def _promote_target(eqn, floats, env, policy) -> np.dtype | None:
  """The widest floating tensor operand's dtype, as torch's ``prioritize``: 0-dim tensors count;
  Python scalars, converted booleans and integers, and fills standing for scalars do not."""
  facts = env.facts
  strong = [
    env.dtype(a)
    for i, (a, f) in enumerate(zip(eqn.invars, floats, strict=True))
    if f and (facts.is_zero_dim_tensor(a) or not facts.follows_partner(eqn, i))
  ]
  return casting.widest(strong) if strong else None


def _native_target(eqn, floats, env, policy) -> None:
  return None


CAST_TARGETS: dict[Category, CastTarget] = {
  Category.LOWER: _lower_target,
  Category.FLOAT32: _float32_target,
  Category.FLOAT32_INSIDE: _float32_target,
  Category.PROMOTE: _promote_target,
  Category.NATIVE: _native_target,
  Category.FORBIDDEN: _native_target,  # raised on entering the op (``op_entry``)
}


def cast_inputs(
  category: Category,
  eqn,
  env: Env,
  policy: Policy,
  select: Sequence[bool] | None = None,
  cast_to: np.dtype | None = None,
  saturate: Sequence[bool] | None = None,
) -> list:
  """The eqn's input values, the selected eligible floating ones cast as ``category`` says
  (to ``cast_to`` whatever the category, when given); those flagged in ``saturate`` keep
  finite values finite."""
  atoms = eqn.invars
  select = [True] * len(atoms) if select is None else select
  floats = [s and casting.is_eligible(env.dtype(a)) for a, s in zip(atoms, select, strict=True)]
  target = cast_to if cast_to is not None else CAST_TARGETS[category](eqn, floats, env, policy)
  if target is None:
    return [env.read(a) for a in atoms]
  saturate = [False] * len(atoms) if saturate is None else saturate
  return [
    env.cast(a, target, saturate=s) if f else env.read(a)
    for a, f, s in zip(atoms, floats, saturate, strict=True)
  ]


def primitive_category(eqn, policy: Policy) -> Category:
  """The category the policy table gives the eqn's primitive (or its variant, if listed)."""
  return policy.primitive_category(eqn.primitive, _variant(eqn))


# jnp functions whose product of two vectors is torch's einsum or linalg_vecdot (lower
# precision), not its dot: their frames are in the product's traceback. ``jnp.dot``, ``vdot``,
# ``matmul`` and ``inner`` are inlined jits that leave none, so their vector products are dots.
EINSUM_CODES = frozenset({inspect.unwrap(jnp.einsum).__code__})
VECTOR_MATMUL_CODES = EINSUM_CODES | {inspect.unwrap(jnp.linalg.vecdot).__code__}


def _sums_nothing(eqn) -> bool:
  """Whether a dot_general contracts no dims of more than one entry: torch's einsum takes a
  summed index of size one as a broadcast (``einsum("bi,ik->bk")`` with ``i`` of size 1 is a
  ``mul``)."""
  lhs_contract = eqn.params["dimension_numbers"][0][0]
  return all(eqn.invars[0].aval.shape[d] == 1 for d in lhs_contract)


def _variant(eqn) -> str | None:
  """A finer key for primitives whose torch op depends on how they are used."""
  primitive = eqn.primitive
  if primitive is prims.div_p:
    numerator = eqn.invars[0]
    if not numerator.aval.shape and (compat.is_literal(numerator) or numerator.aval.weak_type):
      return "rdiv"  # python_scalar / tensor: torch's __rdiv__ / __rtruediv__
  if (
    primitive is prims.dot_general_p
    and _sums_nothing(eqn)
    and compat.traced_inside(eqn, EINSUM_CODES)
  ):
    return "elementwise"  # an einsum summing over no index: torch's composite einsum's mul
  if (
    primitive is prims.dot_general_p
    and all(atom.aval.ndim == 1 for atom in eqn.invars)
    and not compat.traced_inside(eqn, VECTOR_MATMUL_CODES)
  ):
    return "vector"  # vector . vector: torch's dot / vdot, not mm
  if primitive in op_calls.WINDOW_REDUCTIONS:
    return op_calls.pooling_variant(op_calls.windowed_dims(eqn))  # avg_pool3d, max_pool3d
  return None


# --- rules for eqns outside op calls -------------------------------------------------------------


def kept(eqn, env: Env, ctx: Context) -> Applied:
  """A kept region's eqn runs as written: on its inputs in their traced dtypes. In a
  custom_vjp's backward (``ctx.recomputed``), natively on its inputs as they come (what the
  forward saved, cotangents in the outputs' dtypes), as torch runs a custom ``backward`` with
  autocast off: what it recomputes from the residuals it computes as the forward did. Linear
  algebra and FFTs, which have no 16-bit kernels, run in float32 there as everywhere."""
  if ctx.recomputed is None or keeps_dtypes(eqn):
    return _bind_traced(eqn, env, Ruling(Decider.KEPT))
  if eqn.primitive in NO_16_BIT_KERNELS:
    invals = cast_inputs(Category.FLOAT32, eqn, env, ctx.policy)
  else:
    invals = [env.read(a) for a in eqn.invars]
  outs, ran_on = bind_native(eqn, env, invals)
  return Applied(outs, Ruling(Decider.KEPT), ran_on)


def traced_dtypes(eqn, env: Env, ctx: Context) -> Applied:
  """A dtype-sensitive or unknown primitive runs on its inputs in their traced dtypes."""
  ruling = op_ruling(env.call) if env.call is not None else Ruling(Decider.TRACED_DTYPES)
  return _bind_traced(eqn, env, ruling)


def _bind_traced(eqn, env: Env, ruling: Ruling) -> Applied:
  """Binds ``eqn`` on its inputs cast back to the dtypes they had when traced."""
  invals = [
    env.cast(a, a.aval.dtype)
    if casting.is_eligible(getattr(a.aval, "dtype", None))
    else env.read(a)
    for a in eqn.invars
  ]
  return Applied(compat.bind(eqn, invals), ruling, invals)


def by_category(eqn, env: Env, ctx: Context) -> Applied:
  """Casts the eqn's inputs as its primitive's category says, and binds it natively."""
  category = primitive_category(eqn, ctx.policy)
  outs, ran_on = bind_native(eqn, env, cast_inputs(category, eqn, env, ctx.policy))
  if category is Category.FLOAT32_INSIDE:
    outs = _in_input_dtype(eqn, env, outs)
  return Applied(outs, Ruling(Decider.CATEGORY, category), ran_on)


def _in_input_dtype(eqn, env: Env, outs: list) -> list:
  """A FLOAT32_INSIDE primitive's float32 results in the widest floating dtype its inputs had
  (a bare ``lax.reduce_sum`` of bfloat16 is torch's ``sum``: float32 inside, bfloat16 out)."""
  entering = [env.dtype(a) for a in eqn.invars if casting.is_eligible(env.dtype(a))]
  if not entering:
    return outs
  dtype = casting.widest(entering)
  return [casting.as_dtype(out, dtype) if _is_float32(out) else out for out in outs]


def _is_float32(value) -> bool:
  return compat.typeof(value).dtype == FLOAT32


def _convert(eqn, env: Env, ctx: Context) -> Applied:
  """A Python scalar made concrete inside a jit (``jnp.where(x, y, 0.0)``, ``jnp.clip(x, 0)``):
  the dtype it was traced to is its partner's, which autocast may change; it stays weak. jnp's
  promotion of a 16-bit value to float32 (``x_bf16 + x @ w``, traced with a float32 product) is
  redone by its consumer on the dtypes autocast gives (``is_implicit_promotion``)."""
  source = eqn.invars[0]
  if _is_16_bit_promotion(eqn):
    value = env.read(source)
    return Applied([value], Ruling(Decider.PROMOTION), [value])
  if not env.facts.is_weak(source):
    return by_category(eqn, env, ctx)
  if eqn.params["new_dtype"] == source.aval.dtype:
    value = env.read(source)
    return Applied([value], Ruling(Decider.WEAK_SCALAR), [value])
  return by_category(eqn, env, ctx)


def _is_16_bit_promotion(eqn) -> bool:
  """A 16-bit value widened by jnp's promotion to the common dtype of the traced operands: the
  operands autocast gives may have another common dtype (torch's ``bf16 + bf16`` is bf16)."""
  source = eqn.invars[0]
  return (
    not compat.is_literal(source)
    and source.aval.dtype in LOW_DTYPES
    and eqn.params["new_dtype"] == FLOAT32
    and compat.is_implicit_promotion(eqn)
  )


def _add(eqn, env: Env, ctx: Context) -> Applied:
  """``dot_or_conv(x, W) + b`` runs in the dot's low dtype, as torch's ``linear(x, W, b)``,
  ``addmm``, ``addmv`` and ``conv`` with a bias do.

  ``b`` is a bias when it is a parameter or constant that the output is not computed with
  (``Provenance.is_added_parameter``: also when the loss penalizes it) and that varies
  along the free dims of one weight operand at most (``dataflow.is_bias_of``), as a linear or
  conv bias varies along the output features: flax's ``Dense`` (a broadcast vector),
  Equinox's ``Linear`` (``W @ x + b``) and ``Conv2d`` (a ``(C, 1, 1)`` bias), under ``vmap``
  too (layout changes in between keep the dot's output). A computed addend is a residual
  (``h + linear(x)``), and an addend with batch or sequence extent (an attention mask) is not
  a bias: both promote, as in torch. The bias is cast saturating: a parameter or constant
  never becomes an infinity it was not.
  """
  a, b = eqn.invars
  if (
    primitive_category(eqn, ctx.policy) is not Category.NATIVE
    or compat.is_literal(a)
    or compat.is_literal(b)
  ):
    return by_category(eqn, env, ctx)
  facts = env.facts
  for out, bias in ((a, b), (b, a)):
    if (
      out in facts.lowered
      and facts.is_added_parameter(bias, out)
      and dataflow.is_bias_of(facts.dims_of(out), facts.dims_of(bias), out.aval.shape)
    ):
      out_dtype, bias_dtype = env.dtype(out), env.dtype(bias)
      if out_dtype != bias_dtype and casting.is_eligible(bias_dtype):
        outs, invals = weight_grads.bias_add(eqn, env, bias, out_dtype)  # a float32 sum
        return Applied(outs, Ruling(Decider.BIAS_ADD, Category.LOWER), invals)
  return by_category(eqn, env, ctx)


def explicit_precision(eqn) -> bool:
  """Whether a matmul's caller asked for more than the default precision (``precision=HIGHEST``
  or ``HIGH``, or a dot algorithm): an explicit request, like a ``dtype=``. The process's
  ``jax_default_matmul_precision``, which JAX records on every matmul given none, is not one:
  torch's ``set_float32_matmul_precision`` leaves autocast's matmuls low."""
  precision = eqn.params.get("precision")
  if precision is None or precision == compat.configured_matmul_precision():
    return False
  parts = precision if isinstance(precision, tuple | list) else (precision,)
  return any(part is not None and part != lax.Precision.DEFAULT for part in parts)


def explicit_result_type(eqn) -> np.dtype | None:
  """The result dtype a matmul's caller chose (``preferred_element_type=``); None for JAX's own.

  A conv or ragged dot records one only when the caller gave it. jnp's dot functions always
  record one, the traced inputs' dtype by default: there only another dtype was chosen.
  """
  preferred = eqn.params.get("preferred_element_type")
  if preferred is None:
    return None
  preferred = jnp.dtype(preferred)
  if eqn.primitive in RESULT_TYPE_UNSET_BY_DEFAULT:
    return preferred
  traced = casting.widest([jnp.dtype(a.aval.dtype) for a in eqn.invars])
  return None if preferred == traced else preferred


def _matmul(eqn, env: Env, ctx: Context) -> Applied:
  """A dot or conv with an explicit ``precision=`` runs in its traced dtypes, as the caller
  asked (diffrax's Runge-Kutta combination uses ``precision=HIGHEST``); others by category."""
  if explicit_precision(eqn):
    return _bind_traced(eqn, env, Ruling(Decider.EXPLICIT_PRECISION))
  if _quantizes(eqn, env, ctx.policy):
    return _fp8_matmul(eqn, env, ctx)
  return by_category(eqn, env, ctx)


def _quantizes(eqn, env: Env, policy: Policy) -> bool:
  """Whether a float8 policy runs this matmul with float8 operands: one of the lower-precision
  list (not a vector dot, which promotes) on float32 or 16-bit operands."""
  return (
    policy.matmul_dtype is not None
    and eqn.primitive in fp8.MATMULS
    and primitive_category(eqn, policy) is Category.LOWER
    and all(casting.is_eligible(env.dtype(a)) for a in eqn.invars)
  )


def _fp8_matmul(eqn, env: Env, ctx: Context) -> Applied:
  """The matmul with float8 operands quantized from their values as they are (a float32
  parameter is not rounded to 16 bits first), its product in the policy's dtype unless the
  caller chose a ``preferred_element_type``."""
  invals = [env.read(a) for a in eqn.invars]
  out_dtype = explicit_result_type(eqn) or ctx.policy.dtype
  outs = fp8.bind(eqn, invals, out_dtype, ctx.policy.gradient_dtype)
  return Applied(outs, Ruling(Decider.FP8, Category.LOWER), invals)


# Special cases outside op calls, by primitive; every other primitive is ``by_category``.
PRIMITIVE_RULES: dict[Any, Rule] = {
  prims.convert_element_type_p: _convert,
  prims.add_p: _add,
  **dict.fromkeys(MATMULS, _matmul),
}


# --- rules for eqns inside an op call ------------------------------------------------------------


def op_entry(eqn, env: Env, ctx: Context) -> Applied:
  """Values entering the op are cast by its category; inside, everything runs natively."""
  return _bind_in_op(eqn, env, entering_op(eqn, env, ctx))


def entering_op(eqn, env: Env, ctx: Context) -> list:
  """The eqn's input values, those entering its op call (``env.call``) cast by the op's category.

  A parameter or constant entering other than as a matmul operand (an attention mask added to
  the scores) is cast saturating, so a ``finfo(float32).min`` stays finite in 16 bits.
  """
  call = env.call
  entering = [not compat.is_literal(a) and env.region.get(a) != call.instance for a in eqn.invars]
  constants = [not env.facts.is_computed(a) for a in eqn.invars]
  return cast_inputs(
    call.category,
    eqn,
    env,
    ctx.policy,
    select=entering,
    cast_to=call.region.cast_to,
    saturate=constants,
  )


def _bind_in_op(eqn, env: Env, invals: list) -> Applied:
  outs, ran_on = bind_native(eqn, env, invals)
  return Applied(outs, op_ruling(env.call), ran_on)


def op_ruling(call: op_calls.OpCall) -> Ruling:
  return Ruling(Decider.OP, call.category, call.row or call.region.name)


def _convert_in_op(eqn, env: Env, ctx: Context) -> Applied:
  """Inside a float32 op, the library's own casts (``jnp.sum``'s upcast-then-restore, an
  identity matrix made in the input's dtype) stay in float32. A caller's ``dtype=`` makes the
  call another op, its ``[dtype]`` variant (``op_calls``), which runs as traced."""
  call, new_dtype = env.call, eqn.params["new_dtype"]
  if call.category is Category.LOWER and _drops_weak_type_only(eqn):
    value = entering_op(eqn, env, ctx)[0]  # a weakly typed slope made strong: no dtype request
    return Applied([value], op_ruling(call), [value])
  if (
    call.category not in (Category.FLOAT32, Category.FLOAT32_INSIDE)
    or call.region.cast_to is not None
    or not casting.is_eligible(new_dtype)
  ):
    return op_entry(eqn, env, ctx)
  source = eqn.invars[0]
  return Applied([env.cast(source, jnp.float32)], op_ruling(call), [env.read(source)])


def _drops_weak_type_only(eqn) -> bool:
  """Whether a convert only makes a weakly typed value strong (``jnp.full((n,), 0.25)`` meeting
  an array): its dtype was the target's when traced."""
  source = eqn.invars[0]
  return source.aval.weak_type and source.aval.dtype == eqn.params["new_dtype"]


# A dot of operands rounded to 16 bits with a float32 result, lowered for XLA:CPU as the float32
# dot of the rounded operands widened (exact), where some 16-bit -> float32 dots have no kernel;
# an operand computed in float32 is rounded inside, so its cotangent stays float32, as in flash
# attention's backward.
accumulating_dot_p = compat.platform_widened_dot("jaxamp_accumulating_dot", "cpu")


def _matmul_in_op(eqn, env: Env, ctx: Context) -> Applied:
  """A low-precision op's own products run low too, not only what enters it; one with an
  explicit ``precision=`` runs in its traced dtypes. In an op whose kernel accumulates in float32
  (``op_calls.ACCUMULATING_OPS``: attention), the product of the 16-bit operands is float32."""
  call = env.call
  if call.category is not Category.LOWER:
    return op_entry(eqn, env, ctx)
  if explicit_precision(eqn) and call.region.cast_to is None:
    return _bind_traced(eqn, env, op_ruling(call))
  invals = cast_inputs(call.category, eqn, env, ctx.policy, cast_to=call.region.cast_to)
  low = {compat.typeof(value).dtype for value in invals}
  if (
    op_calls.accumulates(call)
    and eqn.primitive is prims.dot_general_p
    and explicit_result_type(eqn) is None
    and len(low) == 1
    and low <= set(LOW_DTYPES)
  ):
    return _accumulating_dot(eqn, env, invals, low.pop())
  return _bind_in_op(eqn, env, invals)


def _accumulating_dot(eqn, env: Env, invals: list, low: np.dtype) -> Applied:
  """The float32 dot of ``invals`` (``accumulating_dot_p``): a float32 operand the op computed
  itself (the probabilities) goes in unrounded, as the dot rounds it to ``low``."""
  operands = [
    env.read(a) if env.region.get(a) == env.call.instance and env.dtype(a) == FLOAT32 else value
    for a, value in zip(eqn.invars, invals, strict=True)
  ]
  params = dict(eqn.params, preferred_element_type=FLOAT32)
  dot = lambda lhs, rhs: accumulating_dot_p.bind(lhs, rhs, **params, operand_dtype=low)
  return Applied([compat.bind_like(eqn, dot, operands)], op_ruling(env.call), invals)


def _no_16_bit_kernel_in_op(eqn, env: Env, ctx: Context) -> Applied:
  """Linear algebra runs in float32 inside any op too (svd inside ``jnp.linalg.norm``): it has
  no 16-bit kernel."""
  if (
    env.call.region.cast_to is not None
    or primitive_category(eqn, ctx.policy) is not Category.FLOAT32
  ):
    return op_entry(eqn, env, ctx)
  return _bind_in_op(eqn, env, cast_inputs(Category.FLOAT32, eqn, env, ctx.policy))


# Special cases inside op calls, by primitive; every other primitive is ``op_entry``.
IN_OP_RULES: dict[Any, Rule] = {
  prims.convert_element_type_p: _convert_in_op,
  **dict.fromkeys(MATMULS, _matmul_in_op),
  **dict.fromkeys(NO_16_BIT_KERNELS, _no_16_bit_kernel_in_op),
}


# --- binding -------------------------------------------------------------------------------------


def bind_native(eqn, env: Env, invals: list) -> tuple[list, list]:
  """Binds with inputs that were equal-typed when traced made equal again (widest wins).

  Returns the outputs and the values bound on.
  """
  invals, rounded_to = _equalize(eqn, invals, env)
  params = _matmul_params(eqn, invals)
  combiner = COMBINER_PARAM.get(eqn.primitive)
  if combiner and params.get(combiner) is not None:
    operand_dtype = compat.typeof(invals[0]).dtype
    if operand_dtype != eqn.invars[0].aval.dtype:
      params[combiner] = _retype_combiner(
        params[combiner], params.get("update_consts", ()), operand_dtype
      )
  outs = weight_grads.bind(eqn, env, invals, params)  # float32 grads of cast-down operands
  if rounded_to is not None:
    shift = eqn.primitive in SHIFTS
    outs = [
      _round(out, rounded_to, shift and env.facts.is_selected(var))
      for out, var in zip(outs, eqn.outvars, strict=True)
    ]
  return outs, invals


# A shift by a constant too large for 16 bits that is only ever a ``jnp.where`` branch is a mask's
# fill (Keras's ``where(padding, scores - 1e9, scores)``, whose shift is 65504 where its scores
# are float16 at run time): it saturates, as fills do. A product overflows, as in torch.
SHIFTS = frozenset({prims.add_p, prims.sub_p})


def _round(value, dtype: np.dtype, saturate: bool) -> Any:
  """A float32 result of a scalar op computed in float32, rounded to the 16-bit ``dtype``;
  a mask's fill (``saturate``, ``SHIFTS``) clipped to its range."""
  if compat.typeof(value).dtype != jnp.float32:
    return value  # a comparison's booleans
  return casting.saturating_convert(value, dtype) if saturate else casting.convert(value, dtype)


def _equalize(eqn, invals: list, env: Env) -> tuple[list, np.dtype | None]:
  """Inputs that were equal-typed when traced made equal again, widest winning, and the dtype
  to round the results to where a scalar that does not fit the 16-bit dtype made the op compute
  in float32 (``SCALAR_OPMATH``); None otherwise.

  ``INDEPENDENT_OPERANDS`` do not compute with their operands together: theirs keep their dtypes.
  A library's primitive keeps its Python scalars as it was given them (K-FAC reads its loss
  tags' weights back from the jaxpr).
  """
  if eqn.primitive in INDEPENDENT_OPERANDS:
    return invals, None
  rounded_to = None
  groups: dict[np.dtype, list[int]] = {}
  library = not compat.is_jax_primitive(eqn.primitive)
  for i, atom in enumerate(eqn.invars):
    if library and compat.is_literal(atom):
      continue
    traced = atom.aval.dtype
    if casting.is_eligible(traced) and casting.is_eligible(compat.typeof(invals[i]).dtype):
      groups.setdefault(traced, []).append(i)
  invals = list(invals)
  for members in groups.values():
    dtypes = {compat.typeof(invals[i]).dtype for i in members}
    if len(dtypes) < 2:
      continue
    weak = {i: env.facts.follows_partner(eqn, i) for i in members}
    refs = [compat.typeof(invals[i]).dtype for i in members if compat.is_ref(invals[i])]
    strong = [compat.typeof(invals[i]).dtype for i in members if not weak[i]] or [
      # All scalars: a rank-0 value outranks a Python scalar, as torch's 0-dim tensors outrank
      # its Python scalars (``jnp.max(..., initial=0)``, ``jnp.where(p, loss, 0.0)`` of a
      # 16-bit rank-0 value stay 16-bit).
      compat.typeof(invals[i]).dtype
      for i in members
      if not env.facts.is_python_scalar(eqn.invars[i])
    ]
    # A Ref keeps its dtype: what is stored into it is cast instead.
    target = refs[0] if refs else casting.widest(strong or sorted(dtypes, key=str))
    if target in LOW_DTYPES and eqn.primitive in SCALAR_OPMATH:
      if not all(_fits(eqn.invars[i], invals[i], env, target) for i in members if weak[i]):
        rounded_to, target = target, jnp.dtype(jnp.float32)
    for i in members:
      if compat.typeof(invals[i]).dtype == target:
        continue
      atom = eqn.invars[i]
      if not compat.is_literal(atom) and invals[i] is env.read(atom):
        invals[i] = env.cast(atom, target)  # cached, and a fill is made in the target dtype
      else:
        saturate = env.facts.saturates(atom)
        invals[i] = env.casts.convert(invals[i], target, saturate=saturate)
  return invals, rounded_to


def _fits(atom, value, env: Env, dtype: np.dtype) -> bool:
  """Whether a scalar operand known while tracing keeps its magnitude in ``dtype`` (one not
  known, a traced scalar, is taken to fit: it saturates as a fill does)."""
  constant = env.facts.constant(atom)
  if constant is None and not atom.aval.shape and not isinstance(value, jax.core.Tracer):
    constant = value  # a closed-over rank-0 array
  return constant is None or casting.fits(constant, dtype)


def _matmul_params(eqn, invals) -> dict:
  """The eqn's params for ``invals``; a matmul's (dense, conv, sparse) with its result dtype
  following the new inputs, unless the caller fixed it, and without the process's configured
  precision where they are 16-bit: set for float32 matmuls, a configured dot algorithm
  (``"F32_F32_F32"``) would compute theirs in float32."""
  params = dict(eqn.params)
  preferred, precision = params.get("preferred_element_type"), params.get("precision")
  if preferred is None and precision is None:
    return params
  new_inputs = casting.widest([compat.typeof(v).dtype for v in invals])
  if preferred is not None and explicit_result_type(eqn) is None:
    params["preferred_element_type"] = new_inputs
  if (
    precision is not None
    and new_inputs in LOW_DTYPES
    and precision == compat.configured_matmul_precision()
  ):
    params["precision"] = None
  return params


def _retype_combiner(jaxpr, consts, dtype) -> Any:
  """A scalar combiner jaxpr (e.g. scatter-add's ``add``) re-traced for ``dtype`` operands."""
  closed = compat.ClosedJaxpr(jaxpr, list(consts))
  avals = [compat.aval_with_dtype(v.aval, dtype) for v in jaxpr.invars]
  return compat.trace(compat.jaxpr_as_fun(closed), avals).jaxpr


# --- higher-order rules, the rule set, and the facts recorded after each eqn ----------------------

# A body rule (``higher_order.py``): (eqn, its input values, Env, Context) -> its outputs, with
# its bodies rewritten by the interpreter under ``ctx``.
BodyRule = Callable[[Any, list, Env, Context], list]


def rewriting(body_rule: BodyRule) -> Rule:
  """The rule of a higher-order primitive: ``body_rule`` on the values entering it; inside an
  op call, those are cast by the op's category and the bodies run natively, as the op's."""

  def rule(eqn, env: Env, ctx: Context) -> Applied:
    ctx = ctx.within(eqn)
    if env.call is None:
      invals = [env.read(a) for a in eqn.invars]
      return Applied(body_rule(eqn, invals, env, ctx), Ruling(Decider.HIGHER_ORDER), invals)
    invals = entering_op(eqn, env, ctx)
    inside = ctx._replace(op=env.call.region, op_category=env.call.category)
    outs = body_rule(eqn, invals, env, inside)
    return Applied(outs, op_ruling(env.call), invals)

  return rule


def rule_set(body_rules: Mapping[Any, BodyRule]) -> RuleSet:
  """The rules of this module with ``body_rules`` for the higher-order primitives."""
  return RuleSet(
    kept=kept,
    higher_order={primitive: rewriting(rule) for primitive, rule in body_rules.items()},
    keeps_dtypes=keeps_dtypes,
    traced_dtypes=traced_dtypes,
    outside=PRIMITIVE_RULES,
    by_category=by_category,
    inside=IN_OP_RULES,
    op_entry=op_entry,
  )


def record_facts(eqn, env: Env, applied: Applied) -> None:
  """What ``eqn``'s evaluation tells about its outputs, recorded once it is bound: where they
  come from, that a low-precision matmul's output stays low under a bias add, and that a layout
  change or a no-op convert of a weak scalar is weak."""
  facts, ruling = env.facts, applied.ruling
  if ruling.rule in (Decider.CATEGORY, Decider.FP8) and ruling.category is Category.LOWER:
    if eqn.primitive in MATMULS:
      facts.note_matmul(eqn)
  if ruling.rule in (Decider.CATEGORY, Decider.WEAK_SCALAR):
    facts.note_weak_flow(eqn)
    if eqn.primitive is prims.convert_element_type_p:
      source = eqn.invars[0]
      if facts.is_weak(source):
        facts.weak.update(eqn.outvars)
  facts.note_like_flow(eqn)
  facts.note(eqn)
