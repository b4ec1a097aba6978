"""Exact float32 (x) float64 arithmetic without float64, in scalar uint32 arithmetic.

torch's ``GradScaler`` multiplies its float32 scale by float64 factors in C++:
``static_cast<float>(float * double)``, i.e. the exact product rounded to float64 and then to
float32 (two roundings); its inverse scale is ``scale.double().reciprocal().float()``. Products
with non-power-of-two factors (0.3, 1.1) must round exactly that way. Without ``jax_enable_x64``
there is no float64 inside ``jit``, so ``mul_f32_f64`` forms the exact product in 12-bit limbs
and rounds it to float64, and ``_reciprocal_magnitude_bits`` takes the quotient from a float
estimate corrected by its exact integer remainder. Both are then kept to 26 or 27 bits rounded to
odd, from which ``_round_to_float32_bits`` rounds to float32 (normal or subnormal) as the exact
value would round. Integer ops are exact on every backend; float error-free transformations
(Dekker, TwoSum) are not safe where XLA contracts ``a * b + c`` into an FMA. Written in ``lax``:
each op traces once per step, not a ``jnp`` wrapper.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax import lax

_F32_INF_BITS = 0x7F800000
_F32_SIGN_BIT = 0x80000000


def _u(value: Any) -> Any:
  """``value`` as a uint32 operand: arrays as they are, Python ints as NumPy literals."""
  return np.uint32(value) if isinstance(value, int) else value


def _shl(x: jax.Array, n: Any) -> jax.Array:
  return lax.shift_left(x, _u(n))


def _shr(x: jax.Array, n: Any) -> jax.Array:
  return lax.shift_right_logical(x, _u(n))


def _and(x: jax.Array, y: Any) -> jax.Array:
  return lax.bitwise_and(x, _u(y))


def _or(x: jax.Array, y: Any) -> jax.Array:
  return lax.bitwise_or(x, _u(y))


def _nonzero(x: jax.Array) -> jax.Array:
  """1 where the uint32 ``x`` is not 0, else 0 (a sticky bit)."""
  return lax.convert_element_type(lax.ne(x, np.uint32(0)), np.uint32)


def _to_int(x: jax.Array) -> jax.Array:
  return lax.convert_element_type(x, np.int32)


def _decompose_f32(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(m, e)``, ``|x| = m * 2**e`` with the uint32 ``m`` in ``[2**23, 2**24)``, from the bits of
  a finite ``x != 0`` without its sign (``_sign_and_magnitude``)."""
  biased = _shr(magnitude, 23)
  frac = _and(magnitude, 0x7FFFFF)
  m = lax.select(lax.gt(biased, np.uint32(0)), _or(frac, 0x800000), frac)
  e = lax.sub(_to_int(lax.max(biased, np.uint32(1))), np.int32(150))  # -149 for subnormals
  shift = lax.sub(lax.clz(m), np.uint32(8))  # normalises subnormals
  return _shl(m, shift), lax.sub(e, _to_int(shift))


def _round_to_float32_bits(q: jax.Array, exponent: jax.Array) -> jax.Array:
  """The bits of ``q * 2**exponent`` rounded to the nearest float32 (ties to even), or inf.

  ``q`` holds 26 or 27 bits rounded to odd (its last bit set wherever bits below it were
  dropped), at least two more than any float32 keeps: rounding it gives what rounding the exact
  value gives. Keeps 24 bits, or fewer down to float32's last subnormal bit ``2**-149``.
  """
  length = lax.sub(np.int32(32), _to_int(lax.clz(q)))
  top = lax.add(lax.sub(length, np.int32(1)), exponent)  # of the leading bit
  dropped = lax.clamp(
    np.int32(0),
    lax.max(lax.sub(length, np.int32(24)), lax.sub(np.int32(-149), exponent)),
    np.int32(28),
  )
  dropped = lax.convert_element_type(dropped, np.uint32)
  half_minus_one = lax.sub(_shl(np.uint32(1), lax.sub(dropped, np.uint32(1))), np.uint32(1))
  odd = _and(_shr(q, dropped), 1)
  significand = _shr(lax.add(lax.add(q, half_minus_one), odd), dropped)
  # A normal float32's bits are ((top + 127) << 23) + significand - 2**23, a subnormal's the
  # significand; a carry of the rounding moves into the exponent by itself.
  field = lax.convert_element_type(
    lax.clamp(np.int32(0), lax.add(top, np.int32(126)), np.int32(255)), np.uint32
  )
  return lax.min(lax.add(_shl(field, 23), significand), np.uint32(_F32_INF_BITS))


def _sign_and_magnitude(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The float32 ``x``'s sign bit and the rest of its bits, as uint32s."""
  u = lax.bitcast_convert_type(x, np.uint32)
  return _and(u, _F32_SIGN_BIT), _and(u, 0x7FFFFFFF)


def _float32(sign: jax.Array, magnitude: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(_or(magnitude, sign), np.float32)


def _is_special(magnitude: jax.Array) -> jax.Array:
  """Zero, inf or NaN (by the bits without the sign): where the integer paths do not apply.

  On the bits, and everything after it in integers: XLA:CPU treats subnormal float operands as
  zero, so ``x == 0`` and ``1 / x`` are wrong for subnormal ``x``.
  """
  return lax.bitwise_or(
    lax.eq(magnitude, np.uint32(0)), lax.ge(magnitude, np.uint32(_F32_INF_BITS))
  )


def f64_limbs(factor: float) -> tuple[np.ndarray, int]:
  """A positive finite float64 as five little-endian 12-bit limbs and a binary exponent."""
  mantissa, exponent = math.frexp(factor)
  m = int(mantissa * 2.0**53)  # exact: a float64 has at most 53 significant bits
  return np.array([(m >> (12 * i)) & 0xFFF for i in range(5)], np.uint32), exponent - 53


def mul_f32_f64(x: jax.Array, factors: tuple[float, ...], index: Any = 0) -> jax.Array:
  """``float32(float64(x) * factors[index])``, torch's ``static_cast<float>(float * double)``.

  ``factors`` are positive finite Python floats; ``index`` (an int32 array) picks one per
  element, so one product serves several factors. Powers of two (torch's defaults 2.0 and 0.5)
  scale the exponent alone; other factors take the exact product in limbs.
  """
  sign, magnitude = _sign_and_magnitude(lax.convert_element_type(x, np.float32))
  m, e = _decompose_f32(magnitude)
  exponents = []
  for factor in factors:
    mantissa, exponent = math.frexp(factor)
    exponents.append(exponent - 1 if mantissa == 0.5 else None)
  if None not in exponents:  # x * 2**k, rounded once as float64's exact product rounds twice
    k = _pick(index, [np.int32(k) for k in exponents])
    bits = _round_to_float32_bits(_shl(m, 2), lax.add(lax.sub(e, np.int32(2)), k))
  else:
    limbs = [f64_limbs(factor) for factor in factors]
    factor_limbs = [_pick(index, [np.uint32(f[0][i]) for f in limbs]) for i in range(5)]
    bits = _product_bits(m, e, factor_limbs, _pick(index, [np.int32(f[1]) for f in limbs]))
  # 0 * f, inf * f and nan * f are x itself (f > 0)
  return _float32(sign, lax.select(_is_special(magnitude), magnitude, bits))


def _pick(index: Any, options: list[np.generic]) -> Any:
  """``options[index]`` (NumPy scalars): the option itself where there is one."""
  if len(options) == 1:
    return options[0]
  index = lax.convert_element_type(index, np.int32)
  return lax.select_n(index, *(lax.full_like(index, o, o.dtype) for o in options))


def _product_bits(
  m: jax.Array, e: jax.Array, f: list[jax.Array], factor_exp: jax.Array
) -> jax.Array:
  """The float32 bits of float64(m * 2**e * F * 2**factor_exp), F in 12-bit limbs ``f``.

  The exact product of the 24-bit and the 53-bit significands (77 bits) is built in 12-bit limbs
  and rounded to 53 bits (float64), then to float32: two roundings, as in C++.
  """
  a = (_and(m, 0xFFF), _shr(m, 12))
  columns = [lax.mul(a[0], f[0])]
  columns += [lax.add(lax.mul(a[0], f[k]), lax.mul(a[1], f[k - 1])) for k in range(1, 5)]
  columns += [lax.mul(a[1], f[4])]
  product, carry = [], None
  for c in columns:  # every column < 2**26
    c = c if carry is None else lax.add(c, carry)
    product.append(_and(c, 0xFFF))
    carry = _shr(c, 12)
  product.append(carry)
  # The product is in [2**75, 2**77): shift it left once where bit 76 is clear.
  s = lax.sub(np.uint32(1), _and(_shr(product[6], 4), 1))
  product = [_and(_shl(product[0], s), 0xFFF)] + [
    _or(_and(_shl(product[i], s), 0xFFF), _shr(product[i - 1], lax.sub(np.uint32(12), s)))
    for i in range(1, 7)
  ]
  # float64 keeps bits 24..76 as hi * 2**29 + lo; bit 23 is the guard bit.
  lo = _or(_or(product[2], _shl(product[3], 12)), _shl(_and(product[4], 0x1F), 24))
  hi = _or(_or(_shr(product[4], 5), _shl(product[5], 7)), _shl(product[6], 19))
  guard = _and(_shr(product[1], 11), 1)
  sticky = _nonzero(_or(_and(product[1], 0x7FF), product[0]))
  up = _and(guard, _or(sticky, _and(lo, 1)))  # to nearest, ties to even
  lo = lax.add(lo, up)
  hi = lax.add(hi, _shr(lo, 29))  # 2**24 where the rounding carried out of 53 bits
  lo = _and(lo, (1 << 29) - 1)
  # The float64 (hi * 2**29 + lo) * 2**exponent, kept to its top 26 or 27 bits rounded to odd.
  exponent = lax.add(lax.sub(lax.add(e, factor_exp), _to_int(s)), np.int32(24 + 27))
  q = _or(_or(_shl(hi, 2), _shr(lo, 27)), _nonzero(_and(lo, (1 << 27) - 1)))
  return _round_to_float32_bits(q, exponent)


def _reciprocal_magnitude_bits(magnitude: jax.Array) -> jax.Array:
  """The uint32 bits of ``float32(1 / float64(|x|))`` for finite ``x != 0``, given ``|x|``'s bits.

  One rounding to float32 gives the same bits as C++'s two: ``1 / x`` is ``2**k / m`` for a 24-bit
  ``m``, which lies more than ``2**-49`` of itself away from every float32 midpoint it does not
  equal, so rounding it to float64 first (relative error ``2**-53``) cannot move it onto one. The
  quotient ``2**49 // m`` (26 bits) is estimated by a float division and made exact by its
  remainder, then rounded to odd.
  """
  m, e = _decompose_f32(magnitude)
  mf = lax.convert_element_type(m, np.float32)  # exact: m < 2**24, a normal float
  # |1 / x| = (2**49 / m) * 2**(-49 - e), with 2**49 / m in (2**25, 2**26]: there a float32 is an
  # integer. Estimated, then corrected by the remainder's quotient, rounded (off by < 1).
  q = lax.convert_element_type(_estimate(np.float32(2.0**49), mf), np.uint32)
  correction = lax.round(_estimate(_remainder(q, m, np.float32), mf))
  q = lax.add(q, lax.bitcast_convert_type(_to_int(correction), np.uint32))  # modulo 2**32
  r = _remainder(q, m, np.int32)  # in (-m, m)
  q = lax.sub(q, lax.convert_element_type(lax.lt(r, np.int32(0)), np.uint32))  # the floor
  # The floor's remainder, r or r + m, is zero exactly where r is.
  sticky = _nonzero(lax.bitcast_convert_type(r, np.uint32))
  return _round_to_float32_bits(_or(q, sticky), lax.sub(np.int32(-49), e))


def _estimate(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """A float32 quotient that only has to be near: the reciprocal stays exact with a relative error
  up to ``2**-20`` (64 units of ``2**49 / m``), far beyond any backend's division. XLA fuses it
  with the rest into one kernel, where an integer long division took a kernel per digit
  (XLA:CPU compiled those ~25 ms slower)."""
  return lax.div(numerator, denominator)


def _remainder(q: jax.Array, m: jax.Array, dtype: Any) -> jax.Array:
  """``2**49 - q * m`` as ``dtype`` (int32, or float32 rounded), exact where it is below ``2**31``
  in magnitude (``q`` within 128 of the quotient): ``2**49`` is 0 modulo ``2**32``, and uint32
  products wrap."""
  r = lax.bitcast_convert_type(lax.sub(np.uint32(0), lax.mul(q, m)), np.int32)
  return lax.convert_element_type(r, dtype)


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
  scale = lax.convert_element_type(scale, np.float32)
  sign, magnitude = _sign_and_magnitude(scale)
  bits = _reciprocal_magnitude_bits(magnitude)
  special = _is_special(magnitude)
  # 1 / 0 is inf, 1 / inf is 0, 1 / nan is nan.
  special_bits = lax.select(
    lax.eq(magnitude, np.uint32(0)),
    lax.full_like(magnitude, _F32_INF_BITS),
    lax.select(lax.gt(magnitude, np.uint32(_F32_INF_BITS)), magnitude, lax.full_like(magnitude, 0)),
  )
  inverse = _float32(sign, lax.select(special, special_bits, bits))
  subnormal = lax.bitwise_and(lax.lt(bits, np.uint32(0x800000)), lax.bitwise_not(special))
  raised = lax.mul(lax.convert_element_type(bits, np.float32), np.float32(2.0**-85))  # * 2**64
  a = lax.select(subnormal, _float32(sign, lax.bitcast_convert_type(raised, np.uint32)), inverse)
  b = lax.select(subnormal, lax.full_like(scale, 2.0**-64), lax.full_like(scale, 1.0))
  return a, b, inverse
