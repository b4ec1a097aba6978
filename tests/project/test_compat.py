"""Every JAX internal jaxamp uses still exists: an upgrade that removes one fails here, loudly."""

import pytest

from jaxamp._src import compat


@pytest.mark.parametrize("name", sorted(compat.REQUIRED_INTERNALS))
def test_required_jax_internal_exists(name):
  assert compat.REQUIRED_INTERNALS[name]() is not None, name
