"""Mixed-precision training reaches float32's results on a real data set.

scikit-learn's handwritten digits (shipped with scikit-learn), 300 Adam steps: a linen MLP and an
nnx MLP with BatchNorm, each trained in float32, in float16 (the "cuda" policy) with
``dynamic_loss_scale``, and in bfloat16 (the "cpu" policy, no scaling), through the train step
helpers. Each mixed run must reach the float32 run's test accuracy within 2 points and its final
training loss within 10%; both are measured with the forward pass the run trained with. The
BatchNorm running statistics must update, stay float32 and track float32's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jaxamp
from jaxamp._src.integrations.train import make_nnx_train_step, make_train_step

sklearn_datasets = pytest.importorskip("sklearn.datasets")

STEPS, BATCH_SIZE, LEARNING_RATE = 300, 64, 1e-3
ACCURACY_POINTS, LOSS_RTOL = 0.02, 0.10
POLICIES = {  # name -> (train step keyword arguments, loss scaling)
  "float32": ({"enabled": False}, False),
  "float16": ({"device_type": "cuda"}, True),
  "bfloat16": ({"device_type": "cpu"}, False),
}
MIXED = ["float16", "bfloat16"]


class Digits(NamedTuple):
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  batches: np.ndarray  # (STEPS, BATCH_SIZE) indices into the training set, shared by every run


@functools.cache
def digits() -> Digits:
  data = sklearn_datasets.load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  batches = np.random.default_rng(1).integers(0, split, (STEPS, BATCH_SIZE))
  return Digits(x[:split], y[:split], x[split:], y[split:], batches)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def optimizer(scaled: bool) -> optax.GradientTransformation:
  tx = optax.adam(LEARNING_RATE)
  return jaxamp.dynamic_loss_scale(tx) if scaled else tx


class Result(NamedTuple):
  accuracy: float  # on the test set
  loss: float  # on the whole training set, after training
  scales: np.ndarray  # the loss scale after each step
  skipped: int
  running_mean: np.ndarray | None = None  # the first BatchNorm's statistics (nnx only)
  running_var: np.ndarray | None = None


def evaluate(forward, data: Digits) -> tuple[float, float]:
  accuracy = float((jnp.argmax(forward(data.x_test), -1) == data.y_test).mean())
  return accuracy, float(cross_entropy(forward(data.x_train), data.y_train))


# --- linen MLP -----------------------------------------------------------------------------------


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(10)(x)


@functools.cache
def train_linen(policy: str) -> Result:
  kwargs, scaled = POLICIES[policy]
  data, model = digits(), MLP()
  params = model.init(jax.random.key(0), data.x_train[:1])["params"]
  state = TrainState.create(apply_fn=model.apply, params=params, tx=optimizer(scaled))
  loss_fn = lambda params, batch: cross_entropy(model.apply({"params": params}, batch[0]), batch[1])
  step = jax.jit(make_train_step(loss_fn, **kwargs))
  scales = []
  for idx in data.batches:
    state, metrics = step(state, (data.x_train[idx], data.y_train[idx]))
    scales.append(metrics["scale"])
  apply = jax.jit(jaxamp.autocast(lambda params, x: model.apply({"params": params}, x), **kwargs))
  accuracy, loss = evaluate(lambda x: apply(state.params, x), data)
  return Result(accuracy, loss, np.asarray(scales), int(metrics["skipped_steps"]))


# --- nnx MLP with BatchNorm ----------------------------------------------------------------------


class BatchNormMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(64, 128, rngs=rngs)
    self.norm1 = nnx.BatchNorm(128, rngs=rngs)
    self.linear2 = nnx.Linear(128, 128, rngs=rngs)
    self.norm2 = nnx.BatchNorm(128, rngs=rngs)
    self.head = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm1(self.linear1(x)))
    x = nnx.relu(self.norm2(self.linear2(x)))
    return self.head(x)


@functools.cache
def train_nnx(policy: str) -> Result:
  kwargs, scaled = POLICIES[policy]
  data, model = digits(), BatchNormMLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optimizer(scaled), wrt=nnx.Param)
  loss_fn = lambda m, batch: cross_entropy(m(batch[0]), batch[1])
  step = nnx.jit(make_nnx_train_step(loss_fn, **kwargs))
  scales = []
  for idx in data.batches:
    metrics = step(model, opt, (data.x_train[idx], data.y_train[idx]))
    scales.append(metrics["scale"])
  model.eval()  # evaluate with the running statistics
  apply = nnx.jit(jaxamp.autocast(lambda m, x: m(x), **kwargs))
  accuracy, loss = evaluate(lambda x: apply(model, x), data)
  return Result(
    accuracy,
    loss,
    np.asarray(scales),
    int(metrics["skipped_steps"]),
    model.norm1.mean[...],
    model.norm1.var[...],
  )


TRAIN = {"linen": train_linen, "nnx": train_nnx}


# --- the float32 baseline is worth matching ------------------------------------------------------


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("api", TRAIN)
def test_float32_baseline_learns_the_digits(api):
  assert TRAIN[api]("float32").accuracy > 0.95


# --- parity --------------------------------------------------------------------------------------


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("api", TRAIN)
def test_mixed_precision_test_accuracy_is_within_two_points_of_float32(api, policy):
  mixed, baseline = TRAIN[api](policy), TRAIN[api]("float32")
  assert abs(mixed.accuracy - baseline.accuracy) <= ACCURACY_POINTS, (mixed, baseline)


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("api", TRAIN)
def test_mixed_precision_final_loss_is_within_ten_percent_of_float32(api, policy):
  mixed, baseline = TRAIN[api](policy), TRAIN[api]("float32")
  assert mixed.loss == pytest.approx(baseline.loss, rel=LOSS_RTOL), (mixed.loss, baseline.loss)


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("api", TRAIN)
def test_float16_run_trains_with_a_dynamic_loss_scale(api):
  result = TRAIN[api]("float16")
  assert result.scales.min() > 1.0 and result.skipped <= STEPS // 100


@pytest.mark.parametrize(
  "api",
  ["linen", pytest.param("nnx", marks=pytest.mark.slow)],  # the fast subset: one run
)
def test_bfloat16_run_trains_unscaled(api):
  result = TRAIN[api]("bfloat16")
  assert set(result.scales.tolist()) == {1.0} and result.skipped == 0


# --- BatchNorm running statistics (nnx) ----------------------------------------------------------


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("policy", MIXED)
def test_batch_norm_running_statistics_visibly_update(policy):
  result = train_nnx(policy)
  assert np.abs(result.running_mean).mean() > 0.05
  assert np.abs(result.running_var - 1.0).mean() > 0.05


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("policy", MIXED)
def test_batch_norm_running_statistics_stay_float32(policy):
  result = train_nnx(policy)
  assert (result.running_mean.dtype, result.running_var.dtype) == (jnp.float32, jnp.float32)


@pytest.mark.slow  # trains each policy for many steps
@pytest.mark.parametrize("policy", MIXED)
def test_batch_norm_running_statistics_track_float32(policy):
  result, baseline = train_nnx(policy), train_nnx("float32")
  scale = np.abs(baseline.running_mean).max()
  np.testing.assert_allclose(result.running_mean, baseline.running_mean, atol=0.05 * scale)
  np.testing.assert_allclose(
    result.running_var,
    baseline.running_var,
    rtol=0.1,
    atol=0.05 * np.abs(baseline.running_var).max(),
  )
