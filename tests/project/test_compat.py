"""Every JAX internal jaxamp uses still exists: an upgrade that removes one fails here, loudly;
and the JAX behaviours compat.py works around stay worked around."""

import jax
import jax.numpy as jnp
import pytest

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
