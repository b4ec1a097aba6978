"""Ops that do not compute with their operands together leave each operand's dtype alone.

Only an op that combines its operands (an add, a concatenate, a select) needs them in one dtype.
``lax.optimization_barrier`` and a multi-operand ``lax.sort`` map each operand to its own
result: a 16-bit operand stays 16-bit even when it shared its dtype with a float32 one when
traced. ``lax.composite`` bodies are autocast like any other call.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jaxpr_utils import dtypes_of

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8))
POLICIES = [("cuda", jnp.float16), ("cpu", jnp.bfloat16)]
policies = pytest.mark.parametrize(
  "device_type,low", POLICIES, ids=[device_type for device_type, _ in POLICIES]
)


@policies
def test_an_optimization_barrier_keeps_each_operands_dtype(device_type, low):
  fun = jaxamp.autocast(lambda x, w: lax.optimization_barrier((x @ w, x)), device_type=device_type)
  product, x = fun(X, W)
  assert (product.dtype, x.dtype) == (low, jnp.float32)


@policies
def test_a_multi_operand_sort_keeps_each_operands_dtype(device_type, low):
  fun = jaxamp.autocast(
    lambda x, w: lax.sort((x @ w, jnp.sin(x)), num_keys=1), device_type=device_type
  )
  keys, values = fun(X, W)
  assert (keys.dtype, values.dtype) == (low, jnp.float32)


@policies
def test_sort_key_val_keeps_each_operands_dtype(device_type, low):
  fun = jaxamp.autocast(lambda x, w: lax.sort_key_val(x @ w, x), device_type=device_type)
  keys, values = fun(X, W)
  assert (keys.dtype, values.dtype) == (low, jnp.float32)
  assert bool(jnp.array_equal(values, lax.sort_key_val((X @ W).astype(low), X)[1]))


@policies
def test_a_combining_op_still_promotes_its_operands(device_type, low):
  fun = jaxamp.autocast(lambda x, w: jnp.concatenate([x @ w, x]), device_type=device_type)
  assert fun(X, W).dtype == jnp.float32


@policies
def test_a_composite_body_is_autocast(device_type, low):
  matmul = lax.composite(lambda x, w: x @ w, name="my.matmul")
  fun = jaxamp.autocast(lambda x, w: matmul(x, w), device_type=device_type)
  assert fun(X, W).dtype == low
  jaxpr = jax.make_jaxpr(fun)(X, W)
  (composite,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "composite"]
  assert composite.params["name"] == "my.matmul"
  assert dtypes_of(composite.params["jaxpr"].jaxpr, "dot_general") == [((low, low), (low,))]
