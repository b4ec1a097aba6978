# Copyright 2023 Patrick Kidger and the Equinox contributors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# ruff: noqa
# Model classes and losses copied verbatim from Equinox's examples (patrick-kidger/equinox,
# Apache-2.0): the CNN and its loss from examples/mnist.ipynb (commit
# 8465ec2c960bfac66e80e88796fad1425c27d828), the stateful Model and its loss from
# examples/stateful.ipynb (commit 2e6703ce4670291c7e76e3d332951d968ace6063). Only the imports
# are gathered here from the notebooks' first cells.

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PyTree  # https://github.com/google/jaxtyping


# --- examples/mnist.ipynb ---


class CNN(eqx.Module):
  layers: list

  def __init__(self, key):
    key1, key2, key3, key4 = jax.random.split(key, 4)
    # Standard CNN setup: convolutional layer, followed by flattening,
    # with a small MLP on top.
    self.layers = [
      eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
      eqx.nn.MaxPool2d(kernel_size=2),
      jax.nn.relu,
      jnp.ravel,
      eqx.nn.Linear(1728, 512, key=key2),
      jax.nn.sigmoid,
      eqx.nn.Linear(512, 64, key=key3),
      jax.nn.relu,
      eqx.nn.Linear(64, 10, key=key4),
      jax.nn.log_softmax,
    ]

  def __call__(self, x: Float[Array, "1 28 28"]) -> Float[Array, "10"]:
    for layer in self.layers:
      x = layer(x)
    return x


def loss(model: CNN, x: Float[Array, "batch 1 28 28"], y: Int[Array, " batch"]) -> Float[Array, ""]:
  # Our input has the shape (BATCH_SIZE, 1, 28, 28), but our model operations on
  # a single input input image of shape (1, 28, 28).
  #
  # Therefore, we have to use jax.vmap, which in this case maps our model over the
  # leading (batch) axis.
  pred_y = jax.vmap(model)(x)
  return cross_entropy(y, pred_y)


def cross_entropy(y: Int[Array, " batch"], pred_y: Float[Array, "batch 10"]) -> Float[Array, ""]:
  # y are the true targets, and should be integers 0-9.
  # pred_y are the log-softmax'd predictions.
  pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
  return -jnp.mean(pred_y)


# --- examples/stateful.ipynb ---


# This model is just a weird mish-mash of stateful and non-stateful layers for
# demonstration purposes, it isn't doing any clever.
class Model(eqx.Module):
  norm1: eqx.nn.BatchNorm
  spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
  norm2: eqx.nn.BatchNorm
  linear1: eqx.nn.Linear
  linear2: eqx.nn.Linear

  def __init__(self, key):
    key1, key2, key3, key4 = jr.split(key, 4)
    self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
    self.spectral_linear = eqx.nn.SpectralNorm(
      layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
      weight_name="weight",
      key=key2,
    )
    self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
    self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
    self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

  def __call__(self, x, state):
    x, state = self.norm1(x, state)
    x, state = self.spectral_linear(x, state)
    x = jax.nn.relu(x)
    x, state = self.norm2(x, state)
    x = self.linear1(x)
    x = jax.nn.relu(x)
    x = self.linear2(x)
    return x, state


def compute_loss(model, state, xs, ys):
  batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
  pred_ys, state = batch_model(xs, state)
  loss = jnp.mean((pred_ys - ys) ** 2)
  return loss, state
