"""`scale_loss`, `get_scale`, `state_dict`, `load_state_dict`, and the containers they search.

The helpers find the scaler's state inside optax combinators (``chain``, ``MultiSteps``,
``inject_hyperparams``), inside flax's ``TrainState`` and inside ``nnx.Optimizer``, and work
with the training loops of both flax APIs.
"""

import math

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


# ------------------------------------------------------------------------------------------------
# scale_loss and get_scale.


def test_get_scale_is_a_float32_scalar_array():
  scale = jaxamp.scaler.get_scale(scaler().init(PARAMS))
  assert isinstance(scale, jax.Array) and scale.dtype == jnp.float32 and scale.shape == ()
  assert scale == 1024.0


def test_get_scale_of_a_disabled_scaler_is_one():
  assert jaxamp.scaler.get_scale(scaler(enabled=False).init(PARAMS)) == 1.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_loss_multiplies_by_the_scale_in_float32(dtype):
  state = scaler(init_scale=2.0**16).init(PARAMS)
  scaled = jax.jit(jaxamp.scale_loss)(jnp.asarray(60000.0, dtype), state)
  assert scaled.dtype == jnp.float32  # a float16 product would be inf
  assert scaled == np.float32(jnp.asarray(60000.0, dtype)) * 2.0**16


def test_scale_loss_scales_a_pytree_of_losses():
  state = scaler(init_scale=4.0).init(PARAMS)
  scaled = jaxamp.scale_loss({"a": jnp.float32(1.0), "b": (jnp.float32(2.0),)}, state)
  assert scaled == {"a": 4.0, "b": (8.0,)}


def test_scale_loss_scales_the_gradient_and_not_the_scale():
  state = scaler(init_scale=8.0).init(PARAMS)
  grads, grad_of_state = jax.grad(
    lambda p, s: jaxamp.scale_loss(jnp.sum(p["w"] ** 2), s), argnums=(0, 1), allow_int=True
  )(PARAMS, state)
  np.testing.assert_array_equal(grads["w"], 8.0 * 2 * PARAMS["w"])
  assert grad_of_state.scale == 0.0


# ------------------------------------------------------------------------------------------------
# Finding the state.


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


def test_missing_scaler_state_raises_naming_what_was_searched():
  message = (
    r"`opt_state` contains no `DynamicLossScaleState`: searched every node "
    r".*optax.chain.*MultiStepsState.*TrainState.*nnx.Optimizer.*got a tuple"
  )
  with pytest.raises(ValueError, match=message):
    jaxamp.scaler.get_scale(optax.adam(1e-3).init(PARAMS))


def test_two_scaler_states_are_ambiguous():
  both = (scaler().init(PARAMS), scaler().init(PARAMS))
  with pytest.raises(ValueError, match=r"contains 2 `DynamicLossScaleState` nodes"):
    jaxamp.scaler.state_dict(both)


# ------------------------------------------------------------------------------------------------
# state_dict / load_state_dict.


def test_state_dict_has_torch_keys_and_python_types():
  d = jaxamp.scaler.state_dict(
    scaler(growth_factor=1.1, backoff_factor=0.3, growth_interval=7).init(PARAMS)
  )
  assert d == {
    "scale": 1024.0,
    "growth_factor": 1.1,
    "backoff_factor": 0.3,
    "growth_interval": 7,
    "_growth_tracker": 0,
  }
  assert [type(v) for v in d.values()] == [float, float, float, int, int]


def test_state_dict_of_a_disabled_scaler_is_empty():
  assert jaxamp.scaler.state_dict(scaler(enabled=False).init(PARAMS)) == {}


def test_load_state_dict_restores_scale_tracker_and_hyperparameters():
  tx = scaler()
  state = jaxamp.scaler.load_state_dict(
    tx.init(PARAMS),
    {
      "scale": 100.0,
      "growth_factor": 1.1,
      "backoff_factor": 0.3,
      "growth_interval": 2,
      "_growth_tracker": 1,
    },
  )
  assert state.scale.dtype == jnp.float32 and state.growth_tracker.dtype == jnp.int32
  step = jax.jit(lambda g, s: tx.update(g, s, PARAMS))
  _, grown = step(jax.tree.map(jnp.ones_like, PARAMS), state)  # tracker 1 -> 2: grow by 1.1
  assert grown.scale == np.float32(np.float64(np.float32(100.0)) * 1.1)
  _, backed_off = step(jax.tree.map(lambda p: p * jnp.nan, PARAMS), state)
  assert backed_off.scale == np.float32(100.0 * 0.3)


def test_state_dict_adds_min_scale_only_when_set_and_load_state_dict_restores_it():
  floored = scaler(min_scale=2.0).init(PARAMS)
  d = jaxamp.scaler.state_dict(floored)
  assert list(d) == [*TORCH_KEYS, "min_scale"] and d["min_scale"] == 2.0
  assert jaxamp.scaler.load_state_dict(scaler().init(PARAMS), d).min_scale == 2.0
  assert jaxamp.scaler.load_state_dict(floored, dict(d, min_scale=None)).min_scale is None


def test_load_state_dict_without_min_scale_keeps_the_programs_floor():
  torch_dict = jaxamp.scaler.state_dict(scaler().init(PARAMS))
  assert (
    jaxamp.scaler.load_state_dict(scaler(min_scale=2.0).init(PARAMS), torch_dict).min_scale == 2.0
  )


@pytest.mark.parametrize(
  "min_scale, error", [(0.0, ValueError), (math.inf, ValueError), ("1", TypeError)]
)
def test_load_state_dict_rejects_a_bad_min_scale_naming_the_valid_choices(min_scale, error):
  d = dict(jaxamp.scaler.state_dict(scaler().init(PARAMS)), min_scale=min_scale)
  with pytest.raises(error, match=r"`min_scale` must be None \(no floor, as in torch\) or a real"):
    jaxamp.scaler.load_state_dict(scaler().init(PARAMS), d)


def test_a_min_scale_state_dict_loads_into_torch_which_ignores_the_floor():
  torch = pytest.importorskip("torch")
  d = jaxamp.scaler.state_dict(scaler(min_scale=2.0).init(PARAMS))
  back = torch.amp.GradScaler("cpu")
  back.load_state_dict(d)
  assert back.state_dict() == {k: d[k] for k in TORCH_KEYS}


def test_flax_checkpoints_save_and_restore_min_scale():
  from flax import serialization

  saved = serialization.to_bytes(scaler(min_scale=2.0).init(PARAMS))
  assert serialization.from_bytes(scaler().init(PARAMS), saved).min_scale == 2.0
  unfloored = serialization.to_bytes(scaler().init(PARAMS))
  assert serialization.from_bytes(scaler().init(PARAMS), unfloored).min_scale is None


def test_load_state_dict_of_a_disabled_scaler_is_a_no_op():
  state = scaler(enabled=False).init(PARAMS)
  assert jaxamp.scaler.load_state_dict(state, {"scale": 2.0}) is state


@pytest.mark.parametrize(
  "d, error, message",
  [
    ({}, ValueError, r"`state_dict` is empty, possibly because it was saved from a disabled"),
    ({"scale": 1.0}, ValueError, r"`state_dict` lacks the keys \['growth_factor'"),
    (
      dict(scale=1.0, growth_factor=0.9, backoff_factor=0.5, growth_interval=1, _growth_tracker=0),
      ValueError,
      r"`growth_factor` must be > 1.0.*got 0.9",
    ),
    (
      dict(
        scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1, _growth_tracker=0.5
      ),
      TypeError,
      r"`_growth_tracker` must be an int.*0.5",
    ),
    ([("scale", 1.0)], TypeError, r"`state_dict` must be a dict, got list"),
  ],
)
def test_load_state_dict_rejects_malformed_dicts(d, error, message):
  with pytest.raises(error, match=message):
    jaxamp.scaler.load_state_dict(scaler().init(PARAMS), d)


def test_state_dict_round_trips_with_torch():
  torch = pytest.importorskip("torch")
  torch_scaler = torch.amp.GradScaler(
    "cpu", init_scale=300.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=3
  )
  torch_scaler.scale(torch.ones(()))
  torch_scaler.update(123.5)
  state = jaxamp.scaler.load_state_dict(scaler().init(PARAMS), torch_scaler.state_dict())
  assert jaxamp.scaler.state_dict(state) == torch_scaler.state_dict()
  back = torch.amp.GradScaler("cpu")
  back.load_state_dict(jaxamp.scaler.state_dict(state))
  assert back.state_dict() == torch_scaler.state_dict()


# ------------------------------------------------------------------------------------------------
# flax.


def test_flax_train_state_apply_gradients_with_the_wrapped_optimizer():
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=scaler(init_scale=8.0))

  @jax.jit
  def train_step(state, poison):
    def loss_fn(p):
      loss = jnp.sum(p["w"] ** 2) + p["b"] * poison
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


def test_load_state_dict_updates_an_nnx_optimizer_in_place():
  optimizer = nnx.Optimizer(TinyModel(nnx.Rngs(0)), scaler(), wrt=nnx.Param)
  d = dict(jaxamp.scaler.state_dict(optimizer), scale=32.0, backoff_factor=0.25)
  assert jaxamp.scaler.load_state_dict(optimizer, d) is optimizer
  assert jaxamp.scaler.state_dict(optimizer) == d
