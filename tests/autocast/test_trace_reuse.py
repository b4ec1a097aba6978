"""A cached trace is reused only while what it read from Python objects is unchanged.

torch reads a module's attributes on every call; a JAX trace bakes in what it reads outside its
array arguments. autocast keeps one trace per signature, so it reads again, on each call, what
the trace could have read (instance attributes, closure cells, globals, plain objects passed as
arguments) and traces again when that changed, instead of running with yesterday's weights.
Outputs follow jax.jit: a pytree of arrays and static values, each array a fresh ``jax.Array``.
"""

import collections
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.autocast import snapshots

X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
Y = jnp.ones((8, 1))


@pytest.fixture(autouse=True)
def _fresh_caches():
  jaxamp.clear_caches()
  yield
  jaxamp.clear_caches()


def autocast(f):
  return jaxamp.autocast(f, device_type="cpu")


class TorchStyleModel:
  """A plain object holding its parameters, updated in place as a torch module is."""

  def __init__(self):
    self.w = jnp.full((4, 1), 0.5)
    self.training = True

  def __call__(self, x):
    y = x @ self.w
    return y * 0.5 if self.training else y


def loss_fn(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _sgd_losses(loss, steps: int = 4) -> list[float]:
  model, losses = TorchStyleModel(), []
  for _ in range(steps):
    losses.append(float(loss(model, X, Y)))
    grad = jax.grad(lambda w: jnp.mean((X @ w - Y) ** 2))(model.w)
    model.w = model.w - 0.5 * grad
  return losses


# --- what a trace read, read again ----------------------------------------------------------------


def test_a_plain_object_argument_whose_arrays_are_replaced_is_read_afresh():
  expected = _sgd_losses(loss_fn)
  losses = _sgd_losses(autocast(loss_fn))
  assert len(set(losses)) == len(losses)  # the loss moves with the weights
  np.testing.assert_allclose(losses, expected, rtol=2e-2)


def test_a_method_reads_its_instance_flags_afresh():
  model = TorchStyleModel()
  amp = autocast(model)
  train = amp(X)
  model.training = False  # torch's model.eval()
  np.testing.assert_allclose(amp(X), 2 * train)


def test_a_reassigned_closure_cell_is_read_afresh():
  w = jnp.ones(4)

  def f(x):
    return x * w

  amp = autocast(f)
  np.testing.assert_array_equal(amp(X), X)
  w = jnp.full(4, 2.0)
  np.testing.assert_array_equal(amp(X), 2 * X)


SCALE = jnp.ones(4)


def _scaled(x):
  return x * SCALE


def test_a_reassigned_module_global_is_read_afresh():
  global SCALE
  amp = autocast(_scaled)
  before = amp(X)
  SCALE = jnp.full(4, 3.0)
  try:
    np.testing.assert_array_equal(amp(X), 3 * before)
  finally:
    SCALE = jnp.ones(4)


def test_an_equinox_model_replaced_in_a_closure_is_read_afresh():
  model = eqx.nn.Linear(4, 1, key=jax.random.key(0))

  def predict(x):
    return jax.vmap(model)(x)

  amp = autocast(predict)
  amp(X)
  model = eqx.tree_at(lambda m: m.weight, model, jnp.zeros_like(model.weight))
  np.testing.assert_allclose(amp(X), jax.vmap(model)(X), atol=1e-2)


def test_a_list_of_layers_that_grew_is_read_afresh():
  layers = [jnp.full((4, 4), 0.5)]

  def f(x):
    for w in layers:
      x = x @ w
    return x

  amp = autocast(f)
  amp(X)
  layers.append(jnp.eye(4) * 2)
  np.testing.assert_allclose(amp(X).astype(jnp.float32), f(X), rtol=2e-2)


def test_a_function_appending_to_a_list_it_closes_over_is_traced_again_once_it_grew():
  seen = []

  def f(x):
    seen.append(x.shape)
    return x @ x.T

  amp = autocast(f)
  amp(X)
  amp(X)
  assert len(seen) == 1  # its own append happened while tracing: the snapshot follows it
  seen.append("elsewhere")
  amp(X)
  assert len(seen) == 3


def test_unchanged_objects_keep_one_trace():
  model = TorchStyleModel()
  traces = collections.deque()  # a deque is not among what a trace is taken to read

  def f(m, x):
    traces.append(1)
    return m(x)

  amp = autocast(f)
  for _ in range(3):
    amp(model, X)
  assert len(traces) == 1


def test_the_snapshot_of_a_huge_object_stays_bounded():
  class Dataset:
    def __init__(self):
      self.rows = [np.full(4, i, np.float32) for i in range(10 * snapshots._LIMIT)]

  snapshot = snapshots.take([Dataset()])
  assert len(snapshot.entries) <= snapshots._LIMIT


def test_a_snapshot_keeps_no_array_alive():
  model = TorchStyleModel()
  weights = weakref.ref(model.w)
  snapshot = snapshots.take([model])
  model.w = jnp.zeros((4, 1))
  gc.collect()
  assert weights() is None and not snapshots.holds(snapshot, [model])


# --- outputs as jax.jit gives them ----------------------------------------------------------------


def test_a_numpy_output_is_a_new_jax_array_on_every_call():
  amp = autocast(lambda x: (x @ x.T, np.zeros(2, np.float32)))
  for _ in range(2):  # the trace is reused: still an immutable array, no shared numpy buffer
    out = amp(X)[1]
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.zeros(2))


def test_an_object_returned_as_a_static_output_is_not_kept_alive():
  class Holder:
    def step(self, x):
      return x @ x.T, self

  holder = Holder()
  instance = weakref.ref(holder)
  _, returned = autocast(holder.step)(X)
  assert returned is holder
  del holder, returned
  gc.collect()
  assert instance() is None


def test_an_object_returned_as_a_static_output_is_the_current_one():
  class Model:
    def __init__(self):
      self.config = {"depth": 1}

    def __call__(self, x):
      return x @ x.T, self.config

  model = Model()
  amp = autocast(model)
  amp(X)
  model.config = {"depth": 2}
  assert amp(X)[1] == {"depth": 2}


def test_a_non_pytree_output_holding_a_traced_array_is_a_type_error():
  class Out:
    def __init__(self, y):
      self.y = y

  with pytest.raises(TypeError, match=r"type Out .*\(at \.y\).*register_dataclass"):
    autocast(lambda x: Out(x @ x.T))(X)


def test_a_generator_output_is_a_type_error():
  with pytest.raises(TypeError, match="returned a generator.*list or tuple"):
    autocast(lambda x: (y for y in [x @ x.T]))(X)
