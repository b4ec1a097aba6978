"""The Haiku benchmark model: ``hk.nets.ResNet`` (BatchNorm, ``hk.transform_with_state``).

``dtype=None`` is the float32 model that ``jaxamp.autocast`` transforms; ``dtype=jnp.bfloat16`` /
``jnp.float16`` is Haiku's hand-written mixed precision with jmp, as Haiku's ImageNet example
writes it: ``params=float32,compute=<dtype>,output=float32`` for the network and
``params=float32,compute=float32,output=<dtype>`` for ``hk.BatchNorm``. The policies are pushed
while the loss is traced (``hk.mixed_precision.push_policy``), so the variants of one process do
not see each other's.
"""

from __future__ import annotations

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from benchmarks.models import Task


def jmp_policies(dtype) -> dict:
  """Module class -> jmp policy of the hand-written variant computing in ``dtype``."""
  name = jnp.dtype(dtype).name
  return {
    hk.nets.ResNet: jmp.get_policy(f"params=float32,compute={name},output=float32"),
    hk.BatchNorm: jmp.get_policy(f"params=float32,compute=float32,output={name}"),
  }


@contextlib.contextmanager
def pushed(policies: dict):
  with contextlib.ExitStack() as stack:
    for cls, policy in policies.items():
      stack.enter_context(hk.mixed_precision.push_policy(cls, policy))
    yield


def resnet_task(
  dtype, *, batch=16, image=32, blocks=(1, 1, 1, 1), channels=(16, 32, 64, 128), seed=0
) -> Task:
  def forward(images, is_training):
    net = hk.nets.ResNet(
      blocks_per_group=tuple(blocks),
      num_classes=10,
      channels_per_group=tuple(channels),
      bn_config=dict(decay_rate=0.9),
      resnet_v2=False,
      bottleneck=False,
    )
    return net(images, is_training)

  model = hk.transform_with_state(forward)
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch, image, image, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)
  # Initialised once, from the float32 model: every variant trains the same parameters.
  params, state = model.init(jax.random.key(seed), images, True)
  policies = {} if dtype is None else jmp_policies(dtype)

  def loss(params, state, batch):
    images, labels = batch
    with pushed(policies):
      logits, new_state = model.apply(params, state, None, images, True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean(), new_state

  return Task("haiku", loss, params, state, (images, labels))
