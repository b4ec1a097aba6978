"""State a function threads through leaves autocast in the dtype it came in with.

torch updates buffers in place (``copy_``), so they keep their dtype. In JAX state goes in as an
argument (or is closed over) and comes back as an output: an output container with the structure
of an argument's or a closed-over value's (``eqx.nn.State``, a linen collection, Haiku state,
``nnx`` Variables) leaves in its traced dtype.
Ordinary outputs (activations, logits, losses) leave in the dtype the policy produced.
"""

import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxamp

POLICIES = [
  pytest.param("cuda", jnp.float16, id="cuda"),
  pytest.param("cpu", jnp.bfloat16, id="cpu"),
]
F32 = jnp.dtype(jnp.float32)
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)


def dtypes(tree) -> set:
  return {leaf.dtype for leaf in jax.tree.leaves(tree)}


# --- Equinox -------------------------------------------------------------------------------------


def spectral_norm():
  key = jax.random.key(0)
  return eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
    eqx.nn.Linear(6, 6, key=key), "weight", key=key
  )


def eqx_forward(model, x, state):
  return model(x, state)


@pytest.mark.slow
@pytest.mark.parametrize("device_type,low", POLICIES)
def test_equinox_state_keeps_its_dtype(device_type, low):
  model, state = spectral_norm()
  _, new_state = jaxamp.autocast(eqx_forward, device_type=device_type)(model, X[0], state)
  assert dtypes(new_state) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_equinox_state_from_autocast_feeds_the_next_autocast_call(device_type, low):
  model, state = spectral_norm()
  forward = jaxamp.autocast(eqx_forward, device_type=device_type)
  _, state = forward(model, X[0], state)
  _, state = forward(model, X[0], state)
  assert dtypes(state) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_equinox_state_from_autocast_feeds_a_float32_call(device_type, low):
  model, state = spectral_norm()
  _, state = jaxamp.autocast(eqx_forward, device_type=device_type)(model, X[0], state)
  out, _ = eqx_forward(model, X[0], state)
  assert out.dtype == F32


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_equinox_output_next_to_the_state_keeps_the_low_dtype(device_type, low):
  model, state = spectral_norm()
  out, _ = jaxamp.autocast(eqx_forward, device_type=device_type)(model, X[0], state)
  assert out.dtype == low


# --- linen ---------------------------------------------------------------------------------------


class LastHidden(nn.Module):
  """Keeps its last hidden activation in a mutable ``cache`` collection."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(6)(x)
    last = self.variable("cache", "last", jnp.zeros, h.shape, jnp.float32)
    last.value = h
    return nn.Dense(3)(h)


@pytest.mark.slow
@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_mutable_collection_keeps_its_dtype(device_type, low):
  variables = LastHidden().init(jax.random.key(0), X)
  forward = jaxamp.autocast(LastHidden().apply, device_type=device_type)
  _, mutated = forward(variables, X, mutable=["cache"])
  assert dtypes(mutated) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_linen_output_next_to_a_mutable_collection_keeps_the_low_dtype(device_type, low):
  variables = LastHidden().init(jax.random.key(0), X)
  forward = jaxamp.autocast(LastHidden().apply, device_type=device_type)
  out, _ = forward(variables, X, mutable=["cache"])
  assert out.dtype == low


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_linen_collection_created_by_the_call_keeps_the_low_dtype(device_type, low):
  """Intermediates sown by the call are outputs, not state the caller passed in."""

  class Sows(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(6)(x)
      self.sow("intermediates", "hidden", h)
      return h

  variables = Sows().init(jax.random.key(0), X)
  _, mutated = jaxamp.autocast(Sows().apply, device_type=device_type)(
    variables, X, mutable=["intermediates"]
  )
  assert dtypes(mutated) == {jnp.dtype(low)}


def closed_over_cache_loss(cache):
  """A loss that closes over the ``cache`` collection and returns its update, as flax's examples
  close over the train state's ``batch_stats``."""

  def loss(params):
    out, mutated = LastHidden().apply({"params": params, "cache": cache}, X, mutable=["cache"])
    return jnp.sum(out.astype(jnp.float32)), mutated

  return loss


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_collection_closed_over_keeps_its_dtype(device_type, low):
  variables = LastHidden().init(jax.random.key(0), X)
  loss = closed_over_cache_loss(variables["cache"])
  _, mutated = jaxamp.autocast(loss, device_type=device_type)(variables["params"])
  assert dtypes(mutated) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_linen_collection_closed_over_in_a_jitted_step_traces_once(device_type, low):
  variables = LastHidden().init(jax.random.key(0), X)
  traces = []

  @jax.jit
  def step(params, cache):
    traces.append(cache)
    loss = jaxamp.autocast(closed_over_cache_loss(cache), device_type=device_type)
    (_, mutated), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), mutated["cache"]

  params, cache = step(variables["params"], variables["cache"])
  params, cache = step(params, cache)
  assert dtypes(cache) == {F32} and len(traces) == 1


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_collection_of_a_closed_over_train_state_keeps_its_dtype(device_type, low):
  """flax's ImageNet example: the loss closes over a ``TrainState`` holding the collection."""

  class TrainState(train_state.TrainState):
    cache: dict

  variables = LastHidden().init(jax.random.key(0), X)
  state = TrainState.create(
    apply_fn=LastHidden().apply,
    params=variables["params"],
    tx=optax.sgd(0.1),
    cache=variables["cache"],
  )

  def loss(params):
    variables = {"params": params, "cache": state.cache}
    out, new_model_state = state.apply_fn(variables, X, mutable=["cache"])
    return jnp.sum(out.astype(jnp.float32)), new_model_state

  _, new_model_state = jaxamp.autocast(loss, device_type=device_type)(state.params)
  assert dtypes(new_model_state) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_collection_bound_by_functools_partial_keeps_its_dtype(device_type, low):
  def loss(params, cache):
    return closed_over_cache_loss(cache)(params)

  variables = LastHidden().init(jax.random.key(0), X)
  bound = functools.partial(loss, cache=variables["cache"])
  _, mutated = jaxamp.autocast(bound, device_type=device_type)(variables["params"])
  assert dtypes(mutated) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_collection_held_by_a_bound_method_instance_keeps_its_dtype(device_type, low):
  class Trainer:
    def __init__(self, cache):
      self.cache = cache

    def loss(self, params):
      return closed_over_cache_loss(self.cache)(params)

  variables = LastHidden().init(jax.random.key(0), X)
  trainer = Trainer(variables["cache"])
  _, mutated = jaxamp.autocast(trainer.loss, device_type=device_type)(variables["params"])
  assert dtypes(mutated) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_linen_collection_closed_over_by_a_decorated_loss_keeps_its_dtype(device_type, low):
  def logged(fun):
    @functools.wraps(fun)
    def wrapper(*args):
      return fun(*args)

    return wrapper

  variables = LastHidden().init(jax.random.key(0), X)
  loss = logged(closed_over_cache_loss(variables["cache"]))
  _, mutated = jaxamp.autocast(loss, device_type=device_type)(variables["params"])
  assert dtypes(mutated) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_activations_of_a_function_closing_over_params_keep_the_low_dtype(device_type, low):
  params = {"a": jnp.ones((6, 6), jnp.float32)}
  out = jaxamp.autocast(lambda x: {"h": x @ params["a"]}, device_type=device_type)(X)
  assert dtypes(out) == {jnp.dtype(low)}


# --- Haiku ---------------------------------------------------------------------------------------


def _haiku_last_hidden(x):
  h = hk.Linear(6)(x)
  hk.get_state("last", h.shape, jnp.float32, init=jnp.zeros)
  hk.set_state("last", h)
  return hk.Linear(3)(h)


haiku_last_hidden = hk.transform_with_state(_haiku_last_hidden)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_haiku_state_keeps_its_dtype(device_type, low):
  params, state = haiku_last_hidden.init(jax.random.key(0), X)
  forward = jaxamp.autocast(haiku_last_hidden.apply, device_type=device_type)
  _, new_state = forward(params, state, None, X)
  assert dtypes(new_state) == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_haiku_output_next_to_the_state_keeps_the_low_dtype(device_type, low):
  params, state = haiku_last_hidden.init(jax.random.key(0), X)
  out, _ = jaxamp.autocast(haiku_last_hidden.apply, device_type=device_type)(params, state, None, X)
  assert out.dtype == low


# --- nnx -----------------------------------------------------------------------------------------


class Last(nnx.Variable):
  """A float32 buffer holding the last hidden activation."""


class NnxLastHidden(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(6, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)
    self.last = Last(jnp.zeros((4, 6), jnp.float32))

  def __call__(self, x):
    h = self.hidden(x)
    self.last[...] = h
    return self.out(h)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", ["eager", "nnx_jit"])
@pytest.mark.slow
def test_nnx_variable_updated_by_a_module_argument_keeps_its_dtype(mode, device_type, low):
  model = NnxLastHidden(nnx.Rngs(0))
  forward = jaxamp.autocast(lambda m, x: m(x), device_type=device_type)
  (forward if mode == "eager" else nnx.jit(forward))(model, X)
  assert model.last[...].dtype == F32 and not np.allclose(model.last[...], 0.0)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_nnx_state_returned_from_split_and_merge_keeps_its_dtype(device_type, low):
  graphdef, state = nnx.split(NnxLastHidden(nnx.Rngs(0)))

  def forward(state, x):
    model = nnx.merge(graphdef, state)
    return model(x), nnx.state(model)

  out, new_state = jaxamp.autocast(forward, device_type=device_type)(state, X)
  assert dtypes(new_state) == {F32} and out.dtype == low


# --- ordinary outputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_an_activation_shaped_like_the_input_keeps_the_low_dtype(device_type, low):
  w = jnp.ones((6, 6), jnp.float32)
  assert jaxamp.autocast(lambda w, x: x @ w, device_type=device_type)(w, X).dtype == low


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_a_dict_of_activations_keeps_the_low_dtype(device_type, low):
  w = {"a": jnp.ones((6, 6), jnp.float32)}
  out = jaxamp.autocast(lambda w, x: {"h": x @ w["a"]}, device_type=device_type)(w, X)
  assert dtypes(out) == {jnp.dtype(low)}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_a_list_of_activations_mirroring_an_input_list_keeps_the_low_dtype(device_type, low):
  w = jnp.ones((6, 6), jnp.float32)
  out = jaxamp.autocast(lambda w, hs: [h @ w for h in hs], device_type=device_type)(w, [X, X])
  assert dtypes(out) == {jnp.dtype(low)}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_a_recurrent_carry_tuple_keeps_the_low_dtype(device_type, low):
  w = jnp.ones((6, 6), jnp.float32)

  def cell(w, carry, x):
    h, c = carry
    return (h @ w, c @ w), x @ w

  (h, c), _ = jaxamp.autocast(cell, device_type=device_type)(w, (X, X), X)
  assert (h.dtype, c.dtype) == (low, low)


class _KeyedByObjects:
  """An instance holding a dict keyed by unorderable objects (a compiled Keras model's
  per-layer state), which jax cannot flatten."""

  def __init__(self):
    self.per_layer = {object(): True, object(): False}

  def loss(self, x):
    return jnp.sum(x @ x)


def test_a_bound_method_of_an_instance_holding_an_unflattenable_dict_runs():
  holder = _KeyedByObjects()
  x = jnp.ones((2, 2))
  out = jaxamp.autocast(holder.loss, device_type="cpu")(x)
  assert out.dtype == jnp.bfloat16 and float(out) == 8.0
