"""Exact float32 (x) float64 arithmetic without float64, in scalar uint32 arithmetic.

torch's ``GradScaler`` multiplies its float32 scale by float64 factors in C++:
``static_cast<float>(float * double)``, i.e. the exact product rounded to float64 and then to
float32 (two roundings); its inverse scale is ``scale.double().reciprocal().float()``. Products
with non-power-of-two factors (0.3, 1.1) must round exactly that way. Without ``jax_enable_x64``
there is no float64 inside ``jit``, so ``mul_f32_f64`` and ``_reciprocal_parts`` form the exact
product (in 12-bit limbs) or quotient (by long division) in scalar uint32 arithmetic and
``_f64_to_f32`` applies both roundings. Integer ops are exact on every backend; float error-free
transformations (Dekker, TwoSum) are not safe where XLA contracts ``a * b + c`` into an FMA.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


def f64_limbs(factor: float) -> tuple[np.ndarray, int]:
  """A positive finite float64 as five little-endian 12-bit limbs and a binary exponent."""
  mantissa, exponent = math.frexp(factor)
  m = int(mantissa * 2.0**53)  # exact: a float64 has at most 53 significant bits
  return np.array([(m >> (12 * i)) & 0xFFF for i in range(5)], np.uint32), exponent - 53


def mul_f32_f64(x: jax.Array, factor_limbs: jax.Array, factor_exp: jax.Array) -> jax.Array:
  """``float32(float64(x) * factor)``, torch's ``static_cast<float>(float * double)``.

  The exact product of the 24-bit and the 53-bit significands (77 bits) is built in 12-bit limbs,
  rounded to 53 bits (float64) and then to float32: two roundings, as in C++.
  """
  m, e = _decompose_f32(x)
  a = (m & 0xFFF, m >> 12)
  f = [factor_limbs[i] for i in range(5)]
  columns = [a[0] * f[0]] + [a[0] * f[k] + a[1] * f[k - 1] for k in range(1, 5)] + [a[1] * f[4]]
  product, carry = [], _u32(0)
  for c in columns:  # every column < 2**26
    c = c + carry
    product.append(c & 0xFFF)
    carry = c >> 12
  product.append(carry)
  # The product is in [2**75, 2**77): shift it left once where bit 76 is clear.
  s = _u32(1) - ((product[6] >> 4) & 1)
  product = [
    ((product[i] << s) & 0xFFF) | ((product[i - 1] >> (_u32(12) - s)) if i else 0) for i in range(7)
  ]
  # float64 keeps bits 24..76; bit 23 is the guard bit.
  lo = product[2] | (product[3] << 12) | ((product[4] & 0x1F) << 24)
  hi = (product[4] >> 5) | (product[5] << 7) | (product[6] << 19)
  hi, lo = _round_half_even(
    hi, lo, (product[1] >> 11) & 1, ((product[1] & 0x7FF) | product[0]) != 0
  )
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


def reciprocal_f32_f64(x: jax.Array) -> jax.Array:
  """``float32(1 / float64(x))``, torch's ``scale.double().reciprocal().float()``."""
  return unscale_factors(x)[2]


def unscale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
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
