"""The rest of torch's ``GradScaler``, as functions of the optimizer state.

``scale_loss`` is ``scale``; ``unscale`` is ``unscale_`` (``update(..., found_inf=...)`` is ``step``
after it); ``set_scale`` is ``update(new_scale)``; then ``get_scale``, the hyperparameter getters
and setters, ``is_enabled``, ``state_dict`` and ``load_state_dict``. Each finds the scaler state
(``loss_scale.DynamicLossScaleState``) anywhere in an optimizer state tree (``state_tree``); the
setters return a new tree. ``jaxamp.scaler`` is the public namespace of the accessors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src.integrations import state_tree
from jaxamp._src.scaler import checks, loss_scale
from jaxamp._src.scaler.checks import EmptyStateDictError


def _find(opt_state: Any) -> loss_scale.DynamicLossScaleState:
  return state_tree.tree_find_one(opt_state, loss_scale.DynamicLossScaleState, "opt_state")


def _replace(opt_state: Any, fn: Any) -> Any:
  """``opt_state`` with its one scaler state ``s`` replaced by ``fn(s)``."""
  return state_tree.tree_replace_one(opt_state, loss_scale.DynamicLossScaleState, fn, "opt_state")


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
  checks.check_no_float8(loss, "loss")
  scale = lax.stop_gradient(get_scale(opt_state))

  def scale_one(x: Any) -> jax.Array:
    checks.check_output(x)
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
  return loss_scale.unscale_and_check(grads, scale, state.hyperparams.axis_name)


def set_scale(opt_state: Any, new_scale: float | jax.Array) -> Any:
  """torch's ``scaler.update(new_scale)``: ``opt_state`` with the scale set to ``new_scale``.

  ``new_scale`` is a Python float (rounded to float32; it must be > 0 and finite there) or a
  1-element float32 array (any shape with one element, traced or not; its value is not checked,
  which would need a host sync, as in torch). The growth tracker, ``found_inf``, the skipped-step
  count, the hyperparameters and the inner state are untouched. Works under ``jit``. Returns a new
  tree of the same structure (an ``nnx.Optimizer`` is updated in place and returned). A disabled
  scaler ignores the call, as in torch, after the same validation.
  """
  value = checks.as_new_scale(new_scale)
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
  checks.check_growth_factor(new_factor)
  return _replace_hyperparams(opt_state, growth_factor=float(new_factor))


def set_backoff_factor(opt_state: Any, new_factor: float) -> Any:
  """torch's ``scaler.set_backoff_factor(new_factor)``, returning the new ``opt_state``.

  ``new_factor`` is validated as ``dynamic_loss_scale``'s ``backoff_factor`` (in (0, 1)).
  """
  checks.check_backoff_factor(new_factor)
  return _replace_hyperparams(opt_state, backoff_factor=float(new_factor))


def set_growth_interval(opt_state: Any, new_interval: int) -> Any:
  """torch's ``scaler.set_growth_interval(new_interval)``, returning the new ``opt_state``.

  ``new_interval`` is validated as ``dynamic_loss_scale``'s ``growth_interval`` (an int >= 1).
  The growth tracker is kept, as in torch: it is compared with the new interval from the next
  update on (a tracker already past it counts up without growing until the next overflow).
  """
  checks.check_growth_interval(new_interval)
  return _replace_hyperparams(opt_state, growth_interval=int(new_interval))


_STATE_DICT_KEYS = (
  "scale",
  "growth_factor",
  "backoff_factor",
  "growth_interval",
  "_growth_tracker",
)


def state_dict(opt_state: Any) -> dict[str, Any]:
  """torch's ``GradScaler.state_dict()``: the scaler's state as Python numbers.

  The keys are torch's: ``scale``, ``growth_factor``, ``backoff_factor`` (floats),
  ``growth_interval`` and ``_growth_tracker`` (ints); ``{}`` when the scaler is disabled, so a
  torch checkpoint's scaler entry loads here and the other way round. A ``min_scale`` floor adds
  that key (a float), which torch's ``load_state_dict`` ignores. Reads the device (a sync).
  """
  state = _find(opt_state)
  if not state.enabled:
    return {}
  d = {
    "scale": float(_host_value("scale", state.scale)),
    "growth_factor": state.growth_factor,
    "backoff_factor": state.backoff_factor,
    "growth_interval": state.growth_interval,
    "_growth_tracker": int(_host_value("growth_tracker", state.growth_tracker)),
  }
  if state.min_scale is not None:
    d["min_scale"] = state.min_scale
  return d


def _host_value(name: str, value: Any) -> np.generic:
  """The one value of a scaler state's leaf, read from the device: a 0-d array, or copies of it
  (a ``pmap``-replicated state holds one per device)."""
  value = state_tree.tree_unwrap(value)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      "`state_dict` reads the scaler's state on the host (a sync, as torch's does): call it "
      "outside `jit`. Inside `jit`, `jaxamp.scaler.get_scale` returns the scale as an array."
    )
  values = np.asarray(value).ravel()
  if values.size == 0 or (values != values[0]).any():
    raise ValueError(
      f"The scaler's {name} holds {values.size} different values {values[:8].tolist()}; a "
      "state_dict has one. Replicas (pmap) agree when the scaler has the `axis_name` of the "
      "gradients' all-reduce; read one replica with `jax.tree.map(lambda x: x[0], opt_state)`."
    )
  return values[0]


def _like(old: Any, value: Any, dtype: Any) -> Any:
  """``value`` as an array shaped and placed like ``old`` (a ``pmap``-replicated leaf gets a copy
  per device); an ``nnx.Variable`` is set in place."""
  if state_tree.is_variable(old):
    old.set_value(_like(old.get_value(), value, dtype))
    return old
  new = jnp.broadcast_to(jnp.asarray(value, dtype), np.shape(old))
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
    return jax.device_put(new, old.sharding)
  return new


def load_state_dict(opt_state: Any, state_dict: dict[str, Any]) -> Any:
  """torch's ``GradScaler.load_state_dict``: returns ``opt_state`` with the scaler state replaced.

  Restores what torch restores: the scale (rounded to float32, as torch's ``fill_``), the growth
  tracker, and the three hyperparameters, the factors kept to the last float64 bit; extra keys are
  ignored. ``enabled`` is not in the dict and stays as it is; so does ``min_scale`` unless the dict
  has that key (``None`` there removes the floor). A disabled scaler ignores the dict
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
      '"The source state dict is empty, possibly because it was saved from a disabled '
      f'instance of GradScaler."); expected the keys {list(_STATE_DICT_KEYS)}.'
    )
  missing = [k for k in _STATE_DICT_KEYS if k not in state_dict]
  if missing:
    raise ValueError(
      f"`state_dict` lacks the keys {missing}; expected {list(_STATE_DICT_KEYS)}, got "
      f"{sorted(state_dict)}."
    )
  checks.check_hyperparams(
    state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"]
  )
  min_scale = state_dict.get("min_scale", state.min_scale)
  checks.check_min_scale(min_scale)
  scale = state_dict["scale"]
  if any(isinstance(state_dict[k], jax.core.Tracer) for k in ("scale", "_growth_tracker")):
    raise TypeError(
      "`load_state_dict` runs on the host, outside `jit`: the hyperparameters it loads are "
      "static. Inside `jit`, set a traced scale with `jaxamp.scaler.set_scale`."
    )
  if (
    isinstance(scale, jax.Array | np.ndarray)
    and np.shape(scale) == ()
    and jnp.issubdtype(scale.dtype, jnp.floating)
  ):
    scale = float(scale)  # the scale is state: get_scale's 0-d array is welcome
  checks.check_real("scale", scale)
  with np.errstate(over="ignore"):
    if not 0.0 <= float(np.float32(scale)) < math.inf:
      raise ValueError(
        f"`scale` must be >= 0 and finite in float32 (a scale backs off to 0 at worst), got "
        f"{scale!r}."
      )
  tracker = state_dict["_growth_tracker"]
  checks.check_growth_tracker(tracker)

  def load(old: loss_scale.DynamicLossScaleState) -> loss_scale.DynamicLossScaleState:
    return old._replace(
      scale=_like(old.scale, float(scale), jnp.float32),
      growth_tracker=_like(old.growth_tracker, int(tracker), jnp.int32),
      hyperparams=dataclasses.replace(  # keeps `enabled` and `axis_name`
        old.hyperparams,
        growth_factor=float(state_dict["growth_factor"]),
        backoff_factor=float(state_dict["backoff_factor"]),
        growth_interval=int(state_dict["growth_interval"]),
        min_scale=None if min_scale is None else float(min_scale),
      ),
    )

  return _replace(opt_state, load)
