"""Activations torch lists nowhere run as its kernels do: in their input's dtype, computing in
float32 inside (opmath), forward and backward.

gelu's and silu's backward multiply the cotangent by the input; run primitive by primitive in
float16, ``x * dy`` overflowed where torch's fused kernel (and float32) stay finite, so a
loss-scaled step was skipped for nothing. The calls keep only their 16-bit input for the
backward, as torch's kernels do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_backward_memory import saved_residuals

import jaxamp

H = (jax.random.normal(jax.random.key(0), (4, 64)) * 3).astype(jnp.float16)
COTANGENT = (jax.random.normal(jax.random.key(1), (4, 64)) * 1e3).astype(jnp.float16)
ACTIVATIONS = {
  "gelu": (jax.nn.gelu, lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
  "gelu_exact": (
    lambda h: jax.nn.gelu(h, approximate=False),
    torch.nn.functional.gelu,
  ),
  "silu": (jax.nn.silu, torch.nn.functional.silu),
  "mish": (jax.nn.mish, torch.nn.functional.mish),
  "elu": (jax.nn.elu, torch.nn.functional.elu),
  "selu": (jax.nn.selu, torch.nn.functional.selu),
  "celu": (jax.nn.celu, torch.nn.functional.celu),
  "log_sigmoid": (jax.nn.log_sigmoid, torch.nn.functional.logsigmoid),
}
activations = pytest.mark.parametrize("name", sorted(ACTIVATIONS))


def autocast_vjp(act, device_type="cuda"):
  out, vjp = jax.vjp(jaxamp.autocast(act, device_type=device_type), H)
  return out, vjp(COTANGENT)[0]


def opmath_vjp(act):
  """The forward and backward computed in float32 and rounded once to float16."""
  out, vjp = jax.vjp(act, H.astype(jnp.float32))
  grad = vjp(COTANGENT.astype(jnp.float32))[0]
  return out.astype(jnp.float16), grad.astype(jnp.float16)


@activations
def test_an_activation_computes_in_float32_and_rounds_once_forward_and_backward(name):
  act = ACTIVATIONS[name][0]
  (out, grad), (expected_out, expected_grad) = autocast_vjp(act), opmath_vjp(act)
  assert out.dtype == grad.dtype == jnp.float16
  # within a few float16 ulps: XLA's fused tanh and erf differ from the eager ones in float32
  # ulps, which the backward's cancellations magnify
  for got, expected, rtol, atol in (
    (out, expected_out, 2e-3, 1e-3),
    (grad, expected_grad, 4e-3, 1e-2),
  ):
    np.testing.assert_allclose(
      got.astype(jnp.float32), expected.astype(jnp.float32), rtol=rtol, atol=atol
    )


@activations
def test_an_activations_float16_forward_and_backward_match_torch(name):
  act, torch_act = ACTIVATIONS[name]
  out, grad = autocast_vjp(act)
  h = torch.tensor(np.asarray(H.astype(jnp.float32)), dtype=torch.float16, requires_grad=True)
  torch_out = torch_act(h)
  (torch_grad,) = torch.autograd.grad(
    torch_out, h, torch.tensor(np.asarray(COTANGENT.astype(jnp.float32)), dtype=torch.float16)
  )
  np.testing.assert_allclose(
    np.asarray(out, np.float32), torch_out.detach().float().numpy(), rtol=2e-3, atol=1e-3
  )
  np.testing.assert_allclose(
    np.asarray(grad, np.float32), torch_grad.float().numpy(), rtol=2e-3, atol=1e-2
  )


@pytest.mark.parametrize("name", ["gelu", "silu", "mish"])
def test_a_loss_scaled_weight_gradient_through_an_activation_stays_finite(name):
  act = ACTIVATIONS[name][0]
  x, w, scale = jnp.array([[3.0]]), jnp.array([[1.0]]), 30000.0
  fun = jaxamp.autocast(lambda x, w: jnp.sum(act(x @ w)), device_type="cuda")
  grad = jax.grad(lambda w: fun(x, w) * scale)(w)
  expected = jax.grad(lambda w: jnp.sum(act(x @ w)) * scale)(w)
  assert np.isfinite(grad).all()
  np.testing.assert_allclose(grad, expected, rtol=2e-3)


@activations
def test_an_activation_keeps_only_its_16_bit_input_for_the_backward(name):
  act = ACTIVATIONS[name][0]
  fun = jaxamp.autocast(act, device_type="cuda")
  residuals = saved_residuals(lambda h: fun(h * 1), H)
  assert residuals and all(r.dtype == jnp.float16 for r in residuals)


def test_an_activation_of_a_float32_input_runs_in_float32():
  fun = jaxamp.autocast(jax.nn.gelu, device_type="cuda")
  x = H.astype(jnp.float32)
  assert fun(x).dtype == jnp.float32
  np.testing.assert_array_equal(fun(x), jax.nn.gelu(x))


@pytest.mark.parametrize("device_type", ["cpu", "xpu", "tpu"])
def test_every_policy_runs_activations_in_float32_inside(device_type):
  dtype = jaxamp.get_autocast_dtype(device_type)
  h = H.astype(dtype)
  out = jaxamp.autocast(jax.nn.silu, device_type=device_type)(h)
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, jax.nn.silu(h.astype(jnp.float32)).astype(dtype))
