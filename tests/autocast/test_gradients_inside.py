"""A gradient taken inside an autocast function has the dtype of what it is the gradient of.

torch's autograd sends a gradient back through autocast's casts: inside ``torch.autocast`` the
gradient of a float32 tensor is float32, though the backward's matmuls run in 16 bits. A
``jax.grad``, ``jax.vjp`` or ``jax.linear_transpose`` traced inside ``jaxamp.autocast`` is a
backward pass in the jaxpr (its eqns are transposed); its results leave it in their traced dtypes.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import optax
import pytest

import jaxamp

F32, F16, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)
DEVICES = [("cpu", BF16), ("cuda", F16)]
X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 6)) / 8


def _loss(x, w):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def _dtypes(tree) -> list:
  return [leaf.dtype for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("device_type, low", DEVICES)
def test_a_jax_grad_inside_gives_float32_gradients_of_float32_inputs(device_type, low):
  inner = jax.grad(_loss, argnums=(0, 1))
  grads = jaxamp.autocast(inner, device_type=device_type)(X, W)
  assert _dtypes(grads) == [F32, F32]
  for got, want in zip(grads, inner(X, W), strict=True):
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("device_type, low", DEVICES)
def test_the_backward_matmuls_inside_still_run_in_the_low_dtype(device_type, low):
  # torch's backward of a 16-bit mm is two 16-bit mms; only the gradient's exit is float32.
  fun = jaxamp.autocast(jax.grad(_loss, argnums=(0, 1)), device_type=device_type)
  matmuls = jaxpr_utils.dtypes_of(jaxpr_utils.traced(fun, X, W), "dot_general")
  assert [operands for operands, _ in matmuls] == [(low, low)] * 3


@pytest.mark.parametrize("device_type, low", DEVICES)
def test_a_jax_vjp_inside_keeps_its_output_16_bit_and_its_gradients_float32(device_type, low):
  def fun(x, w):
    y, backward = jax.vjp(lambda x, w: jnp.tanh(x @ w), x, w)
    return y, backward(jnp.ones_like(y))

  y, grads = jaxamp.autocast(fun, device_type=device_type)(X, W)
  assert y.dtype == low
  assert _dtypes(grads) == [F32, F32]


def test_a_gradient_read_inside_is_float32_where_it_is_read():
  # A gradient penalty: the norm of an input gradient, computed from float32 gradients.
  def penalty(x, w):
    g = jax.grad(_loss)(x, w)
    return jnp.sum(g * g), g

  value, g = jaxamp.autocast(penalty, device_type="cpu")(X, W)
  assert (value.dtype, g.dtype) == (F32, F32)
  np.testing.assert_allclose(value, jnp.sum(g.astype(F32) ** 2), rtol=1e-6)


def test_the_gradient_of_a_value_autocast_made_16_bit_is_in_its_traced_dtype():
  # The 16-bit product's gradient leaves in the float32 the jaxpr declares (torch: bfloat16).
  def fun(x, w):
    return jax.grad(lambda h: jnp.sum(jnp.tanh(h)))(x @ w)

  assert jaxamp.autocast(fun, device_type="cpu")(X, W).dtype == F32


def test_a_linen_vjp_gives_float32_input_and_parameter_gradients():
  class Probe(nn.Module):
    @nn.compact
    def __call__(self, x):
      y, backward = nn.vjp(lambda module, x: module(x), nn.Dense(6), x)
      return backward(jnp.ones_like(y))

  variables = Probe().init(jax.random.key(2), X)
  param_grads, x_grad = jaxamp.autocast(Probe().apply, device_type="cpu")(variables, X)
  assert _dtypes((param_grads, x_grad)) == [F32, F32, F32]


def test_a_jitted_gradient_inside_gives_float32_gradients():
  grads = jaxamp.autocast(jax.jit(jax.grad(_loss, argnums=(0, 1))), device_type="cpu")(X, W)
  assert _dtypes(grads) == [F32, F32]


def test_a_custom_vjp_backward_inside_gives_float32_gradients():
  @jax.custom_vjp
  def sin(x):
    return jnp.sin(x)

  sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
  fun = jax.grad(lambda x, w: jnp.sum(sin(x @ w)), argnums=(0, 1))
  assert _dtypes(jaxamp.autocast(fun, device_type="cpu")(X, W)) == [F32, F32]


def test_a_linear_transpose_inside_gives_its_traced_dtype():
  def fun(x, w):
    transpose = jax.linear_transpose(lambda v: v @ w, x)
    return transpose(x @ w)

  assert _dtypes(jaxamp.autocast(fun, device_type="cpu")(X, W)) == [F32]


def test_an_equinox_filter_grad_inside_gives_float32_gradients():
  model = eqx.nn.MLP(8, 6, 16, 2, key=jax.random.key(3))

  def grads(model, x):
    return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)

  leaves = jax.tree.leaves(
    eqx.filter(jaxamp.autocast(grads, device_type="cpu")(model, X), eqx.is_array)
  )
  assert leaves and all(leaf.dtype == F32 for leaf in leaves)


def test_a_whole_train_step_under_autocast_updates_float32_params_with_float32_gradients():
  # The torch habit of running the backward under autocast too: param.grad stays float32.
  tx = optax.sgd(0.1)
  params = {"w": W}

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: _loss(x, p["w"]))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), grads

  new, grads = jax.jit(jaxamp.autocast(step, device_type="cpu"))(params, tx.init(params), X)
  assert (new["w"].dtype, grads["w"].dtype) == (F32, F32)
  want = params["w"] - 0.1 * jax.grad(lambda w: _loss(X, w))(W)
  np.testing.assert_allclose(new["w"], want, rtol=0.02, atol=0.02)


def test_the_gradient_of_an_inner_gradient_stays_float32_and_finite():
  def penalty(w):
    g = jax.grad(_loss)(X, w)
    return jnp.sum(g * g)

  outer = jax.grad(jaxamp.autocast(penalty, device_type="cuda"))(W)
  assert outer.dtype == F32
  assert bool(jnp.all(jnp.isfinite(outer)))


def test_torch_autocast_gives_float32_gradients_of_float32_leaves():
  # The reference this file follows (live torch CPU autocast; CI installs torch).
  torch = pytest.importorskip("torch")
  x = torch.tensor(np.asarray(X), requires_grad=True)
  w = torch.tensor(np.asarray(W), requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = torch.sum(torch.tanh(x @ w) ** 2)
    gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
  grads = jaxamp.autocast(jax.grad(_loss, argnums=(0, 1)), device_type="cpu")(X, W)
  assert (gx.dtype, gw.dtype) == (torch.float32, torch.float32)
  assert _dtypes(grads) == [F32, F32]
  for got, want in zip(grads, (gx, gw), strict=True):
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=0.05, atol=0.05)


# A bias broadcast over two batch dimensions (a batch of sequences, IQN's batch of quantiles): the
# transpose of its broadcast is a bare ``lax.reduce_sum`` of 32768 bfloat16 cotangents, which
# XLA:CPU accumulates in bfloat16 (half the gradient lost) where torch's sum accumulates in float32.
BATCHES = np.random.default_rng(0).standard_normal((64, 512, 4)).astype(np.float32)
SPREAD = (np.random.default_rng(1).standard_normal((4, 8)) / 4).astype(np.float32)
BIAS = np.random.default_rng(2).uniform(1.0, 2.0, (8,)).astype(np.float32)


def _squares(w, b, x):
  return jnp.sum(jnp.square(x @ w + b)) / 2


def _bias_gradient_inside():
  grad = jax.jit(jaxamp.autocast(jax.grad(_squares, argnums=1), device_type="cpu"))
  return grad(SPREAD, BIAS, BATCHES)


def test_a_bias_gradient_inside_is_summed_in_float32_and_rounded_once():
  got, exact = _bias_gradient_inside(), jax.grad(_squares, argnums=1)(SPREAD, BIAS, BATCHES)
  assert got.dtype == F32
  np.testing.assert_allclose(got, exact, rtol=2**-7)  # bfloat16's half ulp, with its inputs'


def test_a_bias_gradient_inside_matches_torchs_within_one_bfloat16_ulp():
  torch = pytest.importorskip("torch")
  w = torch.tensor(SPREAD, requires_grad=True)
  b = torch.tensor(BIAS, requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = torch.sum(torch.square(torch.nn.functional.linear(torch.tensor(BATCHES), w.T, b))) / 2
    (want,) = torch.autograd.grad(loss, b)
  want = want.numpy()
  one_ulp = np.spacing(want.astype(jnp.bfloat16)).astype(np.float32)
  assert (np.abs(np.asarray(_bias_gradient_inside()) - want) <= one_ulp).all()
