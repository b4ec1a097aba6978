"""jax.scipy.special functions JAX writes for float32 and float64 only run in float32 under
autocast, and a registered function with a custom derivative is one op call, its rule included.

JAX picks those functions' thresholds, series lengths and constants by the dtype it traces; most
reject 16-bit inputs. Traced on float32 and run on a 16-bit matmul's output, their float32 code
would meet 16-bit values: ``log_ndtr`` underflowed to -inf and its gradient to NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import pytest

import jaxamp

F32 = jnp.dtype(jnp.float32)
LOW = {"cuda": jnp.dtype(jnp.float16), "cpu": jnp.dtype(jnp.bfloat16)}

# name -> (function of one array, the interval its inputs are drawn from)
SPECIAL = {
  "ndtr": (jsp.ndtr, (-8.0, 8.0)),
  "log_ndtr": (jsp.log_ndtr, (-12.0, 6.0)),
  "ndtri": (jsp.ndtri, (0.01, 0.99)),
  "spence": (jsp.spence, (0.1, 3.0)),
  "expi": (jsp.expi, (0.1, 4.0)),
  "exp1": (jsp.exp1, (0.1, 4.0)),
  "expn": (lambda x: jsp.expn(2, x), (0.1, 4.0)),
  "sici": (lambda x: jsp.sici(x)[0], (0.1, 4.0)),
  "hyp1f1": (lambda x: jsp.hyp1f1(1.0, 2.0, x), (-2.0, 2.0)),
  "hyp2f1": (lambda x: jsp.hyp2f1(1.0, 2.0, 3.0, x), (-0.5, 0.5)),
}
for _name in ("erfcx", "dawsn"):  # newer jax versions only
  if hasattr(jsp, _name):
    SPECIAL[_name] = (getattr(jsp, _name), (-3.0, 3.0))


def matmul_output(lo: float, hi: float) -> tuple[jax.Array, jax.Array]:
  """(x, w): ``x @ w`` is 16-bit under autocast, float32 when traced."""
  return jnp.linspace(lo, hi, 24, dtype=jnp.float32)[:, None], jnp.ones((1, 1), jnp.float32)


@pytest.mark.parametrize("device_type", sorted(LOW))
@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_a_special_function_of_a_16_bit_value_is_its_float32_value(name, device_type):
  fun, interval = SPECIAL[name]
  x, w = matmul_output(*interval)
  out = jax.jit(jaxamp.autocast(lambda x, w: fun(x @ w), device_type=device_type))(x, w)
  rounded = x.astype(LOW[device_type]).astype(F32)  # the 16-bit matmul's output, exactly
  assert out.dtype == F32
  np.testing.assert_allclose(out, fun(rounded), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device_type", sorted(LOW))
def test_log_ndtr_and_its_gradient_stay_finite_in_the_lower_tail(device_type):
  x, w = matmul_output(-12.0, 6.0)
  loss = lambda x, w: jsp.log_ndtr(x @ w).sum()
  value, grad = jax.value_and_grad(jaxamp.autocast(loss, device_type=device_type))(x, w)
  expected_value, expected_grad = jax.value_and_grad(loss)(x, w)
  assert np.isfinite(value) and np.isfinite(grad).all()
  np.testing.assert_allclose(value, expected_value, rtol=1e-2)
  np.testing.assert_allclose(grad, expected_grad, rtol=2e-2, atol=1e-3)


@jax.custom_jvp
def quartic(x):
  """``x**4 / 1e4``, written with multiplies: in float16 ``x * x * x * x`` overflows past 16."""
  return (x * x * x * x) * 1e-4


@quartic.defjvp
def _quartic_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return quartic(x), (x * x * x) * 4e-4 * t


jaxamp.register_op(quartic, name="test_quartic", category="float32")


def test_a_registered_custom_jvp_function_runs_its_rule_inside_its_op():
  # JAX binds a custom_jvp call outside the function's code and traces its rule with the call's
  # traceback: the call itself is the op's call, so the rule's own primal runs in float32 too.
  x, w = jnp.full((4, 1), 20.0), jnp.ones((1, 1))
  loss = jaxamp.autocast(lambda x, w: quartic(x @ w).sum(), device_type="cuda")
  value, grad = jax.value_and_grad(loss)(x, w)
  assert float(value) == pytest.approx(4 * 16.0, rel=1e-3)
  np.testing.assert_allclose(grad, np.full((4, 1), 3.2), rtol=1e-2)
