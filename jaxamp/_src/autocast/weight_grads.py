"""Float32 gradients for the float32 values autocast casts down (issue #22, point 7).

autocast runs a matmul of a float32 parameter ``W`` as ``dot(x16, convert(W, float16))``. JAX
transposes that in float16: the weight gradient ``dot(g, x)`` comes out in float16, and only then
is converted to float32. Under data parallelism XLA all-reduces the per-device partial sums of
``dW`` before that convert, in float16: precision is lost and, at a loss scale of 2**16 over
many devices, the sum overflows, so the scaler skips a good step. torch's DDP reduces the float32
``param.grad``. A bias added in float16 has the same problem: its gradient is a float16 sum over
the batch.

So an eqn with an operand autocast cast down from float32 is bound through a ``jax.custom_jvp``
(``bind``): its primal is the eqn exactly as before (same values, and the same ``dot_general``
that remat policies look for); its tangent in the cast operand is taken from the float32 value:

* for a matmul, ``cast_tangent_p(other, t)``: evaluated as before (``t`` cast down, the 16-bit
  matmul), but transposed to the matmul of the 16-bit cotangent and operand with
  ``preferred_element_type=float32``, so tensor cores still run it and ``dW`` is not rounded to
  16 bits before it is reduced;
* for an add (a bias), the float32 tangent broadcast before its cast, so the sum over the batch
  that transposes the broadcast is float32. Where the add itself broadcasts the bias (flax's
  ``(1, F)``), no ``custom_jvp`` is needed: the bias is broadcast in float32 before its cast
  (``bias_add``); the ``custom_jvp`` is left for a bias that ``vmap`` broadcasts.

On XLA:CPU (``cpu_result_dot_p``, a dot lowered per platform) a bfloat16 weight gradient keeps
its 16-bit result: XLA:CPU cannot run every bfloat16 x bfloat16 -> float32 dot, and widens
bfloat16 all-reduces to float32 itself. There, too, the dot's output passes through an optimization
barrier before it is transposed (``unfolded_p``), which XLA:CPU would fold into a 2x slower
dot. ``disabled()`` turns all of this off: tests and benchmarks compare with the old behaviour.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import caches, compat
from jaxamp._src.autocast.context import Env
from jaxamp._src.policies.table import LOW_DTYPES

prims = compat.primitives
FLOAT32 = jnp.dtype(jnp.float32)
MATMULS = frozenset({prims.dot_general_p, prims.conv_general_dilated_p})
SymbolicZero = jax.custom_derivatives.SymbolicZero

_enabled = True


@contextlib.contextmanager
def disabled() -> Iterator[None]:
  """Within the block, cast-down operands get 16-bit gradients, as before this module.

  Only for comparisons (tests, benchmarks): clear jaxamp's and JAX's caches around it, since
  traces made in it are cached like any other.
  """
  global _enabled
  previous, _enabled = _enabled, False
  try:
    yield
  finally:
    _enabled = previous


def cast_down(eqn, env: Env, invals: Sequence[Any]) -> list[Any | None]:
  """Per input of ``eqn``: its float32 value where autocast cast it to a 16-bit dtype for this
  eqn (``invals`` are the values it is bound on), else None."""
  return [
    env.read(atom)
    if not compat.is_literal(atom)
    and env.dtype(atom) == FLOAT32
    and compat.typeof(value).dtype in LOW_DTYPES
    else None
    for atom, value in zip(eqn.invars, invals, strict=True)
  ]


def bind(eqn, env: Env, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
  """``compat.bind(eqn, invals, params)``; a matmul (dot_general, conv) some of whose inputs
  autocast cast down from float32 goes through ``jax.custom_jvp``, so that those inputs get
  float32 gradients from a float32-output matmul, and a 16-bit parameter broadcast to a larger
  shape is broadcast so that its gradient is summed in float32 (``_summed_in_float32``)."""
  if eqn.primitive in MATMULS:
    return _bind(eqn, env, invals, params)
  params = eqn.params if params is None else params
  if _enabled and eqn.primitive is prims.broadcast_in_dim_p:
    shape, dims = params["shape"], params["broadcast_dimensions"]
    if _repeats(compat.typeof(invals[0]).shape, shape, dims) and _gets_a_float32_sum(
      eqn.invars[0], invals[0], env
    ):
      broadcast = _summed_in_float32(shape, dims, params)
      return [compat.bind_like(eqn, broadcast, invals)]
  if _enabled and eqn.primitive in _BROADCASTING and len(eqn.outvars) == 1:
    shape = eqn.outvars[0].aval.shape  # a rank-0 operand, or one with size-1 dims, broadcasts
    invals = [
      compat.bind_like(
        eqn, _summed_in_float32(shape, _trailing_dims(np.ndim(value), shape)), [value]
      )
      if compat.typeof(value).shape != shape and _gets_a_float32_sum(atom, value, env)
      else value
      for atom, value in zip(eqn.invars, invals, strict=True)
    ]
  return compat.bind(eqn, invals, params)


def _repeats(operand_shape, shape, broadcast_dimensions) -> bool:
  """Whether a broadcast to ``shape`` repeats its operand: an output axis the operand lacks, or
  has as 1, is larger than 1. Sizes are compared for equality only, which symbolic ones
  (``jax.export``) decide, not ordered."""
  sizes = dict(zip(broadcast_dimensions, operand_shape, strict=True))
  return any(sizes.get(axis, 1) != size != 1 for axis, size in enumerate(shape))


# Elementwise primitives that take a rank-0 operand for one of their output's shape.
_BROADCASTING = frozenset(
  {
    prims.add_p,
    prims.sub_p,
    prims.mul_p,
    prims.div_p,
    prims.max_p,
    prims.min_p,
    prims.pow_p,
    prims.atan2_p,
    prims.rem_p,
  }
)


def _gets_a_float32_sum(atom, value, env: Env) -> bool:
  """Whether the broadcast ``value`` (bound for ``atom``) is differentiable and 16-bit, and a
  parameter or constant (a cast-down float32 one, a PReLU slope, a learnable temperature or
  gate, or one stored so) or a computed value of one element (CLIP's ``exp(logit_scale)``, a
  gate's ``tanh``): what torch's ``sum_to`` sums over a whole cotangent. A computed value of more
  elements (a norm's ``keepdims`` mean) is an activation summed along a few dims only."""
  return (
    not compat.is_literal(atom)
    and (not env.facts.is_computed(atom) or np.size(value) == 1)
    and compat.typeof(value).dtype in LOW_DTYPES
    and compat.traced_now(value)
  )


def _summed_in_float32(shape: tuple, dims: tuple, params: dict | None = None) -> Callable:
  """``broadcast_in_dim`` to ``shape`` (with ``params``, a broadcast eqn's own) whose tangent is
  broadcast in float32 and then cast: the sum over the broadcast dims that transposes it, a
  parameter's gradient, is float32, as torch's ``sum_to`` accumulates. A 16-bit sum of a large
  cotangent is far off (XLA:CPU adds in bfloat16), and overflows in float16."""
  key = (shape, dims, None if params is None else _freeze(params))
  return _cached_summed_in_float32(key)


@caches.lru_cache("weight_grads.float32_sums", maxsize=1024)
def _cached_summed_in_float32(key: tuple) -> Callable[[Any], Any]:
  shape, dims, params = key
  if params is None:
    broadcast = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=dims)
  else:
    broadcast = functools.partial(prims.broadcast_in_dim_p.bind, **dict(params))

  @jax.custom_jvp
  def summed_in_float32(operand):
    return broadcast(operand)

  def summed_in_float32_jvp(primals, tangents):
    (operand,), (tangent,) = primals, tangents
    wide = broadcast(lax.convert_element_type(tangent, FLOAT32))
    return broadcast(operand), lax.convert_element_type(wide, compat.typeof(operand).dtype)

  summed_in_float32.defjvp(summed_in_float32_jvp)
  return summed_in_float32


def bias_add(eqn, env: Env, bias, dtype: np.dtype) -> tuple[list[Any], list[Any]]:
  """The add of ``bias`` (an input of ``eqn``: a float32 parameter or constant, cast saturating
  to ``dtype``) to a matmul's 16-bit output, and the values it was bound on. The bias's
  gradient, a sum over the batch, is taken in float32:

  * a differentiated bias that the add broadcasts (flax's ``(1, F)``, Equinox's ``(C, 1, 1)``)
    is broadcast to the output in float32 before its cast, so JAX sums its cotangent in float32;
  * otherwise (under ``vmap`` with a bias the batch does not vary, where ``vmap`` broadcasts
    it after the cast) the add goes through ``jax.custom_jvp`` (``_add_tangent``).
  """
  high = env.read(bias)
  shape = eqn.outvars[0].aval.shape
  broadcast = _enabled and compat.traced_now(high) and compat.typeof(high).shape != shape
  if broadcast:
    low = env.casts.convert(_broadcast_staged(high, shape), dtype, saturate=True)
  else:
    low = env.cast(bias, dtype, saturate=True)
  invals = [low if atom is bias else env.read(atom) for atom in eqn.invars]
  return (compat.bind(eqn, invals) if broadcast else _bind(eqn, env, invals, None)), invals


def _broadcast_staged(value, shape: tuple[int, ...]) -> Any:
  """``_broadcast``, staged (``compat.staged``) while linearizing."""
  dims = _trailing_dims(compat.typeof(value).ndim, shape)
  broadcast = functools.partial(lax.broadcast_in_dim, shape=shape, broadcast_dimensions=dims)
  return compat.call_staged(("weight_grads.bias_broadcast", shape, dims), broadcast, value)


def _bind(eqn, env: Env, invals: Sequence[Any], params: dict | None) -> list[Any]:
  if not _enabled:
    return compat.bind(eqn, invals, params)
  highs = cast_down(eqn, env, invals)
  if not any(isinstance(high, jax.core.Tracer) for high in highs):
    return compat.bind(eqn, invals, params)  # nothing can be differentiated
  params = dict(eqn.params if params is None else params)
  cast = tuple(high is not None for high in highs)
  args = [*invals, *[high for high in highs if high is not None]]
  key = caches.primitive_key(eqn.primitive, params, cast)
  if key is None:
    fun = _custom_jvp(eqn.primitive, params, cast)
  else:
    fun = _cached_custom_jvp(key)
    if compat.linearizing(args):  # linearized once per signature, as compat.bind does
      fun = compat.staged(("weight_grads", key), lambda: fun)
  return [compat.bind_like(eqn, fun, args)]


@caches.lru_cache("weight_grads.custom_jvps", maxsize=1024)
def _cached_custom_jvp(key: tuple) -> Callable[..., Any]:
  primitive, params, cast = key
  return _custom_jvp(primitive, dict(params), cast)


def _custom_jvp(primitive, params: dict, cast: tuple[bool, ...]) -> Callable[..., Any]:
  """``primitive`` on its (16-bit) inputs, then the float32 values of the ``cast`` ones, which
  only its JVP reads: their tangent terms come from them, not from the 16-bit copies."""
  n = len(cast)

  @jax.custom_jvp
  def float32_gradients(*args):
    return primitive.bind(*args[:n], **params)

  def float32_gradients_jvp(primals, tangents):
    lows = primals[:n]
    out = primitive.bind(*lows, **params)
    highs = iter(tangents[n:])
    chosen = [next(highs) if is_cast else tangents[i] for i, is_cast in enumerate(cast)]
    chosen = [None if isinstance(t, SymbolicZero) else t for t in chosen]
    if all(t is None for t in chosen):
      return out, SymbolicZero.from_primal_value(out)
    return out, _TANGENTS[primitive](primitive, params, lows, chosen, cast, out)

  float32_gradients.defjvp(float32_gradients_jvp, symbolic_zeros=True)
  return float32_gradients


# --- tangents: (primitive, params, 16-bit inputs, tangents (None: zero), cast?, output) ---------


def _matmul_tangent(primitive, params: dict, lows, tangents, cast, out) -> Any:
  """A matmul is bilinear: the term of input ``i`` is the matmul with its tangent in its place;
  for a cast input, ``cast_tangent_p``, which transposes to a float32-output matmul."""
  terms = []
  for i, (tangent, is_cast) in enumerate(zip(tangents, cast, strict=True)):
    if tangent is None:
      continue
    if is_cast:
      low = compat.typeof(lows[i]).dtype
      frozen = _freeze(params)
      terms.append(
        cast_tangent_p.bind(
          lows[1 - i], tangent, matmul=primitive, params=frozen, position=i, low=low
        )
      )
    else:
      terms.append(primitive.bind(*_placed(lows[1 - i], tangent, i), **params))
  return functools.reduce(lax.add, terms)


def _add_tangent(primitive, params: dict, lows, tangents, cast, out) -> Any:
  """The tangents broadcast to the output and added; a cast input's broadcast in float32 before
  its cast, so that the sum transposing the broadcast (a bias's gradient) is float32.

  Under ``vmap`` with an unbatched bias the batch axis is broadcast too, after the cast: there
  the sum is taken in float32 and cast once (the other input's 16-bit cotangent round-trips
  through float32 exactly)."""
  out_type = compat.typeof(out)
  given = [(t, c) for t, c in zip(tangents, cast, strict=True) if t is not None]
  unbatched = any(c and not compat.traced_now(t) for t, c in given)
  terms = [(_broadcast(t, out_type.shape), c) for t, c in given]
  if unbatched and compat.traced_now(out):
    wide = [lax.convert_element_type(t, FLOAT32) for t, _ in terms]
    return lax.convert_element_type(functools.reduce(lax.add, wide), out_type.dtype)
  low = [lax.convert_element_type(t, out_type.dtype) if c else t for t, c in terms]
  return functools.reduce(lax.add, low)


def _broadcast(value, shape) -> Any:
  """``value`` broadcast to ``shape``: trailing dims aligned, size-1 dims expanded."""
  if value.shape == shape:
    return value
  return lax.broadcast_in_dim(value, shape, _trailing_dims(value.ndim, shape))


def _trailing_dims(ndim: int, shape) -> tuple[int, ...]:
  """The dims of ``shape`` that an operand of ``ndim`` dims maps to, aligned at the end."""
  return tuple(range(len(shape) - ndim, len(shape)))


_TANGENTS: dict[Any, Callable[..., Any]] = {
  prims.dot_general_p: _matmul_tangent,
  prims.conv_general_dilated_p: _matmul_tangent,
  prims.add_p: _add_tangent,
}


def _placed(other, operand, position: int) -> tuple[Any, Any]:
  """The two operands of a matmul, ``operand`` at ``position`` and ``other`` at the other."""
  return (operand, other) if position == 0 else (other, operand)


def _freeze(params: dict) -> tuple:
  return tuple(sorted(params.items()))


# --- cast_tangent_p: a matmul's tangent in a cast-down operand -----------------------------------
# Parameters: matmul (dot_general_p or conv_general_dilated_p), params (its frozen params),
# position (of the cast operand), low (its 16-bit dtype). Operands: (other, tangent): the other
# operand (16-bit) and the float32 tangent of the cast one.


def _cast_tangent(other, tangent, *, matmul, params, position, low) -> Any:
  """The tangent as JAX computes it without this module: cast down, then the 16-bit matmul."""
  low_tangent = lax.convert_element_type(tangent, low)
  return matmul.bind(*_placed(other, low_tangent, position), **dict(params))


def _cast_tangent_type(other, tangent, *, matmul, params, position, low) -> Any:
  out, _ = matmul.abstract_eval(
    *_placed(other, compat.aval_with_dtype(tangent, low), position), **dict(params)
  )
  return out


def _transpose_other(ct, other, tangent, *, matmul, params, position, low) -> Any:
  """The cotangent of the other (16-bit) operand: as for the plain matmul."""
  operands = _placed(other, lax.convert_element_type(tangent, low), position)
  return compat.bilinear_transpose(matmul, ct, operands, 1 - position, dict(params))


def _transpose_tangent(ct, other, tangent, *, matmul, params, position, low) -> Any:
  """The float32 cotangent of the cast operand: the matmul of the 16-bit cotangent and operand,
  with a float32 result (JAX's transpose of the matmul with ``preferred_element_type``).

  For a dot, traced once per signature (``compat.staged``): every layer of a deep model
  transposes the same few dots."""
  if matmul is not prims.dot_general_p:
    return _transposed(matmul, params, position, ct, other, tangent)
  cpu_dtype = _cpu_result(params, low)
  if any(_explicitly_sharded(x) for x in (ct, other, tangent)):
    # The cached transposes are typed without shardings: JAX's own transpose, traced here.
    transposed = functools.partial(_transposed, matmul, params, position, tangent=tangent)
    closed = compat.trace(lambda ct, other: [transposed(ct, other)], [_aval(ct), _aval(other)])
    return _evaluate(closed, (ct, other), bind=functools.partial(_bind_dot, cpu_dtype))
  key = (matmul, params, position, cpu_dtype, _aval_key(ct), _aval_key(other), _aval_key(tangent))
  return compat.staged(("weight_grads.transpose", *key), lambda: _unfolded_cotangent(*key))(
    ct, other
  )


def _cpu_result(params, low) -> Any:
  """The result dtype of a weight gradient's dot on XLA:CPU: a bfloat16 one keeps its 16-bit
  result (the forward dot's), since XLA:CPU cannot run every bfloat16 x bfloat16 -> float32 dot
  (YNNPACK takes some, its fallback none), and widens bfloat16 all-reduces to float32 itself.
  None: float32, as elsewhere."""
  if low != jnp.bfloat16:
    return None
  preferred = dict(params)["preferred_element_type"]
  cpu_dtype = jnp.dtype(low if preferred is None else preferred)
  return None if cpu_dtype == FLOAT32 else cpu_dtype


def _unfolded_cotangent(matmul, params, position, cpu_dtype, ct_key, other_key, tangent_key):
  """``(ct, other) -> `` the cotangent of the cast operand, each matmul's output transpose kept
  out of the matmul (``unfolded_p``); with a ``cpu_dtype``, its dots are ``cpu_result_dot_p``."""
  bind = None if cpu_dtype is None else functools.partial(_bind_dot, cpu_dtype)

  def unfolded(ct, other):
    closed, outputs = _unfolded_transpose(matmul, params, position, ct_key, other_key, tangent_key)
    return _evaluate(closed, (ct, other, None), outputs, bind=bind)

  return unfolded


def _bind_dot(cpu_dtype, eqn, ins: Sequence[Any]) -> Any:
  """``eqn`` bound on ``ins``; a float32-result dot as ``cpu_result_dot_p`` with a ``cpu_dtype``
  result on XLA:CPU."""
  if (
    cpu_dtype is None
    or eqn.primitive is not prims.dot_general_p
    or eqn.params["preferred_element_type"] != FLOAT32
  ):
    return eqn.primitive.bind(*ins, **eqn.params)
  return cpu_result_dot_p.bind(*ins, **eqn.params, platform_dtype=cpu_dtype)


# dot_general with a float32 result, lowered for XLA:CPU as the dot with a 16-bit result, then
# converted: one eqn per weight gradient, where ``lax.platform_dependent`` traced both platforms'
# dots and a ``cond``, which doubled the lowering of a deep model.
cpu_result_dot_p = compat.platform_result_dot("jaxamp_cpu_result_dot", "cpu")

# The identity, lowered for XLA:CPU as an optimization barrier: XLA:CPU folds a transpose of a
# dot's output into the dot, whose operands then contract along their leading dims, and YNNPACK
# does not take that dot: its fallback runs a weight gradient 2x slower.
unfolded_p = compat.platform_identity("jaxamp_unfolded", "cpu", prims.optimization_barrier_p)


def _transposed(matmul, params, position, ct, other, tangent) -> Any:
  """JAX's transpose of the matmul in its cast operand at ``ct``, with a float32 result; of
  ``tangent`` only the type is read."""
  result_params = dict(params, preferred_element_type=FLOAT32)
  return compat.bilinear_transpose(
    matmul, ct, _placed(other, tangent, position), position, result_params
  )


def _aval(value) -> Any:
  """The type of a value, tracer or undefined primal (which carries only ``.aval``)."""
  return value.aval if hasattr(value, "aval") else compat.typeof(value)


def _explicitly_sharded(value) -> bool:
  """Whether ``value``'s type names a sharding (explicit mesh axes), which a dot's output type
  must follow."""
  spec = getattr(getattr(_aval(value), "sharding", None), "spec", None)
  return spec is not None and any(part is not None for part in spec)


def _aval_key(value) -> tuple:
  aval = _aval(value)
  return tuple(aval.shape), jnp.dtype(aval.dtype)


@caches.lru_cache("weight_grads.unfolded_transposes", maxsize=1024)
def _unfolded_transpose(matmul, params, position, ct, other, tangent):
  """The cotangent of the cast operand as a jaxpr of ``(ct, other, tangent)``, and the indices
  of its matmuls whose outputs it transposes, to be passed through ``unfolded_p``."""
  transposed = functools.partial(_transposed, matmul, params, position)
  structs = (jax.ShapeDtypeStruct(*key) for key in (ct, other, tangent))
  closed = jax.make_jaxpr(transposed)(*structs)
  producers = {eqn.outvars[0]: index for index, eqn in enumerate(closed.jaxpr.eqns)}
  transposed_outputs = {
    producers[eqn.invars[0]]
    for eqn in closed.jaxpr.eqns
    if eqn.primitive is prims.transpose_p and eqn.invars[0] in producers
  }
  matmuls = {i for i, eqn in enumerate(closed.jaxpr.eqns) if eqn.primitive in MATMULS}
  return closed, frozenset(transposed_outputs & matmuls)


def _evaluate(closed, args: Sequence[Any], unfolded: frozenset = frozenset(), bind=None) -> Any:
  """``compat.evaluate`` with each eqn bound as ``bind(eqn, its input values)`` (its own
  ``bind`` by default); the outputs of the eqns at the indices ``unfolded`` pass through
  ``unfolded_p``."""
  index_of = {id(eqn): index for index, eqn in enumerate(closed.jaxpr.eqns)}

  def bind_eqn(eqn, ins: list) -> Any:
    out = eqn.primitive.bind(*ins, **eqn.params) if bind is None else bind(eqn, ins)
    return unfolded_p.bind(out) if index_of[id(eqn)] in unfolded else out

  return compat.evaluate(closed, args, bind_eqn)


def _batch_cast_tangent(args, dims, *, matmul, params, position, low) -> tuple[Any, int]:
  """Under ``vmap``: JAX's own batching of the matmul, traced on a 16-bit tangent, evaluated on
  the float32 one with this primitive in place of the matmul. The ops JAX puts around it only
  move axes (reshape, transpose), which they do in any dtype."""
  other, tangent = args

  def matmul_of(other, tangent):
    return matmul.bind(*_placed(other, tangent, position), **dict(params))

  shapes = jax.ShapeDtypeStruct(other.shape, other.dtype), jax.ShapeDtypeStruct(tangent.shape, low)
  closed = jax.make_jaxpr(jax.vmap(matmul_of, in_axes=tuple(dims)))(*shapes)
  on_tangent = {closed.jaxpr.invars[1]}

  def bind(eqn, ins):
    reads_tangent = [a in on_tangent for a in eqn.invars]
    if any(reads_tangent):
      on_tangent.update(eqn.outvars)
    if eqn.primitive is not matmul:
      return eqn.primitive.bind(*ins, **eqn.params)
    at = reads_tangent.index(True)
    frozen = _freeze(eqn.params)
    return cast_tangent_p.bind(
      ins[1 - at], ins[at], matmul=matmul, params=frozen, position=at, low=low
    )

  return _evaluate(closed, (other, tangent), bind=bind), 0


cast_tangent_p = compat.bilinear_primitive(
  "jaxamp_cast_tangent",
  _cast_tangent,
  _cast_tangent_type,
  _transpose_other,
  _transpose_tangent,
  _batch_cast_tangent,
)
