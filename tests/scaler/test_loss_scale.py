"""`jaxamp.dynamic_loss_scale`: torch's GradScaler update rule as an optax transformation.

Each test states one behaviour of ``update`` (unscale, finite check, skip, back off, grow), of the
state, of ``enabled=False`` or of the constructor's validation. Updates run under ``jax.jit``.
"""

import math
import re
import textwrap

import cpu_devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._src.scaler import loss_scale

PARAMS = {"w": jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]), "b": jnp.array([0.1, -0.2])}


def grads_like(params, value=1.0, **overrides):
  """Gradients equal to ``value`` everywhere, with ``overrides[name][index] = v``."""
  grads = jax.tree.map(lambda param: jnp.full_like(param, value), params)
  for name, (index, v) in overrides.items():
    grads[name] = grads[name].at[index].set(v)
  return grads


def jitted_update(tx):
  return jax.jit(lambda grads, state, params: tx.update(grads, state, params))


def tree_bitwise_equal(a, b):
  """Same structure, dtypes, shapes and bits (-0.0 is not +0.0; NaN payloads count)."""
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.asarray(x).dtype == np.asarray(y).dtype
    and np.shape(x) == np.shape(y)
    and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    for x, y in zip(leaves_a, leaves_b, strict=True)
  )


def f32_bits(x):
  return int(np.asarray(x, np.float32).view(np.uint32))


# ------------------------------------------------------------------------------------------------
# State.


def test_init_state_has_torch_defaults():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  assert isinstance(state, jaxamp.DynamicLossScaleState)
  assert state.scale.dtype == jnp.float32 and state.scale.shape == () and state.scale == 2.0**16
  assert state.growth_tracker.dtype == jnp.int32 and state.growth_tracker == 0
  assert state.found_inf.dtype == jnp.bool_ and not state.found_inf
  assert state.skipped_steps.dtype == jnp.int32 and state.skipped_steps == 0
  assert (state.growth_factor, state.backoff_factor, state.growth_interval) == (2.0, 0.5, 2000)
  assert state.enabled


def test_state_is_a_jittable_pytree_whose_hyperparameters_are_static():
  state = jaxamp.dynamic_loss_scale(optax.adam(0.1), growth_factor=1.1).init(PARAMS)
  leaves = jax.tree.leaves(state)
  assert all(isinstance(x, jax.Array) for x in leaves)  # the factors are not leaves
  out = jax.jit(lambda s: s)(state)
  assert tree_bitwise_equal(out, state) and out.growth_factor == 1.1


@pytest.mark.slow
def test_scale_stays_float32_whatever_the_gradient_dtypes():
  params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float16)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=3.0, growth_interval=1)
  state = tx.init(params)
  _, state = jitted_update(tx)(params, state, params)
  assert state.scale.dtype == jnp.float32 and state.scale == 6.0


# ------------------------------------------------------------------------------------------------
# Unscaling.


@pytest.mark.slow
def test_finite_step_passes_unscaled_gradients_to_the_inner_optimizer():
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=1024.0)
  grads = grads_like(PARAMS, 2048.0, w=((0, 1), -512.0))
  updates, _ = jitted_update(tx)(grads, tx.init(PARAMS), PARAMS)
  np.testing.assert_array_equal(updates["w"], [[2.0, -0.5, 2.0], [2.0, 2.0, 2.0]])
  assert np.array_equal(updates["b"], [2.0, 2.0])


@pytest.mark.slow
def test_unscale_multiplies_by_torch_inverse_float32_of_float64_reciprocal():
  scale = 3.0  # 1/3 is not a float32: torch uses float32(1 / float64(3.0)), then multiplies
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=scale)
  g = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 1e3
  updates, _ = jitted_update(tx)({"g": jnp.asarray(g)}, tx.init({"g": g}), None)
  torch_inverse = np.float32(1.0 / np.float64(scale))
  np.testing.assert_array_equal(updates["g"], g * torch_inverse)


@pytest.mark.slow
def test_mixed_precision_gradient_leaves_are_unscaled_in_float32_and_keep_their_dtypes():
  params = {
    "f32": jnp.ones(4, jnp.float32),
    "bf16": jnp.ones(4, jnp.bfloat16),
    "f16": jnp.ones(4, jnp.float16),
  }
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=3.0)
  raw = np.array([3.0, 1000.0, -7.5, 0.0625], np.float32)
  grads = {k: jnp.asarray(raw, v.dtype) for k, v in params.items()}
  updates, state = jitted_update(tx)(grads, tx.init(params), params)
  inverse = np.float32(1.0 / np.float64(3.0))
  for name, g in grads.items():
    assert updates[name].dtype == g.dtype
    expected = (np.asarray(g, np.float32) * inverse).astype(g.dtype)
    np.testing.assert_array_equal(np.asarray(updates[name]), expected)
  assert not state.found_inf


@pytest.mark.slow
def test_huge_scale_whose_inverse_is_subnormal_still_unscales_gradients():
  # 1 / 3e38 is a subnormal float32: XLA:CPU would flush a subnormal operand to zero.
  scale = np.float32(3e38)
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=float(scale))
  g = np.array([3e38, -1.5e38, 6e37], np.float32)
  updates, _ = jitted_update(tx)({"g": jnp.asarray(g)}, tx.init({"g": g}), None)
  torch_inverse = np.float32(1.0 / np.float64(scale))
  assert torch_inverse < np.finfo(np.float32).tiny  # subnormal
  np.testing.assert_array_equal(
    updates["g"], (g.astype(np.float64) * torch_inverse).astype(np.float32)
  )


@pytest.mark.slow
def test_extra_args_are_forwarded_to_the_inner_transform():
  def update(updates, state, params=None, *, factor):
    return jax.tree.map(lambda u: u * factor, updates), state

  inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=2.0)
  step = jax.jit(lambda g, s: tx.update(g, s, None, factor=10.0))
  updates, _ = step({"g": jnp.array([4.0])}, tx.init(None))
  assert updates["g"] == 20.0


# ------------------------------------------------------------------------------------------------
# Skipping non-finite steps.


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.slow
def test_non_finite_gradient_skips_the_step_with_zero_updates(bad):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  updates, state = jitted_update(tx)(grads_like(PARAMS, b=(1, bad)), tx.init(PARAMS), PARAMS)
  assert state.found_inf
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.slow
def test_skipped_step_leaves_params_and_adam_state_bit_identical():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=4.0)
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  _, state = step(grads_like(PARAMS, 3.0), state, PARAMS)  # a real step: adam moments nonzero
  updates, skipped = step(grads_like(PARAMS, 3.0, w=((1, 2), np.nan)), state, PARAMS)
  new_params = optax.apply_updates(PARAMS, updates)
  assert tree_bitwise_equal(new_params, PARAMS)
  assert tree_bitwise_equal(skipped.inner_state, state.inner_state)
  assert skipped.inner_state[0].count == 1  # the step count did not advance


@pytest.mark.parametrize(
  "dtype", [jnp.int4, jnp.float8_e4m3fn, jnp.uint16, jnp.bool_, jnp.complex64]
)
def test_skipped_step_keeps_large_inner_state_leaves_of_every_width_bit_identical(dtype):
  # The skipped branch copies big state leaves with a select, whatever their dtype's width.
  old = jnp.asarray(np.arange(5000) % 3, dtype)
  inner = optax.GradientTransformation(
    lambda params: old, lambda updates, state, params=None: (updates, state + state)
  )
  tx = jaxamp.dynamic_loss_scale(inner)
  params = {"w": jnp.ones(3)}
  _, state = jitted_update(tx)({"w": jnp.array([np.inf, 1.0, 1.0])}, tx.init(params), params)
  assert state.found_inf
  assert state.inner_state.dtype == old.dtype
  assert tree_bitwise_equal(state.inner_state, old)


def test_an_inner_state_of_many_prng_keys_takes_and_skips_steps():
  # Typed PRNG keys (an optimizer drawing noise per row) have no -0.0 fill to select against.
  old = jax.random.split(jax.random.key(0), 5000)
  split = jax.vmap(lambda key: jax.random.split(key)[0])
  inner = optax.GradientTransformation(
    lambda params: old, lambda updates, state, params=None: (updates, split(state))
  )
  tx, params = jaxamp.dynamic_loss_scale(inner), {"w": jnp.ones(3)}
  update = jitted_update(tx)
  _, taken = update({"w": jnp.ones(3)}, tx.init(params), params)
  _, skipped = update({"w": jnp.array([np.inf, 1.0, 1.0])}, taken, params)
  assert not taken.found_inf and skipped.found_inf
  np.testing.assert_array_equal(
    jax.random.key_data(taken.inner_state), jax.random.key_data(split(old))
  )
  np.testing.assert_array_equal(
    jax.random.key_data(skipped.inner_state), jax.random.key_data(taken.inner_state)
  )


PROMOTING_STATES = {  # optax's moments start in the params' dtype; the first update promotes them
  "bfloat16 params, float32 gradients": (
    {"w": jnp.full((64, 80), 0.5, jnp.bfloat16), "b": jnp.ones(3, jnp.bfloat16)},
    {"w": jnp.ones((64, 80)), "b": jnp.ones(3)},
  ),
  "an integer leaf": (
    {"w": jnp.ones(3), "step": jnp.arange(3)},
    {"w": jnp.ones(3), "step": jnp.zeros(3, jnp.int32)},
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("inner", [optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)])
@pytest.mark.parametrize("case", list(PROMOTING_STATES), ids=str)
def test_an_inner_update_that_promotes_its_state_takes_and_skips_steps_as_plain_optax(case, inner):
  params, finite = PROMOTING_STATES[case]
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  updates, state = jitted_update(tx)(finite, tx.init(params), params)
  plain_updates, plain_state = jax.jit(inner.update)(finite, inner.init(params), params)
  assert tree_bitwise_equal(updates, plain_updates)
  assert tree_bitwise_equal(state.inner_state, plain_state)
  overflow = dict(finite, w=finite["w"].at[0].set(np.inf))
  updates, skipped = jitted_update(tx)(overflow, tx.init(params), params)
  assert skipped.found_inf
  assert tree_bitwise_equal(optax.apply_updates(params, updates), params)
  promoted = jax.tree.map(lambda old, new: old.astype(new.dtype), inner.init(params), plain_state)
  assert tree_bitwise_equal(skipped.inner_state, promoted)  # the old values, in the new dtypes


@pytest.mark.slow
def test_skipped_step_keeps_negative_zero_params_negative_zero():
  params = {"w": jnp.array([-0.0, 0.0, -1.5])}
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2))
  updates, state = jitted_update(tx)({"w": jnp.array([np.inf, 1.0, 1.0])}, tx.init(params), params)
  assert state.found_inf
  assert tree_bitwise_equal(optax.apply_updates(params, updates), params)


def test_skipped_step_keeps_complex_params_with_negative_zero_parts_bit_identical():
  # A -0.0 update with a +0.0 imaginary part turns a -0.0 imaginary part into +0.0.
  params = {"z": jax.lax.complex(jnp.array([-0.0, 1.0]), jnp.array([-0.0, -0.0]))}
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  grads = {"z": jnp.array([complex(np.inf, 0), 1j], jnp.complex64)}
  updates, state = jitted_update(tx)(grads, tx.init(params), params)
  assert state.found_inf
  assert tree_bitwise_equal(optax.apply_updates(params, updates), params)


@pytest.mark.slow
def test_skipped_step_does_not_advance_learning_rate_schedules():
  schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
  tx = jaxamp.dynamic_loss_scale(optax.sgd(schedule), init_scale=1.0)
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  for bad in (np.inf, np.inf, np.inf):
    _, state = step(grads_like(PARAMS, b=(0, bad)), state, PARAMS)
  updates, _ = step(grads_like(PARAMS, float(state.scale)), state, PARAMS)  # unscaled: 1.0
  assert np.all(np.asarray(updates["b"]) == -1.0)  # -1.0 * the schedule's first value


@pytest.mark.slow
def test_overflow_in_one_float16_leaf_skips_every_leaf():
  params = {"f32": jnp.ones(3), "f16": jnp.ones(3, jnp.float16)}
  grads = {"f32": jnp.ones(3), "f16": jnp.array([1.0, 7e4, 1.0]).astype(jnp.float16)}  # inf
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0))
  updates, state = jitted_update(tx)(grads, tx.init(params), params)
  assert state.found_inf and not np.any(np.asarray(updates["f32"]))


@pytest.mark.parametrize("dtype", (jnp.float16, jnp.bfloat16))
def test_a_16_bit_gradient_that_unscaling_overflows_skips_the_step(dtype):
  """Below a scale of 1 unscaling multiplies: a finite 16-bit gradient can round to Inf on its
  way back to its dtype (torch refuses to unscale float16 gradients). The step is skipped, as
  for an Inf the backward made, and the parameters stay finite."""
  big = float(jnp.finfo(dtype).max) / 2
  params = {"w": jnp.ones(3, dtype)}
  grads = {"w": jnp.array([big, 1.0, 1.0], dtype)}  # finite; big / 2**-10 is not
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1e-3), init_scale=2.0**-10)
  state = tx.init(params)
  updates, state = jitted_update(tx)(grads, state, params)
  assert state.found_inf and not np.any(np.asarray(updates["w"], np.float32))
  unscaled, found_inf = jax.jit(jaxamp.unscale)(grads, tx.init(params))
  assert found_inf and not np.isfinite(np.asarray(unscaled["w"][0], np.float32))


def test_a_float32_gradient_is_checked_scaled_as_torch_checks_it():
  """torch's check reads the scaled float32 gradients: an unscaling that overflows float32 (a
  scale below 1) is applied, not skipped."""
  grads = {"w": jnp.array([3e38, 1.0], jnp.float32)}
  tx = jaxamp.dynamic_loss_scale(optax.identity(), init_scale=0.5)
  updates, state = jitted_update(tx)(grads, tx.init(grads), grads)
  assert not state.found_inf and np.isinf(np.asarray(updates["w"][0]))


@pytest.mark.slow
def test_found_inf_and_skipped_steps_report_the_last_and_all_skips():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  seen = []
  for bad in (None, np.inf, np.nan, None):
    grads = grads_like(PARAMS) if bad is None else grads_like(PARAMS, b=(0, bad))
    _, state = step(grads, state, PARAMS)
    seen.append((bool(state.found_inf), int(state.skipped_steps)))
  assert seen == [(False, 0), (True, 1), (True, 2), (False, 2)]


@pytest.mark.slow
def test_skipped_steps_counter_saturates_instead_of_wrapping():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init(PARAMS)._replace(skipped_steps=jnp.int32(np.iinfo(np.int32).max))
  _, state = jitted_update(tx)(grads_like(PARAMS, b=(0, np.inf)), state, PARAMS)
  assert state.skipped_steps == np.iinfo(np.int32).max


@pytest.mark.slow
def test_update_needs_no_host_transfer():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  step = jitted_update(tx)
  state, grads = tx.init(PARAMS), grads_like(PARAMS, b=(0, np.nan))
  step(grads, state, PARAMS)  # compile
  with jax.transfer_guard("disallow"):
    _, state = step(grads, state, PARAMS)
  assert state.found_inf


# ------------------------------------------------------------------------------------------------
# The scale: back off and growth.


@pytest.mark.slow
def test_overflow_backs_off_the_scale_and_resets_the_growth_tracker():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=1000.0, growth_interval=5)
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  _, state = step(grads_like(PARAMS), state, PARAMS)
  assert state.growth_tracker == 1
  _, state = step(grads_like(PARAMS, w=((0, 0), np.inf)), state, PARAMS)
  assert state.scale == 500.0 and state.growth_tracker == 0


@pytest.mark.slow
def test_scale_grows_after_growth_interval_consecutive_finite_steps():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, growth_interval=3)
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  history = []
  for _ in range(7):
    _, state = step(grads_like(PARAMS), state, PARAMS)
    history.append((float(state.scale), int(state.growth_tracker)))
  assert history == [(8, 1), (8, 2), (16, 0), (16, 1), (16, 2), (32, 0), (32, 1)]


@pytest.mark.slow
def test_growth_that_would_overflow_float32_keeps_the_old_scale():
  big = float(np.float32(2.0**127))
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=big, growth_interval=1)
  _, state = jitted_update(tx)(grads_like(PARAMS), tx.init(PARAMS), PARAMS)
  assert state.scale == big and state.growth_tracker == 0


@pytest.mark.slow
def test_backoff_has_no_floor_and_can_reach_zero():
  tiny = float(np.float32(1.4e-45))  # the smallest subnormal float32
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=tiny)
  _, state = jitted_update(tx)(grads_like(PARAMS, b=(0, np.nan)), tx.init(PARAMS), PARAMS)
  assert state.scale == 0.0  # 2**-150 rounds to even: zero, as in torch


# ------------------------------------------------------------------------------------------------
# min_scale: an optional floor (jmp, flax), off by default (torch).


def overflow_scales(tx, steps):
  """The scale after each of ``steps`` overflowing updates, under ``jit``."""
  step, state, scales = jitted_update(tx), tx.init(PARAMS), []
  for _ in range(steps):
    _, state = step(grads_like(PARAMS, b=(0, np.nan)), state, PARAMS)
    scales.append(float(state.scale))
  return scales


@pytest.mark.slow
def test_repeated_overflows_stop_at_min_scale():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, min_scale=3.0)
  assert overflow_scales(tx, 6) == [32.0, 16.0, 8.0, 4.0, 3.0, 3.0]


@pytest.mark.slow
def test_min_scale_is_reached_exactly_and_kept_by_later_growth_and_backoff():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0, min_scale=4.0, growth_interval=1)
  step, state = jitted_update(tx), tx.init(PARAMS)
  _, state = step(grads_like(PARAMS, b=(0, np.inf)), state, PARAMS)
  assert state.scale == 4.0 and state.found_inf and state.min_scale == 4.0
  _, state = step(grads_like(PARAMS), state, PARAMS)
  assert state.scale == 8.0  # the floor does not stop growth
  _, state = step(grads_like(PARAMS, b=(0, np.inf)), state, PARAMS)
  assert state.scale == 4.0


@pytest.mark.slow
def test_min_scale_never_raises_a_scale_set_below_it():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, min_scale=8.0)
  state = jaxamp.scaler.set_scale(tx.init(PARAMS), 2.0)
  _, state = jitted_update(tx)(grads_like(PARAMS, b=(0, np.nan)), state, PARAMS)
  assert state.scale == 2.0


@pytest.mark.slow
def test_default_min_scale_is_none_and_halves_like_torch():
  torch = pytest.importorskip("torch")
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0)
  assert tx.init(PARAMS).min_scale is None
  w = torch.zeros(1, requires_grad=True)
  opt = torch.optim.SGD([w], lr=0.1)
  torch_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
  torch_scaler.scale(torch.ones(()))
  torch_scales = []
  for _ in range(8):
    w.grad = torch.full((1,), float("nan"))
    torch_scaler.step(opt)
    torch_scaler.update()
    torch_scales.append(torch_scaler.get_scale())
  assert overflow_scales(tx, 8) == torch_scales == [4.0 / 2**k for k in range(1, 9)]


@pytest.mark.parametrize(
  "min_scale, error",
  [
    (0.0, ValueError),
    (-1.0, ValueError),
    (math.inf, ValueError),
    (math.nan, ValueError),
    (1e-50, ValueError),  # 0 in float32
    (128.0, ValueError),  # above init_scale
    ("1", TypeError),
    (True, TypeError),
    (jnp.float32(1.0), TypeError),
  ],
)
def test_bad_min_scale_is_rejected_naming_the_valid_choices(min_scale, error):
  with pytest.raises(error, match=r"`min_scale` must be None \(no floor, as in torch\) or a real "):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, min_scale=min_scale)


def test_min_scale_equal_to_init_scale_is_accepted():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=64.0, min_scale=64)
  assert tx.init(PARAMS).min_scale == 64.0


@pytest.mark.parametrize(
  "init_scale, factor",
  [
    (65536.0, 1.1),
    (1e38, 1.1),
    (3e-39, 16.0),
    (12345.678, 0.3),
    (1e-30, 0.3),
    (7e-45, 0.3),
    (3.4028234e38, 0.25),
  ],
)
@pytest.mark.slow
def test_scale_updates_round_the_float64_product_to_float32_like_torch(init_scale, factor):
  grow = factor > 1
  tx = jaxamp.dynamic_loss_scale(
    optax.sgd(0.1),
    init_scale=init_scale,
    growth_interval=1,
    growth_factor=factor if grow else 2.0,
    backoff_factor=0.5 if grow else factor,
  )
  step = jitted_update(tx)
  state = tx.init(PARAMS)
  grads = grads_like(PARAMS) if grow else grads_like(PARAMS, b=(0, np.inf))
  expected = np.float32(init_scale)
  for _ in range(3):
    _, state = step(grads, state, PARAMS)
    product = np.float32(np.float64(expected) * factor)  # torch: float(float * double)
    expected = product if np.isfinite(product) else expected
    assert f32_bits(state.scale) == f32_bits(expected)


# ------------------------------------------------------------------------------------------------
# enabled=False.


@pytest.mark.slow
def test_disabled_scaler_is_an_exact_pass_through_of_the_inner_optimizer():
  inner = optax.adam(1e-2)
  tx = jaxamp.dynamic_loss_scale(inner, enabled=False)
  state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
  for grads in (grads_like(PARAMS, 3.0), grads_like(PARAMS, 2.0, b=(0, np.inf))):
    updates, state = jitted_update(tx)(grads, state, PARAMS)
    expected, inner_state = jitted_update(inner)(grads, inner_state, PARAMS)
    assert tree_bitwise_equal(updates, expected)  # nothing unscaled, nothing skipped
    assert tree_bitwise_equal(state.inner_state, inner_state)
  assert jaxamp.scaler.get_scale(state) == 1.0 and jaxamp.scaler.state_dict(state) == {}
  assert not state.found_inf and state.skipped_steps == 0


# ------------------------------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize(
  "kwargs, error, message",
  [
    (dict(growth_factor=1.0), ValueError, r"`growth_factor` must be > 1.0 .*got 1.0"),
    (dict(growth_factor=0.5), ValueError, r"`growth_factor` must be > 1.0 .*got 0.5"),
    (dict(growth_factor=math.inf), ValueError, r"`growth_factor` .*finite.*got inf"),
    (dict(growth_factor="2"), TypeError, r"`growth_factor` must be a real number.*'2'"),
    (dict(growth_factor=True), TypeError, r"`growth_factor` must be a real number.*True"),
    (dict(backoff_factor=1.0), ValueError, r"`backoff_factor` must satisfy 0 < .* < 1.*1.0"),
    (dict(backoff_factor=0.0), ValueError, r"`backoff_factor` must satisfy 0 < .* < 1.*0.0"),
    (dict(backoff_factor=-0.5), ValueError, r"`backoff_factor` .*got -0.5"),
    (dict(growth_interval=0), ValueError, r"`growth_interval` must be an int in \[1, .*got 0"),
    (dict(growth_interval=2.5), TypeError, r"`growth_interval` must be an int.*2.5"),
    (dict(growth_interval=True), TypeError, r"`growth_interval` must be an int.*bool.*True"),
    (dict(init_scale=0.0), ValueError, r"`init_scale` must be > 0 and finite.*got 0.0"),
    (dict(init_scale=-1.0), ValueError, r"`init_scale` must be > 0.*got -1.0"),
    (dict(init_scale=math.inf), ValueError, r"`init_scale` must be > 0 and finite.*inf"),
    (dict(init_scale=math.nan), ValueError, r"`init_scale` must be > 0 and finite.*nan"),
    (dict(init_scale=1e39), ValueError, r"`init_scale` .*finite in float32.*1e\+39"),
    (dict(init_scale="1"), TypeError, r"`init_scale` must be a real number"),
    (dict(init_scale=jnp.float32(4.0)), TypeError, r"`init_scale` must be a real number"),
    (dict(growth_factor=math.nan), ValueError, r"`growth_factor` must be > 1.0"),
    (dict(growth_interval=2.0), TypeError, r"`growth_interval` must be an int.*2.0"),
    (dict(enabled="yes"), TypeError, r"`enabled` must be a bool.*'yes'"),
  ],
)
def test_invalid_arguments_are_rejected_naming_the_argument(kwargs, error, message):
  with pytest.raises(error, match=message):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize(
  "inner, got", [(lambda g: g, "function"), (None, "None"), (optax.sgd, "function")]
)
def test_inner_must_be_an_optax_gradient_transformation(inner, got):
  with pytest.raises(TypeError, match=rf"`inner` must be an optax GradientTransformation.*{got}"):
    jaxamp.dynamic_loss_scale(inner)


def test_multisteps_object_is_rejected_with_a_hint():
  with pytest.raises(TypeError, match=r"`inner`.*MultiSteps.*gradient_transformation\(\)"):
    jaxamp.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), 2))


def test_dynamic_loss_scale_accepts_numpy_scalars():
  state = jaxamp.dynamic_loss_scale(
    optax.sgd(0.1), init_scale=np.float32(8.0), growth_interval=np.int64(3)
  ).init(PARAMS)
  assert state.scale == 8.0 and state.growth_interval == 3


def test_dynamic_loss_scale_options_are_keyword_only():
  with pytest.raises(TypeError, match="positional argument"):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), 2.0)


# ------------------------------------------------------------------------------------------------
# update: unusual gradients and states.


@pytest.mark.slow
def test_update_with_axis_name_outside_a_mapped_context_names_the_unbound_axis():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="data")
  with pytest.raises(NameError, match="unbound axis name: data"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("gradient", ["finite", "inf"])
def test_update_passes_the_float0_gradient_of_an_integer_leaf(gradient):
  # jax.grad(allow_int=True) gives an integer leaf a float0 gradient; torch freezes such leaves
  params = {"w": jnp.ones(3), "n": jnp.arange(3)}
  scale = 1.0 if gradient == "finite" else jnp.inf
  loss = lambda p: jnp.sum(scale * p["w"] * p["n"])
  grads = jax.grad(loss, allow_int=True)(params)
  inner = optax.multi_transform(
    {"a": optax.sgd(0.1), "z": optax.set_to_zero()}, {"w": "a", "n": "z"}
  )
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=1.0)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert updates["n"].dtype == jax.dtypes.float0 and updates["n"].shape == (3,)
  assert bool(state.found_inf) == (gradient == "inf")


def test_update_with_a_misspelled_axis_name_inside_shard_map_names_it():
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), axis_name="dta")
  step = jax.shard_map(
    lambda g: tx.update(g, tx.init(g), g)[0], mesh=mesh, in_specs=P("data"), out_specs=P("data")
  )
  with pytest.raises(NameError, match="'dta' is not an axis of an enclosing shard_map or pmap"):
    step(jnp.ones(2))


@pytest.mark.parametrize("state", ["inner", "none"])
def test_update_with_a_state_that_is_not_the_scalers_is_a_type_error(state):
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  wrong = optax.adam(0.1).init(PARAMS) if state == "inner" else None
  with pytest.raises(TypeError, match="DynamicLossScaleState"):
    tx.update(PARAMS, wrong, PARAMS)


@pytest.mark.slow
def test_update_skips_none_leaves_and_checks_the_others():
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  params = {"w": jnp.ones(3), "frozen": None}
  state, update = tx.init(params), jax.jit(tx.update)
  updates, new_state = update({"w": jnp.ones(3), "frozen": None}, state, params)
  assert updates["frozen"] is None and not new_state.found_inf
  _, new_state = update({"w": jnp.full(3, jnp.nan), "frozen": None}, state, params)
  assert new_state.found_inf


@pytest.mark.slow
def test_update_of_zero_size_params_works_and_finds_no_overflow_in_them():
  tx = jaxamp.dynamic_loss_scale(optax.adam(0.1))
  params = {"empty": jnp.ones((0, 4)), "w": jnp.ones(3)}
  state = tx.init(params)
  updates, new_state = jax.jit(tx.update)(params, state, params)
  assert updates["empty"].shape == (0, 4) and not new_state.found_inf
  assert jaxamp.scaler.get_scale(new_state) == 2.0**16


def test_update_of_an_empty_tree_is_a_finite_step():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  updates, state = jax.jit(tx.update)({}, tx.init({}), {})
  assert updates == {} and not state.found_inf and state.growth_tracker == 1


# ------------------------------------------------------------------------------------------------
# axis_name: every shard takes the same decision.

_SHARD_MAP_SCRIPT = textwrap.dedent(
  """
    import json, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxamp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = {"w": jnp.ones(8)}  # each shard owns 2 entries (sharded parameters)
    tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=4.0, axis_name="data")
    state = tx.init(params)

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=({"w": P("data")}, P(), {"w": P("data")}),
        out_specs=({"w": P("data")}, P()), check_vma=False))
    grads = {"w": jnp.full(8, 4.0).at[5].set(jnp.inf)}  # only shard 2 overflows
    new_params, new_state = step(params, state, grads)
    finite_params, finite_state = step(params, state, {"w": jnp.full(8, 4.0)})
    print(json.dumps({
        "devices": len(jax.devices()),
        "params": np.asarray(new_params["w"]).tolist(),
        "found_inf": bool(new_state.found_inf),
        "scale": float(new_state.scale),
        "finite_params": np.asarray(finite_params["w"]).tolist(),
        "finite_scale": float(finite_state.scale),
    }))
    """
)


def run_on_four_cpu_devices(script):
  return cpu_devices.run_json(script, devices=4)


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_axis_name_makes_every_shard_skip_when_one_shard_overflows():
  result = run_on_four_cpu_devices(_SHARD_MAP_SCRIPT)
  assert result["devices"] == 4
  assert result["found_inf"] and result["scale"] == 2.0
  assert result["params"] == [1.0] * 8  # no shard stepped, not even the finite ones
  assert result["finite_params"] == [0.0] * 8 and result["finite_scale"] == 4.0


def _reductions(shapes: dict) -> tuple[int, int]:
  """(reductions in the jaxpr of the scaler's update, times it traced the inner update), for
  gradients of the given ``{name: (shape, dtype)}``."""
  calls = []
  adam = optax.adam(1e-3)

  def counted(grads, state, params=None):
    calls.append(1)
    return adam.update(grads, state, params)

  tx = jaxamp.dynamic_loss_scale(optax.GradientTransformation(adam.init, counted))
  params = {name: jnp.ones(shape, dtype) for name, (shape, dtype) in shapes.items()}
  text = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
  return sum(text.count(f"{r}[") for r in ("reduce_sum", "reduce_and", "reduce_or")), len(calls)


def _leaves(count: int, shapes: tuple, dtype=jnp.float32) -> dict:
  return {f"w{i}": (shapes[i % len(shapes)], dtype) for i in range(count)}


def test_the_finite_check_reduces_large_leaves_in_small_groups_and_the_inner_update_traces_once():
  # One reduction per (shape, dtype) group of leaves, split into kernels of a few leaves (a kernel
  # of hundreds compiled slowly), not one per leaf; the inner update is traced once (not again
  # by jax.eval_shape for the skipped branch's shapes).
  per_kernel = loss_scale._CHECK_LEAVES_PER_KERNEL
  assert 1 < per_kernel < 32
  large = (loss_scale._CHECK_CONCAT_BELOW,), (64, loss_scale._CHECK_CONCAT_BELOW // 32)
  assert _reductions(_leaves(4, large)) == (2, 1)
  assert _reductions(_leaves(64, large)) == (2 * math.ceil(32 / per_kernel), 1)


def test_on_one_device_small_leaves_are_checked_in_one_reduction_per_dtype():
  # Biases and norm scales, flattened and concatenated: one kernel for all of them.
  assert jax.device_count() == 1
  small = (5,), (4, 3), ()
  assert _reductions(_leaves(64, small)) == (1, 1)
  assert _reductions({**_leaves(8, small), **_leaves(3, small, jnp.bfloat16)}) == (2, 1)


def test_a_concatenated_check_vector_holds_at_most_its_size_of_elements():
  size, below = loss_scale._CHECK_CONCAT_SIZE, loss_scale._CHECK_CONCAT_BELOW
  per_vector = size // (below - 1)
  assert _reductions(_leaves(per_vector, ((below - 1,),))) == (1, 1)
  assert _reductions(_leaves(per_vector + 1, ((below - 1,),))) == (2, 1)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16))
@pytest.mark.parametrize("bad", (np.inf, -np.inf, np.nan))
def test_a_non_finite_value_in_any_leaf_small_or_large_is_found(dtype, bad):
  shapes = {"scalar": (), "bias": (3,), "empty": (0,), "norm": (2, 4), "kernel": (64, 96)}
  tree = {name: jnp.ones(shape, dtype) for name, shape in shapes.items()}
  tree["count"] = jnp.arange(3)  # not inexact: not checked
  check = jax.jit(loss_scale._tree_found_inf)
  assert not bool(check(tree))
  for name, x in tree.items():
    if jnp.issubdtype(x.dtype, jnp.inexact) and x.size:
      corrupted = x.at[(-1,) * x.ndim].set(bad) if x.ndim else jnp.asarray(bad, dtype)
      assert bool(check({**tree, name: corrupted})), name


_FSDP_CHECK_SCRIPT = textwrap.dedent(
  """
    import json, re, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxamp

    mesh = Mesh(np.array(jax.devices()), ("d",))
    shapes = {f"layer{i}": {"kernel": (64, 64), "bias": (64,), "scale": (8,)} for i in range(6)}
    params = jax.tree.map(lambda s: jnp.ones(s), shapes, is_leaf=lambda s: isinstance(s, tuple))
    params = jax.device_put(params, NamedSharding(mesh, P("d")))  # every leaf split over "d"
    tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    state = tx.init(params)
    text = jax.jit(step).lower(params, state, params).compile().as_text()
    found = {}
    for name in ("kernel", "bias", "scale"):  # an inf in one shard of one leaf of each kind
      grads = jax.tree.map(lambda g: g, params)  # a copy of the dicts
      grads["layer3"][name] = grads["layer3"][name].at[5].set(jnp.inf)
      grads = jax.device_put(grads, NamedSharding(mesh, P("d")))
      found[name] = bool(jax.jit(step)(params, state, grads)[1].found_inf)
    found["none"] = bool(jax.jit(step)(params, state, params)[1].found_inf)
    moves = r" (all-gather|all-to-all|collective-permute)(?:-start)?\\("
    print(json.dumps({"collectives": re.findall(moves, text), "found_inf": found}))
    """
)


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_the_scaler_moves_no_shard_of_sharded_gradients():
  # Concatenating the small leaves for the finite check, or constraining the gradients' layout,
  # made GSPMD gather every sharded one: with several devices neither is done, and each leaf is
  # reduced where it lies, into one all-reduce.
  result = run_on_four_cpu_devices(_FSDP_CHECK_SCRIPT)
  assert result["found_inf"] == {"kernel": True, "bias": True, "scale": True, "none": False}
  assert result["collectives"] == []


def _compiled_entry(fun, *args):
  """The entry computation of ``jit(fun)``'s compiled HLO text (the called ones left out)."""
  text = jax.jit(fun).lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY") :]
  return entry[: entry.index("\n}\n")]


@pytest.mark.slow
def test_finite_steps_do_not_copy_the_weight_moments():
  # The skipped branch of the cond returns the old inner state; returned as it came in, XLA copied
  # every moment before the cond on every step (one more read and write of the state).
  import flax.linen as nn

  model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(256), nn.relu, nn.Dense(4)])
  params = model.init(jax.random.key(0), jnp.ones((2, 64)))["params"]
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  entry = _compiled_entry(step, params, tx.init(params), params)
  assert "f32[64,256]{1,0} copy(" not in entry and "f32[256,256]{1,0} copy(" not in entry


def _cond_operand_layouts(entry: str) -> list[str]:
  """The layouts (minor to major) of every array the conditional of an entry computation
  (``_compiled_entry``) takes."""
  cond = next(line for line in entry.splitlines() if " conditional(" in line)
  layouts = []
  for name in re.findall(r"%([\w.\-]+)", cond.split("conditional(")[1].split(")")[0]):
    definition = next(line for line in entry.splitlines() if f"%{name} = " in line)
    layouts += re.findall(r"\{[\d,]+\}", definition.split(f"%{name} = ")[1].split(" tuple(")[0])
  return layouts


@pytest.mark.slow
def test_attention_gradients_reach_the_check_and_the_cond_row_major_on_cpu():
  # Flax's attention kernels get their gradients as transposed dots. Taken as they came, XLA:CPU
  # wrote them once row-major for the check and once in the dot's layout for the cond, and copied
  # that to row-major inside the taken branch.
  import flax.linen as nn

  model = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
  x = jnp.ones((2, 16, 64))
  params = model.init(jax.random.key(0), x)["params"]
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))

  def step(params, state, x):
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  layouts = _cond_operand_layouts(_compiled_entry(step, params, tx.init(params), x))
  assert "{2,1,0}" in layouts
  assert all(layout in ("{0}", "{1,0}", "{2,1,0}") for layout in layouts), layouts


def _inverse_kernels(leaves: int) -> int:
  """How many times ``unscale``'s compiled HLO decomposes the scale (``count-leading-zeros``)."""
  params = {f"w{i}": jnp.ones((4, 3) if i % 2 else (5,)) for i in range(leaves)}
  state = jaxamp.dynamic_loss_scale(optax.adam(1e-3)).init(params)
  text = jax.jit(jaxamp.unscale).lower(params, state).compile().as_text()
  return text.count("count-leading-zeros(")


@pytest.mark.slow
def test_unscale_compiles_the_exact_inverse_once_whatever_the_leaf_count():
  # XLA fused the ~100 scalar ops of torch's float64 inverse into every leaf's kernel.
  assert _inverse_kernels(4) == _inverse_kernels(32)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_losses_and_gradients_are_a_type_error_saying_to_cast_to_float32(dtype):
  # torch's GradScaler has no float8 arithmetic either ("Promotion for Float8 Types is not
  # supported"); the message names the float32 cast.
  params = {"w": jnp.ones(4, dtype)}
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0)
  state = tx.init(params)
  grads = {"w": jnp.ones(4, dtype)}
  calls = {
    "updates": lambda: tx.update(grads, state, params),
    "grads": lambda: jaxamp.unscale(grads, state),
    "loss": lambda: jaxamp.scale_loss(jnp.asarray(2.0, dtype), state),
  }
  for argument, call in calls.items():
    with pytest.raises(
      TypeError, match=rf"`{argument}` has a {jnp.dtype(dtype).name} leaf.*float32"
    ):
      call()
