"""Walks a jaxpr and every sub-jaxpr inside it, to assert the dtypes autocast chose."""

from collections.abc import Iterator

from jax.extend import core


def _sub_jaxprs(value) -> Iterator:
  if isinstance(value, core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, core.Jaxpr):
    yield value
  elif isinstance(value, tuple | list):
    for item in value:
      yield from _sub_jaxprs(item)


def walk(jaxpr, path: str = "") -> Iterator[tuple[str, object]]:
  """Yields (path, eqn) for every eqn of ``jaxpr`` and of its sub-jaxprs, depth first."""
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
  for eqn in jaxpr.eqns:
    yield path, eqn
    for name, value in eqn.params.items():
      for sub in _sub_jaxprs(value):
        yield from walk(sub, f"{path}/{eqn.primitive.name}.{name}")


def dtypes_of(jaxpr, primitive: str) -> list[tuple[tuple, tuple]]:
  """(input dtypes, output dtypes) of every ``primitive`` eqn anywhere in ``jaxpr``."""
  return [(tuple(v.aval.dtype for v in eqn.invars), tuple(v.aval.dtype for v in eqn.outvars))
          for _, eqn in walk(jaxpr) if eqn.primitive.name == primitive]
