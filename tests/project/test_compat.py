"""Every JAX internal jaxamp uses still exists: an upgrade that removes one fails here, loudly;
and the JAX behaviours compat.py works around stay worked around."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as _pe

from jaxamp._src import compat


@pytest.mark.parametrize("name", sorted(compat.REQUIRED_INTERNALS))
def test_required_jax_internal_exists(name):
  assert compat.REQUIRED_INTERNALS[name]() is not None, name


def test_an_eager_bind_is_strongly_typed_where_its_trace_is():
  # jax 0.10.0 caches eager binds without weak types: a strong fill after a weak one came out
  # weak. compat.bind types a concrete output as the traced one.
  jaxpr = jax.make_jaxpr(
    lambda: (jnp.full((3, 5), 0.0), jnp.full((3, 5), jnp.finfo(jnp.float32).min))
  )().jaxpr
  weak, strong = (compat.bind(eqn, [eqn.invars[0].val])[0] for eqn in jaxpr.eqns)
  assert jax.typeof(weak).weak_type
  assert not jax.typeof(strong).weak_type


# --- jaxamp's own primitives: lowered by JAX's rules, nothing traced per shape ------------------


def _exp_lowering(ctx, x):
  return compat.lower_as(ctx, compat.primitives.exp_p, [x], ctx.avals_in, ctx.avals_out)


exp_like_p = compat.unary_primitive(
  "test_exp_like", _exp_lowering, lambda aval: aval, lambda t, x: t * jnp.exp(x)
)


def test_a_unary_primitive_runs_eagerly_jitted_and_vmapped_as_its_lowering():
  x = jnp.arange(6.0).reshape(2, 3) / 4
  expected = jnp.exp(x)
  np.testing.assert_allclose(exp_like_p.bind(x), expected, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(exp_like_p.bind)(x), expected, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(exp_like_p.bind)(x), expected, rtol=1e-6)


def test_a_unary_primitive_is_differentiated_by_its_jvp():
  grad = jax.grad(lambda x: exp_like_p.bind(x).sum())(jnp.ones(3))
  np.testing.assert_allclose(grad, jnp.exp(jnp.ones(3)), rtol=1e-6)


def test_lower_as_emits_each_platforms_rule_when_lowering_for_several():
  lower = jax.jit(exp_like_p.bind).trace(jnp.ones(3)).lower
  assert "exponential" in lower(lowering_platforms=("cpu", "cuda", "tpu")).as_text()


def test_lowering_a_primitive_by_lower_as_traces_no_jaxpr():
  lowered = jax.jit(exp_like_p.bind).trace(jnp.ones((4, 5))).lower  # traced before counting
  with mock.patch.object(_pe, "trace_to_jaxpr_dynamic", wraps=_pe.trace_to_jaxpr_dynamic) as trace:
    text = lowered().as_text()
  assert "exponential" in text and trace.call_count == 0


def test_a_platform_identity_is_its_barrier_only_when_lowered_for_its_platform():
  barrier = compat.primitives.optimization_barrier_p
  identity_p = compat.platform_identity("test_platform_identity", "cpu", barrier)
  traced = jax.jit(lambda x: identity_p.bind(x) * 2).trace(jnp.ones(3))
  assert "optimization_barrier" in traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "optimization_barrier" not in traced.lower(lowering_platforms=("cuda",)).as_text()
  both = traced.lower(lowering_platforms=("cpu", "cuda")).as_text()  # a case per platform
  assert "optimization_barrier" in both and "stablehlo.case" in both
  np.testing.assert_array_equal(jax.grad(lambda x: identity_p.bind(x).sum())(jnp.ones(3)), 1.0)


# --- call_staged: one jit per operation while linearizing, a plain call otherwise ---------------


def _staged_calls(f, x):
  """(the value of f(x), the keys compat.staged was asked for while computing it)."""
  keys = []
  original = compat.staged

  def recording(key, make):
    keys.append(key)
    return original(key, make)

  with mock.patch.object(compat, "staged", recording):
    return f(x), keys


def test_call_staged_calls_the_function_directly_when_not_linearizing():
  value, keys = _staged_calls(lambda x: compat.call_staged(("test", "sin"), jnp.sin, x), 1.0)
  np.testing.assert_allclose(value, np.sin(1.0), rtol=1e-6)
  assert keys == []


def test_call_staged_goes_through_one_jit_per_key_while_linearizing():
  compat.clear_staged()
  f = lambda x: (
    compat.call_staged(("test", "sin"), jnp.sin, x)
    * compat.call_staged(("test", "sin"), jnp.sin, 2 * x)
  )
  grad, keys = _staged_calls(jax.grad(f), 1.0)
  np.testing.assert_allclose(grad, np.cos(1.0) * np.sin(2.0) + 2 * np.sin(1.0) * np.cos(2.0))
  assert keys == [("test", "sin"), ("test", "sin")]
  assert compat.staged(("test", "sin"), lambda: None) is compat.staged(("test", "sin"), jnp.cos)


def _converts(fun, *args):
  """The converts in ``fun``'s jaxpr and the bodies it calls (``jnp.where``'s jit)."""

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "convert_element_type":
        yield eqn
      for body in compat.sub_jaxprs(eqn):
        yield from walk(body)

  return list(walk(jax.make_jaxpr(fun)(*args).jaxpr))


@pytest.mark.parametrize(
  "spelling",
  [
    lambda n: n.astype(jnp.float32),
    lambda n: jnp.astype(n, jnp.float32),
    lambda n: jnp.asarray(n, jnp.float32),
    lambda n: jax.lax.convert_element_type(n, jnp.float32),
  ],
)
def test_a_conversion_the_caller_asks_for_is_a_requested_cast(spelling):
  (convert,) = _converts(spelling, jnp.arange(4))
  assert compat.is_requested_cast(convert)


@pytest.mark.parametrize(
  "spelling",
  [lambda h, n: h / n, lambda h, n: h * n, lambda h, n: jnp.where(h > 0, h, n)],
)
def test_jnps_promotion_of_an_operand_is_no_requested_cast(spelling):
  (convert,) = _converts(spelling, jnp.ones(4), jnp.arange(4))
  assert not compat.is_requested_cast(convert)


def test_jaxs_and_jaxamps_primitives_are_jaxs_own_and_a_librarys_is_not():
  from jax.experimental import sparse  # a JAX module imported after the first scan
  from jax.extend.core import Primitive

  assert compat.is_jax_primitive(compat.primitives.add_p)
  assert compat.is_jax_primitive(compat.primitives.remat_opt_p)
  assert compat.is_jax_primitive(exp_like_p)  # made by compat.unary_primitive
  assert compat.is_jax_primitive(sparse.bcoo_dot_general_p)
  assert not compat.is_jax_primitive(Primitive("a_librarys_tag"))
