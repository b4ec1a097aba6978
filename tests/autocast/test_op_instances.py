"""One call of a library op is one op instance, whatever the call site.

Calls are told apart by the call itself: two calls from one source line (a list comprehension,
a loop) and two linen module calls (whose caller is always flax's wrapper) are two instances,
each returning its own input's dtype. Only stateful ops (batch_norm) keep outputs shaped like
their state in float32.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp

W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8))
Y = jax.random.normal(jax.random.key(2), (3, 8))
X16, Y16 = X.astype(jnp.bfloat16), Y.astype(jnp.bfloat16)  # activations a layer made 16-bit


@pytest.mark.parametrize("op", [jax.nn.softmax, jax.nn.log_softmax, jnp.mean, jnp.sum])
@pytest.mark.slow
def test_two_calls_from_one_line_are_two_instances(op):
  fun = jaxamp.autocast(lambda *xs: [op(x) for x in xs], device_type="cpu")
  assert [o.dtype for o in fun(X16, Y16)] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.parametrize("op", [jax.nn.softmax, jax.nn.log_softmax, jnp.mean, jnp.sum])
def test_two_calls_from_one_line_after_dots_are_two_instances(op):
  fun = jaxamp.autocast(lambda w, *xs: [op(x @ w) for x in xs], device_type="cpu")
  assert [o.dtype for o in fun(W, X, Y)] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.slow
def test_calls_in_a_loop_each_return_their_inputs_dtype():
  def repeated(x, w):
    outs = []
    for h in (x @ w, (x @ w)[:2], x @ w @ w):
      outs.append(jax.nn.softmax(h))
    return outs

  outs = jaxamp.autocast(repeated, device_type="cpu")(X, W)
  assert [o.dtype for o in outs] == [jnp.bfloat16] * 3


class CrossAttentionNorms(nn.Module):
  """The query and context pre-norms of a cross-attention block: two linen LayerNorm calls."""

  @nn.compact
  def __call__(self, queries, context):
    return nn.LayerNorm()(queries), nn.LayerNorm()(context)


@pytest.mark.slow
def test_two_linen_layer_norms_in_one_module_are_two_instances():
  module = CrossAttentionNorms()
  variables = module.init(jax.random.key(3), X, Y)
  outs = jaxamp.autocast(module.apply, device_type="cpu")(variables, X16, Y16)
  assert [o.dtype for o in outs] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.slow
def test_two_nnx_layer_norms_are_two_instances():
  norms = [nnx.LayerNorm(8, rngs=nnx.Rngs(0)) for _ in range(2)]
  fun = jaxamp.autocast(
    lambda ns, x, y: [n(h) for n, h in zip(ns, (x, y), strict=True)], device_type="cpu"
  )
  assert [o.dtype for o in fun(norms, X16, Y16)] == [jnp.bfloat16, jnp.bfloat16]


def test_one_call_on_a_multi_line_statement_is_one_instance():
  # log_softmax's log(sum(exp(...))) spans lines traced out of order; it stays one op.
  jaxpr = jax.make_jaxpr(
    jaxamp.autocast(lambda x, w: jax.nn.log_softmax(x @ w), device_type="cpu")
  )(X, W)
  text = str(jaxpr)
  assert text.count("remat2") == 1  # one recomputed instance


@pytest.mark.slow
def test_batch_norm_state_stays_float32_and_its_output_is_low():
  module = nn.BatchNorm(use_running_average=False)
  variables = module.init(jax.random.key(4), X)
  fun = jaxamp.autocast(
    lambda v, x, w: module.apply(v, x @ w, mutable=["batch_stats"]), device_type="cpu"
  )
  out, state = fun(variables, X, W)
  assert out.dtype == jnp.bfloat16
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_a_non_stateful_op_returns_every_output_in_its_inputs_dtype():
  # Outputs shaped unlike the main input are results too, for ops without state: a row-wise
  # statistic of softmax-normalised values leaves in the input's dtype.
  def two_outputs(x, w):
    h = x @ w
    return jax.nn.softmax(h), jax.nn.softmax(h[:1, :3])

  outs = jaxamp.autocast(two_outputs, device_type="cpu")(X, W)
  assert [o.dtype for o in outs] == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.parametrize("op", [jax.nn.softmax, jnp.sum, jnp.mean])
def test_consecutive_calls_on_values_computed_before_are_two_instances(op):
  def fun(x, y, w):
    a, b = x @ w, y @ w
    return [op(a), op(b)]

  outs = jaxamp.autocast(fun, device_type="cpu")(X, Y, W)
  assert [o.dtype for o in outs] == [jnp.bfloat16, jnp.bfloat16]
