"""``casting``: which dtypes autocast changes, how constants and Python scalars keep finite
values finite in a 16-bit dtype (saturating casts), conversions staged while linearizing, and
the cast cache that converts a value at most once per dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.autocast import casting

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
F32_MIN = float(jnp.finfo(jnp.float32).min)
F16_MAX = float(jnp.finfo(jnp.float16).max)


# --- which dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_float32_float16_and_bfloat16_are_eligible(dtype):
  assert casting.is_eligible(jnp.dtype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.int32, jnp.bool_, jnp.complex64])
def test_other_dtypes_are_not_eligible(dtype):
  assert not casting.is_eligible(jnp.dtype(dtype))


def test_the_widest_of_float16_and_bfloat16_is_float32():
  assert casting.widest([F16, BF16]) == F32


def test_the_widest_of_one_dtype_is_itself():
  assert casting.widest([BF16]) == BF16


# --- constants ------------------------------------------------------------------------------------


def test_a_float32_minimum_constant_in_float16_is_float16s_minimum_not_minus_inf():
  assert casting.saturating_constant(F32_MIN, F16) == -F16_MAX


def test_a_saturating_constant_keeps_infinities_and_nan():
  out = casting.saturating_constant([np.inf, -np.inf, np.nan], F16)
  assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


def test_a_float16_constant_moved_to_bfloat16_is_exact_and_warns_nothing():
  """bfloat16's bounds do not fit float16: the clip happens in float64 (numpy warned "overflow
  encountered in cast", an error under ``-W error``, in the backward of float16 code)."""
  with np.errstate(all="raise"):
    out = casting.saturating_constant(np.array([0.0, -3.5, 1024.0], np.float16), BF16)
  assert out.dtype == BF16 and out.tolist() == [0.0, -3.5, 1024.0]


@pytest.mark.filterwarnings("error")
def test_the_backward_of_float16_code_under_the_bfloat16_policy_warns_nothing():
  import jaxamp

  f = lambda w, x: jax.nn.relu(x @ w.astype(jnp.float16)).astype(jnp.float32).sum()
  grads = jax.grad(jaxamp.autocast(f, device_type="cpu"))(
    jnp.ones((4, 4)), jnp.ones((2, 4), jnp.float16)
  )
  assert grads.dtype == jnp.float32


def test_a_constant_in_float32_is_not_clipped():
  with np.errstate(over="ignore"):
    assert casting.saturating_constant(np.float64(1e300), F32) == np.inf


def test_an_integer_constant_is_converted_as_it_is():
  assert casting.saturating_constant(np.int32(70000), jnp.int32) == 70000


@pytest.mark.parametrize("value", [1e5, 1e-8])
def test_a_constant_overflowing_or_underflowing_float16_does_not_fit(value):
  assert not casting.fits(value, F16)


@pytest.mark.parametrize("value", [0.0, 1.0, np.inf, np.nan, 60000])
def test_zero_ordinary_values_infinities_nan_and_integers_fit_float16(value):
  assert casting.fits(value, F16)


def test_a_value_too_small_for_float16_fits_bfloat16():
  assert casting.fits(1e-8, BF16)


# --- saturating conversions of traced values ------------------------------------------------------


def test_a_saturating_convert_of_a_traced_value_clips_finite_values_to_the_range():
  out = jax.jit(lambda x: casting.saturating_convert(x, F16))(jnp.array([1e5, -1e5, 1.0]))
  np.testing.assert_array_equal(out, np.array([F16_MAX, -F16_MAX, 1.0], F16))


def test_a_saturating_convert_of_a_traced_value_keeps_infinities_and_nan():
  out = jax.jit(lambda x: casting.saturating_convert(x, BF16))(jnp.array([np.inf, np.nan]))
  assert out.dtype == BF16 and out[0] == np.inf and np.isnan(out[1])


def test_a_saturating_convert_of_bfloat16_into_float16_clips_to_a_finite_value():
  x = jnp.array([1e6, -1e6], BF16)  # float16's largest value rounds up to 65536 in bfloat16
  out = jax.jit(lambda x: casting.saturating_convert(x, F16))(x)
  assert np.isfinite(out).all() and out[0] > 65000 and out[1] < -65000


def test_a_saturating_convert_into_a_wider_range_is_a_plain_convert():
  jaxpr = jax.make_jaxpr(lambda x: casting.saturating_convert(x, BF16))(jnp.ones(3, F16))
  assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["convert_element_type"]


def test_a_saturating_convert_of_a_known_value_is_a_constant_traced_nowhere():
  out = casting.saturating_convert(np.float32(F32_MIN), F16)
  assert isinstance(out, np.ndarray) and out == -F16_MAX


def test_a_saturating_convert_differentiates_as_a_cast_whether_or_not_it_clipped():
  # torch's x.to(float16) passes the gradient back cast, whatever the value: so does the clip.
  grad = jax.grad(lambda x: (casting.saturating_convert(x, F16).astype(F32) * 3.0).sum())
  np.testing.assert_array_equal(grad(jnp.array([1e5, 2.0, np.inf])), [3.0, 3.0, 3.0])


def test_a_saturating_convert_is_one_eqn_in_the_jaxpr_and_in_its_linearization():
  jaxpr = jax.make_jaxpr(lambda x: casting.saturating_convert(x, F16))(jnp.ones(3))
  assert [eqn.primitive for eqn in jaxpr.eqns] == [casting.saturating_convert_p]
  _, linear = jax.linearize(lambda x: casting.saturating_convert(x, F16), jnp.ones(3))
  linear_jaxpr = jax.make_jaxpr(linear)(jnp.ones(3))
  assert [eqn.primitive.name for eqn in linear_jaxpr.eqns] == ["convert_element_type"]


def test_a_saturating_convert_clips_under_vmap_and_run_eagerly():
  x = jnp.array([[1e5, 1.0], [-1e5, np.inf]])
  expected = np.array([[F16_MAX, 1.0], [-F16_MAX, np.inf]], F16)
  np.testing.assert_array_equal(jax.vmap(lambda r: casting.saturating_convert(r, F16))(x), expected)
  np.testing.assert_array_equal(casting.saturating_convert_p.bind(x, new_dtype=F16), expected)


# --- convert and as_dtype -------------------------------------------------------------------------


def test_convert_while_linearizing_differentiates_as_a_convert():
  grad = jax.grad(lambda x: (casting.convert(x, BF16).astype(F32) * 3.0).sum())
  np.testing.assert_array_equal(grad(jnp.ones(4)), np.full(4, 3.0))


def test_as_dtype_returns_a_value_already_in_the_dtype_itself():
  x = jnp.ones(3, BF16)
  assert casting.as_dtype(x, BF16) is x


def test_as_dtype_of_none_returns_the_value_itself():
  x = jnp.ones(3)
  assert casting.as_dtype(x, None) is x


def test_as_dtype_converts_a_value_in_another_dtype():
  assert casting.as_dtype(jnp.ones(3), F16).dtype == F16


# --- CastCache ------------------------------------------------------------------------------------


def test_the_cache_counts_the_converts_it_makes():
  cache = casting.CastCache()
  cache.convert(jnp.ones(3), F16)
  cache.convert(jnp.ones(3), BF16, saturate=True)
  assert cache.converts == 2


def test_a_saturating_cache_convert_clips():
  assert casting.CastCache().convert(jnp.array([1e5]), F16, saturate=True)[0] == F16_MAX


def test_a_cache_convert_without_saturate_overflows_as_torch_does():
  assert casting.CastCache().convert(jnp.array([1e5]), F16)[0] == np.inf


def test_the_cache_answers_a_cast_it_was_given():
  value = jnp.ones(3, F16)
  cache = casting.CastCache(precast={("x", F16): value})
  assert cache.ask(("x", F16)) is value


def test_the_cache_has_no_answer_for_a_cast_it_has_not_made():
  assert casting.CastCache().ask(("x", F16)) is None


def test_a_hoistable_invars_cast_is_noted_once_as_wanted_outside():
  cache = casting.CastCache(hoistable=frozenset({"x"}))
  cache.ask(("x", F16))
  cache.ask(("x", F16))
  cache.ask(("y", F16))
  assert cache.hoisted == [("x", F16)]


def test_a_cast_made_already_is_not_noted_as_wanted_outside():
  cache = casting.CastCache(hoistable=frozenset({"x"}), precast={("x", F16): jnp.ones(3, F16)})
  cache.ask(("x", F16))
  assert cache.hoisted == []
