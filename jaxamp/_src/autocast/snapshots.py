"""What a cached trace read from Python objects, so it is reused only while that still holds.

A trace bakes in what ``f`` reads from outside its array arguments: the arrays of an object it
is a method of or closes over (a torch-style model whose ``self.w`` is replaced after each step),
a flag such as ``self.training``, a closure cell or module global reassigned, the arrays of a
plain object passed as an argument (which, not being a pytree, is a static argument). torch reads
them afresh on every call. ``take`` records, breadth first from the function and its static
arguments, each value reachable through closures, globals the code names, instance attributes,
``functools.partial`` arguments and list, tuple and dict items; ``holds`` reads them again. An
array must be the same object (a replaced one is a change; one changed in place, a numpy array
written into, is not seen), a Python scalar or numpy scalar equal, an instance of the same class
with the same attributes, a function of the same code, a container of the same length.

The walk is bounded (``_DEPTH`` levels, ``_LIMIT`` values): what lies beyond is read once, as
``jax.jit`` reads everything it closes over.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxamp._src import caches

_DEPTH = 6
_LIMIT = 2048
_SCALARS = (*caches.PLAIN, np.generic)
_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType)
_LEAVES = (*_SCALARS, jax.Array, np.ndarray, *_OPAQUE)

Step = tuple  # (kind, key): how a value is read from its parent, see ``_read``


class Entry(NamedTuple):
  """One recorded value: read by ``step`` from entry ``parent`` (root ``step[1]`` when None),
  and what it must still satisfy (``_fingerprint``)."""

  parent: int | None
  step: Step
  fingerprint: tuple


class Snapshot(NamedTuple):
  """The values a trace may have read, in breadth-first order (parents before children)."""

  entries: tuple[Entry, ...]


def take(roots: Sequence[Any]) -> Snapshot:
  """The values reachable from ``roots`` (the traced function, its static arguments) now."""
  entries: list[Entry] = []
  seen: set[int] = set()
  frontier: list[tuple[int | None, Step, Any]] = [
    (None, ("root", k), r) for k, r in enumerate(roots)
  ]
  for _ in range(_DEPTH + 1):
    deeper = []
    for parent, step, value in frontier:
      if len(entries) >= _LIMIT:
        return Snapshot(tuple(entries))
      fingerprint = _fingerprint(value)
      if fingerprint is None:
        continue
      entries.append(Entry(parent, step, fingerprint))
      if _is_leaf(value) or id(value) in seen:
        continue
      seen.add(id(value))
      index = len(entries) - 1
      deeper.extend((index, child_step, child) for child_step, child in _safe_children(value))
    frontier = deeper
  return Snapshot(tuple(entries))


def holds(snapshot: Snapshot, roots: Sequence[Any]) -> bool:
  """Whether every value of ``snapshot`` reads the same from ``roots`` as when it was taken."""
  values: list[Any] = []
  for parent, step, fingerprint in snapshot.entries:
    try:
      value = roots[step[1]] if parent is None else _read(values[parent], step)
    except Exception:  # noqa: BLE001 -- gone or unreadable: a change
      return False
    if not _matches(value, fingerprint):
      return False
    values.append(value)
  return True


def tracer_in(value: Any, depth: int = 3) -> str | None:
  """Where ``value`` holds a JAX tracer, a few levels down (``.y``, ``[0].h``); None if nowhere."""
  frontier = [("", value)]
  for _ in range(depth + 1):
    deeper = []
    for path, obj in frontier:
      if isinstance(obj, jax.core.Tracer):
        return path
      if not _is_leaf(obj):
        deeper.extend((path + _spelling(step), child) for step, child in _safe_children(obj))
    frontier = deeper
  return None


def _is_leaf(value: Any) -> bool:
  return isinstance(value, _LEAVES)


def _fingerprint(value: Any) -> tuple | None:
  """What ``value`` must stay (None: nothing to record)."""
  if isinstance(value, jax.Array | np.ndarray):
    try:
      return ("same", weakref.ref(value))
    except TypeError:
      return None
  if isinstance(value, _SCALARS):
    return ("equal", type(value), value)
  if isinstance(value, _OPAQUE):
    return None
  if isinstance(value, list | tuple | dict):
    return ("length", type(value), len(value))
  if isinstance(value, types.FunctionType):
    return ("code", value.__code__)
  if isinstance(value, functools.partial | types.MethodType):
    return ("type", type(value))
  return ("instance", weakref.ref(type(value)), _attribute_count(value))


def _attribute_count(value: Any) -> int | None:
  """How many attributes ``value``'s ``__dict__`` holds (None: it has none)."""
  attributes = getattr(value, "__dict__", None)
  return len(attributes) if isinstance(attributes, dict) else None


def _matches(value: Any, fingerprint: tuple) -> bool:
  kind = fingerprint[0]
  if kind == "same":
    return fingerprint[1]() is value
  if kind == "equal":
    expected = fingerprint[2]
    return type(value) is fingerprint[1] and (value is expected or bool(value == expected))
  if kind == "code":
    return getattr(value, "__code__", None) is fingerprint[1]
  if kind == "instance":
    return type(value) is fingerprint[1]() and _attribute_count(value) == fingerprint[2]
  if type(value) is not fingerprint[1]:
    return False
  return kind != "length" or len(value) == fingerprint[2]


def _safe_children(value: Any) -> list[tuple[Step, Any]]:
  """``_children``, or none where reading them fails (a proxy's ``__getattr__``)."""
  try:
    return list(_children(value))
  except Exception:  # noqa: BLE001 -- an object that cannot be walked is read once, as jit does
    return []


def _children(value: Any) -> Iterator[tuple[Step, Any]]:
  """``(step, child)`` for each value ``value`` holds that a trace may read."""
  if isinstance(value, functools.partial):
    yield ("partial_func", None), value.func
    yield from ((("partial_arg", i), a) for i, a in enumerate(value.args))
    yield from ((("partial_keyword", k), v) for k, v in value.keywords.items())
  elif isinstance(value, types.MethodType):
    yield ("method_self", None), value.__self__
    yield ("method_func", None), value.__func__
  elif isinstance(value, types.FunctionType):
    for i, cell in enumerate(value.__closure__ or ()):
      try:
        yield ("cell", i), cell.cell_contents
      except ValueError:  # an empty cell
        pass
    names = value.__code__.co_names
    yield from ((("global", n), value.__globals__[n]) for n in names if n in value.__globals__)
    yield from ((("attribute", k), v) for k, v in vars(value).items())
  elif isinstance(value, list | tuple):
    yield from ((("item", i), v) for i, v in enumerate(value))
  elif isinstance(value, dict):
    yield from ((("item", k), v) for k, v in value.items() if isinstance(k, _SCALARS))
  else:
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
      yield from ((("attribute", k), v) for k, v in list(attributes.items()))
    for name in _slots(type(value)):
      if hasattr(value, name):  # not an unset slot
        yield ("slot", name), getattr(value, name)


def _slots(cls: type) -> list[str]:
  names = []
  for klass in cls.__mro__:
    slots = klass.__dict__.get("__slots__", ())
    names.extend([slots] if isinstance(slots, str) else slots)
  return [n for n in names if n not in ("__dict__", "__weakref__")]


def _read(parent: Any, step: Step) -> Any:
  kind, key = step
  if kind == "attribute":
    return vars(parent)[key]
  if kind == "item":
    return parent[key]
  if kind == "cell":
    return parent.__closure__[key].cell_contents
  if kind == "global":
    return parent.__globals__[key]
  if kind == "slot":
    return getattr(parent, key)
  if kind == "method_self":
    return parent.__self__
  if kind == "method_func":
    return parent.__func__
  if kind == "partial_func":
    return parent.func
  if kind == "partial_arg":
    return parent.args[key]
  return parent.keywords[key]  # "partial_keyword"


def _spelling(step: Step) -> str:
  """``step`` as Python spells the read: ``.w``, ``[0]``."""
  kind, key = step
  if kind in ("attribute", "slot", "global"):
    return f".{key}"
  if kind in ("item", "partial_arg", "partial_keyword"):
    return f"[{key!r}]"
  if kind == "cell":
    return f".__closure__[{key}]"
  return {"method_self": ".__self__", "method_func": ".__func__", "partial_func": ".func"}[kind]
