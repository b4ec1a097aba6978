"""A recurrent cell's step is torch's ``LSTMCell``/``GRUCell``/``RNNCell``.

torch's CUDA (and XPU) lower-precision list holds ``lstm_cell``, ``gru_cell`` and
``rnn_*_cell``: the cell casts its input, its state and its weights, so ``h`` and ``c`` come out
16-bit. The library cells (flax linen and nnx, Haiku, Equinox) are that op by identity. Computed
as a composition instead, the 16-bit matmuls met the float32 state and the step came out float32.
torch's CPU list has no cells (its CPU cells decompose into ``linear``): there the step is a
composition, its matmuls bfloat16.
"""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

B, IN, H = 2, 8, 16
X = jax.random.normal(jax.random.key(0), (B, IN))
STATE = jax.random.normal(jax.random.key(1), (B, H)) * 0.5


def linen_cell(cell, carry):
  params = cell.init(jax.random.key(2), carry, X)
  return lambda x: cell.apply(params, carry, x)


def haiku_cell(make, carry):
  model = hk.without_apply_rng(hk.transform(lambda x: make()(x, carry)))
  params = model.init(jax.random.key(2), X)
  return lambda x: model.apply(params, x)


LSTM_STATE = (STATE, STATE)
EQX_LSTM = eqx.nn.LSTMCell(IN, H, key=jax.random.key(2))
EQX_GRU = eqx.nn.GRUCell(IN, H, key=jax.random.key(2))
NNX_LSTM = nnx.LSTMCell(IN, H, rngs=nnx.Rngs(2))
NNX_GRU = nnx.GRUCell(IN, H, rngs=nnx.Rngs(2))
CELLS = {
  "linen_lstm": linen_cell(nn.LSTMCell(H), LSTM_STATE),
  "linen_optimized_lstm": linen_cell(nn.OptimizedLSTMCell(H), LSTM_STATE),
  "linen_gru": linen_cell(nn.GRUCell(H), STATE),
  "linen_simple": linen_cell(nn.SimpleCell(H), STATE),
  "nnx_lstm": lambda x: NNX_LSTM(LSTM_STATE, x),
  "nnx_gru": lambda x: NNX_GRU(STATE, x),
  "haiku_lstm": haiku_cell(lambda: hk.LSTM(H), hk.LSTMState(*LSTM_STATE)),
  "haiku_gru": haiku_cell(lambda: hk.GRU(H), STATE),
  "haiku_vanilla": haiku_cell(lambda: hk.VanillaRNN(H), STATE),
  "equinox_lstm": jax.vmap(lambda x, h, c: EQX_LSTM(x, (h, c)), in_axes=(0, None, None)),
  "equinox_gru": jax.vmap(lambda x, h: EQX_GRU(x, h), in_axes=(0, None)),
}
EQX_ARGS = {"equinox_lstm": (STATE[0], STATE[0]), "equinox_gru": (STATE[0],)}


def run(name, device_type=None):
  cell = CELLS[name]
  fun = cell if device_type is None else jaxamp.autocast(cell, device_type=device_type)
  return jax.jit(fun)(X, *EQX_ARGS.get(name, ()))


@pytest.mark.parametrize("name", list(CELLS))
def test_a_cells_step_is_16_bit_under_the_cuda_list(name):
  out = run(name, "cuda")
  assert {leaf.dtype for leaf in jax.tree.leaves(out)} == {jnp.dtype(jnp.float16)}
  for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(run(name)), strict=True):
    np.testing.assert_allclose(got.astype(jnp.float32), ref, atol=5e-3)


@pytest.mark.parametrize("name", ["linen_lstm", "haiku_gru", "equinox_lstm", "nnx_lstm"])
def test_a_cells_step_is_a_composition_under_the_cpu_list(name):
  """torch's CPU cells are ``linear`` and elementwise ops: bfloat16 matmuls meet the float32
  state, and the step comes out float32."""
  out = run(name, "cpu")
  assert {leaf.dtype for leaf in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}


def test_an_rnn_over_a_sequence_outputs_16_bit_steps_and_float32_gradients():
  rnn = nn.RNN(nn.LSTMCell(H))
  xs = jax.random.normal(jax.random.key(3), (B, 5, IN))
  params = rnn.init(jax.random.key(4), xs)
  loss = lambda p, xs: jnp.mean(rnn.apply(p, xs).astype(jnp.float32) ** 2)
  autocast = jaxamp.autocast(lambda p, xs: rnn.apply(p, xs), device_type="cuda")
  assert jax.jit(autocast)(params, xs).dtype == jnp.float16
  grads = jax.jit(jax.grad(lambda p: jnp.mean(autocast(p, xs).astype(jnp.float32) ** 2)))(params)
  expected = jax.grad(loss)(params, xs)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-4)
