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
  """Returns ``(m, e)`` with ``|x| = m * 2**e`` and ``m`` in ``[2**23, 2**24)`` (finite ``x != 0``)."""
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
