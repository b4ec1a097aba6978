"""Validation of the loss scaler's arguments, as torch's ``GradScaler`` validates them, and more.

``dynamic_loss_scale``, the hyperparameter setters and ``load_state_dict`` share these checks, so
a value one of them rejects is rejected by all, with the same message. Each error names the
argument in backticks and says what was expected and what was received.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


class EmptyStateDictError(RuntimeError, ValueError):
  """A scaler state from a disabled scaler loaded into an enabled one: ``load_state_dict`` of
  ``{}``, or a flax checkpoint of a disabled scaler restored into an enabled one.

  A ``RuntimeError``, as torch raises, and a ``ValueError``, as jaxamp raises for bad values.
  """


def check_args(
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
  check_hyperparams(growth_factor, backoff_factor, growth_interval)
  check_positive_scale("init_scale", init_scale)
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"`enabled` must be a bool, got {type(enabled).__name__}: {enabled!r}.")
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
      f"`axis_name` must be None, an axis name or a tuple of axis names, got "
      f"{type(axis_name).__name__}: {axis_name!r}."
    ) from None


def check_real(name: str, value: Any) -> None:
  """Raises a TypeError unless ``value`` is a real Python/NumPy number (bools are not)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    hint = ""
    if isinstance(value, jax.Array):
      hint = " (hyperparameters are static Python numbers, not arrays)"
    raise TypeError(f"`{name}` must be a real number{hint}, got {type(value).__name__}: {value!r}.")


def check_positive_scale(name: str, value: Any) -> None:
  """A scale given as a number must be > 0 and finite once rounded to float32."""
  check_real(name, value)
  with np.errstate(over="ignore"):
    as_float32 = float(np.float32(value))
  if not 0.0 < as_float32 < math.inf:
    raise ValueError(
      f"`{name}` must be > 0 and finite in float32 (at most 3.4028235e38), got {value!r}."
    )


def check_growth_factor(growth_factor: Any) -> None:
  """A real number > 1, finite: the scale must grow."""
  check_real("growth_factor", growth_factor)
  if not 1.0 < float(growth_factor) < math.inf:
    raise ValueError(f"`growth_factor` must be > 1.0 and finite, got {growth_factor!r}.")


def check_backoff_factor(backoff_factor: Any) -> None:
  """A real number in (0, 1): the scale must shrink and stay > 0."""
  check_real("backoff_factor", backoff_factor)
  if not 0.0 < float(backoff_factor) < 1.0:
    raise ValueError(
      f"`backoff_factor` must satisfy 0 < backoff_factor < 1, got {backoff_factor!r}."
    )


def check_growth_tracker(tracker: Any) -> None:
  """An int in [0, 2**31 - 1], the int32 it is stored in. A tracker at or past the interval is
  valid (set_growth_interval lowering the interval leaves one): it counts on until the next
  overflow resets it, as torch's does."""
  if isinstance(tracker, (bool, np.bool_)) or not isinstance(tracker, numbers.Integral):
    raise TypeError(f"`_growth_tracker` must be an int, got {type(tracker).__name__}: {tracker!r}.")
  if not 0 <= int(tracker) <= np.iinfo(np.int32).max:
    raise ValueError(
      f"`_growth_tracker` must be an int in [0, 2**31 - 1] (it is stored in int32), got "
      f"{tracker!r}."
    )


def check_growth_interval(growth_interval: Any) -> None:
  """An int in [1, 2**31 - 1]: the growth tracker is an int32."""
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


def check_min_scale(min_scale: Any, init_scale: Any = None) -> None:
  """``None`` (no floor, as torch) or a scale > 0, finite in float32, at most ``init_scale``."""
  if min_scale is None:
    return
  valid = "None (no floor, as in torch) or a real number > 0 and finite in float32"
  if init_scale is not None:
    valid += f", at most `init_scale` ({init_scale!r})"
  if isinstance(min_scale, (bool, np.bool_)) or not isinstance(min_scale, numbers.Real):
    raise TypeError(f"`min_scale` must be {valid}, got {type(min_scale).__name__}: {min_scale!r}.")
  with np.errstate(over="ignore"):
    as_float32 = float(np.float32(min_scale))
  too_big = init_scale is not None and as_float32 > float(np.float32(init_scale))
  if not 0.0 < as_float32 < math.inf or too_big:
    raise ValueError(f"`min_scale` must be {valid}, got {min_scale!r}.")


def check_hyperparams(growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
  """Validates the hyperparameters kept in the state (constructor, setters, load_state_dict)."""
  check_growth_factor(growth_factor)
  check_backoff_factor(backoff_factor)
  check_growth_interval(growth_interval)


def check_found_inf(found_inf: Any) -> jax.Array:
  """The ``found_inf`` extra argument of ``update``: a bool scalar (``unscale``'s second output)."""
  is_array = isinstance(found_inf, (bool, np.bool_, jax.Array, np.ndarray))
  if not (is_array and jnp.shape(found_inf) == () and jnp.result_type(found_inf) == jnp.bool_):
    what = type(found_inf).__name__
    if hasattr(found_inf, "dtype") and hasattr(found_inf, "shape"):
      what = f"a {found_inf.dtype} array of shape {tuple(found_inf.shape)}"
    raise TypeError(
      f"`found_inf` must be a bool scalar (the second output of `jaxamp.unscale`), got {what}."
    )
  return jnp.asarray(found_inf)


def check_output(x: Any) -> None:
  """A leaf of ``scale_loss``'s ``loss``: an array or a number (torch: a Tensor)."""
  if not isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)):
    raise TypeError(
      "`loss` must be an array or a pytree of arrays (torch: a Tensor or an iterable of "
      f"Tensors), got a leaf of type {type(x).__name__}: {x!r}."
    )


def check_no_float8(tree: Any, argument: str) -> None:
  """Refuses float8 leaves of ``argument`` (the loss or the gradients): torch's GradScaler has no
  float8 arithmetic (float8 does not promote with the float32 scale), and neither has JAX."""
  for leaf in jax.tree.leaves(tree):
    dtype = getattr(leaf, "dtype", None)  # other leaves fail their own checks
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
      raise TypeError(
        f"`{argument}` has a {dtype} leaf: loss scaling computes in float32 with the scale, "
        "which float8 does not promote with (torch's GradScaler refuses float8 too). Float8 "
        "autocast (`dtype=jnp.float8_e4m3fn`) keeps float32 parameters, losses and gradients; "
        f"cast float8 values to float32 first (`jax.tree.map(lambda x: x.astype(jnp.float32), "
        f"{argument})`)."
      )


def as_new_scale(new_scale: Any) -> Any:
  """Validates ``set_scale``'s ``new_scale``; returns a Python float or a float32 0-d array."""
  if isinstance(new_scale, float):  # np.float64 too
    check_positive_scale("new_scale", new_scale)
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
