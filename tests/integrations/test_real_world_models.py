"""Third-party models train under autocast with no change to their code.

Small configurations of real models, their code copied verbatim under ``tests/real_world/`` (with
its license) or imported from the installed package:

- ``flax_resnet``: flax's ``examples/imagenet`` ResNet (linen, BatchNorm), 2 stages of 1 block,
  4 filters, 4 classes, on 8x8 images; also run with its own ``dtype=jnp.bfloat16`` for comparison;
- ``flax_lm1b``: flax's ``examples/lm1b`` TransformerLM (linen, LayerNorm, causal and padding
  masks built from ``inputs > 0``), vocabulary 32, width 16, 1 layer, 2 heads, length 8, padded;
- ``nnx_mnist``: the nnx MNIST CNN of flax's ``benchmarks/tracing`` (BatchNorm, Dropout with an
  ``nnx.Rngs`` passed to the loss) through ``jaxamp.make_nnx_train_step``, on its fake batch;
- ``equinox_cnn``: Equinox's ``examples/mnist.ipynb`` CNN (Conv2d, MaxPool2d, Linear, vmapped);
- ``equinox_stateful``: Equinox's ``examples/stateful.ipynb`` model (BatchNorm, SpectralNorm,
  ``eqx.nn.State``), with its MSE loss;
- ``haiku_resnet``: ``hk.nets.ResNet`` from the installed package, ``transform_with_state``.

Each trains ``STEPS`` Adam steps on a fixed synthetic batch (so every run is deterministic) in
float32, under the "cpu" policy (bfloat16) and under the "cuda" policy (float16) with
``jaxamp.dynamic_loss_scale``, and under the "cuda" policy with ``dtype=jnp.float8_e4m3fn``,
whose every dot and conv must run on dequantized float8 operands. The 16-bit runs must put every
dot and conv of the step in the low dtype; all mixed runs must compute the norms' ``rsqrt``
(Equinox: ``sqrt`` and ``/``) in float32, hand the model state (BatchNorm statistics, power
iterations, counters) back in float32's dtypes, and end within ``LOSS_RTOL`` of float32's loss.
The ResNet's gradients and losses must also be as close to float32's as those of flax's own
``dtype=`` path.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.extend import core as jex_core
from jaxpr_utils import dtypes_of, matmuls_off_dtype, matmuls_without_float8_operands, traced
from real_world import equinox_examples, flax_lm1b, flax_nnx_mnist, flax_resnet

import jaxamp

# The tests that train the real models (ResNet, lm1b, nnx MNIST, Equinox) are marked slow.
pytestmark = pytest.mark.filterwarnings(  # lm1b's model code uses linen's SelfAttention
  "ignore:SelfAttention will be deprecated:DeprecationWarning"
)

STEPS, LOSS_RTOL = 8, 0.15
F32 = jnp.dtype(jnp.float32)


class Policy(NamedTuple):
  autocast: dict | None  # jaxamp.autocast keyword arguments; None: no autocast (float32)
  scaled: bool  # train with jaxamp.dynamic_loss_scale
  low: Any  # the dtype dots and convs must run in


POLICIES = {
  "float32": Policy(None, False, F32),
  "bfloat16": Policy({"device_type": "cpu"}, False, jnp.dtype(jnp.bfloat16)),
  "float16": Policy({"device_type": "cuda"}, True, jnp.dtype(jnp.float16)),
  # float8 matmuls (autocast/fp8.py): XLA:CPU emulates float8.
  "float8": Policy(
    {"device_type": "cuda", "dtype": jnp.float8_e4m3fn}, False, jnp.dtype(jnp.bfloat16)
  ),
}
MIXED = ["bfloat16", "float16"]
ALL_MIXED = [*MIXED, "float8"]


class Run(NamedTuple):
  losses: np.ndarray  # the loss of each step, float32, before that step's update
  state: Any  # the model state after training (statistics, counters), or None
  jaxpr: jex_core.Jaxpr  # of one whole train step (forward, backward, optimizer)
  skipped: int  # steps the loss scaler skipped
  visited: tuple = ()  # (params, state) before each step, where kept (the flax ResNet)


def optimizer(policy: str, learning_rate: float = 1e-2) -> optax.GradientTransformation:
  tx = optax.adam(learning_rate)
  return jaxamp.dynamic_loss_scale(tx) if POLICIES[policy].scaled else tx


def under(policy: str, fun: Callable) -> Callable:
  """``fun`` as the policy runs it: autocast, or as written for float32."""
  kwargs = POLICIES[policy].autocast
  return fun if kwargs is None else jaxamp.autocast(fun, **kwargs)


def dtypes(tree) -> tuple:
  """The tree's structure and its leaves' dtypes (``eqx.nn.State`` compares by identity)."""
  leaves, structure = jax.tree.flatten(tree)
  return structure, [jnp.asarray(leaf).dtype for leaf in leaves]


def array_step(loss_of: Callable, tx: optax.GradientTransformation, policy: str) -> Callable:
  """A jittable step for ``loss_of(params, state, batch) -> (loss, new_state)`` on array trees.

  The Equinox and Haiku steps, written as their READMEs show (autocast the loss function, scale
  the loss when a scaler is present, let the optimizer unscale and skip).
  """
  loss_of = under(policy, loss_of)

  def step(params, state, opt_state, batch):
    def scaled(params):
      loss, new_state = loss_of(params, state, batch)
      if POLICIES[policy].scaled:
        return jaxamp.scale_loss(loss, opt_state), (loss, new_state)
      return loss, (loss, new_state)

    grads, (loss, state) = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss.astype(jnp.float32)

  return step


def train_arrays(loss_of, params, state, batch, policy, learning_rate=1e-2) -> Run:
  tx = optimizer(policy, learning_rate)
  opt_state = tx.init(params)
  step = array_step(loss_of, tx, policy)
  jaxpr = traced(step, params, state, opt_state, batch)
  jitted, losses, skipped = jax.jit(step), [], 0
  for _ in range(STEPS):
    scale = jaxamp.scaler.get_scale(opt_state) if POLICIES[policy].scaled else 1.0
    params, state, opt_state, loss = jitted(params, state, opt_state, batch)
    losses.append(float(loss))
    if POLICIES[policy].scaled:
      skipped += int(jaxamp.scaler.get_scale(opt_state) < scale)  # a skipped step backs off
  return Run(np.asarray(losses), state, jaxpr, skipped)


# --- flax examples/imagenet ResNet (linen, BatchNorm) --------------------------------------------

RESNET_X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, 8, 3)), jnp.float32)
RESNET_Y = jnp.asarray(np.random.default_rng(1).integers(0, 4, 16), jnp.int32)


def train_resnet(model, policy: str) -> Run:
  """Trains with ``jaxamp.make_train_step``, threading ``batch_stats`` through the loss's aux.

  The learning rate is low enough for the trajectories to stay close, so that the comparison with
  flax's own ``dtype=`` path measures rounding, not chaos.
  """
  batch = (RESNET_X, RESNET_Y)
  variables = model.init(jax.random.key(0), RESNET_X[:1], train=False)
  params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
  loss_of = resnet_loss(model)
  train_state = TrainState.create(apply_fn=model.apply, params=params, tx=optimizer(policy, 1e-3))
  kwargs = POLICIES[policy].autocast or {"enabled": False}
  step = jaxamp.make_train_step(loss_of, **kwargs)
  jaxpr = traced(step, train_state, batch, state)
  jitted, losses, visited = jax.jit(step), [], []
  for _ in range(STEPS):
    visited.append((train_state.params, state))
    train_state, metrics = jitted(train_state, batch, state)
    state = metrics["aux"]
    losses.append(float(metrics["loss"]))
  return Run(np.asarray(losses), state, jaxpr, int(metrics["skipped_steps"]), tuple(visited))


def resnet(dtype=jnp.float32):
  return flax_resnet.ResNet(
    stage_sizes=[1, 1], block_cls=flax_resnet.ResNetBlock, num_classes=4, num_filters=4, dtype=dtype
  )


def resnet_loss(model):
  def loss_of(params, batch, state):
    logits, updates = model.apply(
      {"params": params, **state}, batch[0], train=True, mutable=["batch_stats"]
    )
    labels = batch[1]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss.mean(), updates

  return loss_of


@functools.cache
def train_flax_resnet(policy: str) -> Run:
  return train_resnet(resnet(), policy)


def resnet_gradients(policy: str, dtype=jnp.float32) -> jax.Array:
  """The flattened gradients at initialisation, under ``policy``, of a ResNet of ``dtype``.

  BatchNorm runs on its running averages: in training mode the gradient of a kernel that feeds a
  BatchNorm is a small difference of large terms, which rounding moves by tens of percent in any
  16-bit precision, so it would measure the draw of the weights rather than the precision.
  """
  model = resnet(dtype)
  variables = model.init(jax.random.key(0), RESNET_X[:1], train=False)

  def loss_of(params):
    logits = model.apply({**variables, "params": params}, RESNET_X, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), RESNET_Y
    ).mean()

  grads = jax.jit(under(policy, jax.grad(loss_of)))(variables["params"])
  return jnp.concatenate([g.astype(jnp.float32).ravel() for g in jax.tree.leaves(grads)])


def resnet_loss_deviations(policy: str, dtype=jnp.float32) -> np.ndarray:
  """How far the loss under ``policy`` of a ResNet of ``dtype`` is from float32's, at each point
  of float32's training run (so that it measures rounding, not the trajectories drifting apart)."""
  loss_of = resnet_loss(resnet(dtype))
  loss = jax.jit(under(policy, lambda params, state: loss_of(params, (RESNET_X, RESNET_Y), state)))
  baseline = train_flax_resnet("float32")
  losses = [float(loss(params, state)[0]) for params, state in baseline.visited]
  return np.abs(np.asarray(losses) - baseline.losses)


# --- flax examples/lm1b TransformerLM (linen, LayerNorm, padding masks) --------------------------

LM1B_CONFIG = flax_lm1b.TransformerConfig(
  vocab_size=32,
  output_vocab_size=32,
  emb_dim=16,
  num_heads=2,
  num_layers=1,
  qkv_dim=16,
  mlp_dim=32,
  max_len=8,
  dropout_rate=0.0,
  attention_dropout_rate=0.0,
  deterministic=True,
)
LM1B_LENGTHS = (8, 6, 4, 3)  # tokens after these are padding (0): whole rows of keys are masked


def lm1b_tokens() -> jax.Array:
  tokens = np.random.default_rng(2).integers(1, 32, (len(LM1B_LENGTHS), 8))
  for row, length in enumerate(LM1B_LENGTHS):
    tokens[row, length:] = 0
  return jnp.asarray(tokens, jnp.int32)


def lm1b_loss(params, batch):
  """lm1b's train.py loss: next-token cross entropy, weighted by ``inputs > 0``."""
  logits = flax_lm1b.TransformerLM(LM1B_CONFIG).apply({"params": params}, batch)
  weights = (batch > 0).astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch)
  return (loss * weights).sum() / weights.sum()


@functools.cache
def train_flax_lm1b(policy: str) -> Run:
  tokens = lm1b_tokens()
  params = flax_lm1b.TransformerLM(LM1B_CONFIG).init(jax.random.key(0), tokens)["params"]
  tx = optimizer(policy)
  train_state = TrainState.create(apply_fn=None, params=params, tx=tx)
  kwargs = POLICIES[policy].autocast or {"enabled": False}
  step = jaxamp.make_train_step(lm1b_loss, **kwargs)
  jaxpr = traced(step, train_state, tokens)
  jitted, losses = jax.jit(step), []
  for _ in range(STEPS):
    train_state, metrics = jitted(train_state, tokens)
    losses.append(float(metrics["loss"]))
  return Run(np.asarray(losses), None, jaxpr, int(metrics["skipped_steps"]))


# --- nnx MNIST CNN (BatchNorm, Dropout with an nnx.Rngs argument) --------------------------------


@functools.cache
def train_nnx_mnist(policy: str) -> Run:
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optimizer(policy, 3e-4), wrt=nnx.Param)
  rngs, batch = nnx.Rngs(dropout=1), flax_nnx_mnist.get_fake_batch(8)
  kwargs = POLICIES[policy].autocast or {"enabled": False}
  step = jaxamp.make_nnx_train_step(flax_nnx_mnist.loss_fn, **kwargs)

  graphdef, graph_state = nnx.split((model, opt, rngs))

  def pure_step(graph_state, batch):
    model, opt, rngs = nnx.merge(graphdef, graph_state)
    metrics = step(model, opt, batch, rngs)
    return nnx.state((model, opt, rngs)), metrics

  jaxpr = traced(pure_step, graph_state, batch)
  jitted, losses = nnx.jit(step), []
  for _ in range(STEPS):
    metrics = jitted(model, opt, batch, rngs)
    losses.append(float(metrics["loss"]))
  state = nnx.state(model, nnx.BatchStat)
  return Run(np.asarray(losses), state, jaxpr, int(metrics["skipped_steps"]))


# --- Equinox examples: mnist.ipynb CNN, stateful.ipynb BatchNorm + SpectralNorm ------------------


@functools.cache
def train_equinox_cnn(policy: str) -> Run:
  model = equinox_examples.CNN(jax.random.key(5678))
  params, static = eqx.partition(model, eqx.is_array)
  x = jax.random.normal(jax.random.key(0), (8, 1, 28, 28), jnp.float32)
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10, jnp.int32)

  def loss_of(params, state, batch):
    return equinox_examples.loss(eqx.combine(params, static), *batch), state

  return train_arrays(loss_of, params, None, (x, y), policy, learning_rate=1e-3)


@functools.cache
def train_equinox_stateful(policy: str) -> Run:
  with warnings.catch_warnings():  # the example leaves BatchNorm's mode to its legacy default
    warnings.simplefilter("ignore", UserWarning)
    model, state = eqx.nn.make_with_state(equinox_examples.Model)(jax.random.key(5678))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  xs = jax.random.normal(jax.random.key(0), (10, 3), jnp.float32)
  ys = jnp.sin(xs) + 1

  def loss_of(params, state, batch):
    return equinox_examples.compute_loss(eqx.combine(params, static), state, *batch)

  return train_arrays(loss_of, params, state, (xs, ys), policy)


# --- Haiku ResNet (hk.nets.ResNet, transform_with_state) -----------------------------------------

HAIKU_X = jnp.asarray(np.random.default_rng(3).standard_normal((8, 16, 16, 3)), jnp.float32)
HAIKU_Y = jnp.asarray(np.random.default_rng(4).integers(0, 4, 8), jnp.int32)


def haiku_forward(x, y):
  net = hk.nets.ResNet(
    blocks_per_group=(1, 1, 1, 1),
    num_classes=4,
    bottleneck=False,
    channels_per_group=(4, 8, 8, 8),
    initial_conv_config={"output_channels": 4},
  )
  logits = net(x, is_training=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


@functools.cache
def train_haiku_resnet(policy: str) -> Run:
  model = hk.transform_with_state(haiku_forward)
  params, state = model.init(jax.random.key(0), HAIKU_X, HAIKU_Y)

  def loss_of(params, state, batch):
    return model.apply(params, state, None, *batch)

  return train_arrays(loss_of, params, state, (HAIKU_X, HAIKU_Y), policy)


TRAIN = {
  "flax_resnet": train_flax_resnet,
  "flax_lm1b": train_flax_lm1b,
  "nnx_mnist": train_nnx_mnist,
  "equinox_cnn": train_equinox_cnn,
  "equinox_stateful": train_equinox_stateful,
  "haiku_resnet": train_haiku_resnet,
}
WITH_RSQRT_NORMS = ["flax_resnet", "flax_lm1b", "nnx_mnist", "haiku_resnet"]
WITH_STATE = ["flax_resnet", "nnx_mnist", "equinox_stateful", "haiku_resnet"]


# --- the float32 baseline trains -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", TRAIN)
def test_float32_baseline_loss_decreases(model):
  losses = TRAIN[model]("float32").losses
  assert losses[-1] < losses[0], losses


# --- dtypes inside the step ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("model", TRAIN)
def test_dots_and_convs_run_in_the_low_dtype(model, policy):
  jaxpr = TRAIN[model](policy).jaxpr
  assert dtypes_of(jaxpr, "dot_general") or dtypes_of(jaxpr, "conv_general_dilated")
  assert not matmuls_off_dtype(jaxpr, POLICIES[policy].low)


@pytest.mark.slow
@pytest.mark.parametrize("model", TRAIN)
def test_float8_dots_and_convs_run_on_float8_operands(model):
  jaxpr = TRAIN[model]("float8").jaxpr
  assert dtypes_of(jaxpr, "dot_general") or dtypes_of(jaxpr, "conv_general_dilated")
  assert not matmuls_without_float8_operands(jaxpr)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_MIXED)
@pytest.mark.parametrize("model", WITH_RSQRT_NORMS)
def test_norms_compute_their_rsqrt_in_float32(model, policy):
  rsqrts = dtypes_of(TRAIN[model](policy).jaxpr, "rsqrt")
  assert rsqrts and set(rsqrts) == {((F32,), (F32,))}


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.slow_after_first
def test_equinox_batch_norm_divides_by_a_float32_sqrt(policy):
  """Equinox's BatchNorm computes ``(y - m) / jnp.sqrt(v + eps)``: float32 inside.

  (SpectralNorm's power iteration normalises with a plain ``sqrt`` and ``/``, which follow their
  16-bit inputs, as torch's do.)
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    model, state = eqx.nn.make_with_state(equinox_examples.Model)(jax.random.key(5678))
  params, static = eqx.partition(model, eqx.is_array)
  xs = jax.random.normal(jax.random.key(0), (10, 3), jnp.float32)

  def loss_of(params, state, xs, ys):
    return equinox_examples.compute_loss(eqx.combine(params, static), state, xs, ys)

  explanation = jaxamp.explain(loss_of, **POLICIES[policy].autocast)(
    params, state, xs, jnp.sin(xs) + 1
  )
  rows = [row for row in explanation.to_dicts() if row["rule"].startswith("op batch_norm")]
  norm_math = [row for row in rows if row["primitive"] in ("sqrt", "div")]
  assert norm_math and {row["outputs"] for row in norm_math} == {("float32",)}


# --- state ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_MIXED)
@pytest.mark.parametrize("model", WITH_STATE)
def test_model_state_keeps_float32_dtypes_after_training(model, policy):
  assert dtypes(TRAIN[model](policy).state) == dtypes(TRAIN[model]("float32").state)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_MIXED)
@pytest.mark.parametrize("model", WITH_STATE)
def test_model_state_stays_finite(model, policy):
  leaves = jax.tree.leaves(TRAIN[model](policy).state)
  assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in leaves)


# --- losses --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_MIXED)
@pytest.mark.parametrize("model", TRAIN)
def test_mixed_precision_losses_are_finite(model, policy):
  assert np.isfinite(TRAIN[model](policy).losses).all()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ALL_MIXED)
@pytest.mark.parametrize("model", TRAIN)
def test_final_loss_is_close_to_float32s(model, policy):
  mixed, baseline = TRAIN[model](policy).losses, TRAIN[model]("float32").losses
  assert mixed[-1] == pytest.approx(baseline[-1], rel=LOSS_RTOL), (mixed, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("model", TRAIN)
def test_float16_run_skips_no_step(model):
  assert TRAIN[model]("float16").skipped == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", MIXED)
def test_resnet_gradients_are_as_close_to_float32_as_with_flax_dtype(policy):
  """The gradients at initialisation, against flax's own ``dtype=`` path (5% slack)."""
  baseline = resnet_gradients("float32")
  autocast = resnet_gradients(policy)
  flax_dtype = resnet_gradients("float32", POLICIES[policy].low)
  error = lambda g: float(jnp.linalg.norm(g - baseline) / jnp.linalg.norm(baseline))
  assert error(autocast) <= 1.05 * error(flax_dtype), (error(autocast), error(flax_dtype))


@pytest.mark.slow
@pytest.mark.parametrize("policy", MIXED)
def test_resnet_losses_are_as_close_to_float32_as_with_flax_dtype(policy):
  """Mean deviation along float32's training run, against flax's ``dtype=`` path."""
  autocast = resnet_loss_deviations(policy).mean()
  flax_dtype = resnet_loss_deviations("float32", POLICIES[policy].low).mean()
  assert autocast <= 1.25 * flax_dtype, (autocast, flax_dtype)


@pytest.mark.slow
def test_lm1b_fully_masked_padding_rows_give_finite_float16_logits():
  tokens = lm1b_tokens()
  model = flax_lm1b.TransformerLM(LM1B_CONFIG)
  params = model.init(jax.random.key(0), tokens)["params"]
  logits = jaxamp.autocast(model.apply, device_type="cuda")({"params": params}, tokens)
  assert logits.dtype == jnp.float16 and bool(jnp.isfinite(logits).all())
