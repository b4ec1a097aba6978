"""``dataflow`` on hand-built jaxprs: where values come from (``Provenance``: parameters,
activations, computed values, Python scalars and fills), which casts saturate, what each dim of
a value varies along (``layout_dims``, ``matmul_dims``) and when an addend is a matmul's bias
(``is_bias_of``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import compat
from jaxamp._src.autocast import dataflow

OWN, OTHER, LHS, RHS, NOWHERE = (
  dataflow.OWN,
  dataflow.OTHER,
  dataflow.LHS,
  dataflow.RHS,
  dataflow.NOWHERE,
)


X, W, B = jnp.ones((4, 8)), jnp.ones((8, 5)), jnp.ones((5,))


def only_eqn(fun, *args):
  (eqn,) = jax.make_jaxpr(fun)(*args).jaxpr.eqns
  return eqn


def facts_of(fun, *args):
  """``fun``'s jaxpr and the provenance of its values, gathered as the interpreter does (every
  dot a low-precision matmul)."""
  jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
  facts = dataflow.Provenance()
  facts.reads = (dataflow.input_reads(jaxpr),)
  for eqn in jaxpr.eqns:
    if eqn.primitive is compat.primitives.dot_general_p:
      facts.note_matmul(eqn)
    facts.note_weak_flow(eqn)
    facts.note(eqn)
  return jaxpr, facts


def eqn_named(jaxpr, name):
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == name]
  return eqn


# --- activation_reads -----------------------------------------------------------------------------


def test_the_operands_of_a_dot_are_activations_and_its_bias_is_not():
  jaxpr = jax.make_jaxpr(lambda x, w, b: x @ w + b)(X, W, B).jaxpr
  x, w, b = jaxpr.invars
  assert dataflow.activation_reads(jaxpr) == {x, w}
  assert b not in dataflow.activation_reads(jaxpr)


def test_a_value_read_through_a_layout_change_is_read_at_its_root():
  jaxpr = jax.make_jaxpr(lambda x, v: x * v.reshape(1, 8))(X, jnp.ones(8)).jaxpr
  assert jaxpr.invars[1] in dataflow.activation_reads(jaxpr)


def test_a_value_a_sub_jaxpr_only_adds_is_not_an_activation():
  jaxpr = jax.make_jaxpr(lambda x, b: jax.jit(lambda x, b: x + b)(x, b))(X, jnp.ones(8)).jaxpr
  assert dataflow.activation_reads(jaxpr) == set()


def test_a_value_a_sub_jaxpr_computes_with_is_an_activation():
  jaxpr = jax.make_jaxpr(lambda x, v: x + jax.jit(lambda v: v * 2.0)(v))(X, jnp.ones(8)).jaxpr
  assert dataflow.activation_reads(jaxpr) == {jaxpr.invars[1]}


def test_a_bodys_activations_are_computed_once_per_jaxpr():
  jaxpr = jax.make_jaxpr(lambda x, w: x @ w)(X, W).jaxpr
  assert dataflow.body_activations(jaxpr) is dataflow.body_activations(jaxpr)


# --- Provenance: parameters, computed values, roots -----------------------------------------------


def test_a_layout_change_and_a_cast_keep_their_inputs_root():
  jaxpr, facts = facts_of(lambda b: b.astype(jnp.bfloat16).reshape(1, 5), B)
  (b,) = jaxpr.invars
  assert [facts.root(eqn.outvars[0]) for eqn in jaxpr.eqns] == [b, b]


def test_an_added_parameter_is_a_parameter_through_its_broadcast():
  jaxpr, facts = facts_of(lambda x, w, b: x @ w + b, X, W, B)
  broadcast = eqn_named(jaxpr, "broadcast_in_dim").outvars[0]
  product = eqn_named(jaxpr, "dot_general").outvars[0]
  assert facts.is_added_parameter(jaxpr.invars[2], product)
  assert facts.is_added_parameter(broadcast, product)


def test_an_input_the_product_is_computed_with_is_not_an_added_parameter():
  jaxpr, facts = facts_of(lambda x, w: x + jnp.tanh(x) @ w, X, jnp.ones((8, 8)))
  product = eqn_named(jaxpr, "dot_general").outvars[0]
  assert facts.is_parameter(jaxpr.invars[0])  # passed in, not computed
  assert not facts.is_added_parameter(jaxpr.invars[0], product)  # x + W @ tanh(x): a residual


# --- input_reads ----------------------------------------------------------------------------------


def test_a_value_is_computed_with_the_inputs_read_on_its_way():
  jaxpr = jax.make_jaxpr(lambda x, w, b: jnp.tanh(x @ w + b))(X, W, B).jaxpr
  reads = dataflow.input_reads(jaxpr)
  x, w, b = jaxpr.invars
  (out,) = jaxpr.outvars
  assert all(reads.computes_with(out, var) for var in (x, w))


def test_a_value_is_not_computed_with_an_input_only_added_on_its_way():
  # A bias the steps of an unrolled loop share: added, never read otherwise on the way.
  jaxpr = jax.make_jaxpr(lambda x, w, b: jnp.tanh(x @ w + b) @ w.T)(X, W, B).jaxpr
  reads = dataflow.input_reads(jaxpr)
  assert not reads.computes_with(jaxpr.outvars[0], jaxpr.invars[2])


def test_a_value_is_not_computed_with_an_input_read_beside_it():
  jaxpr = jax.make_jaxpr(lambda x, w, b: (x @ w, jnp.sum(b**2)))(X, W, B).jaxpr
  reads = dataflow.input_reads(jaxpr)
  assert not reads.computes_with(jaxpr.outvars[0], jaxpr.invars[2])


def test_an_input_a_sub_jaxpr_computes_with_is_read_by_its_outputs():
  fun = lambda x, b: x + jax.jit(lambda b: b * 2.0)(b)
  jaxpr = jax.make_jaxpr(fun)(X, jnp.ones(8)).jaxpr
  call = eqn_named(jaxpr, "jit")
  assert dataflow.input_reads(jaxpr).computes_with(call.outvars[0], jaxpr.invars[1])


def test_a_computed_value_is_computed_and_not_a_parameter():
  jaxpr, facts = facts_of(lambda x: jnp.exp(x), X)
  (out,) = jaxpr.outvars
  assert facts.is_computed(out) and not facts.is_parameter(out)


def test_inputs_and_literals_are_not_computed():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  (mul,) = jaxpr.eqns
  assert not facts.is_computed(mul.invars[0]) and not facts.is_computed(mul.invars[1])


def test_a_layout_change_of_a_low_precision_matmuls_output_stays_low():
  jaxpr, facts = facts_of(lambda x, w: (x @ w).T, X, W)
  assert facts.lowered == {eqn.outvars[0] for eqn in jaxpr.eqns}


def test_a_matmuls_output_varies_along_its_operands_free_dims_through_a_transpose():
  jaxpr, facts = facts_of(lambda x, w: (x @ w).T, X, W)
  assert facts.dims_of(jaxpr.outvars[0]) == (RHS, LHS)


def test_a_value_of_no_recorded_dims_varies_along_its_own_dims_but_unit_ones():
  jaxpr, facts = facts_of(lambda x: x, jnp.ones((4, 1, 3)))
  assert facts.dims_of(jaxpr.invars[0]) == (OWN, NOWHERE, OWN)


# --- Provenance: Python scalars, fills, saturating casts ------------------------------------------


def test_a_broadcast_literal_is_a_fill_and_weak():
  jaxpr, facts = facts_of(lambda x: jnp.maximum(x, jnp.zeros_like(x)), X)
  fill = eqn_named(jaxpr, "broadcast_in_dim").outvars[0]
  assert fill in facts.fills and facts.is_weak(fill)


def test_a_layout_change_of_a_fill_is_weak():
  jaxpr, facts = facts_of(lambda x: x + jnp.zeros((8, 4)).T, X)
  assert facts.is_weak(eqn_named(jaxpr, "transpose").outvars[0])


def fill_roles(fun, operands: dict[str, int]) -> dict[str, tuple[bool, bool]]:
  """(is a fill, follows its partner) of one operand of each named eqn of ``fun(X)``."""
  jaxpr, facts = facts_of(fun, X)
  roles = {}
  for name, position in operands.items():
    eqn = eqn_named(jaxpr, name)
    roles[name] = (facts.is_fill(eqn.invars[position]), facts.follows_partner(eqn, position))
  return roles


def test_a_fill_stands_for_a_scalar_where_torch_takes_one():
  def fun(x):
    fill = jnp.zeros((4, 8))
    return (
      lax.select(x > 0, x, fill),
      jnp.maximum(x, fill),
      lax.clamp(fill, x, fill + 1),
      lax.dynamic_update_slice(x, jnp.zeros((1, 8)), (0, 0)),
      x.at[0].add(jnp.zeros(8)),
    )

  operands = {"select_n": 1, "max": 1, "clamp": 0, "dynamic_update_slice": 1, "scatter-add": 2}
  assert fill_roles(fun, operands) == dict.fromkeys(operands, (True, True))


def test_a_fill_is_an_array_of_its_dtype_as_an_accumulator_buffer_or_block():
  # torch.zeros(shape) is float32: added to, scattered or written into, or concatenated, it
  # promotes a 16-bit partner.
  def fun(x):
    fill = jnp.zeros((4, 8))
    return (
      fill + x,
      jax.ops.segment_sum(x, jnp.array([0, 0, 1, 1]), num_segments=4),
      lax.dynamic_update_slice(fill, x[:1], (0, 0)),
      jnp.concatenate([fill, x]),
    )

  operands = {"add": 0, "scatter-add": 0, "dynamic_update_slice": 0, "concatenate": 0}
  assert fill_roles(fun, operands) == dict.fromkeys(operands, (True, False))


def test_a_fill_made_like_a_prototype_follows_its_partner_everywhere():
  # torch's zeros_like / ones_like / full_like / empty_like take the prototype's run-time dtype.
  def fun(x):
    return (
      jnp.zeros_like(x) + x,
      jnp.concatenate([jnp.ones_like(x), x]),
      lax.dynamic_update_slice(jnp.full_like(x, 2.0), x[:1], (0, 0)),
      jnp.empty_like(x).T @ x,
    )

  operands = {"add": 0, "concatenate": 0, "dynamic_update_slice": 0, "dot_general": 0}
  assert fill_roles(fun, operands) == dict.fromkeys(operands, (True, True))


def test_a_fill_of_a_given_shape_is_not_made_like_a_prototype():
  jaxpr, facts = facts_of(lambda x: jnp.zeros((4, 8), x.dtype) + x, X)
  add = eqn_named(jaxpr, "add")
  assert not facts.is_like(add.invars[0]) and not facts.follows_partner(add, 0)


def test_a_broadcast_rank_0_value_follows_its_partner_everywhere():
  jaxpr, facts = facts_of(lambda x, s: x + jnp.broadcast_to(s, (4, 8)), X, jnp.float32(2.0))
  add = eqn_named(jaxpr, "add")
  assert not facts.is_fill(add.invars[1]) and facts.follows_partner(add, 1)


def test_a_rank_0_array_is_weak_as_torchs_0_dim_tensors():
  jaxpr, facts = facts_of(lambda x, s: x * s, X, jnp.float32(2.0))
  assert facts.is_weak(jaxpr.invars[1])


def test_a_python_float_passed_in_is_weak():
  jaxpr, facts = facts_of(lambda x, s: x * s, X, 3.0)
  assert jaxpr.invars[1].aval.weak_type and facts.is_weak(jaxpr.invars[1])


def test_an_array_passed_in_is_not_weak():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  assert not facts.is_weak(jaxpr.invars[0])


def test_a_literal_is_weak():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  assert facts.is_weak(jaxpr.eqns[0].invars[1])


def test_a_broadcast_of_a_rank_0_value_is_weak():
  jaxpr, facts = facts_of(lambda x, s: x * jnp.broadcast_to(s, (4, 8)), X, jnp.float32(2.0))
  assert facts.is_weak(eqn_named(jaxpr, "broadcast_in_dim").outvars[0])


def test_an_array_with_dims_is_not_weak_however_jax_types_it():
  # torch: -1e9 * mask is a float32 tensor, which promotes; JAX types it weakly.
  mask = -1e9 * (jnp.arange(8) > 3)
  jaxpr, facts = facts_of(lambda m: m, mask)
  assert jaxpr.invars[0].aval.weak_type and not facts.is_weak(jaxpr.invars[0])


def test_a_cast_of_a_fill_saturates():
  jaxpr, facts = facts_of(lambda x: x + jnp.full((4, 8), -3e38), X)
  assert facts.saturates(eqn_named(jaxpr, "broadcast_in_dim").outvars[0])


def test_a_cast_of_a_computed_scalar_does_not_saturate():
  jaxpr, facts = facts_of(lambda x: x / jnp.sum(x), X)
  total = eqn_named(jaxpr, "reduce_sum").outvars[0]
  assert facts.is_weak(total) and not facts.saturates(total)  # it overflows, as in torch


def test_a_cast_of_an_activation_does_not_saturate():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  assert not facts.saturates(jaxpr.invars[0])


def test_the_constant_of_a_literal_is_its_value():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  assert facts.constant(jaxpr.eqns[0].invars[1]) == 2.0


def test_a_rank_0_input_has_the_constant_given_for_it_through_a_cast():
  jaxpr, facts = facts_of(lambda x, s: x * s, X, 2.0)
  facts.constants[jaxpr.invars[1]] = 2.0
  convert = eqn_named(jaxpr, "convert_element_type")
  assert facts.constant(convert.outvars[0]) == 2.0


def test_an_array_has_no_constant():
  jaxpr, facts = facts_of(lambda x: x * 2.0, X)
  assert facts.constant(jaxpr.invars[0]) is None


def test_the_carried_facts_are_those_of_the_atoms_alone():
  jaxpr, facts = facts_of(lambda x, w, b: (x @ w + b, jnp.zeros((3,))), X, W, B)
  out = jaxpr.eqns[0].outvars[0]  # the dot's output
  fill = jaxpr.outvars[1]
  carried = facts.carried([out])
  assert carried.lowered == {out} and carried.dims == {out: (LHS, RHS)}
  assert fill in facts.fills and not carried.fills and not carried.weak


def test_the_carried_facts_keep_an_atoms_root():
  jaxpr, facts = facts_of(lambda b: b.reshape(1, 5) * 2.0, B)
  reshaped = eqn_named(jaxpr, "reshape").outvars[0]
  assert facts.carried([reshaped]).root(reshaped) is jaxpr.invars[0]


def test_a_rank_zero_value_is_weak_without_provenance():
  jaxpr = jax.make_jaxpr(lambda x, s: x * s)(X, np.float32(2.0)).jaxpr
  x, s = jaxpr.invars
  facts = dataflow.Provenance()
  assert facts.is_weak(s) and not facts.is_weak(x)


# --- what each dim varies along -------------------------------------------------------------------


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


def test_a_squeeze_of_a_negative_dim_drops_it_counted_from_the_end():
  eqn = only_eqn(lambda x: lax.squeeze(x, (-1,)), jnp.ones((4, 1)))
  assert dataflow.layout_dims(eqn, (LHS, NOWHERE)) == (LHS,)


def test_a_cast_keeps_the_dims():
  eqn = only_eqn(lambda x: x.astype(jnp.bfloat16), jnp.ones((4, 5)))
  assert dataflow.layout_dims(eqn, (LHS, RHS)) == (LHS, RHS)


BATCH = frozenset({"batch"})
STACKED_RHS = frozenset({"batch", "stacked rhs"})


def test_a_dots_output_dims_are_batch_then_lhs_then_rhs_free_dims():
  eqn = only_eqn(
    lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4))
  )
  assert dataflow.matmul_dims(eqn, [False, False]) == (BATCH, LHS, RHS)


def test_a_dots_batch_dims_name_the_operands_passed_in():
  eqn = only_eqn(
    lambda x, w: jnp.einsum("eni,eio->eno", x, w), jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
  )
  assert dataflow.matmul_dims(eqn, [False, True]) == (STACKED_RHS, LHS, RHS)
  both = frozenset({"batch", "stacked lhs", "stacked rhs"})
  assert dataflow.matmul_dims(eqn, [True, True]) == (both, LHS, RHS)


def test_a_convs_output_features_come_from_the_kernel():
  eqn = only_eqn(
    lambda x, k: lax.conv(x, k, (1, 1), "SAME"), jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
  )
  assert dataflow.matmul_dims(eqn, [False, True]) == (OTHER, RHS, OTHER, OTHER)


def test_a_bias_varies_along_one_operands_free_dims_only():
  out, shape = (BATCH, LHS, RHS), (2, 5, 6)
  assert dataflow.is_bias_of(out, (NOWHERE, NOWHERE, OWN), shape)
  assert dataflow.is_bias_of(out, (NOWHERE, OWN, NOWHERE), shape)
  assert dataflow.is_bias_of(out, (NOWHERE, NOWHERE, NOWHERE), shape)  # a scalar
  assert not dataflow.is_bias_of(out, (NOWHERE, OWN, OWN), shape)  # a mask over queries and keys
  assert not dataflow.is_bias_of(out, (OWN, NOWHERE, OWN), shape)  # a mask over the batch
  assert not dataflow.is_bias_of((OTHER, RHS), (OWN, OWN), (5, 6))  # a conv bias over the batch


def test_an_ensembles_bias_varies_along_the_batch_dims_its_stacked_weight_brings():
  out, shape = (STACKED_RHS, LHS, RHS), (3, 5, 6)  # vmap(lambda w, b, x: x @ w + b), w passed in
  assert dataflow.is_bias_of(out, (OWN, NOWHERE, OWN), shape)
  assert not dataflow.is_bias_of(out, (OWN, OWN, NOWHERE), shape)  # along the inputs' rows
  assert not dataflow.is_bias_of(out, (OWN, NOWHERE, NOWHERE), shape)  # a scalar per member
  # vmapped attention: a padding mask over the batch and the keys of computed k is no bias
  assert not dataflow.is_bias_of((BATCH, LHS, RHS), (OWN, NOWHERE, OWN), shape)


def test_the_bias_of_an_ensembles_one_feature_layer_is_one_value_per_member():
  out = (STACKED_RHS, LHS, RHS)  # a stack of value heads, Dense(1): one output feature each
  assert dataflow.is_bias_of(out, (OWN, NOWHERE, NOWHERE), (3, 5, 1))
  assert not dataflow.is_bias_of(out, (OWN, OWN, NOWHERE), (3, 5, 1))  # along the inputs' rows
  assert not dataflow.is_bias_of((BATCH, LHS, RHS), (OWN, NOWHERE, NOWHERE), (3, 5, 1))
