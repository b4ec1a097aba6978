"""A dtype the user wrote wins over the policy (DESIGN §2, "Explicit dtypes").

torch runs an op called with ``dtype=`` as written, also when it is on the float32 list; in JAX
the caller's ``dtype=`` is a cast at the op's entrance, told apart from the op's own
upcast-then-restore. ``preferred_element_type`` chosen by the caller is kept as well.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
DEVICES = ("cuda", "cpu", "xpu")
REDUCTIONS = {
  "sum": jnp.sum,
  "mean": jnp.mean,
  "cumsum": jnp.cumsum,
  "prod": jnp.prod,
  "cumprod": jnp.cumprod,
  "nansum": jnp.nansum,
}


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_reductions_explicit_dtype_is_kept(device_type, name, dtype):
  # (dtype=jnp.float32 on a value traced as float32 leaves no trace in the jaxpr: JAX drops the
  # cast to the dtype a value already has, so autocast cannot see it; README "Limits".)
  reduce = REDUCTIONS[name]
  fun = jaxamp.autocast(lambda x, w: reduce(x @ w, dtype=dtype), device_type=device_type)
  assert jax.jit(fun)(X, W).dtype == dtype


@pytest.mark.parametrize("device_type", DEVICES)
def test_an_explicit_dtype_changes_what_the_op_computes_in(device_type):
  fun = jaxamp.autocast(lambda x: jnp.sum(x, dtype=jnp.float16), device_type=device_type)
  x = jnp.full((4096,), 1.0 + 2.0**-9)  # float16 accumulation loses the low bits
  assert fun(x) == jnp.sum(x, dtype=jnp.float16)


@pytest.mark.parametrize("device_type", DEVICES)
def test_without_a_dtype_the_policy_decides(device_type):
  fun = jaxamp.autocast(lambda x, w: jnp.sum(x @ w), device_type=device_type)
  expected = jnp.bfloat16 if device_type == "cpu" else jnp.float32  # cpu: sum returns its input's
  assert fun(X, W).dtype == expected


@pytest.mark.parametrize("device_type", DEVICES)
def test_the_callers_preferred_element_type_is_kept(device_type):
  dot = lambda x, w: lax.dot(
    x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
  )
  assert jaxamp.autocast(dot, device_type=device_type)(X, W).dtype == jnp.float32


@pytest.mark.parametrize("device_type", DEVICES)
def test_a_16_bit_input_summed_without_dtype_returns_the_policys_dtype(device_type):
  # jnp.sum's own float16 upcast-then-restore is not an explicit dtype.
  fun = jaxamp.autocast(lambda x: jnp.sum(x), device_type=device_type)
  expected = jnp.float16 if device_type == "cpu" else jnp.float32
  assert fun(X.astype(jnp.float16)).dtype == expected
