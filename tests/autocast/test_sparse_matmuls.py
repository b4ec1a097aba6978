"""jax.experimental.sparse's matmuls are torch's ``mm`` on a sparse tensor: the low dtype.

torch's CPU autocast runs ``torch.mm(coo, dense)`` and ``torch.sparse.mm`` in bfloat16 or float16
(recorded in the golden case ``sparse_mm``); every sparse matmul primitive of JAX runs in the
autocast dtype like ``dot_general``. jaxamp does not import ``jax.experimental.sparse`` (half a
second): its rows apply once the user's code has imported it.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import jaxamp
from jaxamp import Category

DEVICE_TYPES = {"cuda": jnp.float16, "cpu": jnp.bfloat16}
DENSE = jnp.where(
  jax.random.bernoulli(jax.random.key(0), 0.4, (6, 8)),
  jax.random.normal(jax.random.key(1), (6, 8)),
  0.0,
)
X = jax.random.normal(jax.random.key(2), (8, 5))
V = jax.random.normal(jax.random.key(3), (8,))

# Each spelling: (the sparse operand from DENSE, the product) -> a dense result (or its data).
SPELLINGS = {
  "bcoo @ dense": (sparse.BCOO.fromdense, lambda s: s @ X),
  "dense @ bcoo": (sparse.BCOO.fromdense, lambda s: X.T @ s.T),
  "bcoo @ vector": (sparse.BCOO.fromdense, lambda s: s @ V),
  "batched bcoo @ dense": (
    lambda d: sparse.BCOO.fromdense(d.reshape(2, 3, 8), n_batch=1),
    lambda s: s @ X,
  ),
  "bcoo @ bcoo": (sparse.BCOO.fromdense, lambda s: (s @ s.T).todense()),
  "bcsr @ dense": (sparse.BCSR.fromdense, lambda s: s @ X),
  "coo @ dense": (sparse.COO.fromdense, lambda s: s @ X),
  "coo @ vector": (sparse.COO.fromdense, lambda s: s @ V),
  "csr @ dense": (sparse.CSR.fromdense, lambda s: s @ X),
  "csr @ vector": (sparse.CSR.fromdense, lambda s: s @ V),
  "sparsify": (
    sparse.BCOO.fromdense,
    lambda s: sparse.sparsify(lambda a, b: jnp.matmul(a, b))(s, X),
  ),
}
LOW_PRECISION = {"float16": 2e-3, "bfloat16": 2e-2}


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.slow_after_first
def test_a_sparse_matmul_runs_in_the_low_dtype_like_a_dense_one(spelling, device_type):
  make, product = SPELLINGS[spelling]
  operand = make(DENSE)
  low = jnp.dtype(DEVICE_TYPES[device_type])
  out = jax.jit(jaxamp.autocast(product, device_type=device_type))(operand)
  assert out.dtype == low
  expected = product(operand)
  assert expected.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(expected)))
  np.testing.assert_allclose(
    out.astype(jnp.float32), expected, atol=LOW_PRECISION[low.name] * scale
  )


def _dtypes_of(jaxpr, name: str) -> list:
  return [
    [v.aval.dtype for v in eqn.invars] + [v.aval.dtype for v in eqn.outvars]
    for eqn in jaxpr.eqns
    if eqn.primitive.name == name
  ]


def test_the_gradient_of_sparse_values_is_a_sampled_product_in_the_low_dtype():
  operand = sparse.BCOO.fromdense(DENSE)

  def loss(data, x):
    return jnp.sum(sparse.BCOO((data, operand.indices), shape=DENSE.shape) @ x)

  grads = jaxamp.autocast(jax.grad(loss, argnums=(0, 1)), device_type="cpu")
  jaxpr = jax.make_jaxpr(grads)(operand.data, X).jaxpr
  (sampled,) = _dtypes_of(jaxpr, "bcoo_dot_general_sampled")
  assert sampled == [jnp.bfloat16, jnp.bfloat16, jnp.int32, jnp.bfloat16]
  assert all(
    dtype == jnp.bfloat16
    for dtypes in _dtypes_of(jaxpr, "bcoo_dot_general")
    for dtype in dtypes
    if dtype != jnp.int32
  )


def test_gradients_through_an_autocast_sparse_matmul_are_float32_and_close():
  operand = sparse.BCOO.fromdense(DENSE)

  def loss(data, x):
    out = sparse.BCOO((data, operand.indices), shape=DENSE.shape) @ x
    return jnp.sum(jnp.tanh(out))

  low = jax.grad(jaxamp.autocast(loss, device_type="cpu"), argnums=(0, 1))(operand.data, X)
  full = jax.grad(loss, argnums=(0, 1))(operand.data, X)
  for got, want in zip(low, full, strict=True):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=0.05)


def test_a_float8_policy_runs_sparse_matmuls_in_bfloat16_unquantized():
  operand = sparse.BCOO.fromdense(DENSE)
  fp8 = jaxamp.autocast(lambda s: s @ X, device_type="cuda", dtype=jnp.float8_e4m3fn)
  jaxpr = jax.make_jaxpr(fp8)(operand).jaxpr
  assert _dtypes_of(jaxpr, "bcoo_dot_general") == [
    [jnp.bfloat16, jnp.int32, jnp.bfloat16, jnp.bfloat16]
  ]


def test_a_rule_keyed_by_a_sparse_primitive_changes_its_row():
  policy = jaxamp.policy("cpu").with_rules({sparse.bcoo_dot_general_p: jnp.float32})
  operand = sparse.BCOO.fromdense(DENSE)
  out = jaxamp.autocast(lambda s: s @ X, policy=policy)(operand)
  assert out.dtype == jnp.float32
  assert policy.primitive_category(sparse.bcoo_dot_general_p) is Category.FLOAT32
  assert policy.primitive_category(sparse.bcsr_dot_general_p) is Category.LOWER


def test_the_sparse_rows_apply_once_jax_experimental_sparse_is_imported():
  # A fresh interpreter: this test module has imported jax.experimental.sparse already.
  script = textwrap.dedent(
    """
    import sys
    import jaxamp
    from jaxamp import Category
    policy = jaxamp.policy("cuda")
    assert "jax.experimental.sparse" not in sys.modules, "jaxamp imported it"
    names = {getattr(k, "name", None) for k in policy.table.primitive_categories}
    assert "bcoo_dot_general" not in names, names
    from jax.experimental import sparse
    assert policy.primitive_category(sparse.bcoo_dot_general_p) is Category.LOWER
    assert policy.primitive_category(sparse.csr_matvec_p) is Category.LOWER
    print("ok")
    """
  )
  result = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
  )
  assert result.stdout.strip() == "ok", result.stderr
