"""jaxamp's caches: bounded LRU maps whose keys hold the user's objects weakly.

A trace of ``f`` holds the arrays ``f`` closes over, so a cache keyed strongly on ``f`` keeps
them alive after the user has dropped ``f`` (an eager loop over
``autocast(lambda params: loss(batch, params))`` would keep every batch). Here keys are built
with ``key_part``: functions, bound methods' instances and other weakly referenceable objects
enter a key through a weak reference, and an entry is dropped as soon as one of them dies, like
``jax``'s ``weakref_lru_cache``. This holds as long as a cached value does not itself reference
its key's objects.

Every cache of jaxamp registers here where it is defined (``register``, or made by
``weak_lru_cache`` / ``lru_cache`` / ``weak_key_dict``), so ``clear_caches`` empties them all
without knowing the modules that hold them.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

PLAIN = (int, float, complex, bool, str, bytes, type(None))
_caches: weakref.WeakSet[WeakLRUCache] = weakref.WeakSet()


class _Ref(weakref.ref):
  """A weak key part: equal to another for the same object (or an equal one, for objects hashed
  by value); once its object is dead, equal only to itself. Made by ``_ref``."""

  __slots__ = ("_hash", "_by_identity")

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    if self is other:
      return True
    if type(other) is not _Ref or self._by_identity is not other._by_identity:
      return False
    a = self()
    if a is None:
      return False
    b = other()
    return a is b or b is not None and not self._by_identity and type(a) is type(b) and bool(a == b)

  def __repr__(self) -> str:
    return f"_Ref({self()!r})"


def _ref(obj: Any, by_identity: bool) -> _Ref:
  """A weak key part for ``obj``; raises TypeError if it has no weak references."""
  ref = _Ref(obj, _on_death)
  ref._by_identity = by_identity
  ref._hash = id(obj) if by_identity else hash(obj)
  return ref


def _on_death(ref: _Ref) -> None:
  if sys.is_finalizing():  # at shutdown, hashing a dead key can need torn-down modules
    return
  for cache in _caches or ():  # None at interpreter shutdown
    cache._object_died(ref)


def primitive_key(primitive, params: dict, *rest: Hashable) -> Hashable | None:
  """``(primitive, its params, *rest)`` as a cache key; None where a param is unhashable."""
  key = (primitive, tuple(sorted(params.items())), *rest)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def key_part(x: Any, by_identity: bool = False) -> Hashable:
  """``x`` as part of a cache key that does not keep ``x`` alive.

  Weakly referenceable objects are held weakly (compared by identity when ``by_identity`` or
  when their type hashes by identity, else by type and value). A bound method becomes its
  instance (by identity) and its function, and a ``functools.partial`` its function and
  arguments, so the same method or partial made afresh on each call finds its entry. Other
  values are kept as they are, with their type (``1`` and ``1.0`` are different keys).

  Raises:
    TypeError: ``x`` is unhashable.
  """
  if type(x) in PLAIN:
    return type(x), x
  if type(x) is tuple:
    return tuple, tuple(key_part(e) for e in x)
  if type(x) is types.MethodType:
    try:
      return types.MethodType, _ref(x.__self__, True), key_part(x.__func__)
    except TypeError:
      return x  # an instance without weak references: the method holds it, as it hashes
  if isinstance(x, functools.partial) and type(x).__call__ is functools.partial.__call__:
    try:
      return (
        functools.partial,
        key_part(x.func),
        key_part(x.args),
        tuple(sorted((k, key_part(v)) for k, v in x.keywords.items())),
      )
    except TypeError:  # an unhashable argument (an array): the partial itself is the key
      pass
  by_identity = by_identity or type(x).__hash__ is object.__hash__
  if not by_identity:
    hash(x)  # raises for unhashable values
  try:
    return _ref(x, by_identity)
  except TypeError:  # not weakly referenceable: held, as before
    return type(x), x


def _weak_parts(key: Any):
  """The ``_Ref`` parts of a key built from ``key_part``s and plain values."""
  if type(key) is _Ref:
    yield key
  elif type(key) is tuple:
    for part in key:
      yield from _weak_parts(part)


class WeakLRUCache:
  """A bounded LRU map whose entries go as soon as an object their key holds weakly dies.

  Keys are tuples of ``key_part``s and plain hashable values. Thread-safe; an object dying
  during an operation of this cache (or of another thread) has its entries removed when that
  operation ends, at the latest at the cache's next operation.
  """

  def __init__(self, maxsize: int):
    self.maxsize = maxsize
    # key -> (the stored key, value), least recently used first: the stored key's weak
    # references are the ones whose deaths remove the entry.
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._dependents: dict[int, Hashable] = {}  # id of a stored key's _Ref -> that key
    self._dead: list[_Ref] = []
    self._lock = threading.RLock()
    self._busy = False  # inside an operation: a death then only queues its reference
    _caches.add(self)

  def __len__(self) -> int:
    return len(self._entries)

  def get(self, key: Hashable, default: Any = None) -> Any:
    """The value at ``key`` (now the most recently used), or ``default``."""
    with self._lock:
      self._busy = True
      try:
        entry = self._entries.get(key)
        if entry is not None:
          self._entries.move_to_end(key)
      finally:
        self._busy = False
        if self._dead:
          self._drop_dead()
    return default if entry is None else entry[1]

  def put(self, key: Hashable, value: Any) -> None:
    """Stores ``value`` at ``key``, evicting the least recently used entry beyond ``maxsize``."""
    parts = list(_weak_parts(key))
    with self._lock:
      self._busy = True
      try:
        if key in self._entries:
          self._remove(key)
        if not any(part() is None for part in parts):  # else it would never go
          self._entries[key] = (key, value)
          for part in parts:
            self._dependents[id(part)] = key
        while len(self._entries) > self.maxsize:
          self._remove(next(iter(self._entries)))
      finally:
        self._busy = False
        self._drop_dead()

  def clear(self) -> None:
    with self._lock:
      self._busy = True
      try:
        entries, self._entries = self._entries, collections.OrderedDict()
        self._dependents = {}
        del entries  # values freed here may kill key objects: their deaths find nothing
      finally:
        self._busy = False
        self._drop_dead()

  def _remove(self, key: Hashable) -> None:
    stored, _ = self._entries.pop(key)
    for part in _weak_parts(stored):
      self._dependents.pop(id(part), None)

  def _object_died(self, ref: _Ref) -> None:
    self._dead.append(ref)  # keeps ``ref``, so its id stays its own until handled
    if self._lock.acquire(blocking=False):  # else the thread holding it handles the death
      try:
        if not self._busy:
          self._drop_dead()
      finally:
        self._lock.release()

  def _drop_dead(self) -> None:
    """Removes the entries of the dead references queued so far (lock held, not busy)."""
    self._busy = True
    try:
      while self._dead:
        key = self._dependents.pop(id(self._dead.pop()), None)
        if key is not None:
          self._remove(key)
    finally:
      self._busy = False


class Registered(NamedTuple):
  """A registered cache: how to empty it and how many entries it holds."""

  clear: Callable[[], None]
  size: Callable[[], int]


_registry: dict[str, Registered] = {}


def register(name: str, clear: Callable[[], None], size: Callable[[], int]) -> None:
  """Makes ``clear_caches`` empty a cache with ``clear()``; ``size()`` counts its entries.

  ``name`` (``"module.cache"``) identifies it; registering a name again replaces the entry (a
  reloaded module's new cache replaces its old one).
  """
  _registry[name] = Registered(clear, size)


def registered() -> dict[str, Registered]:
  """The registered caches by name."""
  return dict(_registry)


def weak_lru_cache(name: str, maxsize: int) -> WeakLRUCache:
  """A registered ``WeakLRUCache``."""
  cache = WeakLRUCache(maxsize)
  register(name, cache.clear, cache.__len__)
  return cache


def weak_key_dict(name: str) -> weakref.WeakKeyDictionary:
  """A registered ``weakref.WeakKeyDictionary``."""
  cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
  register(name, cache.clear, cache.__len__)
  return cache


def lru_cache(name: str, maxsize: int) -> Callable[[_F], _F]:
  """``functools.lru_cache(maxsize)``, registered."""

  def decorate(fun: _F) -> _F:
    cached = functools.lru_cache(maxsize=maxsize)(fun)
    register(name, cached.cache_clear, lambda: cached.cache_info().currsize)
    return cached

  return decorate


def clear_caches() -> None:
  """Empties jaxamp's caches (traced and rewritten jaxprs, region lookups): the next call of
  an autocast function traces afresh. Like ``jax.clear_caches()``, for jaxamp's own caches."""
  for cache in list(_registry.values()):
    cache.clear()
