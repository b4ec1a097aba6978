"""The benchmark models: a Flax linen transformer LM and a small conv net, each with a `dtype=`.

``dtype=None`` is the float32 model that ``jaxamp.autocast`` transforms; ``dtype=jnp.bfloat16`` /
``jnp.float16`` is the hand-written Flax mixed precision users compare with (parameters stay
float32, every layer computes in ``dtype``, the logits are cast to float32 before the loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

# --- transformer LM ------------------------------------------------------------------------------


class Block(nn.Module):
  d_model: int
  num_heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads, dtype=self.dtype, deterministic=True
    )(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * self.d_model, dtype=self.dtype)(h)
    h = nn.gelu(h)
    h = nn.Dense(self.d_model, dtype=self.dtype)(h)
    return x + h


class TransformerLM(nn.Module):
  vocab: int
  d_model: int
  num_heads: int
  num_layers: int
  max_len: int
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = x + jnp.asarray(pos[: tokens.shape[1]], x.dtype)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.num_layers):
      x = Block(self.d_model, self.num_heads, self.dtype)(x, mask)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(x)


# --- conv net ------------------------------------------------------------------------------------


class ConvNet(nn.Module):
  features: tuple[int, ...] = (32, 64, 64, 128)
  num_classes: int = 10
  norm: str = "batch"  # "batch" (BatchNorm, mutable batch_stats) or "group" (GroupNorm)
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, feats in enumerate(self.features):
      x = nn.Conv(feats, (3, 3), use_bias=self.norm != "batch", dtype=self.dtype)(x)
      if self.norm == "batch":
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
      else:
        x = nn.GroupNorm(num_groups=8, dtype=self.dtype)(x)
      x = nn.relu(x)
      if i % 2 == 1:
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.mean(axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)


# --- tasks: a model, its batch and its loss ------------------------------------------------------


@dataclasses.dataclass
class Task:
  """One benchmark model at one dtype: ``loss(params, state, batch) -> (loss, new_state)``."""

  name: str
  loss: Callable
  params: Any
  state: Any  # non-trainable collections (batch_stats), {} when there are none
  batch: Any


def lm_sizes(quick: bool = False) -> dict:
  """The transformer LM's sizes in the benchmarks (``--quick``: smaller)."""
  return dict(
    layers=1 if quick else 4,
    d_model=128 if quick else 256,
    heads=4,
    seq=64 if quick else 128,
    batch=4 if quick else 8,
    vocab=512 if quick else 1024,
  )


def lm_param_shapes(*, layers=4, d_model=256, heads=4, seq=128, vocab=1024, **_) -> Any:
  """The LM's parameters as ``jax.ShapeDtypeStruct``s, without initialising them."""
  model = TransformerLM(vocab, d_model, heads, layers, seq)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def lm_task(dtype, *, layers=4, d_model=256, heads=4, seq=128, batch=8, vocab=1024, seed=0) -> Task:
  model = TransformerLM(vocab, d_model, heads, layers, seq, dtype)
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  # Parameters are initialised once, from the float32 model: every variant trains the same ones.
  params = TransformerLM(vocab, d_model, heads, layers, seq).init(jax.random.key(seed), inputs)[
    "params"
  ]

  def loss(params, state, batch):
    inputs, targets = batch
    logits = model.apply({"params": params}, inputs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return ce.mean(), state

  return Task("lm", loss, params, {}, (inputs, targets))


def conv_task(dtype, *, batch=32, norm="batch", features=(32, 64, 64, 128), seed=0) -> Task:
  model = ConvNet(tuple(features), 10, norm, dtype)
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch, 32, 32, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, (batch,)), jnp.int32)
  variables = ConvNet(tuple(features), 10, norm).init(jax.random.key(seed), images)
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss(params, state, batch):
    images, labels = batch
    if state:
      logits, new_state = model.apply(
        {"params": params, **state}, images, train=True, mutable=list(state)
      )
    else:
      logits, new_state = model.apply({"params": params}, images, train=True), state
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean(), new_state

  return Task("conv", loss, params, state, (images, labels))


def param_count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
