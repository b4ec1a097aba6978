"""Haiku converts: autocast of a Haiku BatchNorm ResNet converts no more than jmp.

Before ``hk.BatchNorm`` was recognised as torch's ``batch_norm`` op, the autocast training step of
a Haiku ResNet held about 3x the converts of the same model under Haiku's hand-written jmp policy
(``params=float32,compute=bfloat16,output=float32``, with a float32 policy for ``hk.BatchNorm``
as Haiku's ImageNet example sets). Jaxpr-level counts only (no compilation), on a tiny model.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

hk = pytest.importorskip("haiku")
jmp = pytest.importorskip("jmp")

from jaxpr_utils import dtypes_of, traced, walk  # noqa: E402

BN = dict(create_scale=True, create_offset=True, decay_rate=0.9)


class Block(hk.Module):
  def __init__(self, channels, stride, project, name=None):
    super().__init__(name=name)
    self.channels, self.stride, self.project = channels, stride, project

  def __call__(self, x, is_training):
    shortcut = x
    if self.project:
      shortcut = hk.Conv2D(self.channels, 1, stride=self.stride, with_bias=False)(x)
      shortcut = hk.BatchNorm(**BN)(shortcut, is_training)
    h = hk.Conv2D(self.channels, 3, stride=self.stride, with_bias=False)(x)
    h = jax.nn.relu(hk.BatchNorm(**BN)(h, is_training))
    h = hk.Conv2D(self.channels, 3, with_bias=False)(h)
    h = hk.BatchNorm(**BN)(h, is_training)
    return jax.nn.relu(h + shortcut)


class Net(hk.Module):
  """Stem conv + 2 residual blocks (6 hk.BatchNorm in all) + a Linear head."""

  def __call__(self, x, is_training):
    x = hk.Conv2D(4, 3, with_bias=False)(x)
    x = jax.nn.relu(hk.BatchNorm(**BN)(x, is_training))
    x = Block(4, 1, False)(x, is_training)
    x = Block(8, 2, True)(x, is_training)
    return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))


NUM_BATCH_NORMS = 6


def train_step_jaxpr(variant: str):
  """The jaxpr of value_and_grad of the cross-entropy of ``Net`` under ``variant``."""
  model = hk.transform_with_state(lambda x, is_training: Net()(x, is_training))
  images = jnp.ones((2, 8, 8, 3), jnp.float32)
  labels = jnp.zeros((2,), jnp.int32)
  # Only the types matter to a trace: no initializer runs (XLA:CPU compiles them in seconds).
  init = functools.partial(model.init, x=images, is_training=True)
  params, state = jax.eval_shape(init, jax.random.key(0))
  apply = model.apply
  if variant == "autocast":
    apply = jaxamp.autocast(model.apply, device_type="cpu")

  def loss(params, state):
    logits, new_state = apply(params, state, None, images, True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean(), new_state

  step = jax.value_and_grad(loss, has_aux=True)
  if variant != "jmp":
    return traced(step, params, state)
  with (
    hk.mixed_precision.push_policy(
      Net, jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    ),
    hk.mixed_precision.push_policy(
      hk.BatchNorm, jmp.get_policy("params=float32,compute=float32,output=bfloat16")
    ),
  ):
    return traced(step, params, state)


def converts(jaxpr) -> int:
  return sum(eqn.primitive.name == "convert_element_type" for _, eqn in walk(jaxpr))


@functools.cache
def jaxpr_of(variant: str):
  """``train_step_jaxpr(variant)``, traced once per module run."""
  return train_step_jaxpr(variant)


@pytest.mark.slow
def test_autocast_converts_no_more_than_the_hand_written_jmp_policy():
  ours, theirs = converts(jaxpr_of("autocast")), converts(jaxpr_of("jmp"))
  assert ours <= theirs, f"autocast: {ours} convert_element_type eqns, jmp: {theirs}"


def test_batch_norm_rsqrt_runs_in_float32_and_convs_in_bfloat16():
  rsqrts = dtypes_of(jaxpr_of("autocast"), "rsqrt")
  assert len(rsqrts) >= NUM_BATCH_NORMS  # the forward one of each hk.BatchNorm, at least
  assert all(ins == (jnp.float32,) and outs == (jnp.float32,) for ins, outs in rsqrts), rsqrts
  convs = dtypes_of(jaxpr_of("autocast"), "conv_general_dilated")
  assert len(convs) >= 7  # 7 forward convs, plus their gradients
  assert all(ins == (jnp.bfloat16, jnp.bfloat16) for ins, _ in convs), convs
  # Forward convs and input gradients give bfloat16; the weight gradients float32 (weight_grads).
  results = {outs for _, outs in convs}
  assert results == {(jnp.dtype(jnp.bfloat16),), (jnp.dtype(jnp.float32),)}, convs
