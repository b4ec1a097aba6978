"""Every natural way to autocast an nnx module works wherever plain nnx does.

``autocast(model)(x)`` (the module as the function) and ``autocast(f)(model, x)`` keep the
module's state updates (BatchNorm statistics, a Dropout's own RNG counter, a Variable made in
``__call__``) eagerly and under ``nnx.jit``, ``nnx.grad``, ``nnx.value_and_grad``, ``nnx.remat``,
``nnx.vmap`` and ``nnx.scan``; a module closed over and only read runs inside ``jax.jit`` and
``jax.grad``, as in plain JAX.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32) + 1.0
STATE = nnx.Any(nnx.BatchStat, nnx.RngCount)


class CountsCalls(nnx.Module):
  """Creates its call counter on the first call."""

  def __call__(self, x):
    if not hasattr(self, "calls"):
      self.calls = nnx.BatchStat(jnp.zeros((), jnp.float32))
    self.calls[...] += 1.0
    return x * 2.0


MODELS = {
  "batch_norm": lambda: nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0)),
  "dropout": lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0)),
  "variable_made_in_call": CountsCalls,
}


def module_as_function(model, x):
  return jaxamp.autocast(model, device_type="cpu")(x)


def module_as_argument(model, x):
  return jaxamp.autocast(lambda m, x: m(x), device_type="cpu")(model, x)


def plain(model, x):
  return model(x)


def _loss(forward):
  return lambda model, x: jnp.sum(forward(model, x).astype(jnp.float32))


def _scan(forward):
  body = lambda model, x: (model, forward(model, x))
  return lambda model, xs: nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
    model, xs
  )[1]


XS = jnp.stack([X, X + 1.0])
TRANSFORMS = {
  "eager": (lambda forward: forward, X),
  "nnx_jit": (nnx.jit, X),
  "nnx_grad": (lambda forward: nnx.grad(_loss(forward)), X),
  "nnx_value_and_grad": (lambda forward: nnx.value_and_grad(_loss(forward)), X),
  "nnx_remat": (nnx.remat, X),
  "nnx_vmap": (lambda forward: nnx.vmap(forward, in_axes=(None, 0)), XS),
  "nnx_scan": (_scan, XS),
}
# Plain nnx rejects these too: batch statistics of a broadcast module under vmap, and a carry
# whose structure changes in the scan body.
PLAIN_NNX_FAILS = {("batch_norm", "nnx_vmap"), ("variable_made_in_call", "nnx_scan")}
CASES = [
  pytest.param(model, transform, id=f"{model}-{transform}")
  for model in MODELS
  for transform in TRANSFORMS
  if (model, transform) not in PLAIN_NNX_FAILS
]


def state_after(forward, model_name, transform_name):
  """The module's statistics and RNG counts after one ``forward`` under the transform."""
  model = MODELS[model_name]()
  transform, x = TRANSFORMS[transform_name]
  transform(forward)(model, x)
  return nnx.to_pure_dict(nnx.state(model, STATE))


def assert_same_state(found, expected):
  assert jax.tree.structure(found) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2)


@pytest.mark.slow  # every nnx transform
@pytest.mark.parametrize("model_name,transform_name", CASES)
def test_module_as_the_function_updates_state_like_plain_nnx(model_name, transform_name):
  assert_same_state(
    state_after(module_as_function, model_name, transform_name),
    state_after(plain, model_name, transform_name),
  )


@pytest.mark.slow  # every nnx transform
@pytest.mark.parametrize("model_name,transform_name", CASES)
def test_module_as_an_argument_updates_state_like_plain_nnx(model_name, transform_name):
  assert_same_state(
    state_after(module_as_argument, model_name, transform_name),
    state_after(plain, model_name, transform_name),
  )


@pytest.mark.slow
def test_module_as_the_function_runs_under_the_policy():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  assert jaxamp.autocast(model, device_type="cpu")(X).dtype == BF16


def test_module_as_the_function_with_autocast_disabled_runs_as_written():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(jaxamp.autocast(model, enabled=False)(X), model(X))


def test_module_as_the_function_passes_keyword_arguments():
  model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
  np.testing.assert_array_equal(
    jaxamp.autocast(model, device_type="cpu")(X, deterministic=True), X.astype(F32)
  )


# --- a module closed over and only read ----------------------------------------------------------


def linear():
  return nnx.Linear(3, 2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "spelling",
  [module_as_function, module_as_argument],
  ids=["module_as_function", "module_as_argument"],
)
def test_module_read_inside_jax_jit_runs(spelling):
  model = linear()
  out = jax.jit(lambda x: spelling(model, x))(X)
  np.testing.assert_allclose(out.astype(F32), model(X), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
  "spelling",
  [module_as_function, module_as_argument],
  ids=["module_as_function", "module_as_argument"],
)
@pytest.mark.slow
def test_module_read_inside_jax_grad_runs(spelling):
  model = linear()
  grad = jax.grad(lambda x: jnp.sum(spelling(model, x).astype(jnp.float32)))(X)
  expected = jax.grad(lambda x: jnp.sum(model(x)))(X)
  np.testing.assert_allclose(grad, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
  "spelling",
  [module_as_function, module_as_argument],
  ids=["module_as_function", "module_as_argument"],
)
def test_module_read_inside_jax_jit_is_left_unchanged(spelling):
  model = linear()
  before = nnx.to_pure_dict(nnx.state(model))
  jax.jit(lambda x: spelling(model, x))(X)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)), before)


class CountingLinear(nnx.Module):
  """Holds a plain array attribute, as nnx.Conv(mask=...) does, and updates it."""

  def __init__(self):
    self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.calls = jnp.zeros(())

  def __call__(self, x):
    self.calls = self.calls + 1
    return self.linear(x)


def test_a_module_holding_a_plain_array_runs_and_its_array_updates():
  mask = jnp.ones((3, 3, 3, 4)).at[1, 1].set(0.0)
  conv = nnx.Conv(3, 4, (3, 3), mask=mask, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 8, 8, 3))
  out = jaxamp.autocast(conv, device_type="cpu")(x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), conv(x), rtol=2e-2, atol=2e-2)
  counting = CountingLinear()
  jaxamp.autocast(lambda m, x: m(x), device_type="cpu")(counting, jnp.ones((2, 4)))
  jaxamp.autocast(counting, device_type="cpu")(jnp.ones((2, 4)))
  assert counting.calls == 2


# --- a module closed over that writes its state ---------------------------------------------------


@pytest.mark.parametrize("name", ["batch_norm", "dropout"])
def test_a_closed_over_module_that_writes_its_state_says_to_pass_it_in(name):
  """As under ``jax.jit``, nnx cannot write a closed-over module's Variables from the trace; the
  error says how to write it instead."""
  model = MODELS[name]()
  with pytest.raises(TypeError, match=r"Pass the module in: `jaxamp.autocast\(lambda m, x"):
    jaxamp.autocast(lambda x: model(x), device_type="cpu")(X)
