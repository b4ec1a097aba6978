"""Where the scaler's helpers find its state: ``scale_loss``, ``get_scale``, the getters and
setters, ``state_dict`` and ``load_state_dict`` search optax combinators (``chain``,
``MultiSteps``, ``inject_hyperparams``, ``masked``, ``multi_transform``), flax's ``TrainState``
and ``nnx.Optimizer``, and work in the training loops of both flax APIs. A state without a scaler,
or with two, is an error naming what was searched.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxamp

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
TORCH_KEYS = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]


def scaler(**kwargs):
  kwargs.setdefault("init_scale", 1024.0)
  return jaxamp.dynamic_loss_scale(optax.adam(1e-2), **kwargs)


def containers():
  """(name, make_state) for every place the scaler state may sit."""
  return {
    "bare": lambda: scaler().init(PARAMS),
    "chain": lambda: optax.chain(optax.add_decayed_weights(1e-4), scaler()).init(PARAMS),
    "multisteps": lambda: optax.MultiSteps(scaler(), 2).init(PARAMS),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
      lambda learning_rate: optax.chain(scaler(), optax.scale(learning_rate))
    )(learning_rate=0.1).init(PARAMS),
    "masked": lambda: optax.masked(scaler(), {"w": True, "b": True}).init(PARAMS),
    "multi_transform": lambda: optax.multi_transform(
      {"a": scaler(), "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}
    ).init(PARAMS),
    "nested": lambda: optax.MultiSteps(
      optax.chain(optax.identity(), scaler(growth_factor=1.1)), 4
    ).init(PARAMS),
    "train_state": lambda: train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=scaler()),
    "nnx_optimizer": lambda: nnx.Optimizer(
      nnx.Linear(2, 3, rngs=nnx.Rngs(0)), scaler(), wrt=nnx.Param
    ),
  }


# --- finding the state ----------------------------------------------------------------------------


@pytest.mark.parametrize("container", list(containers()))
def test_helpers_find_the_scaler_state_in(container):
  opt_state = containers()[container]()
  assert jaxamp.scaler.get_scale(opt_state) == 1024.0
  assert jaxamp.scale_loss(jnp.float32(2.0), opt_state) == 2048.0
  assert list(jaxamp.scaler.state_dict(opt_state)) == TORCH_KEYS
  d = dict(jaxamp.scaler.state_dict(opt_state), scale=64.0, _growth_tracker=3)
  loaded = jaxamp.scaler.load_state_dict(opt_state, d)
  assert jaxamp.scaler.state_dict(loaded) == d
  if container != "nnx_optimizer":
    assert jax.tree.structure(loaded) == jax.tree.structure(opt_state)
    assert jaxamp.scaler.get_scale(opt_state) == 1024.0  # pure: the input is unchanged


@pytest.mark.parametrize("container", list(containers()))
def test_getters_and_setters_find_the_scaler_state_in(container):
  state = containers()[container]()
  growth_factor = jaxamp.scaler.get_growth_factor(state)
  new = jaxamp.scaler.set_growth_interval(
    jaxamp.scaler.set_backoff_factor(jaxamp.scaler.set_growth_factor(state, 4.0), 0.25), 3
  )
  new = jaxamp.scaler.set_scale(new, 16.0)
  assert (
    jaxamp.scaler.get_growth_factor(new),
    jaxamp.scaler.get_backoff_factor(new),
    jaxamp.scaler.get_growth_interval(new),
    jaxamp.scaler.is_enabled(new),
  ) == (4.0, 0.25, 3, True)
  assert jaxamp.scaler.get_scale(new) == 16.0
  if container != "nnx_optimizer":  # nnx objects are mutable: updated in place
    assert jaxamp.scaler.get_growth_factor(state) == growth_factor
    assert jaxamp.scaler.get_scale(state) == 1024.0
    assert type(new) is type(state)


# --- no scaler, two scalers -----------------------------------------------------------------------


def test_missing_scaler_state_raises_naming_what_was_searched():
  message = (
    r"`opt_state` contains no `DynamicLossScaleState`: searched every node "
    r".*optax.chain.*MultiStepsState.*TrainState.*nnx.Optimizer.*got a tuple"
  )
  with pytest.raises(ValueError, match=message):
    jaxamp.scaler.get_scale(optax.adam(1e-3).init(PARAMS))


NO_SCALER = {
  "optax state": optax.sgd(0.1).init(PARAMS),
  "None": None,
  "params": PARAMS,
  "the transformation": jaxamp.dynamic_loss_scale(optax.sgd(0.1)),
}


HELPERS = {
  "scale_loss": lambda state: jaxamp.scale_loss(jnp.ones(()), state),
  "get_scale": jaxamp.scaler.get_scale,
  "state_dict": jaxamp.scaler.state_dict,
  "load_state_dict": lambda state: jaxamp.scaler.load_state_dict(state, {"scale": 1.0}),
  "set_growth_factor": lambda state: jaxamp.scaler.set_growth_factor(state, 4.0),
  "unscale": lambda state: jaxamp.unscale(PARAMS, state),
}


@pytest.mark.parametrize("helper", sorted(HELPERS))
@pytest.mark.parametrize("state", sorted(NO_SCALER))
def test_helpers_on_a_state_without_a_scaler_name_what_they_searched(helper, state):
  with pytest.raises(ValueError, match="contains no `DynamicLossScaleState`: searched"):
    HELPERS[helper](NO_SCALER[state])


def test_two_scaler_states_are_ambiguous():
  both = (scaler().init(PARAMS), scaler().init(PARAMS))
  with pytest.raises(ValueError, match=r"contains 2 `DynamicLossScaleState` nodes"):
    jaxamp.scaler.state_dict(both)


def test_a_scaler_wrapping_a_scaler_is_refused_at_init():
  # Each would unscale the updates once: they would come out `scale` times too small.
  with pytest.raises(ValueError, match="holds a dynamic_loss_scale already"):
    jaxamp.dynamic_loss_scale(jaxamp.dynamic_loss_scale(optax.sgd(1.0))).init(PARAMS)
  with pytest.raises(ValueError, match="holds a dynamic_loss_scale already"):
    inner = optax.chain(optax.clip(1.0), jaxamp.dynamic_loss_scale(optax.sgd(1.0)))
    jaxamp.dynamic_loss_scale(inner).init(PARAMS)


# --- flax training loops --------------------------------------------------------------------------


@pytest.mark.slow
def test_flax_train_state_apply_gradients_with_the_wrapped_optimizer():
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=scaler(init_scale=8.0))

  @jax.jit
  def train_step(state, poison):
    def loss_fn(params):
      loss = jnp.sum(params["w"] ** 2) + params["b"] * poison
      return jaxamp.scale_loss(loss, state)  # finds state.opt_state

    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  stepped = train_step(state, 1.0)
  assert not np.array_equal(stepped.params["w"], PARAMS["w"]) and stepped.step == 1
  skipped = train_step(stepped, jnp.inf)
  assert skipped.opt_state.found_inf and jaxamp.scaler.get_scale(skipped) == 4.0
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(stepped.params), strict=True)
  )


class TinyModel(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


@pytest.mark.slow
def test_nnx_optimizer_with_the_wrapped_optimizer():
  model = TinyModel(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, scaler(init_scale=8.0), wrt=nnx.Param)
  x = jnp.ones((4, 3))

  @nnx.jit
  def train_step(model, optimizer, poison):
    def loss_fn(model):
      loss = jnp.mean(model(x) ** 2) * poison
      return jaxamp.scale_loss(loss, optimizer)  # finds optimizer.opt_state

    optimizer.update(model, nnx.grad(loss_fn)(model))

  train_step(model, optimizer, 1.0)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  train_step(model, optimizer, jnp.inf)
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  assert all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
  )
  assert jaxamp.scaler.get_scale(optimizer) == 4.0
  assert jaxamp.scaler.state_dict(optimizer)["_growth_tracker"] == 0
