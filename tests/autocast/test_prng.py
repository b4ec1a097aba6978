"""Random draws under autocast are plain JAX's, under either threefry implementation.

JAX's default threefry is the partitionable one (``jax_threefry_partitionable``); the other
draws other bits through the same primitives. autocast leaves both alone.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

X = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)
W = jnp.linspace(-0.5, 0.5, 64, dtype=jnp.float32).reshape(8, 8)
THREEFRY = pytest.mark.parametrize(
  "partitionable", [True, False], ids=["partitionable", "not_partitionable"]
)


@THREEFRY
def test_a_dropout_mask_is_the_float32_runs(partitionable):
  layer = nn.Dropout(0.5, deterministic=False)
  apply = lambda x, w: layer.apply({}, x @ w, rngs={"dropout": jax.random.key(3)})
  with jax.threefry_partitionable(partitionable):
    low = jaxamp.autocast(apply, device_type="cuda")(X, W)
    plain = apply(X, W)
  assert low.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(low) == 0, np.asarray(plain) == 0)


@THREEFRY
def test_a_key_split_in_a_scan_draws_what_plain_jax_draws(partitionable):
  def noisy(x, key):
    def step(carry, _):
      x, key = carry
      key, sub = jax.random.split(key)
      return (x + jax.random.normal(sub, x.shape), key), None

    return lax.scan(step, (x, key), None, length=3)[0]

  with jax.threefry_partitionable(partitionable):
    (x, key) = jaxamp.autocast(noisy, device_type="cpu")(X, jax.random.key(0))
    (plain_x, plain_key) = noisy(X, jax.random.key(0))
  assert (jax.random.key_data(key) == jax.random.key_data(plain_key)).all()
  np.testing.assert_array_equal(x, plain_x)


@THREEFRY
def test_a_raw_uint32_key_draws_what_plain_jax_draws(partitionable):
  fun = lambda x, w, key: x @ w + jax.random.uniform(key, (4, 8))
  key = jax.random.PRNGKey(1)
  with jax.threefry_partitionable(partitionable):
    low = jaxamp.autocast(fun, device_type="cpu")(X, W, key)
    noise = jax.random.uniform(key, (4, 8))
  assert low.dtype == jnp.float32  # a float32 tensor added to a bfloat16 product promotes
  np.testing.assert_allclose(low - noise, X @ W, atol=0.05)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("sampler", [jax.random.gamma, jax.random.loggamma, jax.random.dirichlet])
def test_a_gamma_draw_of_a_16_bit_alpha_is_plain_jaxs_float32_draw(sampler, device_type):
  # jax.random.gamma casts alpha to float32 itself, a cast a float32 trace does not hold.
  key, x, w = jax.random.key(0), jnp.asarray([[0.5], [2.0], [30.0]]), jnp.ones((1, 1))
  draw = lambda key, x, w: sampler(key, (x @ w)[:, 0])  # alphas exact in 16 bits
  out = jax.jit(jaxamp.autocast(draw, device_type=device_type))(key, x, w)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, draw(key, x, w))


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=str)
@pytest.mark.parametrize(
  "sampler",
  [jax.random.normal, jax.random.exponential, jax.random.gumbel, jax.random.logistic],
  ids=lambda f: f.__name__,
)
def test_a_draw_in_a_16_bit_dtype_is_plain_jaxs_draw(sampler, dtype, device_type):
  """torch's samplers are factories autocast leaves alone: the draw keeps its dtype and bits
  (the CUDA list's float32 ``log`` and ``erfinv`` would widen it)."""
  draw = lambda key: sampler(key, (64,), dtype)
  out = jaxamp.autocast(draw, device_type=device_type)(jax.random.key(0))
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, draw(jax.random.key(0)))
