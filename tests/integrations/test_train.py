"""The train step helpers: ``make_train_step`` (linen TrainState) and ``make_nnx_train_step``.

Each step autocasts the forward pass, scales the loss when the optimizer holds a
``dynamic_loss_scale`` (and only then), applies the update and reports metrics; both run under
``jit`` and with ``jaxamp.multi_steps`` around the scaler.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jaxamp
from jaxamp._src.integrations.train import make_nnx_train_step, make_train_step

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 6)), jnp.float32) + 0.5
Y = jnp.arange(16, dtype=jnp.int32) % 3
BATCH = (X, Y)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def leaves_equal(a, b) -> bool:
  return all(
    np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


# --- linen ---------------------------------------------------------------------------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


class BatchNormMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(16)(x))
    return nn.Dense(3)(nn.relu(h))


@functools.cache
def mlp_params():
  return MLP().init(jax.random.key(0), X)["params"]


def linen_loss(params, batch, poison=1.0):
  logits = MLP().apply({"params": params}, batch[0])
  return cross_entropy(logits, batch[1]) * poison


def linen_state(tx) -> TrainState:
  return TrainState.create(apply_fn=MLP().apply, params=mlp_params(), tx=tx)


def scaler(**kwargs):
  return jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


@functools.cache
def _linen_step(device_type: str, enabled: bool):
  return jax.jit(make_train_step(linen_loss, device_type=device_type, enabled=enabled))


def linen_step(state, poison=1.0, device_type="cuda", enabled=True):
  """One jitted ``make_train_step(linen_loss)`` step (compiled once per policy and optimizer)."""
  return _linen_step(device_type, enabled)(state, BATCH, jnp.float32(poison))


@pytest.mark.slow  # compiles a train step
def test_linen_step_returns_loss_scale_found_inf_and_skipped_steps():
  _, metrics = linen_step(linen_state(scaler(init_scale=8.0)))
  assert set(metrics) == {"loss", "scale", "found_inf", "skipped_steps"}
  assert (
    metrics["loss"].dtype,
    float(metrics["scale"]),
    bool(metrics["found_inf"]),
    int(metrics["skipped_steps"]),
  ) == (F32, 8.0, False, 0)


@pytest.mark.slow  # compiles a train step
def test_linen_step_loss_is_the_unscaled_loss():
  _, metrics = linen_step(linen_state(scaler(init_scale=1024.0)), enabled=False)
  np.testing.assert_allclose(metrics["loss"], linen_loss(mlp_params(), BATCH), rtol=1e-6)


@pytest.mark.slow  # compiles a train step
def test_linen_step_updates_params_and_step_count():
  state = linen_state(scaler())
  new_state, _ = linen_step(state)
  assert int(new_state.step) == 1 and not leaves_equal(new_state.params, state.params)


@pytest.mark.slow
def test_linen_step_keeps_float32_params():
  state, _ = linen_step(linen_state(scaler()))
  assert {param.dtype for param in jax.tree.leaves(state.params)} == {F32}


@pytest.mark.parametrize("device_type", ["cuda", "cpu", "xpu"])
@pytest.mark.slow
def test_linen_step_runs_every_dot_in_the_device_types_autocast_dtype(device_type):
  low = jaxamp.get_autocast_dtype(device_type)
  step = make_train_step(linen_loss, device_type=device_type)
  jaxpr = jaxpr_utils.traced(step, linen_state(scaler()), BATCH)
  assert jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert not jaxpr_utils.matmuls_off_dtype(jaxpr, low)


@pytest.mark.slow
def test_linen_step_dtype_overrides_the_device_default():
  jaxpr = jaxpr_utils.traced(
    make_train_step(linen_loss, device_type="cuda", dtype=jnp.bfloat16),
    linen_state(scaler()),
    BATCH,
  )
  assert jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert not jaxpr_utils.matmuls_off_dtype(jaxpr, BF16)


def test_linen_step_with_autocast_disabled_runs_in_float32():
  jaxpr = jaxpr_utils.traced(
    make_train_step(linen_loss, enabled=False), linen_state(scaler()), BATCH
  )
  assert {ins for ins, _ in jaxpr_utils.dtypes_of(jaxpr, "dot_general")} == {(F32, F32)}


@pytest.mark.slow  # compiles a train step
def test_linen_step_with_autocast_disabled_matches_a_hand_written_step():
  state = linen_state(optax.sgd(0.1))
  new_state, _ = linen_step(state, enabled=False)
  expected = state.apply_gradients(grads=jax.grad(linen_loss)(state.params, BATCH))
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, rtol=1e-6), new_state.params, expected.params
  )


@pytest.mark.slow
def test_linen_step_without_a_scaler_trains_unscaled_and_reports_scale_one():
  state, metrics = linen_step(linen_state(optax.sgd(0.1)), device_type="cpu")
  assert (float(metrics["scale"]), bool(metrics["found_inf"]), int(state.step)) == (1.0, False, 1)


@pytest.mark.slow  # compiles a train step
def test_linen_scaled_step_updates_like_the_unscaled_step():
  scaled, _ = linen_step(linen_state(scaler(init_scale=2.0**12)))
  unscaled, _ = linen_step(linen_state(optax.sgd(0.1)))
  for a, b in zip(jax.tree.leaves(scaled.params), jax.tree.leaves(unscaled.params), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)


@pytest.mark.slow
def test_linen_step_multiplies_the_loss_by_the_scale():
  """A scale past float16's range makes the float16 gradients overflow: proof it was applied."""
  state, metrics = linen_step(linen_state(scaler(init_scale=2.0**40)))
  assert bool(metrics["found_inf"]) and float(metrics["scale"]) == 2.0**39


@pytest.mark.slow
def test_linen_step_skips_a_non_finite_loss_and_backs_off():
  state = linen_state(scaler(init_scale=8.0))
  new_state, metrics = linen_step(state, jnp.inf)
  assert (bool(metrics["found_inf"]), int(metrics["skipped_steps"]), float(metrics["scale"])) == (
    True,
    1,
    4.0,
  )
  assert leaves_equal(new_state.params, state.params)


@pytest.mark.slow  # compiles a train step
def test_linen_step_grows_the_scale_after_growth_interval_finite_steps():
  state = linen_state(scaler(init_scale=8.0, growth_interval=2))
  scales = []
  for _ in range(4):
    state, metrics = linen_step(state)
    scales.append(float(metrics["scale"]))
  assert scales == [8.0, 16.0, 16.0, 32.0]


@pytest.mark.slow
def test_linen_step_passes_extra_arguments_to_the_loss_function():
  _, metrics = linen_step(linen_state(optax.sgd(0.1)), poison=2.0, enabled=False)
  np.testing.assert_allclose(metrics["loss"], 2.0 * linen_loss(mlp_params(), BATCH), rtol=1e-6)


@pytest.mark.slow  # compiles a train step
@pytest.mark.parametrize("enabled", [True, False], ids=["autocast", "float32"])
def test_linen_step_passes_a_key_and_keyword_arguments_to_the_loss_function(enabled):
  def loss_fn(params, batch, dropout_key, *, poison):
    mask = jax.random.bernoulli(dropout_key, 0.5, batch[0].shape)
    return linen_loss(params, (batch[0] * mask, batch[1])) * poison

  step = jax.jit(make_train_step(loss_fn, device_type="cpu", enabled=enabled))
  _, metrics = step(linen_state(scaler()), BATCH, jax.random.key(1), poison=jnp.float32(2.0))
  assert np.isfinite(metrics["loss"])


@pytest.mark.slow  # compiles a train step
def test_linen_step_returns_the_loss_functions_aux_in_metrics():
  def loss_with_aux(params, batch):
    logits = MLP().apply({"params": params}, batch[0])
    return cross_entropy(logits, batch[1]), {"logits": logits}

  _, metrics = jax.jit(make_train_step(loss_with_aux, device_type="cuda"))(
    linen_state(scaler()), BATCH
  )
  assert metrics["aux"]["logits"].shape == (16, 3)


@pytest.mark.slow  # compiles a train step
def test_linen_step_carries_batch_norm_statistics_through_aux():
  class State(TrainState):
    batch_stats: dict

  model = BatchNormMLP()
  variables = model.init(jax.random.key(0), X, train=False)
  state = State.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=scaler(),
    batch_stats=variables["batch_stats"],
  )

  def loss_fn(params, batch, batch_stats):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, batch[0], train=True, mutable=["batch_stats"]
    )
    return cross_entropy(logits, batch[1]), updates["batch_stats"]

  @jax.jit
  def train_step(state, batch):
    state, metrics = make_train_step(loss_fn, device_type="cuda")(state, batch, state.batch_stats)
    return state.replace(batch_stats=metrics["aux"])

  new_stats = train_step(state, BATCH).batch_stats
  assert not leaves_equal(new_stats, state.batch_stats)
  assert {s.dtype for s in jax.tree.leaves(new_stats)} == {F32}


@pytest.mark.slow  # compiles a train step
def test_linen_step_runs_without_jit():
  state, metrics = make_train_step(linen_loss, device_type="cpu")(linen_state(scaler()), BATCH)
  assert int(state.step) == 1 and np.isfinite(metrics["loss"])


@pytest.mark.slow
def test_linen_step_with_multi_steps_updates_once_per_window():
  tx = jaxamp.multi_steps(scaler(init_scale=8.0, growth_interval=1), every_k_schedule=2)
  state = linen_state(tx)
  first, metrics_1 = linen_step(state)
  second, metrics_2 = linen_step(first)
  assert leaves_equal(first.params, state.params) and not leaves_equal(second.params, state.params)
  assert (float(metrics_1["scale"]), float(metrics_2["scale"])) == (8.0, 16.0)


@pytest.mark.slow
def test_linen_step_with_multi_steps_skips_a_window_with_one_non_finite_micro_batch():
  tx = jaxamp.multi_steps(scaler(init_scale=8.0), every_k_schedule=2)
  state = linen_state(tx)
  first, _ = linen_step(state, jnp.inf)
  second, metrics = linen_step(first)
  assert leaves_equal(second.params, state.params)
  assert (bool(metrics["found_inf"]), float(metrics["scale"])) == (True, 4.0)


@pytest.mark.slow
def test_linen_step_rejects_a_loss_function_returning_three_values():
  step = make_train_step(lambda params, b: (linen_loss(params, b), 1.0, 2.0), enabled=False)
  with pytest.raises(ValueError, match="pair"):
    step(linen_state(optax.sgd(0.1)), BATCH)


@pytest.mark.slow
def test_linen_step_rejects_a_non_scalar_loss():
  step = make_train_step(lambda params, b: MLP().apply({"params": params}, b[0]), enabled=False)
  with pytest.raises(ValueError, match="scalar"):
    step(linen_state(optax.sgd(0.1)), BATCH)


def test_linen_step_rejects_an_optimizer_with_two_scalers():
  tx = optax.multi_transform(
    {"a": scaler(), "b": scaler()},
    lambda params: jax.tree.map(lambda _: "a", params) | {"Dense_1": "b"},
  )
  with pytest.raises(ValueError, match="one scaler"):
    make_train_step(linen_loss, enabled=False)(linen_state(tx), BATCH)


# --- nnx -----------------------------------------------------------------------------------------


class Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(6, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def nnx_loss(model, batch, poison=1.0):
  return cross_entropy(model(batch[0]), batch[1]) * poison


def nnx_setup(tx) -> tuple[Net, nnx.Optimizer]:
  model = Net(nnx.Rngs(0))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@functools.cache
def _nnx_step(device_type: str, enabled: bool):
  return nnx.jit(make_nnx_train_step(nnx_loss, device_type=device_type, enabled=enabled))


def nnx_step(model, optimizer, poison=1.0, device_type="cuda", enabled=True):
  """One jitted ``make_nnx_train_step(nnx_loss)`` step (compiled once per policy and optimizer)."""
  return _nnx_step(device_type, enabled)(model, optimizer, BATCH, jnp.float32(poison))


def params_of(model) -> dict:
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.slow
def test_nnx_step_returns_loss_scale_found_inf_and_skipped_steps():
  model, optimizer = nnx_setup(scaler(init_scale=8.0))
  metrics = nnx_step(model, optimizer)
  assert set(metrics) == {"loss", "scale", "found_inf", "skipped_steps"}
  assert (
    metrics["loss"].dtype,
    float(metrics["scale"]),
    bool(metrics["found_inf"]),
    int(metrics["skipped_steps"]),
  ) == (F32, 8.0, False, 0)


@pytest.mark.slow
def test_nnx_step_updates_the_params_in_place():
  model, optimizer = nnx_setup(scaler())
  before = params_of(model)
  nnx_step(model, optimizer)
  assert not leaves_equal(params_of(model), before) and int(optimizer.step[...]) == 1


@pytest.mark.slow
def test_nnx_step_keeps_float32_params():
  model, optimizer = nnx_setup(scaler())
  nnx_step(model, optimizer)
  assert {param.dtype for param in jax.tree.leaves(params_of(model))} == {F32}


@pytest.mark.slow  # compiles a train step
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_nnx_step_updates_batch_norm_running_statistics(device_type):
  model, optimizer = nnx_setup(scaler())
  nnx_step(model, optimizer, device_type=device_type)
  assert not np.allclose(model.norm.mean[...], 0.0) and not np.allclose(model.norm.var[...], 1.0)


@pytest.mark.slow  # compiles a train step
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_nnx_step_keeps_batch_norm_running_statistics_float32(device_type):
  model, optimizer = nnx_setup(scaler())
  nnx_step(model, optimizer, device_type=device_type)
  assert (model.norm.mean[...].dtype, model.norm.var[...].dtype) == (F32, F32)


@pytest.mark.slow  # compiles a train step
def test_nnx_step_batch_norm_statistics_are_close_to_the_float32_step():
  model, optimizer = nnx_setup(scaler())
  nnx_step(model, optimizer)
  reference, reference_optimizer = nnx_setup(optax.sgd(0.1))
  nnx_step(reference, reference_optimizer, enabled=False)
  np.testing.assert_allclose(model.norm.mean[...], reference.norm.mean[...], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("device_type,low", [("cuda", F16), ("cpu", BF16)])
@pytest.mark.slow
def test_nnx_step_runs_every_dot_in_the_autocast_dtype(device_type, low):
  model, optimizer = nnx_setup(scaler())
  step = nnx.jit(make_nnx_train_step(nnx_loss, device_type=device_type))
  jaxpr = jaxpr_utils.traced(step, model, optimizer, BATCH)
  assert jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert not jaxpr_utils.matmuls_off_dtype(jaxpr, low)


@pytest.mark.slow
def test_nnx_step_without_a_scaler_trains_unscaled_and_reports_scale_one():
  model, optimizer = nnx_setup(optax.sgd(0.1))
  before = params_of(model)
  metrics = nnx_step(model, optimizer, device_type="cpu")
  assert (float(metrics["scale"]), bool(metrics["found_inf"])) == (1.0, False)
  assert not leaves_equal(params_of(model), before)


@pytest.mark.slow
def test_nnx_step_with_autocast_disabled_matches_a_hand_written_step():
  model, optimizer = nnx_setup(optax.sgd(0.1))
  nnx_step(model, optimizer, enabled=False)
  reference, reference_optimizer = nnx_setup(optax.sgd(0.1))

  @nnx.jit
  def hand_written(model, optimizer):
    optimizer.update(model, nnx.grad(nnx_loss)(model, BATCH))

  hand_written(reference, reference_optimizer)
  jax.tree.map(np.testing.assert_allclose, params_of(model), params_of(reference))


@pytest.mark.slow  # compiles a train step
def test_nnx_step_skips_a_non_finite_loss_and_backs_off():
  model, optimizer = nnx_setup(scaler(init_scale=8.0))
  before = params_of(model)
  metrics = nnx_step(model, optimizer, jnp.inf)
  assert (bool(metrics["found_inf"]), int(metrics["skipped_steps"]), float(metrics["scale"])) == (
    True,
    1,
    4.0,
  )
  assert leaves_equal(params_of(model), before)
  assert float(jaxamp.scaler.get_scale(optimizer)) == 4.0


@pytest.mark.slow  # compiles a train step
def test_nnx_step_multiplies_the_loss_by_the_scale():
  model, optimizer = nnx_setup(scaler(init_scale=2.0**40))
  metrics = nnx_step(model, optimizer)
  assert bool(metrics["found_inf"]) and float(metrics["scale"]) == 2.0**39


@pytest.mark.slow  # compiles a train step
def test_nnx_step_returns_the_loss_functions_aux_in_metrics():
  def loss_with_aux(model, batch):
    logits = model(batch[0])
    return cross_entropy(logits, batch[1]), logits

  model, optimizer = nnx_setup(scaler())
  metrics = nnx.jit(make_nnx_train_step(loss_with_aux, device_type="cuda"))(model, optimizer, BATCH)
  assert metrics["aux"].shape == (16, 3)


@pytest.mark.slow  # compiles a train step
def test_nnx_step_runs_without_jit():
  model, optimizer = nnx_setup(scaler())
  metrics = make_nnx_train_step(nnx_loss, device_type="cpu")(model, optimizer, BATCH)
  assert np.isfinite(metrics["loss"]) and int(optimizer.step[...]) == 1


class DropoutNet(nnx.Module):
  """Draws its dropout mask from an ``nnx.Rngs`` passed to each call, as flax's examples do."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(6, 16, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x, rngs):
    return self.out(self.dropout(nnx.relu(self.hidden(x)), rngs=rngs))


def dropout_loss(model, batch, rngs):
  return cross_entropy(model(batch[0], rngs), batch[1])


def dropout_loss_keyword(model, batch, *, rngs):
  return dropout_loss(model, batch, rngs)


@pytest.mark.slow  # compiles a train step
@pytest.mark.parametrize("enabled", [True, False], ids=["autocast", "float32"])
@pytest.mark.parametrize("mode", ["eager", "nnx_jit"])
def test_nnx_step_passes_an_rngs_argument_to_the_loss_function(mode, enabled):
  model = DropoutNet(nnx.Rngs(0))
  optimizer, rngs = nnx.Optimizer(model, scaler(), wrt=nnx.Param), nnx.Rngs(dropout=1)
  step = make_nnx_train_step(dropout_loss, device_type="cpu", enabled=enabled)
  metrics = (step if mode == "eager" else nnx.jit(step))(model, optimizer, BATCH, rngs)
  assert np.isfinite(metrics["loss"]) and int(rngs.dropout.count[...]) == 1


@pytest.mark.slow  # compiles a train step
@pytest.mark.parametrize("enabled", [True, False], ids=["autocast", "float32"])
def test_nnx_step_passes_keyword_arguments_to_the_loss_function(enabled):
  model = DropoutNet(nnx.Rngs(0))
  optimizer, rngs = nnx.Optimizer(model, scaler(), wrt=nnx.Param), nnx.Rngs(dropout=1)
  step = nnx.jit(make_nnx_train_step(dropout_loss_keyword, device_type="cpu", enabled=enabled))
  metrics = step(model, optimizer, BATCH, rngs=rngs)
  assert np.isfinite(metrics["loss"]) and int(rngs.dropout.count[...]) == 1


@pytest.mark.slow
def test_nnx_step_draws_a_new_dropout_mask_each_step():
  model = DropoutNet(nnx.Rngs(0))
  optimizer, rngs = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), nnx.Rngs(dropout=1)
  step = nnx.jit(make_nnx_train_step(dropout_loss, device_type="cpu"))
  losses = [float(step(model, optimizer, BATCH, rngs)["loss"]) for _ in range(2)]
  assert losses[0] != losses[1]


@pytest.mark.slow  # compiles a train step
def test_nnx_step_with_multi_steps_updates_once_per_window():
  tx = jaxamp.multi_steps(scaler(init_scale=8.0, growth_interval=1), every_k_schedule=2)
  model, optimizer = nnx_setup(tx)
  before = params_of(model)
  metrics_1 = nnx_step(model, optimizer)
  after_1 = params_of(model)
  metrics_2 = nnx_step(model, optimizer)
  assert leaves_equal(after_1, before) and not leaves_equal(params_of(model), before)
  assert (float(metrics_1["scale"]), float(metrics_2["scale"])) == (8.0, 16.0)
