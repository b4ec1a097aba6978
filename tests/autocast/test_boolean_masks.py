"""A boolean mask multiplied into a 16-bit activation leaves it 16-bit, as torch's bool tensors do.

JAX converts the bool to the traced float32 before the multiply; taken as a float32 tensor, it
promoted the activation (and everything after it) to float32. Its values, zeros and ones, are
exact in every dtype, so following the partner changes no value. An explicit
``m.astype(jnp.float32)`` is the same eqn as ``m.astype(h.dtype)`` in a float32 trace: it follows
too (torch would promote that one; the values are the same).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8))
MASK = jax.random.bernoulli(jax.random.key(2), 0.5, (4, 8))

SPELLINGS = {
  "mask_times_activation": lambda h, m: m * h,
  "activation_times_mask_as_its_dtype": lambda h, m: h * m.astype(h.dtype),
  "broadcast_mask": lambda h, m: h[..., None] * m[..., None],
  "mask_as_float32": lambda h, m: m.astype(jnp.float32) * h,
  "mask_added": lambda h, m: h + m,
  "one_hot": lambda h, m: h * jax.nn.one_hot(jnp.argmax(m, -1), h.shape[-1]),
  "mask_made_in_a_jit": lambda h, m: h * jax.jit(lambda m: m.astype(jnp.float32))(m),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("device_type,dtype", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_a_boolean_mask_keeps_the_activation_in_its_16_bit_dtype(spelling, device_type, dtype):
  combine = SPELLINGS[spelling]
  fun = jaxamp.autocast(lambda x, w, m: combine(x @ w, m), device_type=device_type)
  out = jax.jit(fun)(X, W, MASK)
  assert out.dtype == dtype
  h = X.astype(dtype) @ W.astype(dtype)
  np.testing.assert_array_equal(out, combine(h, MASK).astype(dtype))


@jax.custom_jvp
def _multiply(u, v):  # distrax's multiply_no_nan has this shape (Categorical.log_prob)
  return u * v


_multiply.defjvp(lambda p, t: (_multiply(*p), t[0] * p[1] + p[0] * t[1]))


@jax.custom_vjp
def _multiply_vjp(u, v):
  return u * v


_multiply_vjp.defvjp(lambda u, v: (u * v, (u, v)), lambda res, g: (g * res[1], g * res[0]))

# A mask converted outside, multiplied into the activation inside a body it is passed into (a
# cond's outputs and a loop's carries keep their declared dtypes, so they are not here).
BODIES = {
  "jit": lambda h, m: jax.jit(lambda u, v: u * v)(h, m),
  "custom_jvp": _multiply,
  "custom_vjp": _multiply_vjp,
  "checkpoint": lambda h, m: jax.checkpoint(lambda u, v: u * v)(h, m),
  "scan_over_rows": lambda h, m: jax.lax.scan(lambda c, uv: (c, uv[0] * uv[1]), 0.0, (h, m))[1],
  "scan_constant": lambda h, m: jax.lax.scan(lambda c, u: (c, u * m[0]), 0.0, h)[1],
}


@pytest.mark.parametrize("body", list(BODIES))
@pytest.mark.parametrize("convert", ["bool_astype", "one_hot"])
@pytest.mark.parametrize("device_type,dtype", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_a_mask_passed_into_a_body_follows_its_partner_there(body, convert, device_type, dtype):
  """As torch's ``one_hot(a) * h`` (Categorical.log_prob): the mask was converted outside."""

  def fun(x, w, m):
    one_hot = jax.nn.one_hot(jnp.argmax(m, -1), 8)
    mask = m.astype(jnp.float32) if convert == "bool_astype" else one_hot
    return BODIES[body](x @ w, mask)

  out = jax.jit(jaxamp.autocast(fun, device_type=device_type))(X, W, MASK)
  assert out.dtype == dtype
  np.testing.assert_allclose(out.astype(jnp.float32), fun(X, W, MASK), rtol=2e-2, atol=2e-2)


def test_a_mask_passed_into_a_custom_jvp_keeps_its_gradients_float32():
  fun = jaxamp.autocast(lambda x, w, m: _multiply(x @ w, m.astype(jnp.float32)), device_type="cuda")
  grad = jax.grad(lambda w: jnp.sum(fun(X, w, MASK).astype(jnp.float32)))(W)
  assert grad.dtype == jnp.float32
  expected = jax.grad(lambda w: jnp.sum(MASK * (X @ w)))(W)
  np.testing.assert_allclose(grad, expected, rtol=1e-2, atol=1e-2)


def test_an_array_of_ones_passed_into_a_body_still_promotes():
  ones = MASK.astype(jnp.float32)
  fun = jaxamp.autocast(lambda x, w, m: _multiply(x @ w, m), device_type="cuda")
  assert fun(X, W, ones).dtype == jnp.float32


def test_a_boolean_mask_under_vmap_and_grad_keeps_the_activation_16_bit():
  fun = jaxamp.autocast(lambda x, w, m: m * (x @ w), device_type="cuda")
  assert jax.vmap(fun, (0, None, 0))(X, W, MASK).dtype == jnp.float16
  grad = jax.grad(lambda w: jnp.sum(fun(X, w, MASK).astype(jnp.float32)))(W)
  assert grad.dtype == jnp.float32
  expected = jax.grad(lambda w: jnp.sum(MASK * (X @ w)))(W)
  np.testing.assert_allclose(grad, expected, rtol=1e-2, atol=1e-2)


def test_haiku_dropout_keeps_its_input_dtype():
  def forward(x):
    return hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(8)(x))

  model = hk.transform(forward)
  params = model.init(jax.random.key(3), X)
  out = jax.jit(jaxamp.autocast(model.apply, device_type="cuda"))(params, jax.random.key(4), X)
  assert out.dtype == jnp.float16
  reference = model.apply(params, jax.random.key(4), X)
  np.testing.assert_array_equal(out == 0, reference == 0)  # the same units dropped


def test_an_array_of_ones_passed_in_still_promotes():
  """A float32 array of zeros and ones is a float32 tensor in torch, not a mask."""
  ones = MASK.astype(jnp.float32)
  fun = jaxamp.autocast(lambda x, w, m: m * (x @ w), device_type="cuda")
  assert fun(X, W, ones).dtype == jnp.float32
