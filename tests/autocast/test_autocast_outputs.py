"""Every output autocast computes is a ``jax.Array`` of its traced dtype, also run eagerly.

A jaxpr literal (``jnp.array(True)``, ``jnp.zeros(())``) and an input returned as it is would
otherwise come back as the Python or numpy value the interpreter holds: ``eqx.filter_jit`` treats a
Python ``bool`` as static and retraces on it (Equinox ``BatchNorm(mode="ema")``'s first-time flag).
Static values that ``f`` returns (Python numbers, strings) stay as they are.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)


def autocast(f):
  return jaxamp.autocast(f, device_type="cuda")


def assert_array(value, dtype, shape=()):
  assert isinstance(value, jax.Array), type(value)
  assert (value.dtype, value.shape) == (jnp.dtype(dtype), shape)


# --- constants and inputs ------------------------------------------------------------------------


def test_a_constant_bool_output_is_a_bool_array():
  assert_array(autocast(lambda x: (x, jnp.array(True)))(X)[1], jnp.bool_)


def test_a_constant_float_output_is_a_float32_array():
  assert_array(autocast(lambda x: (x, jnp.zeros(())))(X)[1], jnp.float32)


def test_a_constant_int_output_is_an_int32_array():
  assert_array(autocast(lambda x: (x, jnp.asarray(2)))(X)[1], jnp.int32)


def test_a_numpy_input_returned_unchanged_is_an_array_of_its_traced_dtype():
  x = np.ones((2, 3), np.float32)
  assert_array(autocast(lambda x, y: (x @ y.T, y))(x, x)[1], jnp.float32, (2, 3))


def test_static_outputs_stay_python_values():
  out = autocast(lambda x: (x @ x.T, 3, "tag", None))(X)
  assert out[1:] == (3, "tag", None) and type(out[1]) is int


def test_the_matmul_output_keeps_the_policy_dtype():
  assert_array(autocast(lambda x: x @ x.T)(X), jnp.float16, (4, 4))


# --- Equinox BatchNorm(mode="ema") ---------------------------------------------------------------


def ema_batch_norm():
  return eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="ema")


def batch_norm_forward(model, x, state):
  batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
  return batched(x, state)


@pytest.mark.slow
def test_ema_batch_norm_state_leaves_are_arrays_run_eagerly():
  model, state = ema_batch_norm()
  _, state = autocast(batch_norm_forward)(model, X, state)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))


def test_ema_batch_norm_step_under_filter_jit_does_not_retrace():
  model, state = ema_batch_norm()
  traces = []

  @eqx.filter_jit
  def step(model, x, state):
    traces.append(None)
    return autocast(batch_norm_forward)(model, x, state)

  _, state = step(model, X, state)
  _, state = step(model, X + 1.0, state)
  assert len(traces) == 1
