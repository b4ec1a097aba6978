"""What each dim of a value varies along, through layout changes (``dataflow.layout_dims``),
and when an addend is a matmul's bias (``dataflow.is_bias_of``), on hand-built jaxprs."""

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._src.autocast import dataflow

OWN, OTHER, LHS, RHS, NOWHERE = (
  dataflow.OWN,
  dataflow.OTHER,
  dataflow.LHS,
  dataflow.RHS,
  dataflow.NOWHERE,
)


def only_eqn(fun, *args):
  (eqn,) = jax.make_jaxpr(fun)(*args).jaxpr.eqns
  return eqn


def test_a_transpose_moves_the_dims():
  eqn = only_eqn(lambda x: x.T, jnp.ones((2, 3)))
  assert dataflow.layout_dims(eqn, (LHS, RHS)) == (RHS, LHS)


def test_a_broadcasts_new_and_stretched_dims_vary_along_nothing():
  eqn = only_eqn(lambda b: lax.broadcast_in_dim(b, (5, 3, 4), (0, 1)), jnp.ones((1, 3)))
  assert dataflow.layout_dims(eqn, (NOWHERE, OWN)) == (NOWHERE, OWN, NOWHERE)


def test_a_reshape_merging_dims_unites_what_they_vary_along():
  eqn = only_eqn(lambda x: x.reshape(6, 4), jnp.ones((2, 3, 4)))
  assert dataflow.layout_dims(eqn, (OTHER, LHS, RHS)) == (OTHER | LHS, RHS)


def test_a_reshape_splitting_a_dim_shares_it():
  eqn = only_eqn(lambda x: x.reshape(2, 3, 4), jnp.ones((6, 4)))
  assert dataflow.layout_dims(eqn, (LHS, RHS)) == (LHS, LHS, RHS)


def test_a_reshape_adding_unit_dims_leaves_them_varying_along_nothing():
  eqn = only_eqn(lambda x: x.reshape(1, 4, 1), jnp.ones((4,)))
  assert dataflow.layout_dims(eqn, (OWN,)) == (NOWHERE, OWN, NOWHERE)


def test_a_squeeze_drops_the_dims():
  eqn = only_eqn(lambda x: x.squeeze(0), jnp.ones((1, 4)))
  assert dataflow.layout_dims(eqn, (NOWHERE, RHS)) == (RHS,)


def test_a_dots_output_dims_are_batch_then_lhs_then_rhs_free_dims():
  eqn = only_eqn(
    lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4))
  )
  assert dataflow.matmul_dims(eqn) == (OTHER, LHS, RHS)


def test_a_convs_output_features_come_from_the_kernel():
  eqn = only_eqn(
    lambda x, k: lax.conv(x, k, (1, 1), "SAME"), jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
  )
  assert dataflow.matmul_dims(eqn) == (OTHER, RHS, OTHER, OTHER)


def test_a_bias_varies_along_one_operands_free_dims_only():
  out = (OTHER, LHS, RHS)
  assert dataflow.is_bias_of(out, (NOWHERE, NOWHERE, OWN))
  assert dataflow.is_bias_of(out, (NOWHERE, OWN, NOWHERE))
  assert dataflow.is_bias_of(out, (NOWHERE, NOWHERE, NOWHERE))  # a scalar
  assert not dataflow.is_bias_of(out, (NOWHERE, OWN, OWN))  # a mask over queries and keys
  assert not dataflow.is_bias_of(out, (OWN, NOWHERE, OWN))  # a mask over the batch
