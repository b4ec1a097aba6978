"""The scaler's arithmetic is torch's, bit for bit, although ``jit`` has no float64.

torch computes the new scale as ``static_cast<float>(float_scale * double_factor)`` (the exact
product rounded to float64, then to float32: two roundings) and the inverse scale as
``scale.double().reciprocal().float()``. NumPy's ``np.float32(np.float64(s) * f)`` performs the
same C operations, so it is the reference here (``test_loss_scale_goldens.py`` checks torch).
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import script_modules
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from jaxamp._src.scaler import exact_f64

FACTORS = [0.5, 0.3, 0.25, 2.0, 1.1, 16.0, 0.1, 1.0000001, 0.7, 1.5, 3.0, 1e-300, 1e300]


inverse_of = jax.jit(jax.vmap(exact_f64.reciprocal_f32_f64))


def multiply(scales, factor, other=None, compiled=True):
  """``scales`` times ``factor`` (with ``other``: one product picking either per element), each
  scale a scalar as in the scaler's update, compiled; or op by op: no compile for each factor."""
  factors = (factor,) if other is None else (other, factor)
  times = lambda s, i: exact_f64.mul_f32_f64(s, factors, i)
  times = jax.jit(jax.vmap(times)) if compiled else times
  scales = jnp.asarray(scales, jnp.float32)
  return np.asarray(times(scales, jnp.full(scales.shape, len(factors) - 1, jnp.int32)))


def torch_multiply(scales, factor):
  with np.errstate(over="ignore", invalid="ignore"):
    return (np.asarray(scales, np.float32).astype(np.float64) * factor).astype(np.float32)


def assert_same_bits(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  assert same.all(), (got[~same][:5], want[~same][:5])


def every_kind_of_float32(n=4000, seed=0):
  """Random bit patterns (normals, subnormals, inf, NaN) plus the corners."""
  rng = np.random.default_rng(seed)
  random_bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  corners = np.array(
    [
      0.0,
      -0.0,
      1.4e-45,
      2.8e-45,
      1.1754942e-38,
      1.1754944e-38,
      1e-30,
      1.0,
      65536.0,
      1e38,
      3.4028235e38,
      np.inf,
      -np.inf,
      np.nan,
    ],
    np.float32,
  )
  return np.concatenate([random_bits, corners])


@pytest.mark.parametrize("factor", FACTORS)
def test_scale_times_factor_rounds_the_float64_product_to_float32(factor):
  scales = every_kind_of_float32()
  assert_same_bits(multiply(scales, factor), torch_multiply(scales, factor))


@pytest.mark.parametrize("pair", [(2.0, 0.5), (16.0, 0.25), (2.0, 0.3), (1.1, 0.5), (1.1, 0.3)])
def test_one_product_picking_either_factor_rounds_as_that_factor_alone(pair):
  # The scale update multiplies by the growth or the backoff factor, picked by found_inf: powers
  # of two take the exponent path, any other pair the limbs.
  scales = every_kind_of_float32()
  for factor, other in (pair, pair[::-1]):
    assert_same_bits(multiply(scales, factor, other), torch_multiply(scales, factor))


def round_once_to_float32(q):
  """The float32 nearest to the rational ``q`` (ties to even): one rounding, unlike C++."""
  a = np.float32(float(q))
  candidates = [np.nextafter(a, np.float32(-np.inf)), a, np.nextafter(a, np.float32(np.inf))]
  return min(candidates, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.uint32)) & 1))


def double_rounding_cases(n=100, seed=1):
  """(scale, factor) whose exact product lies within half a float64 ulp of a float32 midpoint."""
  rng = np.random.default_rng(seed)
  cases = []
  while len(cases) < n:
    scale = np.float32(rng.uniform(1, 2) * 2.0 ** int(rng.integers(-100, 100)))
    midpoint = Fraction(2 * int(rng.integers(2**23, 2**24)) + 1, 2**24) * Fraction(2) ** int(
      rng.integers(-140, 120)
    )
    factor = float(midpoint / Fraction(float(scale)))
    exact = Fraction(float(scale)) * Fraction(factor)
    if exact != midpoint and Fraction(float(exact)) == midpoint:
      cases.append((scale, factor))
  return cases


def test_double_rounding_is_reproduced_where_it_differs_from_one_rounding():
  cases = double_rounding_cases()
  got = np.array([multiply([s], f, compiled=False)[0] for s, f in cases], np.float32)
  want = np.array([torch_multiply([s], f)[0] for s, f in cases], np.float32)
  once = np.array([round_once_to_float32(Fraction(float(s)) * Fraction(f)) for s, f in cases])
  assert_same_bits(got, want)
  assert (want.view(np.uint32) != once.view(np.uint32)).sum() > len(cases) // 4


def test_inverse_scale_is_the_float64_reciprocal_rounded_to_float32():
  scales = np.concatenate([every_kind_of_float32(), 2.0 ** np.arange(-149, 128, dtype=np.float32)])
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    want = (1.0 / scales.astype(np.float64)).astype(np.float32)
  assert_same_bits(inverse_of(jnp.asarray(scales)), want)


@pytest.mark.slow
def test_inverse_of_every_significand_matches():
  # One binade, every 61st significand: 137k scales covering all the division's chunk patterns.
  scales = (np.arange(2**23, 2**24, 61, dtype=np.float64) * 2.0**-23).astype(np.float32)
  want = (1.0 / scales.astype(np.float64)).astype(np.float32)
  assert_same_bits(inverse_of(jnp.asarray(scales)), want)


def test_inverse_rounds_to_every_subnormal_precision_as_float64_then_float32_does():
  # Scales in [2**126, 2**128): inverses with 23 down to 21 significant bits, where the quotient
  # kept to 26 bits must round as the float64 quotient does.
  scales = (np.arange(2**23, 2**24, 97, dtype=np.float64) * 2.0**-23).astype(np.float32)
  scales = np.concatenate([scales * np.float32(2.0**126), scales * np.float32(2.0**127)])
  want = (1.0 / scales.astype(np.float64)).astype(np.float32)
  assert (want <= np.finfo(np.float32).tiny).all()  # 2**-126 itself is the smallest normal
  assert_same_bits(inverse_of(jnp.asarray(scales)), want)


@pytest.mark.parametrize("relative_error", [2.0**-20, -(2.0**-20), 2.0**-30])
def test_inverse_is_exact_however_far_the_division_estimate_is_within_its_bound(
  monkeypatch, relative_error
):
  # The quotient is estimated by a float division and corrected by its integer remainder: a
  # backend whose division is off by 64 units (TPUs' is within a few) still gives torch's bits.
  exact = exact_f64._estimate
  skewed = lambda n, d: lax.mul(exact(n, d), np.float32(1 + relative_error))
  monkeypatch.setattr(exact_f64, "_estimate", skewed)
  scales = np.concatenate(
    [
      every_kind_of_float32(),
      2.0 ** np.arange(-149, 128, dtype=np.float32),
      (np.arange(2**23, 2**24, 997, dtype=np.float64) * 2.0**-23).astype(np.float32),
    ]
  )
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    want = (1.0 / scales.astype(np.float64)).astype(np.float32)
  inverse = jax.jit(jax.vmap(lambda s: exact_f64.reciprocal_f32_f64(s)))
  assert_same_bits(inverse(jnp.asarray(scales)), want)


@settings(max_examples=300, deadline=None)
@given(
  scale=st.floats(width=32, allow_nan=True, allow_infinity=True),
  factor=st.one_of(
    st.sampled_from(FACTORS),
    st.floats(min_value=5e-324, max_value=1e300, allow_subnormal=True),
  ),
)
@pytest.mark.slow
def test_any_scale_times_any_factor_matches_numpy(scale, factor):
  got = multiply([scale], factor, compiled=False)
  assert_same_bits(got, torch_multiply([scale], factor))


@settings(max_examples=300, deadline=None)
@given(scale=st.floats(width=32, allow_nan=True, allow_infinity=True))
@pytest.mark.slow
def test_any_inverse_matches_numpy(scale):
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    want = np.float32(1.0 / np.float64(np.float32(scale)))
  assert_same_bits(inverse_of(jnp.asarray([scale], jnp.float32)), [want])


def test_factor_limbs_hold_the_float64_exactly():
  for factor in FACTORS + [5e-324, 1.7976931348623157e308]:
    limbs, exponent = exact_f64.f64_limbs(factor)
    value = sum(int(limb) << (12 * i) for i, limb in enumerate(limbs))
    assert math.ldexp(value, exponent) == factor


def test_the_exhaustive_check_script_finds_every_inverse_right_in_its_hardest_chunks(capsys):
  check = script_modules.load("check_exact_f64")
  chunk = 2**16
  # Subnormal scales; scales whose inverse is subnormal; inf and the NaNs after it.
  for first in (0, 0x7F000000 // chunk, 0x7F7F0000 // chunk, 0x7F800000 // chunk):
    assert check.main(["--chunk", str(chunk), "--first", str(first), "--count", "1"]) == 0
  assert "all 65536 scales match" in capsys.readouterr().out


def test_the_exhaustive_check_script_reports_a_wrong_inverse(monkeypatch, capsys):
  check = script_modules.load("check_exact_f64")
  off_by_one_ulp = lambda s: tuple(jnp.nextafter(f, jnp.inf) for f in exact_f64.unscale_factors(s))
  monkeypatch.setattr(check, "_factors", jax.jit(off_by_one_ulp))
  assert check.main(["--chunk", str(2**12), "--first", str(0x3F800000 // 2**12), "--count", "1"])
  assert "mismatches among 4096 scales" in capsys.readouterr().out
