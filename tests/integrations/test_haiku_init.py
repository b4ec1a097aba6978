"""A Haiku init run under autocast creates the parameters and state a float32 init creates.

torch creates parameters outside autocast, and flax linen's ``Module.init`` under autocast runs
as written; Haiku's init (of every transform) is its ``module_init`` op region too, so its norm
layers' scales and statistics and a data-dependent parameter stay float32.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxamp

hk = pytest.importorskip("haiku")

KEY = jax.random.key(0)
X = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
F32 = jnp.dtype(jnp.float32)


def forward(x):
  h = hk.Linear(8)(x)
  h = hk.BatchNorm(True, True, 0.9)(h, is_training=True)
  h = hk.LayerNorm(-1, True, True)(h)
  first_batch_mean = hk.get_parameter("shift", (8,), init=lambda *_: jnp.mean(h, 0))
  return jnp.sum(h * first_batch_mean)


def _multi_transform_init(key, x):
  model = hk.multi_transform_with_state(lambda: (forward, (forward,)))
  return model.init(key, x)


INITS = {
  "transform_with_state": hk.transform_with_state(forward).init,
  "multi_transform_with_state": _multi_transform_init,
  "transform": hk.transform(lambda x: hk.LayerNorm(-1, True, True)(hk.Linear(8)(x))).init,
}


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("init", sorted(INITS))
def test_an_autocast_haiku_init_creates_the_float32_inits_parameters_and_state(init, device_type):
  created = jaxamp.autocast(INITS[init], device_type=device_type)(KEY, X)
  expected = INITS[init](KEY, X)
  dtypes = lambda tree: jax.tree.map(lambda leaf: leaf.dtype, tree)
  assert dtypes(created) == dtypes(expected)
  assert jax.tree.all(
    jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), created, expected)
  )


def test_parameters_an_autocast_haiku_init_created_get_float32_gradients():
  model = hk.transform_with_state(forward)
  params, state = jaxamp.autocast(model.init, device_type="cuda")(KEY, X)
  apply = jaxamp.autocast(model.apply, device_type="cuda")
  grads = jax.grad(lambda p: apply(p, state, None, X)[0].astype(jnp.float32))(params)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}
