"""Elementwise functions torch computes in one kernel each, on none of its lists (logaddexp,
xlogy, logit, hypot, i0, ...), run as those kernels do: in their input's dtype, computing in
float32 inside, forward and backward.

JAX builds them from exp, log, log1p and pow, which the CUDA list sends to float32: run primitive
by primitive, ``jnp.logaddexp`` of float16 inputs returned float32 under "cuda", where torch
returns float16. Their calls keep only their 16-bit inputs for the backward, as torch's kernels.
"""

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import pytest
import torch
from test_backward_memory import saved_residuals

import jaxamp

_KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.uniform(_KEYS[0], (4, 32), minval=0.05, maxval=0.95).astype(jnp.float16)
Y = jax.random.uniform(_KEYS[1], (4, 32), minval=0.05, maxval=0.95).astype(jnp.float16)
COTANGENT = (jax.random.normal(_KEYS[2], (4, 32)) * 1e2).astype(jnp.float16)

# name -> (the JAX function of (x, y), torch's of (x, y))
FUNCTIONS = {
  "logaddexp": (jnp.logaddexp, torch.logaddexp),
  "logaddexp2": (jnp.logaddexp2, torch.logaddexp2),
  "xlogy": (jss.xlogy, torch.xlogy),
  "xlog1py": (jss.xlog1py, torch.special.xlog1py),
  "entr": (lambda x, y: jss.entr(x), lambda x, y: torch.special.entr(x)),
  "logit": (lambda x, y: jss.logit(x), lambda x, y: torch.logit(x)),
  "hypot": (jnp.hypot, torch.hypot),
  "i0": (lambda x, y: jnp.i0(x), lambda x, y: torch.i0(x)),
  "i0@scipy": (lambda x, y: jss.i0(x), lambda x, y: torch.i0(x)),
  "i1": (lambda x, y: jss.i1(x), lambda x, y: torch.special.i1(x)),
}
functions = pytest.mark.parametrize("name", sorted(FUNCTIONS))


def autocast_vjp(fun, device_type="cuda"):
  out, vjp = jax.vjp(jaxamp.autocast(fun, device_type=device_type), X, Y)
  return out, vjp(COTANGENT)


def opmath_vjp(fun):
  """The forward and backward computed in float32 and rounded once to float16."""
  out, vjp = jax.vjp(fun, X.astype(jnp.float32), Y.astype(jnp.float32))
  grads = vjp(COTANGENT.astype(jnp.float32))
  return out.astype(jnp.float16), tuple(g.astype(jnp.float16) for g in grads)


def close(got, expected, rtol=2e-3, atol=1e-3):
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=rtol, atol=atol
  )


@functions
def test_an_elementwise_function_of_16_bit_inputs_returns_their_dtype_under_cuda(name):
  fun = FUNCTIONS[name][0]
  (out, grads), (expected_out, expected_grads) = autocast_vjp(fun), opmath_vjp(fun)
  assert out.dtype == jnp.float16 and {g.dtype for g in grads} == {jnp.dtype(jnp.float16)}
  close(out, expected_out)
  for grad, expected in zip(grads, expected_grads, strict=True):
    close(grad, expected, rtol=4e-3, atol=1e-2)


@functions
def test_an_elementwise_functions_float16_forward_matches_torch(name):
  fun, torch_fun = FUNCTIONS[name]
  out = jaxamp.autocast(fun, device_type="cuda")(X, Y)
  x, y = (torch.tensor(np.asarray(a, np.float32), dtype=torch.float16) for a in (X, Y))
  close(out, torch_fun(x, y).float().numpy())


# torch's CPU i1_backward has no float16 kernel (i1's backward is checked against float32 above).
@pytest.mark.parametrize("name", sorted(set(FUNCTIONS) - {"i1"}))
def test_an_elementwise_functions_float16_backward_is_no_less_accurate_than_torchs(name):
  """torch's backward formulas run as float16 ops, each rounding (entr's ``-(1 + log x)``
  cancels near 1/e); the float32 backward inside rounds once, so it is at least as close to the
  float32 gradient."""
  fun, torch_fun = FUNCTIONS[name]
  _, grads = autocast_vjp(fun)
  _, exact = jax.vjp(fun, X.astype(jnp.float32), Y.astype(jnp.float32))
  exact_grads = exact(COTANGENT.astype(jnp.float32))
  x, y = (
    torch.tensor(np.asarray(a, np.float32), dtype=torch.float16, requires_grad=True) for a in (X, Y)
  )
  cotangent = torch.tensor(np.asarray(COTANGENT, np.float32), dtype=torch.float16)
  torch_grads = torch.autograd.grad(torch_fun(x, y), (x, y), cotangent, allow_unused=True)
  for grad, torch_grad, expected in zip(grads, torch_grads, exact_grads, strict=True):
    expected = np.asarray(expected, np.float32)
    theirs = expected * 0 if torch_grad is None else torch_grad.float().numpy()
    error = np.abs(np.asarray(grad, np.float32) - expected).max()
    assert error <= np.abs(theirs - expected).max() + 1e-3 * np.abs(expected).max()


@functions
def test_an_elementwise_function_keeps_only_its_16_bit_inputs_for_the_backward(name):
  fun = jaxamp.autocast(FUNCTIONS[name][0], device_type="cuda")
  residuals = saved_residuals(lambda x, y: fun(x * 1, y * 1), X, Y)
  assert residuals and all(r.dtype == jnp.float16 for r in residuals)


@functions
def test_an_elementwise_function_of_float32_inputs_is_plain_jax(name):
  fun = FUNCTIONS[name][0]
  x, y = X.astype(jnp.float32), Y.astype(jnp.float32)
  out = jax.jit(jaxamp.autocast(fun, device_type="cuda"))(x, y)
  assert out.dtype == jnp.float32
  close(out, fun(x, y), rtol=1e-6, atol=1e-7)


BINARY = ["hypot", "logaddexp", "logaddexp2", "xlog1py", "xlogy"]
# The operands' dtypes and shapes: a 16-bit and a float32 tensor, in either order, also
# broadcast; a 16-bit tensor beside a float32 0-dim one, which it outranks in torch.
MIXED = {
  "low_f32": ((jnp.float16, (4, 32)), (jnp.float32, (4, 32))),
  "f32_low": ((jnp.float32, (4, 32)), (jnp.float16, (4, 32))),
  "low_f32_row": ((jnp.float16, (4, 32)), (jnp.float32, (32,))),
  "low_f32_0d": ((jnp.float16, (4, 32)), (jnp.float32, ())),
}


@pytest.mark.parametrize("operands", sorted(MIXED))
@pytest.mark.parametrize("name", BINARY)
def test_an_elementwise_function_of_mixed_dtypes_returns_torchs_promoted_dtype(name, operands):
  jax_fun, torch_fun = FUNCTIONS[name]
  values = [jnp.full(shape, 0.5, dtype) for dtype, shape in MIXED[operands]]
  got = jax.jit(jaxamp.autocast(jax_fun, device_type="cuda"))(*values)
  tensors = [torch.full(v.shape, 0.5, dtype=getattr(torch, v.dtype.name)) for v in values]
  assert got.dtype.name == str(torch_fun(*tensors).dtype).removeprefix("torch.")


@pytest.mark.parametrize("device_type", ["cpu", "xpu", "tpu"])
def test_every_policy_computes_elementwise_functions_in_float32_inside(device_type):
  dtype = jaxamp.get_autocast_dtype(device_type)
  x, y = X.astype(dtype), Y.astype(dtype)
  out = jaxamp.autocast(jnp.logaddexp, device_type=device_type)(x, y)
  assert out.dtype == dtype
  np.testing.assert_array_equal(
    out, jnp.logaddexp(*(a.astype(jnp.float32) for a in (x, y))).astype(dtype)
  )


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_nansum_is_its_own_kernel_and_returns_its_inputs_dtype_where_sum_returns_float32(
  device_type,
):
  x = X.at[0, 0].set(jnp.nan)
  nansum = jaxamp.autocast(lambda a: jnp.nansum(a, axis=1), device_type=device_type)(x)
  total = jaxamp.autocast(lambda a: jnp.sum(a, axis=1), device_type=device_type)(x)
  assert nansum.dtype == jnp.float16 and total.dtype == jnp.float32
  expected = jnp.nansum(x.astype(jnp.float32), axis=1).astype(jnp.float16)
  np.testing.assert_array_equal(nansum, expected)


def test_a_logspace_given_a_16_bit_dtype_computes_in_it_as_plain_jax():
  fun = jaxamp.autocast(lambda: jnp.logspace(0.0, 4.0, 9, dtype=jnp.float16), device_type="cuda")
  out = fun()
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(out, jnp.logspace(0.0, 4.0, 9, dtype=jnp.float16))


def test_a_trace_under_cuda_is_torchs_diagonal_sum_in_float32():
  """torch's CUDA trace is ``self.diagonal().sum()``, and the sum it dispatches is on the CUDA
  float32 list: float32, as autocast's float32 jnp.sum inside jnp.trace gives."""
  out = jaxamp.autocast(jnp.trace, device_type="cuda")(X[:, :4])
  assert out.dtype == jnp.float32
