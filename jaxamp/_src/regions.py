"""Regions: parts of a traced program that autocast treats as a whole.

A region is marked with a JAX name scope, which every eqn traced inside it carries in its
``source_info.name_stack`` (through jit, jvp and transpose alike). Three kinds exist:

* *kept* regions run exactly as written: ``autocast_disabled()`` blocks, ``autocast(enabled=False)``
  calls and nested ``autocast`` calls, whose eqns were already rewritten by their own policy;
* *op* regions stand for one torch op made of several primitives (softmax, mse_loss, ...): the
  values entering them are cast by the op's category, the eqns inside run as they are;
* library functions recognised by the traceback of their eqns are op regions too, so optax, flax
  and ``jax.nn`` composites are found without wrapping them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import compat
from jaxamp._src.policy import Category

# Name scopes of eqns autocast runs exactly as written: what an autocast call emitted (the scope
# profiles show around autocast code) and the inside of autocast_disabled() blocks.
AUTOCAST_MARK = "jaxamp.autocast"
KEPT_MARK = "jaxamp.kept"
_KEPT_MARKS = frozenset({AUTOCAST_MARK, KEPT_MARK})
_OP_PREFIX = "jaxamp.op:"
_instances = itertools.count()


class OpRegion(NamedTuple):
  """A named op region.

  Attributes:
    name: the op's name, which keys the policy tables.
    instance: tells two calls of the op apart.
    default: the category where the table has no row for ``name``.
    cast_to: a dtype every entering floating value is cast to, whatever the policy
      (``custom_fwd(cast_inputs=...)``).
  """

  name: str
  instance: str
  default: Category | None
  cast_to: np.dtype | None = None


_user_defaults: dict[str, Category | None] = {}


@contextlib.contextmanager
def kept_region(mark: str = KEPT_MARK) -> Iterator[None]:
  """Marks everything traced inside as run exactly as written (``mark``: one of _KEPT_MARKS)."""
  with jax.named_scope(mark):
    yield


def autocast_disabled() -> contextlib.AbstractContextManager[None]:
  """A block inside an autocast function that autocast leaves untouched.

  torch's ``with torch.autocast(device_type, enabled=False):``. Values entering the block get
  back the dtypes they had when the function was traced, so the block computes as written.
  """
  return kept_region()


@contextlib.contextmanager
def op_region(name: str) -> Iterator[None]:
  """Marks everything traced inside as one op named ``name`` (a row of the policy tables)."""
  with jax.named_scope(f"{_OP_PREFIX}{name}#{next(_instances)}"):
    yield


_CUSTOM_FWD = "custom_fwd:"


def custom_fwd_name(dtype: np.dtype) -> str:
  """The op-region name of a ``custom_fwd(cast_inputs=dtype)`` function."""
  return f"{_CUSTOM_FWD}{np.dtype(dtype).name}"


def register_op(name: str, *, category: Category | str | None = None) -> Callable:
  """Decorator making a function one autocast op region named ``name``.

  The policy's table decides the category of ``name``; ``category`` is used where the table has
  no row for it (for your own ops). Without either, the op runs in its inputs' dtypes, as torch
  runs the ops its lists leave out.

  Example::

    @jaxamp.register_op("my_loss", category="float32")
    def my_loss(pred, target): ...
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"`name` must be a non-empty string; got {name!r}.")
  default = _as_category(category)
  _user_defaults[name] = default

  def decorate(fun: Callable) -> Callable:
    if not callable(fun):
      raise TypeError(f"register_op({name!r}) decorates a callable; got {fun!r}.")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
      with op_region(name):
        return fun(*args, **kwargs)

    return wrapped

  return decorate


def registered_ops() -> tuple[str, ...]:
  """The names of the op regions made with ``register_op``."""
  return tuple(_user_defaults)


def _as_category(category: Category | str | None) -> Category | None:
  if category is None or isinstance(category, Category):
    return category
  try:
    return Category(category)
  except ValueError:
    choices = [c.value for c in Category]
    raise ValueError(f"`category` must be one of {choices} or None; got {category!r}.") from None


# Library functions recognised as op regions by the frames of their eqns' tracebacks:
# function name -> [(path suffix of the defining file, op name in the policy tables)].
_library_ops: dict[str, list[tuple[str, str]]] = {}


def register_library_op(path_suffix: str, function: str, name: str) -> None:
  """Treats eqns traced inside ``function`` of a file ending in ``path_suffix`` as op ``name``."""
  _library_ops.setdefault(function, []).append((path_suffix, name))
  _library_ops_of.cache_clear()


class Marks(NamedTuple):
  """What an eqn's provenance says: kept, and the op regions around it, outermost first."""

  kept: bool
  ops: tuple[OpRegion, ...]


NO_MARKS = Marks(False, ())


def marks_of(eqn) -> Marks:
  """The region marks of one eqn, from its name stack and its traceback."""
  scopes = compat.name_scopes(eqn)
  if not _KEPT_MARKS.isdisjoint(scopes):
    return Marks(True, ())
  named = tuple(_named_op(scope) for scope in scopes if scope.startswith(_OP_PREFIX))
  library = _library_ops_of(compat.traceback_frames(eqn))
  return Marks(False, named + library) if named or library else NO_MARKS


@functools.lru_cache(maxsize=4096)
def _named_op(scope: str) -> OpRegion:
  name = scope[len(_OP_PREFIX):].rpartition("#")[0]
  cast_to = np.dtype(jnp.dtype(name[len(_CUSTOM_FWD):])) if name.startswith(_CUSTOM_FWD) else None
  return OpRegion(name, scope, _user_defaults.get(name), cast_to)


@functools.lru_cache(maxsize=4096)
def _library_ops_of(frames: tuple[tuple[str, str, int], ...]) -> tuple[OpRegion, ...]:
  """The recognised library functions among ``frames`` (innermost first), outermost first."""
  found = []
  for index, (file_name, function, _) in enumerate(frames):
    for suffix, name in _library_ops.get(function, ()):
      if file_name.endswith(suffix):
        caller = frames[index + 1] if index + 1 < len(frames) else ("", "", 0)
        found.append(OpRegion(name, f"{name}@{caller}", None))
  return tuple(reversed(found))
