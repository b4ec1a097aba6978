"""Dynamic loss scaling: torch's ``GradScaler`` as an optax ``GradientTransformation``.

``dynamic_loss_scale(inner)`` wraps the real optimizer. Its ``update`` receives the gradients of
the *scaled* loss and does what ``scaler.step(optimizer); scaler.update()`` does in torch:

1. one finite check over the whole gradient tree, a single flag (reduced over ``axis_name`` when
   given): one read of every gradient, the check's floor on a memory-bound backend;
2. unscale in float32 with ``inv = f32(1 / f64(scale))``;
3. on overflow skip the inner step (-0.0 updates: params and inner state stay bit-identical),
   else run it;
4. back off or grow the scale, rounding ``f64(scale) * factor`` to float32 as torch does.

The functions after the transform are the rest of ``GradScaler``, functional: ``scale_loss``
(``scale``), ``unscale`` (``unscale_``; ``update(..., found_inf=...)`` is ``step`` after it),
``set_scale`` (``update(new_scale)``), ``get_scale``, the hyperparameter getters and setters,
``is_enabled``, ``state_dict`` and ``load_state_dict``. Each finds the scaler state anywhere in an
optimizer state tree (``state_tree``); the setters return a new tree.

Products with non-power-of-two factors (0.3, 1.1) must round exactly as torch's C++ does:
``static_cast<float>(float * double)``, i.e. the exact product rounded to float64 and then to
float32 (two roundings); the inverse is ``scale.double().reciprocal().float()``. Without
``jax_enable_x64`` there is no float64 inside ``jit``, so ``_mul_f32_f64`` and
``_reciprocal_parts`` form the exact product (in 12-bit limbs) or quotient (by long division) in
scalar uint32 arithmetic and ``_f64_to_f32`` applies both roundings. Integer ops are exact on every
backend; float error-free transformations (Dekker, TwoSum) are not safe where XLA contracts
``a * b + c`` into an FMA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import state_tree

__all__ = [
    "DynamicLossScaleState",
    "EmptyStateDictError",
    "dynamic_loss_scale",
    "get_backoff_factor",
    "get_growth_factor",
    "get_growth_interval",
    "get_scale",
    "is_enabled",
    "load_state_dict",
    "scale_loss",
    "set_backoff_factor",
    "set_growth_factor",
    "set_growth_interval",
    "set_scale",
    "state_dict",
    "unscale",
]


# ------------------------------------------------------------------------------------------------
# State.


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LossScaleHyperparams:
  """The scaler's static hyperparameters, kept in its state so checkpoints can restore them.

  They are Python numbers, as in torch's ``GradScaler``: a pytree node with no leaves, so ``jit``
  sees them as compile-time constants and the float64 factors keep every bit (a float32 array
  could not hold 1.1 or 0.3 exactly). Changing them (``load_state_dict``) changes the treedef.

  Attributes:
    growth_factor: factor the scale is multiplied by after ``growth_interval`` finite steps.
    backoff_factor: factor the scale is multiplied by after a non-finite step.
    growth_interval: number of consecutive finite steps before the scale grows.
    enabled: ``False`` makes the scaler a pass-through of the inner optimizer.
    axis_name: the mapped axis name(s) the finite check is reduced over (``update`` and
      ``unscale``), or ``None``. Part of the program, not of its state: checkpoints leave it out.
  """

  growth_factor: float
  backoff_factor: float
  growth_interval: int
  enabled: bool = True
  axis_name: Any = None


def _hyperparams_to_state_dict(hp: LossScaleHyperparams) -> dict[str, Any]:
  return {
      "growth_factor": hp.growth_factor,
      "backoff_factor": hp.backoff_factor,
      "growth_interval": hp.growth_interval,
      "enabled": hp.enabled,
  }


def _hyperparams_from_state_dict(
    target: LossScaleHyperparams, state: dict[str, Any]
) -> LossScaleHyperparams:
  if not state:
    return target
  return dataclasses.replace(  # the axis name comes from the target, i.e. from the program
      target,
      growth_factor=float(state["growth_factor"]),
      backoff_factor=float(state["backoff_factor"]),
      growth_interval=int(state["growth_interval"]),
      enabled=bool(state["enabled"]),
  )


@functools.cache
def _register_flax_serialization() -> None:
  """Lets ``flax.serialization`` (``to_bytes``, msgpack checkpoints) save the hyperparameters."""
  try:
    from flax import serialization
  except ImportError:  # without flax there is nothing to register
    return
  serialization.register_serialization_state(
      LossScaleHyperparams, _hyperparams_to_state_dict, _hyperparams_from_state_dict,
      override=True,
  )


class DynamicLossScaleState(NamedTuple):
  """State of the ``GradientTransformation`` returned by ``dynamic_loss_scale``.

  Attributes:
    scale: the current loss scale, a float32 scalar whatever the gradient dtypes (1.0 when the
      scaler is disabled).
    growth_tracker: int32 number of consecutive finite steps since the last growth or skipped
      step (torch's ``_growth_tracker``).
    found_inf: bool scalar, whether the last update found an Inf or NaN and was skipped.
    skipped_steps: int32 number of updates skipped since ``init`` (saturates, never wraps).
    inner_state: the state of the wrapped optimizer.
    hyperparams: the static ``LossScaleHyperparams`` (growth/backoff factors, growth interval,
      enabled flag, axis name); also readable as ``state.growth_factor`` etc.
  """

  scale: Any
  growth_tracker: Any
  found_inf: Any
  skipped_steps: Any
  inner_state: Any
  hyperparams: LossScaleHyperparams

  @property
  def growth_factor(self) -> float:
    """The growth factor, a Python float."""
    return self.hyperparams.growth_factor

  @property
  def backoff_factor(self) -> float:
    """The backoff factor, a Python float."""
    return self.hyperparams.backoff_factor

  @property
  def growth_interval(self) -> int:
    """The growth interval, a Python int."""
    return self.hyperparams.growth_interval

  @property
  def enabled(self) -> bool:
    """Whether loss scaling is enabled."""
    return self.hyperparams.enabled


# ------------------------------------------------------------------------------------------------
# Exact float32 (x) float64 arithmetic without float64, in scalar uint32 arithmetic.
#
# A float64 significand D (53 bits, 2**52 <= D <= 2**53) is held as two words,
# D = hi * 2**29 + lo with lo < 2**29, next to a binary exponent: the value is D * 2**exponent.

_F32_INF_BITS = 0x7F800000
_LO_BITS = 29


def _u32(x: Any) -> jax.Array:
  return jnp.asarray(x, jnp.uint32)


def _decompose_f32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)``, ``|x| = m * 2**e`` with the uint32 ``m`` in ``[2**23, 2**24)`` (finite x != 0)."""
  u = lax.bitcast_convert_type(x, jnp.uint32)
  biased = (u >> 23) & 0xFF
  frac = u & 0x7FFFFF
  normal = biased > 0
  m = jnp.where(normal, frac | 0x800000, frac)
  e = jnp.where(normal, biased.astype(jnp.int32) - 150, -149)
  shift = jnp.maximum(lax.clz(m).astype(jnp.int32) - 8, 0)  # normalises subnormals
  return m << shift.astype(jnp.uint32), e - shift


def _round_half_even(
    hi: jax.Array, lo: jax.Array, guard: jax.Array, sticky: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Rounds ``hi * 2**29 + lo`` (plus a guard bit and a sticky bit below it) to nearest even."""
  up = (guard != 0) & ((sticky != 0) | ((lo & 1) != 0))
  lo = lo + up.astype(jnp.uint32)
  return hi + (lo >> _LO_BITS), lo & ((1 << _LO_BITS) - 1)


def _f64_to_f32(hi: jax.Array, lo: jax.Array, exponent: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Rounds the float64 ``(hi * 2**29 + lo) * 2**exponent`` to float32, ties to even.

  float64's exponent range is treated as unbounded: where it is not (below 2**-1022, above
  2**1024), float32 gives 0 or inf all the same. Returns the float32 significand ``m`` (at most
  2**24) and biased exponent ``field``; the float32's bits are ``(field << 23) + m`` (a rounding
  carry of ``m`` moves into the exponent by itself).
  """
  carry = hi >> 24  # D == 2**53
  hi = jnp.where(carry > 0, _u32(1 << 23), hi)
  exponent = exponent + carry.astype(jnp.int32)
  # Bits lost below float32's 24 when the result is subnormal (its last bit is 2**-149).
  k = jnp.clip(-126 - (exponent + 52), 0, 25).astype(jnp.uint32)
  km1 = jnp.maximum(k, 1) - 1
  m = hi >> k
  guard = jnp.where(k == 0, lo >> (_LO_BITS - 1), hi >> km1) & 1
  sticky = jnp.where(
      k == 0,
      (lo & ((1 << (_LO_BITS - 1)) - 1)) != 0,
      ((hi & ((_u32(1) << km1) - 1)) != 0) | (lo != 0),
  )
  m = m + ((guard != 0) & (sticky | ((m & 1) != 0))).astype(jnp.uint32)
  field = jnp.where(k > 0, 0, exponent + _LO_BITS + 149)
  return m, field


def _assemble_f32(m: jax.Array, field: jax.Array) -> jax.Array:
  """The float32 with significand ``m`` and biased exponent ``field``; inf past float32's range."""
  bits = (jnp.clip(field, 0, 255).astype(jnp.uint32) << 23) + m
  bits = jnp.where((field >= 255) | (bits >= _F32_INF_BITS), _u32(_F32_INF_BITS), bits)
  return lax.bitcast_convert_type(bits, jnp.float32)


def _with_sign_of(y: jax.Array, x: jax.Array) -> jax.Array:
  sign = lax.bitcast_convert_type(x, jnp.uint32) & _u32(0x80000000)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.uint32) | sign, jnp.float32)


def _f64_limbs(factor: float) -> tuple[np.ndarray, int]:
  """A positive finite float64 as five little-endian 12-bit limbs and a binary exponent."""
  mantissa, exponent = math.frexp(factor)
  m = int(mantissa * 2.0**53)  # exact: a float64 has at most 53 significant bits
  return np.array([(m >> (12 * i)) & 0xFFF for i in range(5)], np.uint32), exponent - 53


def _mul_f32_f64(x: jax.Array, factor_limbs: jax.Array, factor_exp: jax.Array) -> jax.Array:
  """``float32(float64(x) * factor)``, torch's ``static_cast<float>(float * double)``.

  The exact product of the 24-bit and the 53-bit significands (77 bits) is built in 12-bit limbs,
  rounded to 53 bits (float64) and then to float32: two roundings, as in C++.
  """
  m, e = _decompose_f32(x)
  a = (m & 0xFFF, m >> 12)
  f = [factor_limbs[i] for i in range(5)]
  columns = [a[0] * f[0]] + [a[0] * f[k] + a[1] * f[k - 1] for k in range(1, 5)] + [a[1] * f[4]]
  p, carry = [], _u32(0)
  for c in columns:  # every column < 2**26
    c = c + carry
    p.append(c & 0xFFF)
    carry = c >> 12
  p.append(carry)
  # The product is in [2**75, 2**77): shift it left once where bit 76 is clear.
  s = _u32(1) - ((p[6] >> 4) & 1)
  p = [((p[i] << s) & 0xFFF) | ((p[i - 1] >> (_u32(12) - s)) if i else 0) for i in range(7)]
  # float64 keeps bits 24..76; bit 23 is the guard bit.
  lo = p[2] | (p[3] << 12) | ((p[4] & 0x1F) << 24)
  hi = (p[4] >> 5) | (p[5] << 7) | (p[6] << 19)
  hi, lo = _round_half_even(hi, lo, (p[1] >> 11) & 1, ((p[1] & 0x7FF) | p[0]) != 0)
  y = _assemble_f32(*_f64_to_f32(hi, lo, e + factor_exp - s.astype(jnp.int32) + 24))
  special = (x == 0) | ~jnp.isfinite(x)  # 0 * f, inf * f and nan * f are x itself (f > 0)
  return jnp.where(special, x, _with_sign_of(y, x))


def _reciprocal_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``float32(1 / float64(x))`` as ``_f64_to_f32``'s ``(m, field)``, for finite ``x != 0``."""
  m, e = _decompose_f32(x)
  # Long division of 2**24 by m: q0 (1, or 2 where m == 2**23), then the fraction in chunks of
  # at most 8 bits (remainder < m < 2**24, so remainder << 8 fits), a guard bit, and the sticky
  # remainder.
  q0 = _u32(1 << 24) // m
  r = _u32(1 << 24) - q0 * m
  c = []
  for size in (8, 8, 8, 8, 8, 8, 4, 1):
    r = r << size
    c.append(r // m)
    r = r - c[-1] * m
  hi = (q0 << 23) | (c[0] << 15) | (c[1] << 7) | (c[2] >> 1)
  lo = ((c[2] & 1) << 28) | (c[3] << 20) | (c[4] << 12) | (c[5] << 4) | c[6]
  hi, lo = _round_half_even(hi, lo, c[7], r != 0)
  return _f64_to_f32(hi, lo, -76 - e)  # 1 / (m * 2**e) = (2**76 / m) * 2**(-76 - e)


def _reciprocal_f32_f64(x: jax.Array) -> jax.Array:
  """``float32(1 / float64(x))``, torch's ``scale.double().reciprocal().float()``."""
  return _unscale_factors(x)[2]


def _unscale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(a, b, inverse)``: ``g * a * b == g * inverse`` wherever the result is a normal float32.

  ``inverse = float32(1 / float64(scale))`` is torch's. Usually ``a`` is that inverse and
  ``b == 1``. Above ``scale = 2**126`` the inverse is subnormal, and XLA:CPU and TPUs treat
  subnormal operands as zero: the gradients would silently vanish. There ``a`` is the inverse
  times ``2**64`` (a normal float with the same significand) and ``b = 2**-64``.
  """
  m, field = _reciprocal_parts(scale)
  special = (scale == 0) | ~jnp.isfinite(scale)
  inverse = jnp.where(special, 1.0 / scale, _with_sign_of(_assemble_f32(m, field), scale))
  subnormal = (field == 0) & ~special
  raised = _with_sign_of(m.astype(jnp.float32) * jnp.float32(2.0**-85), scale)  # m * 2**-149+64
  a = jnp.where(subnormal, raised, inverse)
  b = jnp.where(subnormal, jnp.float32(2.0**-64), jnp.float32(1.0))
  return a, b, inverse


# ------------------------------------------------------------------------------------------------
# The transform.


def _check_args(
    inner: Any,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    enabled: Any,
    axis_name: Any,
) -> None:
  """Validates ``dynamic_loss_scale``'s arguments the way torch's ``GradScaler`` does, and more."""
  if not isinstance(inner, optax.GradientTransformation):
    hint = ""
    if isinstance(inner, optax.MultiSteps):
      hint = " (for `optax.MultiSteps`, pass `.gradient_transformation()`)"
    raise TypeError(
        "`inner` must be an optax GradientTransformation (`init` and `update`), got "
        f"{type(inner).__name__}: {inner!r}{hint}."
    )
  _check_hyperparams(growth_factor, backoff_factor, growth_interval)
  _check_positive_scale("init_scale", init_scale)
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"`enabled` must be a bool, got {type(enabled).__name__}: {enabled!r}.")
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
        f"`axis_name` must be None, an axis name or a tuple of axis names, got "
        f"{type(axis_name).__name__}: {axis_name!r}."
    ) from None


def _check_real(name: str, value: Any) -> None:
  """Raises a TypeError unless ``value`` is a real Python/NumPy number (bools are not)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    hint = ""
    if isinstance(value, jax.Array):
      hint = " (hyperparameters are static Python numbers, not arrays)"
    raise TypeError(
        f"`{name}` must be a real number{hint}, got {type(value).__name__}: {value!r}."
    )


def _check_positive_scale(name: str, value: Any) -> None:
  """A scale given as a number must be > 0 and finite once rounded to float32."""
  _check_real(name, value)
  with np.errstate(over="ignore"):
    as_float32 = float(np.float32(value))
  if not 0.0 < as_float32 < math.inf:
    raise ValueError(
        f"`{name}` must be > 0 and finite in float32 (at most 3.4028235e38), got {value!r}."
    )


def _check_growth_factor(growth_factor: Any) -> None:
  _check_real("growth_factor", growth_factor)
  if not 1.0 < float(growth_factor) < math.inf:
    raise ValueError(f"`growth_factor` must be > 1.0 and finite, got {growth_factor!r}.")


def _check_backoff_factor(backoff_factor: Any) -> None:
  _check_real("backoff_factor", backoff_factor)
  if not 0.0 < float(backoff_factor) < 1.0:
    raise ValueError(
        f"`backoff_factor` must satisfy 0 < backoff_factor < 1, got {backoff_factor!r}."
    )


def _check_growth_interval(growth_interval: Any) -> None:
  if isinstance(growth_interval, (bool, np.bool_)) or not isinstance(
      growth_interval, numbers.Integral
  ):
    raise TypeError(
        "`growth_interval` must be an int, got "
        f"{type(growth_interval).__name__}: {growth_interval!r}."
    )
  if not 1 <= int(growth_interval) <= np.iinfo(np.int32).max:
    raise ValueError(
        f"`growth_interval` must be an int in [1, 2**31 - 1], got {growth_interval!r}."
    )


def _check_hyperparams(growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
  """Validates the hyperparameters kept in the state (constructor, setters, load_state_dict)."""
  _check_growth_factor(growth_factor)
  _check_backoff_factor(backoff_factor)
  _check_growth_interval(growth_interval)


def _tree_found_inf(tree: Any) -> jax.Array:
  """One bool: whether any inexact leaf of ``tree`` holds an Inf or NaN."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.array(False)
  return jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def _tree_unscale(tree: Any, scale: jax.Array) -> Any:
  """``g * float32(1 / float64(scale))`` in (at least) float32, cast back to each leaf's dtype."""
  return _tree_unscale_by(tree, _unscale_factors(scale)[:2])


def _tree_unscale_by(tree: Any, factors: tuple[jax.Array, jax.Array]) -> Any:
  """``g * a * b`` (``_unscale_factors``) in (at least) float32, cast back to each leaf's dtype."""
  a, b = factors

  def unscale(g: Any) -> Any:
    dtype = jnp.result_type(g)
    if not jnp.issubdtype(dtype, jnp.inexact):
      return g
    compute = jnp.promote_types(dtype, jnp.float32)
    return (jnp.asarray(g, compute) * a.astype(compute) * b.astype(compute)).astype(dtype)

  return jax.tree.map(unscale, tree)


def _unscale_and_check(
    grads: Any, scale: jax.Array, axis_name: Any
) -> tuple[Any, jax.Array]:
  """torch's ``_amp_foreach_non_finite_check_and_unscale_``: ``(unscaled grads, found_inf)``.

  ``found_inf`` is about the *scaled* gradients, as in torch, reduced over ``axis_name``.
  ``update`` and ``unscale`` share this, so both give the same bits.
  """
  return _tree_unscale(grads, scale), _found_inf(grads, axis_name)


def _found_inf(grads: Any, axis_name: Any) -> jax.Array:
  """Whether any gradient is Inf or NaN, on any device of ``axis_name``: one bool for the tree."""
  found_inf = _tree_found_inf(grads)
  if axis_name is not None:
    found_inf = lax.pmax(found_inf.astype(jnp.int32), axis_name) > 0
  return found_inf


def _no_op_update(shape: jax.ShapeDtypeStruct) -> jax.Array:
  """The update of a skipped step: -0.0, for ``p + -0.0`` is ``p`` bit for bit (``+0.0`` would
  turn a ``-0.0`` parameter into ``+0.0``). Varying over the manual axes ``shape`` varies over."""
  if jnp.issubdtype(shape.dtype, jnp.inexact):
    update = jnp.full(shape.shape, -0.0, shape.dtype)
  else:
    update = jnp.zeros(shape.shape, shape.dtype)
  return _vary_like(update, shape)


def _varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes over which ``x`` (a value or a ``ShapeDtypeStruct``) varies.

  Empty outside ``shard_map`` and under ``check_vma=False``: there nothing is typed as varying.
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # the name before jax 0.10


def _vary_like(x: Any, like: Any) -> Any:
  """``x``, cast to vary also over the manual axes ``like`` varies over (the values unchanged).

  Under ``shard_map`` (``check_vma=True``) the two branches of a ``cond`` must have the same
  varying axes: a constant or an unchanged state is invariant where the computed one varies.
  """
  missing = _varying_axes(like) - _varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def _check_found_inf(found_inf: Any) -> jax.Array:
  """The ``found_inf`` extra argument of ``update``: a bool scalar (``unscale``'s second output)."""
  is_array = isinstance(found_inf, (bool, np.bool_, jax.Array, np.ndarray))
  if not (is_array and jnp.shape(found_inf) == () and jnp.result_type(found_inf) == jnp.bool_):
    what = type(found_inf).__name__
    if hasattr(found_inf, "dtype") and hasattr(found_inf, "shape"):
      what = f"a {found_inf.dtype} array of shape {tuple(found_inf.shape)}"
    raise TypeError(
        "`found_inf` must be a bool scalar (the second output of `jaxamp.unscale`), got "
        f"{what}."
    )
  return jnp.asarray(found_inf)


def _next_scale(
    scale: jax.Array, growth_tracker: jax.Array, found_inf: jax.Array, hp: LossScaleHyperparams
) -> tuple[jax.Array, jax.Array]:
  """torch's ``_amp_update_scale_``: back off on overflow, grow after ``growth_interval`` steps."""
  successful = growth_tracker + 1
  grow = successful == hp.growth_interval
  growth_limbs, growth_exp = _f64_limbs(hp.growth_factor)
  backoff_limbs, backoff_exp = _f64_limbs(hp.backoff_factor)
  # One exact product serves both branches: the factor is chosen first.
  product = _mul_f32_f64(
      scale,
      jnp.where(found_inf, backoff_limbs, growth_limbs),
      jnp.where(found_inf, backoff_exp, growth_exp),
  )
  grown = jnp.where(jnp.isfinite(product), product, scale)  # never grow past float32 to inf
  new_scale = jnp.where(found_inf, product, jnp.where(grow, grown, scale))
  new_tracker = jnp.where(found_inf | grow, 0, successful).astype(jnp.int32)
  return new_scale, new_tracker


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with torch's dynamic loss scaling (``torch.amp.GradScaler``).

  ``update`` expects the gradients of the loss scaled by ``scale_loss``. It checks them for
  Inf/NaN into one flag, unscales them in float32 by ``float32(1 / float64(scale))``, and
  then either runs ``inner`` on the unscaled gradients or, on overflow, skips it: ``-0.0`` updates
  (``apply_updates`` leaves every parameter bit-identical, ``-0.0`` ones too) and an inner state
  left bit-identical (step counts and schedules do not advance). Finally the scale
  is multiplied by ``backoff_factor`` after an overflow, or by ``growth_factor`` after
  ``growth_interval`` consecutive finite steps (unless that would overflow float32), rounding the
  float64 product to float32 exactly as torch's kernel does. Everything runs under ``jit``.

  Args:
    inner: the optimizer to wrap; put gradient clipping inside it so it sees unscaled gradients.
    init_scale: the initial scale, > 0 and finite in float32.
    growth_factor: the factor (> 1) the scale grows by.
    backoff_factor: the factor (in (0, 1)) the scale backs off by. There is no floor, as in torch.
    growth_interval: the number (>= 1) of consecutive finite steps before the scale grows.
    enabled: ``False`` makes the wrapper an exact pass-through of ``inner`` (scale 1.0).
    axis_name: a mapped axis name (``shard_map``, ``pmap``) or tuple of names over which the
      finite check is reduced, so that every shard skips the same steps. Needed whenever shards
      see different gradients (e.g. sharded parameters, or gradients not yet averaged). Sharded
      gradients, updates and optimizer states work under ``shard_map``'s ``check_vma``.

  Returns:
    A ``GradientTransformationExtraArgs``. Its ``update(grads, state, params, **extra_args)``
    forwards the extra arguments to ``inner``, except ``found_inf``: passing the ``found_inf``
    returned by ``unscale`` says that ``grads`` are already unscaled (torch's ``unscale_`` before
    ``step``), so ``update`` neither unscales nor checks them again and skips the step exactly when
    ``found_inf`` is true.
  """
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  _check_args(
      inner, init_scale, growth_factor, backoff_factor, growth_interval, enabled, axis_name
  )
  inner = optax.with_extra_args_support(inner)
  hyperparams = LossScaleHyperparams(
      growth_factor=float(growth_factor),
      backoff_factor=float(backoff_factor),
      growth_interval=int(growth_interval),
      enabled=bool(enabled),
      axis_name=axis_name,
  )

  def init_fn(params: optax.Params) -> DynamicLossScaleState:
    _register_flax_serialization()
    return DynamicLossScaleState(
        scale=jnp.asarray(init_scale if enabled else 1.0, jnp.float32),
        growth_tracker=jnp.zeros([], jnp.int32),
        found_inf=jnp.array(False),
        skipped_steps=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params),
        hyperparams=hyperparams,
    )

  def update_fn(
      updates: optax.Updates,
      state: DynamicLossScaleState,
      params: optax.Params | None = None,
      *,
      found_inf: Any = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, DynamicLossScaleState]:
    if not isinstance(state, DynamicLossScaleState):
      raise TypeError(
          "`state` must be the DynamicLossScaleState made by this transform's init(), got "
          f"{type(state).__name__}; initialise with the dynamic_loss_scale wrapper, not the "
          "inner optimizer."
      )
    if not state.hyperparams.enabled:  # found_inf is ignored: unscale returned False
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)

    if found_inf is None:
      found_inf = _found_inf(updates, state.hyperparams.axis_name)
      unscale_first = True
    else:  # already unscaled by `unscale` (torch's unscale_ before step): used as given
      found_inf, unscale_first = _check_found_inf(found_inf), False

    # The factors (~100 scalar integer ops) are computed before the cond: inside its branch
    # XLA fuses them into every leaf's update, which tripled the compile time at 516 leaves.
    factors = _unscale_factors(state.scale)[:2] if unscale_first else None

    def do_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      # Unscaling inside the taken branch lets XLA fuse it into the inner update instead of
      # writing a float32 copy of every gradient as the cond's operand.
      grads = _tree_unscale_by(updates, factors) if unscale_first else updates
      return inner.update(grads, state.inner_state, params, **extra_args)

    # Under shard_map the branches must agree on the axes each output varies over: a skipped
    # step's -0.0 updates vary like the taken step's updates, and each inner state leaf varies
    # over the axes of its old and its new value in both branches (sharded gradients make
    # the new updates and moments vary where the constants and the old state need not).
    out_updates, out_state = jax.eval_shape(do_update, None)
    same_tree = jax.tree.structure(out_state) == jax.tree.structure(state.inner_state)

    def take_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      new_updates, inner_state = do_update(None)
      if same_tree:  # else the cond reports the mismatch
        inner_state = jax.tree.map(_vary_like, inner_state, state.inner_state)
      return new_updates, inner_state

    def skip_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      inner_state = state.inner_state
      if same_tree:
        inner_state = jax.tree.map(_vary_like, inner_state, out_state)
      return jax.tree.map(_no_op_update, out_updates), inner_state

    new_updates, inner_state = lax.cond(found_inf, skip_update, take_update, None)
    scale, growth_tracker = _next_scale(
        state.scale, state.growth_tracker, found_inf, state.hyperparams
    )
    return new_updates, DynamicLossScaleState(
        scale=scale,
        growth_tracker=growth_tracker,
        found_inf=found_inf,
        skipped_steps=jnp.where(
            found_inf, optax.safe_increment(state.skipped_steps), state.skipped_steps
        ),
        inner_state=inner_state,
        hyperparams=state.hyperparams,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------------------------------------------
# Helpers that find the scaler state anywhere inside an optimizer state tree.


def _find(opt_state: Any) -> DynamicLossScaleState:
  return state_tree.tree_find_one(opt_state, DynamicLossScaleState, "opt_state")


def _replace(opt_state: Any, fn: Any) -> Any:
  """``opt_state`` with its one scaler state ``s`` replaced by ``fn(s)``."""
  return state_tree.tree_replace_one(opt_state, DynamicLossScaleState, fn, "opt_state")


def get_scale(opt_state: Any) -> jax.Array:
  """The current loss scale, a float32 scalar array (1.0 when the scaler is disabled).

  ``opt_state`` may be the scaler's state or any tree holding it: an ``optax.chain`` /
  ``MultiSteps`` / ``inject_hyperparams`` state, a flax ``TrainState`` or an ``nnx.Optimizer``.
  Unlike torch's ``get_scale`` this does not sync with the host: call ``float()`` for that.
  """
  state = _find(opt_state)
  if not state.enabled:
    return jnp.ones([], jnp.float32)
  return jnp.asarray(state_tree.tree_unwrap(state.scale), jnp.float32)


def _scaled_dtype(x: Any) -> jnp.dtype:
  """The dtype of torch's ``outputs * scale`` for a float32 0-d ``scale``.

  A 0-d scale does not widen a floating n-d tensor (float16/bfloat16 stay what they are); a 0-d
  output promotes with float32 (float16 -> float32, float64 stays); integers and bools become
  float32.
  """
  dtype = jnp.result_type(x)
  if jnp.ndim(x) > 0 and jnp.issubdtype(dtype, jnp.inexact):
    return dtype
  return jnp.promote_types(dtype, jnp.float32)


def _check_output(x: Any) -> None:
  if not isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)):
    raise TypeError(
        "`loss` must be an array or a pytree of arrays (torch: a Tensor or an iterable of "
        f"Tensors), got a leaf of type {type(x).__name__}: {x!r}."
    )


def scale_loss(loss: chex.ArrayTree, opt_state: Any) -> chex.ArrayTree:
  """``loss * scale``: torch's ``scaler.scale(outputs)``, with torch's result dtypes.

  ``loss`` is one array or any pytree of them (torch takes a tensor, a list or a tuple); the result
  has the same structure. Each leaf's dtype is what torch gives for ``output * scale`` with the
  float32 0-d scale: a 0-d loss (the usual case) promotes with float32, so float16/bfloat16/
  float32 losses give float32 and float64 gives float64; an n-d floating output keeps its dtype
  (float16 stays float16, and ``65504 * 2**16`` is inf there, as in torch); integer and bool
  outputs give float32. The product is formed in ``promote_types(dtype, float32)`` and then
  rounded to that dtype, as torch's CPU kernel does for a 0-d scale. The scale is not
  differentiated. When the scaler is disabled ``loss`` is returned unmodified, as in torch.
  """
  if loss is None:
    raise TypeError("`loss` must be an array or a pytree of arrays, got None.")
  state = _find(opt_state)
  if not state.enabled:
    return loss
  scale = lax.stop_gradient(get_scale(opt_state))

  def scale_one(x: Any) -> jax.Array:
    _check_output(x)
    dtype = _scaled_dtype(x)
    compute = jnp.promote_types(dtype, jnp.float32)
    return (jnp.asarray(x, compute) * scale.astype(compute)).astype(dtype)

  return jax.tree.map(scale_one, loss)


def unscale(grads: optax.Updates, opt_state: Any) -> tuple[optax.Updates, jax.Array]:
  """torch's ``scaler.unscale_(optimizer)``, functionally: ``(unscaled grads, found_inf)``.

  ``grads`` (of the scaled loss) are multiplied in float32 by ``float32(1 / float64(scale))``, the
  exact inverse ``update`` uses, and cast back to each leaf's dtype (float16 leaves included,
  which torch's ``unscale_`` refuses). ``found_inf`` is a bool scalar: whether any *scaled*
  gradient is Inf or NaN, reduced over the scaler's ``axis_name`` if it has one. ``opt_state`` is
  not changed. A disabled scaler returns ``grads`` unmodified and ``False``.

  Use it to inspect or modify (e.g. clip) unscaled gradients before the update; then call
  ``tx.update(grads, opt_state, params, found_inf=found_inf)`` so that the update does not unscale
  them again (torch's ``step`` after ``unscale_``). To only inspect them, pass the original scaled
  gradients to ``tx.update`` and no ``found_inf``: both give the same bits.
  """
  state = _find(opt_state)
  if not state.enabled:
    return grads, jnp.array(False)
  scale = jnp.asarray(state_tree.tree_unwrap(state.scale), jnp.float32)
  return _unscale_and_check(grads, scale, state.hyperparams.axis_name)


def _as_new_scale(new_scale: Any) -> Any:
  """Validates ``set_scale``'s ``new_scale``; returns a Python float or a float32 0-d array."""
  if isinstance(new_scale, float):  # np.float64 too
    _check_positive_scale("new_scale", new_scale)
    return new_scale
  if isinstance(new_scale, (jax.Array, np.ndarray, np.generic)):
    if new_scale.dtype == jnp.float32 and new_scale.size == 1:
      return jnp.reshape(new_scale, ())
    got = f"a {new_scale.dtype} array of shape {tuple(new_scale.shape)}"
  else:
    got = f"{type(new_scale).__name__}: {new_scale!r}"
  raise TypeError(
      "`new_scale` must be a float or a 1-element float32 array (as torch's "
      f"`GradScaler.update(new_scale)`), got {got}."
  )


def set_scale(opt_state: Any, new_scale: float | jax.Array) -> Any:
  """torch's ``scaler.update(new_scale)``: ``opt_state`` with the scale set to ``new_scale``.

  ``new_scale`` is a Python float (rounded to float32; it must be > 0 and finite there) or a
  1-element float32 array (any shape with one element, traced or not; its value is not checked,
  which would need a host sync, as in torch). The growth tracker, ``found_inf``, the skipped-step
  count, the hyperparameters and the inner state are untouched. Works under ``jit``. Returns a new
  tree of the same structure (an ``nnx.Optimizer`` is updated in place and returned). A disabled
  scaler ignores the call, as in torch, after the same validation.
  """
  value = _as_new_scale(new_scale)
  if not _find(opt_state).enabled:
    return opt_state
  return _replace(opt_state, lambda s: s._replace(scale=_like(s.scale, value, jnp.float32)))


def _replace_hyperparams(opt_state: Any, **changes: Any) -> Any:
  return _replace(
      opt_state, lambda s: s._replace(hyperparams=dataclasses.replace(s.hyperparams, **changes))
  )


def get_growth_factor(opt_state: Any) -> float:
  """torch's ``scaler.get_growth_factor()``: the growth factor, a Python float."""
  return _find(opt_state).growth_factor


def get_backoff_factor(opt_state: Any) -> float:
  """torch's ``scaler.get_backoff_factor()``: the backoff factor, a Python float."""
  return _find(opt_state).backoff_factor


def get_growth_interval(opt_state: Any) -> int:
  """torch's ``scaler.get_growth_interval()``: the growth interval, a Python int."""
  return _find(opt_state).growth_interval


def is_enabled(opt_state: Any) -> bool:
  """torch's ``scaler.is_enabled()``: whether the scaler in ``opt_state`` is enabled."""
  return _find(opt_state).enabled


def set_growth_factor(opt_state: Any, new_factor: float) -> Any:
  """torch's ``scaler.set_growth_factor(new_factor)``, returning the new ``opt_state``.

  ``new_factor`` is validated as ``dynamic_loss_scale``'s ``growth_factor`` (a real number > 1,
  finite). It is a static hyperparameter: a jitted step retraces once for the new value.
  """
  _check_growth_factor(new_factor)
  return _replace_hyperparams(opt_state, growth_factor=float(new_factor))


def set_backoff_factor(opt_state: Any, new_factor: float) -> Any:
  """torch's ``scaler.set_backoff_factor(new_factor)``, returning the new ``opt_state``.

  ``new_factor`` is validated as ``dynamic_loss_scale``'s ``backoff_factor`` (in (0, 1)).
  """
  _check_backoff_factor(new_factor)
  return _replace_hyperparams(opt_state, backoff_factor=float(new_factor))


def set_growth_interval(opt_state: Any, new_interval: int) -> Any:
  """torch's ``scaler.set_growth_interval(new_interval)``, returning the new ``opt_state``.

  ``new_interval`` is validated as ``dynamic_loss_scale``'s ``growth_interval`` (an int >= 1).
  The growth tracker is kept, as in torch: it is compared with the new interval from the next
  update on (a tracker already past it counts up without growing until the next overflow).
  """
  _check_growth_interval(new_interval)
  return _replace_hyperparams(opt_state, growth_interval=int(new_interval))


_STATE_DICT_KEYS = (
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"
)


def state_dict(opt_state: Any) -> dict[str, Any]:
  """torch's ``GradScaler.state_dict()``: the scaler's state as Python numbers.

  The keys are torch's: ``scale``, ``growth_factor``, ``backoff_factor`` (floats),
  ``growth_interval`` and ``_growth_tracker`` (ints); ``{}`` when the scaler is disabled, so a
  torch checkpoint's scaler entry loads here and the other way round. Reads the device (a sync).
  """
  state = _find(opt_state)
  if not state.enabled:
    return {}
  return {
      "scale": float(state_tree.tree_unwrap(state.scale)),
      "growth_factor": state.growth_factor,
      "backoff_factor": state.backoff_factor,
      "growth_interval": state.growth_interval,
      "_growth_tracker": int(state_tree.tree_unwrap(state.growth_tracker)),
  }


def _like(old: Any, value: Any, dtype: Any) -> Any:
  """``value`` as an array shaped and placed like ``old``; an ``nnx.Variable`` is set in place."""
  new = jnp.asarray(value, dtype)
  if state_tree.is_variable(old):
    old.set_value(_like(old.get_value(), value, dtype))
    return old
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
    return jax.device_put(new, old.sharding)
  return new


class EmptyStateDictError(RuntimeError, ValueError):
  """``load_state_dict`` of ``{}`` into an enabled scaler.

  A ``RuntimeError``, as torch raises, and a ``ValueError``, as jaxamp raises for bad values.
  """


def load_state_dict(opt_state: Any, state_dict: dict[str, Any]) -> Any:
  """torch's ``GradScaler.load_state_dict``: returns ``opt_state`` with the scaler state replaced.

  Restores what torch restores: the scale (rounded to float32, as torch's ``fill_``), the growth
  tracker, and the three hyperparameters, the factors kept to the last float64 bit; extra keys are
  ignored. ``enabled`` is not in the dict and stays as it is. A disabled scaler ignores the dict
  (whatever it holds), as in torch. For an enabled one, an empty dict (saved from a disabled
  scaler) raises ``EmptyStateDictError``, a ``RuntimeError`` as in torch; missing keys and values
  ``dynamic_loss_scale`` would reject raise ``ValueError``/``TypeError`` (torch checks nothing).

  The result has the structure of ``opt_state`` (a chain tuple stays a tuple, a ``TrainState`` a
  ``TrainState``); the scale and growth tracker keep their dtype, shape and sharding. Loading other
  factors or interval than the current ones changes the static hyperparameters and hence the
  treedef, so a jitted step retraces once. An ``nnx.Optimizer`` is updated in place and returned.
  """
  state = _find(opt_state)
  if not state.enabled:
    return opt_state
  if not isinstance(state_dict, dict):
    raise TypeError(f"`state_dict` must be a dict, got {type(state_dict).__name__}.")
  if not state_dict:
    raise EmptyStateDictError(
        "`state_dict` is empty, possibly because it was saved from a disabled scaler (torch: "
        "\"The source state dict is empty, possibly because it was saved from a disabled "
        f"instance of GradScaler.\"); expected the keys {list(_STATE_DICT_KEYS)}."
    )
  missing = [k for k in _STATE_DICT_KEYS if k not in state_dict]
  if missing:
    raise ValueError(
        f"`state_dict` lacks the keys {missing}; expected {list(_STATE_DICT_KEYS)}, got "
        f"{sorted(state_dict)}."
    )
  _check_hyperparams(
      state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"]
  )
  scale = state_dict["scale"]
  if isinstance(scale, jax.Array | np.ndarray) and np.shape(scale) == () \
      and jnp.issubdtype(scale.dtype, jnp.floating) and not isinstance(scale, jax.core.Tracer):
    scale = float(scale)  # the scale is state: get_scale's 0-d array is welcome
  _check_real("scale", scale)
  with np.errstate(over="ignore"):
    if not 0.0 <= float(np.float32(scale)) < math.inf:
      raise ValueError(
          f"`scale` must be >= 0 and finite in float32 (a scale backs off to 0 at worst), got "
          f"{scale!r}."
      )
  tracker = state_dict["_growth_tracker"]
  if isinstance(tracker, (bool, np.bool_)) or not isinstance(tracker, numbers.Integral):
    raise TypeError(
        f"`_growth_tracker` must be an int, got {type(tracker).__name__}: {tracker!r}."
    )
  interval = int(state_dict["growth_interval"])
  if not 0 <= int(tracker) < interval:
    raise ValueError(
        f"`_growth_tracker` must be an int in [0, growth_interval) = [0, {interval}): a tracker "
        f"that reached the interval would never let the scale grow again; got {tracker!r}."
    )

  def load(old: DynamicLossScaleState) -> DynamicLossScaleState:
    return old._replace(
        scale=_like(old.scale, float(scale), jnp.float32),
        growth_tracker=_like(old.growth_tracker, int(tracker), jnp.int32),
        hyperparams=dataclasses.replace(  # keeps `enabled` and `axis_name`
            old.hyperparams,
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            growth_interval=int(state_dict["growth_interval"]),
        ),
    )

  return _replace(opt_state, load)
