"""``op_calls`` on hand-built jaxprs: which eqns form one call of an op, how calls are numbered,
what a FLOAT32_INSIDE call returns its float32 results in (``OpExits``), and which runs of eqns
are recomputed softmaxes (``recomputed_runs``, ``segment``)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import compat
from jaxamp._src.autocast import op_calls, regions
from jaxamp._src.policies.policy import make_policy
from jaxamp._src.policies.table import Category

POLICY = make_policy("cpu", jnp.bfloat16)
X = jnp.ones((4, 8))


def calls_of(fun, *args, inside=None):
  """The eqns of ``fun``'s jaxpr and the op call of each, numbered from 0."""
  eqns = jax.make_jaxpr(fun)(*args).jaxpr.eqns
  marks = [regions.marks_of(eqn) for eqn in eqns]
  return eqns, op_calls.op_calls(eqns, marks, inside, POLICY, itertools.count())


def softmax_by_hand(x):
  with regions.op_region("softmax"):
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def instances(calls):
  return [call.instance if call is not None else None for call in calls]


# --- op_calls -------------------------------------------------------------------------------------


def test_eqns_outside_every_op_belong_to_no_call():
  _, calls = calls_of(lambda x: jnp.exp(x) * 2.0, X)
  assert calls == [None, None]


def test_the_eqns_of_one_op_region_form_one_call_of_its_category():
  _, calls = calls_of(softmax_by_hand, X)
  assert len(set(calls)) == 1
  assert calls[0].region.name == "softmax" and calls[0].category is Category.FLOAT32_INSIDE


def test_two_regions_of_one_op_are_two_calls_numbered_in_order():
  _, calls = calls_of(lambda x: softmax_by_hand(softmax_by_hand(x)), X)
  first, second = dict.fromkeys(instances(calls))
  assert first.endswith("#0") and second.endswith("#1")


def test_an_eqn_outside_the_op_ends_its_call():
  _, calls = calls_of(lambda x: softmax_by_hand(softmax_by_hand(x) * 2.0), X)
  assert calls.count(None) == 1 and len(set(instances(calls)) - {None}) == 2


def test_an_op_the_table_does_not_list_is_searched_inward_for_a_listed_one():
  def composite(x):
    with regions.op_region("my_composite"):  # no row, no default: a plain composition
      return softmax_by_hand(x) + 1.0

  _, calls = calls_of(composite, X)
  assert {call.region.name if call else None for call in calls} == {"softmax", None}


def test_eqns_of_a_kept_region_belong_to_no_call():
  def kept(x):
    with regions.autocast_disabled():
      return softmax_by_hand(x)

  _, calls = calls_of(kept, X)
  assert set(calls) == {None}


def test_inside_an_op_every_eqn_belongs_to_it():
  inside = op_calls.OpCall(regions.OpRegion("softmax", "s", None), "s#0", Category.FLOAT32)
  _, calls = calls_of(lambda x: jnp.exp(x) * 2.0, X, inside=inside)
  assert calls == [inside, inside]


def test_two_library_calls_from_one_line_are_two_calls():
  _, calls = calls_of(lambda x, y: [jnp.sum(v) for v in (x, y)], X, X)
  assert len(set(instances(calls)) - {None}) == 2


def test_a_library_call_is_one_call_of_its_outermost_listed_op():
  eqns, calls = calls_of(jax.nn.softmax, X)  # its sum is a listed op too
  assert len(eqns) > 1 and len(set(calls)) == 1 and calls[0].region.name == "softmax"


def marked(position, site="sum@site"):
  return regions.Marks(False, (regions.OpRegion("sum", site, None),), ((position,),))


def numbered_calls(eqns, marks):
  return instances(op_calls.op_calls(eqns, marks, None, POLICY, itertools.count()))


def test_a_position_going_back_at_one_site_starts_the_next_call():
  eqns = jax.make_jaxpr(lambda x: (jnp.exp(x), jnp.sin(x)))(X).jaxpr.eqns
  assert numbered_calls(eqns, [marked(10), marked(10)]) == ["sum@site#0", "sum@site#1"]


def test_a_position_going_back_on_a_value_the_call_computed_stays_in_the_call():
  eqns = jax.make_jaxpr(lambda x: jnp.sin(jnp.exp(x)))(X).jaxpr.eqns
  assert numbered_calls(eqns, [marked(10), marked(10)]) == ["sum@site#0", "sum@site#0"]


def test_a_position_moving_on_at_one_site_stays_in_the_call():
  eqns = jax.make_jaxpr(lambda x: (jnp.exp(x), jnp.sin(x)))(X).jaxpr.eqns
  assert numbered_calls(eqns, [marked(10), marked(20)]) == ["sum@site#0", "sum@site#0"]


def test_a_part_computed_apart_and_read_by_a_later_eqn_stays_in_the_call():
  # jnp.mean(x, where=m) is an inlined jit: all its eqns have one position; the count of the
  # where= elements is computed apart from the sum and read by the final division.
  eqns = jax.make_jaxpr(lambda x: jnp.exp(x) + jnp.sin(x))(X).jaxpr.eqns
  assert numbered_calls(eqns, [marked(10)] * 3) == ["sum@site#0"] * 3


def test_a_part_nothing_later_reads_starts_the_next_call():
  eqns = jax.make_jaxpr(lambda x: (jnp.exp(x), jnp.cos(jnp.sin(x))))(X).jaxpr.eqns
  assert numbered_calls(eqns, [marked(10)] * 3) == ["sum@site#0", "sum@site#1", "sum@site#1"]


def test_the_calls_of_an_inlined_op_from_one_site_in_a_loop_are_apart():
  _, calls = calls_of(lambda x: [jnp.mean(x[i], where=x[i] > 0) for i in range(2)], X)
  assert len(set(instances(calls)) - {None}) == 2


def test_another_site_starts_another_call():
  eqns = jax.make_jaxpr(lambda x: jnp.sin(jnp.exp(x)))(X).jaxpr.eqns
  marks = [marked(10, "sum@a"), marked(20, "sum@b")]
  assert numbered_calls(eqns, marks) == ["sum@a#0", "sum@b#1"]


def test_a_custom_fwd_region_is_native_whatever_the_policy():
  region = regions.OpRegion("softmax", "s", None, cast_to=np.dtype(np.float32))
  assert op_calls.op_category(region, POLICY) is Category.NATIVE


def test_an_unlisted_op_has_its_default_category():
  region = regions.OpRegion("not_in_any_table", "n", Category.FLOAT32)
  assert op_calls.op_category(region, POLICY) is Category.FLOAT32


def test_an_unlisted_op_without_a_default_is_a_plain_composition():
  region = regions.OpRegion("not_in_any_table", "n", None)
  assert op_calls.op_category(region, POLICY) is None


# --- OpExits --------------------------------------------------------------------------------------

BF16 = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
SCALE = jax.ShapeDtypeStruct((8,), jnp.float32)
F16 = jnp.dtype(jnp.float16)


def _traced(*shape: int, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  """The aval a value leaving an op was traced with."""
  return jax.ShapeDtypeStruct(shape, dtype)


def test_a_float32_result_leaves_in_its_main_inputs_dtype():
  exits = op_calls.OpExits()
  exits.note_entering("norm#0", [BF16, SCALE], stateful=False)
  assert exits.exit_dtype("norm#0", _traced(4, 8), jnp.float32) == jnp.bfloat16


def test_the_main_input_is_the_largest_floating_one():
  exits = op_calls.OpExits()
  exits.note_entering("norm#0", [SCALE, BF16], stateful=False)
  assert exits.exit_dtype("norm#0", _traced(8), jnp.float32) == jnp.bfloat16


def test_integer_inputs_are_never_the_main_input():
  exits = op_calls.OpExits()
  exits.note_entering("loss#0", [jax.ShapeDtypeStruct((64,), jnp.int32), BF16], stateful=False)
  assert exits.exit_dtype("loss#0", _traced(4, 8), jnp.float32) == jnp.bfloat16


def test_a_result_not_in_float32_leaves_as_it_is():
  exits = op_calls.OpExits()
  exits.note_entering("norm#0", [BF16], stateful=False)
  assert exits.exit_dtype("norm#0", _traced(4, 8), jnp.float16) is None


def test_a_call_with_no_floating_input_leaves_its_results_as_they_are():
  exits = op_calls.OpExits()
  exits.note_entering("argmax#0", [jax.ShapeDtypeStruct((4,), jnp.int32)], stateful=False)
  assert exits.exit_dtype("argmax#0", _traced(4), jnp.float32) is None


def test_a_stateful_ops_outputs_shaped_like_its_state_stay_float32():
  exits = op_calls.OpExits()
  exits.note_entering("batch_norm#0", [BF16, SCALE], stateful=True)
  assert exits.exit_dtype("batch_norm#0", _traced(8), jnp.float32) is None
  assert exits.exit_dtype("batch_norm#0", _traced(4, 8), jnp.float32) == jnp.bfloat16


def test_a_stateful_ops_state_leaves_in_its_traced_16_bit_dtype():
  # A float16 layer's running statistics: computed in float32 inside, traced as float16.
  exits = op_calls.OpExits()
  exits.note_entering("batch_norm#0", [BF16, SCALE], stateful=True)
  assert exits.exit_dtype("batch_norm#0", _traced(8, dtype=jnp.float16), jnp.float32) == F16


def test_inputs_noted_in_several_steps_add_up():
  exits = op_calls.OpExits()
  exits.note_entering("norm#0", [SCALE], stateful=False)
  exits.note_entering("norm#0", [BF16], stateful=False)
  assert exits.exit_dtype("norm#0", _traced(4, 8), jnp.float32) == jnp.bfloat16


# --- recomputed runs and their segments -----------------------------------------------------------


def test_the_eqns_of_a_softmax_call_are_one_recomputed_run():
  _, calls = calls_of(lambda x: softmax_by_hand(x) * 2.0, X)
  assert op_calls.recomputed_runs(calls) == {0: len(calls) - 1}


def test_two_softmax_calls_in_a_row_are_two_runs():
  _, calls = calls_of(lambda x: softmax_by_hand(softmax_by_hand(x)), X)
  half = len(calls) // 2
  assert op_calls.recomputed_runs(calls) == {0: half, half: len(calls)}


def test_a_float32_op_is_not_recomputed():
  def loss(x):
    with regions.op_region("mse_loss"):
      return jnp.mean(x**2)

  _, calls = calls_of(loss, X)
  assert op_calls.recomputed_runs(calls) == {}


def test_a_segment_reads_its_inputs_from_outside_and_returns_what_is_read_after_it():
  jaxpr = jax.make_jaxpr(lambda x: softmax_by_hand(x * 2.0) + 1.0)(X).jaxpr
  eqns = jaxpr.eqns
  last_read = {a: i for i, eqn in enumerate(eqns) for a in eqn.invars if not compat.is_literal(a)}
  part = op_calls.segment(eqns, 1, len(eqns) - 1, last_read)
  assert part.invars == eqns[0].outvars
  assert part.outvars == eqns[-2].outvars
  assert part.eqns == eqns[1:-1]


def test_a_run_with_effects_is_no_segment():
  def printing(x):
    jax.debug.print("{}", x)
    return x

  eqns = jax.make_jaxpr(printing)(X).jaxpr.eqns
  assert op_calls.segment(eqns, 0, len(eqns), {}) is None
