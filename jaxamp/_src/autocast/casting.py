"""The dtype conversions autocast inserts: which dtypes it casts, how constants keep finite
values finite in a 16-bit dtype, and the cast cache that converts a value at most once."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from jaxamp._src import compat
from jaxamp._src.policies.table import ELIGIBLE_DTYPES, LOW_DTYPES

prims = compat.primitives


def is_eligible(dtype) -> bool:
  """Whether autocast may change a value of ``dtype``: float32, float16 or bfloat16."""
  return dtype in ELIGIBLE_DTYPES


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
  """The dtype JAX promotes ``dtypes`` to."""
  result = dtypes[0]
  for dtype in dtypes[1:]:
    result = jnp.promote_types(result, dtype)
  return jnp.dtype(result)


def saturating_constant(value, dtype: np.dtype) -> np.ndarray:
  """A constant in ``dtype``, finite values clipped to its range (infinities and NaN kept).

  torch takes ``finfo(x.dtype).min`` of the run-time dtype for masks; a ``finfo(float32).min``
  taken at trace time and moved into float16 must not become ``-inf``.
  """
  value = np.asarray(value)
  if jnp.dtype(dtype) in LOW_DTYPES and jnp.issubdtype(value.dtype, jnp.floating):
    info = jnp.finfo(dtype)
    wide = value.astype(np.float64)  # clipped there: float16 cannot hold bfloat16's bounds
    value = np.where(np.isfinite(wide), np.clip(wide, float(info.min), float(info.max)), wide)
  return np.asarray(value, dtype)


def fits(value, dtype: np.dtype) -> bool:
  """Whether a constant keeps its magnitude in ``dtype``: a finite value stays finite and a
  nonzero one nonzero (infinities and NaN are what they are in any dtype)."""
  value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return True
  with np.errstate(over="ignore", under="ignore"):
    rounded = np.asarray(value, jnp.dtype(dtype))
  lost = np.isfinite(value) & (~np.isfinite(rounded) | ((rounded == 0) & (value != 0)))
  return not lost.any()


def saturating_convert(value, dtype: np.dtype) -> Any:
  """``value`` converted to ``dtype``, finite values clipped to its range as constants are;
  staged (``compat.staged``) while linearizing, as ``convert`` is."""
  source = jnp.dtype(compat.typeof(value).dtype)
  if jnp.dtype(dtype) not in LOW_DTYPES or jnp.finfo(source).max <= jnp.finfo(dtype).max:
    return convert(value, dtype)
  if not isinstance(value, jax.core.Tracer):  # known now: clipped here, nothing traced
    return saturating_constant(value, dtype)
  dtype = jnp.dtype(dtype)
  saturate = functools.partial(saturating_convert_p.bind, new_dtype=dtype)
  return compat.call_staged(("saturate", dtype), saturate, value)


def _saturated(ctx, value, *, new_dtype: np.dtype) -> list[Any]:
  """The lowering: ``value`` in ``new_dtype``, finite values clamped to its range, infinities
  and NaN kept (``clamp`` keeps NaN): ``convert(select(is_finite(x), clamp(low, x, high), x))``."""
  (aval,), (out_aval,) = ctx.avals_in, ctx.avals_out
  low, high = _bounds(aval.dtype, new_dtype)
  bound = jax.core.ShapedArray((), aval.dtype)
  mask = aval.update(dtype=np.dtype(bool), weak_type=False)
  bounds = [mlir.ir_constant(low), mlir.ir_constant(high)]
  (clipped,) = compat.lower_as(
    ctx, prims.clamp_p, [bounds[0], value, bounds[1]], [bound, aval, bound], [aval]
  )
  (finite,) = compat.lower_as(ctx, prims.is_finite_p, [value], [aval], [mask])
  (kept,) = compat.lower_as(
    ctx, prims.select_n_p, [finite, value, clipped], [mask, aval, aval], [aval]
  )
  return [compat.lower_convert(ctx, kept, aval, out_aval)]


def _saturated_type(aval, *, new_dtype: np.dtype) -> Any:
  return compat.aval_with_dtype(aval, new_dtype)


def _saturated_tangent(tangent, value, *, new_dtype: np.dtype) -> Any:
  """The tangent converted, clipped values' too: differentiated as the cast it stands for, as
  torch's ``x.to(dtype)`` is (its gradient is the incoming one cast back, whatever the value)."""
  return lax.convert_element_type(tangent, new_dtype)


def _bounds(source: np.dtype, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
  """``dtype``'s finite range in ``source``, rounded toward zero."""
  info = jnp.finfo(dtype)
  return _within(info.min, jnp.dtype(source)), _within(info.max, jnp.dtype(source))


# A cast that clips finite values to the 16-bit range: one eqn, where it is traced for every
# float32 parameter a model casts down (five as ``lax`` ops, linearized call by call).
saturating_convert_p = compat.unary_primitive(
  "jaxamp_saturating_convert", _saturated, _saturated_type, _saturated_tangent
)


def _within(bound, source: np.dtype) -> np.ndarray:
  """``bound`` in ``source``, rounded toward zero: float16's largest value rounds up to 65536 in
  bfloat16, which float16 cannot hold."""
  rounded = np.asarray(bound, source)
  if abs(float(rounded)) > abs(float(bound)):
    rounded = np.nextafter(rounded, np.zeros((), source))
  return rounded


def convert(value, dtype: np.dtype) -> Any:
  """``lax.convert_element_type``; staged (``compat.staged``) while linearizing."""
  dtype = jnp.dtype(dtype)
  cast = functools.partial(lax.convert_element_type, new_dtype=dtype)
  return compat.call_staged(("convert", dtype), cast, value)


def as_dtype(value, dtype: np.dtype | None) -> Any:
  """``value`` in ``dtype`` (None: as it is), converted only if it is not in it already."""
  if dtype is None or compat.typeof(value).dtype == dtype:
    return value
  return convert(value, dtype)


class CastCache:
  """The casts made while evaluating one jaxpr, so a value is converted at most once per dtype.

  Attributes:
    made: (variable, dtype) -> the converted value (a loop's hoisted casts are given in).
    converts: converts emitted so far (``explain`` counts them per eqn).
    hoistable: loop-invariant invars whose casts may move out of the loop body.
    hoisted: the casts asked of hoistable invars, in order.
  """

  def __init__(self, hoistable: frozenset = frozenset(), precast: dict | None = None):
    self.made: dict[tuple[Any, np.dtype], Any] = dict(precast or {})
    self.converts = 0
    self.hoistable = hoistable
    self.hoisted: list[tuple[Any, np.dtype]] = []

  def convert(self, value, dtype: np.dtype, saturate: bool = False) -> Any:
    """``value`` in ``dtype``; a constant (``saturate``) keeps finite values finite."""
    self.converts += 1
    if saturate:
      return saturating_convert(value, dtype)
    return convert(value, dtype)

  def ask(self, key: tuple[Any, np.dtype]) -> Any | None:
    """The cached cast for ``key``, noting a hoistable invar's cast as wanted outside."""
    if key in self.made:
      return self.made[key]
    if key[0] in self.hoistable and key not in self.hoisted:
      self.hoisted.append(key)
    return None
