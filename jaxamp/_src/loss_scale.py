"""Dynamic loss scaling: torch's ``GradScaler`` as an optax ``GradientTransformation``.

``dynamic_loss_scale(inner)`` wraps the real optimizer. Its ``update`` receives the gradients of
the *scaled* loss and does what ``scaler.step(optimizer); scaler.update()`` does in torch:

1. one fused finite check over the whole gradient tree (reduced over ``axis_name`` when given);
2. unscale in float32 with ``inv = f32(1 / f64(scale))``;
3. on overflow skip the inner step (zero updates, inner state bit-identical), else run it;
4. back off or grow the scale, rounding ``f64(scale) * factor`` to float32 as torch does.

Products with non-power-of-two factors (0.3, 1.1) must round exactly as torch's C++ does:
``static_cast<float>(float * double)``, i.e. the exact product rounded to float64 and then to
float32 (two roundings). Without ``jax_enable_x64`` there is no float64 inside ``jit``, so
``_round_f64_then_f32`` emulates both roundings on the exact product held as a vector of bits,
using integer arithmetic only. Integer ops are exact on every backend; float error-free
transformations (Dekker, TwoSum) are not safe where XLA contracts ``a * b + c`` into an FMA.
"""

from __future__ import annotations

import dataclasses
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
    "dynamic_loss_scale",
    "get_scale",
    "load_state_dict",
    "scale_loss",
    "state_dict",
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
  """

  growth_factor: float
  backoff_factor: float
  growth_interval: int
  enabled: bool = True


class DynamicLossScaleState(NamedTuple):
  """State of the ``GradientTransformation`` returned by ``dynamic_loss_scale``.

  Attributes:
    scale: the current loss scale, a float32 scalar whatever the gradient dtypes (1.0 when the
      scaler is disabled).
    growth_tracker: int32 number of consecutive finite steps since the scale last changed
      (torch's ``_growth_tracker``).
    found_inf: bool scalar, whether the last update found an Inf or NaN and was skipped.
    skipped_steps: int32 number of updates skipped since ``init`` (saturates, never wraps).
    inner_state: the state of the wrapped optimizer.
    hyperparams: the static ``LossScaleHyperparams`` (growth/backoff factors, growth interval,
      enabled flag); also readable as ``state.growth_factor`` etc.
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
# Exact float32 (x) float64 arithmetic without float64: integers held as vectors of bits.

_F32_INF_BITS = 0x7F800000


def _decompose_f32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)`` with ``|x| = m * 2**e`` and ``m`` in ``[2**23, 2**24)``, for finite ``x != 0``."""
  u = lax.bitcast_convert_type(x, jnp.uint32)
  biased = (u >> 23) & 0xFF
  frac = u & 0x7FFFFF
  normal = biased > 0
  m = jnp.where(normal, frac | 0x800000, frac)
  e = jnp.where(normal, biased.astype(jnp.int32) - 150, -149)
  shift = jnp.maximum(lax.clz(m).astype(jnp.int32) - 8, 0)  # normalises subnormals
  return (m << shift.astype(jnp.uint32)).astype(jnp.int32), e - shift


def _limbs_to_bits(limbs: jax.Array, limb_bits: int) -> jax.Array:
  """Little-endian int32 limbs of ``limb_bits`` bits each -> little-endian vector of 0/1 bits."""
  shifts = jnp.arange(limb_bits, dtype=jnp.int32)
  return ((limbs[:, None] >> shifts[None, :]) & 1).reshape(-1)


def _round_at(bits: jax.Array, pos: jax.Array) -> jax.Array:
  """Rounds the integer ``bits`` to a multiple of ``2**pos``, ties to even (any ``pos >= 0``)."""
  idx = jnp.arange(bits.shape[0], dtype=jnp.int32)
  guard = jnp.sum(jnp.where(idx == pos - 1, bits, 0))
  sticky = jnp.any((bits > 0) & (idx < pos - 1))
  lsb = jnp.sum(jnp.where(idx == pos, bits, 0))
  round_up = (guard > 0) & (sticky | (lsb > 0))
  kept = jnp.where(idx >= pos, bits, 0)
  # Adding 2**pos flips the run of ones starting at `pos` and the zero just above it.
  zeros_above_pos = jnp.where(idx >= pos, 1 - kept, 0)
  zeros_before = jnp.cumsum(zeros_above_pos) - zeros_above_pos
  flip = (idx >= pos) & (zeros_before == 0) & round_up
  return kept ^ flip.astype(kept.dtype)


def _top_bit(bits: jax.Array) -> jax.Array:
  """Index of the highest set bit (-1 for zero)."""
  idx = jnp.arange(bits.shape[0], dtype=jnp.int32)
  return jnp.max(jnp.where(bits > 0, idx, -1))


def _round_f64_then_f32(bits: jax.Array, exponent: jax.Array) -> jax.Array:
  """``float32(float64(X * 2**exponent))`` for the positive integer ``X`` given as bits.

  Both roundings are to nearest, ties to even. float64's exponent range is treated as unbounded:
  where it is not (products below 2**-1022 or above 2**1024) float32 gives 0 or inf anyway.
  """
  idx = jnp.arange(bits.shape[0], dtype=jnp.int32)
  as_f64 = _round_at(bits, jnp.maximum(_top_bit(bits) - 52, 0))  # 53 significant bits
  # 24 significant bits, or fewer where the result is subnormal (the last bit is 2**-149).
  pos = jnp.maximum(_top_bit(as_f64) - 23, -149 - exponent)
  as_f32 = _round_at(as_f64, pos)
  in_window = (idx >= pos) & (idx < pos + 25)
  m = jnp.sum(jnp.where(in_window, as_f32 << jnp.clip(idx - pos, 0, 24), 0))  # < 2**25
  # Biased exponent of m's unit bit. One formula covers normal and subnormal results, and the
  # carry of m = 2**24 (or 2**23 for subnormals) moves into the exponent field by itself.
  field = pos + exponent + 149
  out = (jnp.clip(field, 0, 254).astype(jnp.uint32) << 23) + m.astype(jnp.uint32)
  out = jnp.where((field > 254) | (out > _F32_INF_BITS), jnp.uint32(_F32_INF_BITS), out)
  return lax.bitcast_convert_type(out, jnp.float32)


def _f64_limbs(factor: float) -> tuple[np.ndarray, int]:
  """A positive finite float64 as five little-endian 12-bit limbs and an exponent."""
  mantissa, exponent = math.frexp(factor)
  m = int(mantissa * 2.0**53)  # exact: a float64 has at most 53 significant bits
  limbs = np.array([(m >> (12 * i)) & 0xFFF for i in range(5)], np.int32)
  return limbs, exponent - 53


def _mul_f32_f64(x: jax.Array, factor_limbs: jax.Array, factor_exp: jax.Array) -> jax.Array:
  """``float32(float64(x) * factor)``, torch's ``static_cast<float>(float * double)``."""
  m, e = _decompose_f32(x)
  s = jnp.stack([m & 0xFFF, m >> 12])  # 24-bit mantissa in two 12-bit limbs
  f = factor_limbs
  columns = [s[0] * f[0]]
  columns += [s[0] * f[k] + s[1] * f[k - 1] for k in range(1, 5)]
  columns += [s[1] * f[4]]
  limbs, carry = [], jnp.int32(0)
  for c in columns:  # each column < 2**26: no int32 overflow
    c = c + carry
    limbs.append(c & 0xFFF)
    carry = c >> 12
  limbs.append(carry)
  bits = _limbs_to_bits(jnp.stack(limbs), 12)
  y = _round_f64_then_f32(bits, e + factor_exp)
  sign = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x80000000)
  y = lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.uint32) | sign, jnp.float32)
  special = (x == 0) | ~jnp.isfinite(x)  # 0 * f, inf * f and nan * f are x itself (f > 0)
  return jnp.where(special, x, y)


def _reciprocal_f32_f64(x: jax.Array) -> jax.Array:
  """``float32(1 / float64(x))``, torch's ``scale.double().reciprocal().float()``."""
  m, e = _decompose_f32(x)
  mu = m.astype(jnp.uint32)
  # Long division of 2**80 by m, eight quotient bits at a time (remainders < m < 2**24).
  q = jnp.uint32(1 << 24) // mu  # 1 or 2
  r = jnp.uint32(1 << 24) - q * mu
  chunks = []
  for _ in range(7):
    r = r << 8
    chunk = r // mu
    r = r - chunk * mu
    chunks.append(chunk)
  sticky = (r != 0).astype(jnp.int32)  # the remainder, as one bit below the quotient
  bits = jnp.concatenate([
      sticky[None],
      _limbs_to_bits(jnp.stack(chunks[::-1]).astype(jnp.int32), 8),
      _limbs_to_bits(q.astype(jnp.int32)[None], 2),
  ])
  # 1/x = 2**-e / m = (2**80 / m) * 2**(-e - 80); the sticky bit shifts everything by one.
  y = _round_f64_then_f32(bits, -e - 81)
  sign = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x80000000)
  y = lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.uint32) | sign, jnp.float32)
  special = (x == 0) | ~jnp.isfinite(x)
  return jnp.where(special, 1.0 / x, y)


# ------------------------------------------------------------------------------------------------
# The transform.


def _check_args(
    inner: Any,
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    enabled: Any,
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
  _check_real("init_scale", init_scale)
  if not 0.0 < float(np.float32(init_scale)) < math.inf:
    raise ValueError(
        "`init_scale` must be > 0 and finite in float32 (at most 3.4028235e38), "
        f"got {init_scale!r}."
    )
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"`enabled` must be a bool, got {type(enabled).__name__}: {enabled!r}.")


def _check_real(name: str, value: Any) -> None:
  """Raises a TypeError unless ``value`` is a real Python/NumPy number (bools are not)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}: {value!r}.")


def _check_hyperparams(growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
  """Validates the hyperparameters kept in the state (also used by ``load_state_dict``)."""
  _check_real("growth_factor", growth_factor)
  if not 1.0 < float(growth_factor) < math.inf:
    raise ValueError(f"`growth_factor` must be > 1.0 and finite, got {growth_factor!r}.")
  _check_real("backoff_factor", backoff_factor)
  if not 0.0 < float(backoff_factor) < 1.0:
    raise ValueError(
        f"`backoff_factor` must satisfy 0 < backoff_factor < 1, got {backoff_factor!r}."
    )
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


def _tree_found_inf(tree: Any) -> jax.Array:
  """One bool: whether any inexact leaf of ``tree`` holds an Inf or NaN."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.array(False)
  return jnp.logical_not(jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])))


def _tree_unscale(tree: Any, inv_scale: jax.Array) -> Any:
  """``g * inv_scale`` computed in (at least) float32 and cast back to each leaf's dtype."""

  def unscale(g: Any) -> Any:
    dtype = jnp.result_type(g)
    if not jnp.issubdtype(dtype, jnp.inexact):
      return g
    compute = jnp.promote_types(dtype, jnp.float32)
    return (jnp.asarray(g, compute) * inv_scale.astype(compute)).astype(dtype)

  return jax.tree.map(unscale, tree)


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
  Inf/NaN in one fused reduction, unscales them in float32 by ``float32(1 / float64(scale))``, and
  then either runs ``inner`` on the unscaled gradients or, on overflow, skips it: zero updates and
  an inner state left bit-identical (step counts and schedules do not advance). Finally the scale
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
      see different gradients (e.g. sharded parameters, or gradients not yet averaged).

  Returns:
    A ``GradientTransformationExtraArgs`` whose extra arguments are forwarded to ``inner``.
  """
  _check_args(inner, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
  inner = optax.with_extra_args_support(inner)
  hyperparams = LossScaleHyperparams(
      growth_factor=float(growth_factor),
      backoff_factor=float(backoff_factor),
      growth_interval=int(growth_interval),
      enabled=bool(enabled),
  )

  def init_fn(params: optax.Params) -> DynamicLossScaleState:
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
      **extra_args: Any,
  ) -> tuple[optax.Updates, DynamicLossScaleState]:
    if not state.hyperparams.enabled:
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)

    found_inf = _tree_found_inf(updates)
    if axis_name is not None:
      found_inf = lax.pmax(found_inf.astype(jnp.int32), axis_name) > 0
    grads = _tree_unscale(updates, _reciprocal_f32_f64(state.scale))

    def do_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      return inner.update(grads, state.inner_state, params, **extra_args)

    def skip_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      out_updates, _ = jax.eval_shape(do_update, None)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_updates)
      return zeros, state.inner_state

    new_updates, inner_state = lax.cond(found_inf, skip_update, do_update, None)
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


def scale_loss(loss: chex.ArrayTree, opt_state: Any) -> chex.ArrayTree:
  """``loss * scale`` (torch's ``scaler.scale(outputs)``), computed and returned in float32.

  The product's dtype is ``promote_types(loss.dtype, float32)``: float16/bfloat16/float32 losses
  give float32, float64 losses float64. torch gives the same for the usual 0-d loss (a 0-d float16
  tensor times the 0-d float32 scale is float32), but keeps float16 for non-scalar float16 outputs,
  where ``65504 * 2**16`` overflows; returning float32 always is what a caller differentiating the
  result needs. ``loss`` may be a pytree of losses; the scale is not differentiated. When the
  scaler is disabled ``loss`` is returned unmodified, as in torch.
  """
  state = _find(opt_state)
  if not state.enabled:
    return loss
  scale = lax.stop_gradient(get_scale(opt_state))

  def scale_one(x: Any) -> jax.Array:
    dtype = jnp.promote_types(jnp.result_type(x), jnp.float32)
    return jnp.asarray(x, dtype) * scale.astype(dtype)

  return jax.tree.map(scale_one, loss)


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


def load_state_dict(opt_state: Any, state_dict: dict[str, Any]) -> Any:
  """torch's ``GradScaler.load_state_dict``: returns ``opt_state`` with the scaler state replaced.

  The result has the structure of ``opt_state`` (a chain tuple stays a tuple, a ``TrainState`` a
  ``TrainState``); the scale and growth tracker keep their dtype, shape and sharding. Loading other
  factors or interval than the current ones changes the static hyperparameters and hence the
  treedef, so a jitted step retraces once. An ``nnx.Optimizer`` is updated in place and returned.
  A disabled scaler ignores the dict, as in torch; an empty dict for an enabled one is an error.
  """
  state = _find(opt_state)
  if not state.enabled:
    return opt_state
  if not isinstance(state_dict, dict):
    raise TypeError(f"`state_dict` must be a dict, got {type(state_dict).__name__}.")
  if not state_dict:
    raise ValueError(
        "`state_dict` is empty, possibly because it was saved from a disabled scaler; expected "
        f"the keys {list(_STATE_DICT_KEYS)}."
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
  _check_real("scale", state_dict["scale"])
  tracker = state_dict["_growth_tracker"]
  if isinstance(tracker, (bool, np.bool_)) or not isinstance(tracker, numbers.Integral):
    raise TypeError(
        f"`_growth_tracker` must be an int, got {type(tracker).__name__}: {tracker!r}."
    )
  hyperparams = LossScaleHyperparams(
      growth_factor=float(state_dict["growth_factor"]),
      backoff_factor=float(state_dict["backoff_factor"]),
      growth_interval=int(state_dict["growth_interval"]),
      enabled=True,
  )

  def load(old: DynamicLossScaleState) -> DynamicLossScaleState:
    return old._replace(
        scale=_like(old.scale, float(state_dict["scale"]), jnp.float32),
        growth_tracker=_like(old.growth_tracker, int(tracker), jnp.int32),
        hyperparams=hyperparams,
    )

  return state_tree.tree_replace_nodes(opt_state, DynamicLossScaleState, load)
