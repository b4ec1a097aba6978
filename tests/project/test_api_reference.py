"""The API reference (docs/api/index.rst) documents every public name, and each has a docstring.

The public names are ``__all__`` of ``jaxamp``, ``jaxamp.scaler`` and ``jaxamp.functional``. A
new public name without an ``.. auto*::`` entry in the reference, or without a docstring (autodoc
renders an empty entry without a warning), fails here; a broken docstring fails the reference's
build, ``sphinx-build -W --keep-going -b html docs/api docs/api/_build`` (run by ``.ci/run``).
"""

from __future__ import annotations

import enum
import inspect
import re
import types

import pytest
from paths import ROOT

import jaxamp

REFERENCE = ROOT / "docs" / "api" / "index.rst"
MODULES = (jaxamp, jaxamp.scaler, jaxamp.functional)
DIRECTIVE = re.compile(r"^\.\. auto(\w+):: ([\w.]+)\s*$", flags=re.M)


def documented() -> dict[str, str]:
  """``{qualified name: directive}`` of every autodoc entry of the reference."""
  return {name: kind for kind, name in DIRECTIVE.findall(REFERENCE.read_text())}


def public_names() -> list[tuple[str, object]]:
  """``(qualified name, object)`` of every public name of the public modules."""
  return [
    (f"{module.__name__}.{name}", getattr(module, name))
    for module in MODULES
    for name in module.__all__
  ]


def public_members(cls: type) -> list[tuple[str, object]]:
  """A class's own public methods and properties (not NamedTuple fields, not enum values)."""
  fields = set(getattr(cls, "_fields", ()))
  members = []
  for name, value in vars(cls).items():
    if name.startswith("_") or name in fields:
      continue
    if isinstance(value, enum.Enum):
      continue
    if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
      members.append((name, value))
  return members


NAMES = public_names()


def test_every_module_in_the_reference_is_public():
  assert [m.__name__ for m in MODULES] == ["jaxamp", "jaxamp.scaler", "jaxamp.functional"]
  modules = {n for n, kind in documented().items() if kind == "module"}
  assert modules == {m.__name__ for m in MODULES}


@pytest.mark.parametrize("qualname, obj", NAMES, ids=[n for n, _ in NAMES])
def test_public_name_has_a_reference_entry_and_a_docstring(qualname, obj):
  entries = documented()
  assert qualname in entries, f"{qualname} has no `.. auto*:: {qualname}` in {REFERENCE}"
  if isinstance(obj, types.ModuleType):
    assert entries[qualname] == "module"
  doc = inspect.getdoc(obj)
  assert doc and doc.strip(), f"{qualname} has no docstring"


@pytest.mark.parametrize(
  "qualname, cls", [(n, o) for n, o in NAMES if inspect.isclass(o)], ids=lambda v: str(v)
)
def test_public_methods_and_properties_have_docstrings(qualname, cls):
  """autodoc's ``:members:`` leaves out an undocumented method without a warning."""
  missing = [name for name, value in public_members(cls) if not inspect.getdoc(value)]
  assert not missing, f"{qualname}: no docstring on {missing}"


def test_every_reference_entry_is_a_public_name():
  """No stale entries: each documented name is still public, and documented once."""
  public = {n for n, _ in NAMES} | {m.__name__ for m in MODULES}
  assert set(documented()) <= public
  names = [name for _, name in DIRECTIVE.findall(REFERENCE.read_text())]
  assert len(names) == len(set(names)), "a name is documented twice (Sphinx would warn)"
