"""Overrides by place: parts of a model that run under another policy, or with autocast off.

``autocast(f, overrides={"router": jnp.float32, "block_3": None, eqx.nn.MultiheadAttention:
jnp.bfloat16})`` finds the parts by the scopes an eqn was traced under (its name stack: flax
linen and Haiku module names, Equinox layer scopes, ``jax.named_scope``; nnx modules passed as
arguments are traced under scopes of their attribute paths, ``nnx_modules.named_calls``) or, for
a key that is a class, by the class's ``__call__`` in the eqn's traceback, the way ``regions``
recognises library functions. An overridden eqn gets its override's policy; ``None`` (or
``jnp.float32``) makes it a kept region, as ``autocast_disabled()`` does.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxamp._src import caches, compat
from jaxamp._src.autocast import regions
from jaxamp._src.policies.policy import Policy, canonical_dtype
from jaxamp._src.policies.table import LOW_DTYPES

_OWN_SCOPES = "jaxamp."  # autocast's marks (kept regions, op regions) name no place of a model


class Override(NamedTuple):
  """One override.

  Attributes:
    key: the key as written (a pattern or a class); ``explain`` shows it.
    pattern: a pattern's scope names (globs), outermost first; () for a class.
    code: a class's ``__call__`` code object; None for a pattern.
    policy: the policy of the eqns it matches; None: autocast off there (a kept region).
  """

  key: str | type
  pattern: tuple[str, ...]
  code: types.CodeType | None
  policy: Policy | None

  @property
  def name(self) -> str:
    return self.key if isinstance(self.key, str) else self.key.__qualname__


class Scope(NamedTuple):
  """Where a body sits, as far as overrides can tell: what matching inside it needs to know.

  Attributes:
    tail: the last scopes of the enclosing eqns that a pattern may continue from inside the
      body (usually none: then bodies in different places share one rewrite).
    inherited: the override of the enclosing eqns, for the body's eqns that match none deeper.
  """

  tail: tuple[str, ...] = ()
  inherited: Override | None = None


OUTSIDE = Scope()


class Overrides(NamedTuple):
  """A mapping's overrides, in its order; hashable, so a ``Context`` holding them keys caches."""

  entries: tuple[Override, ...]

  def decide(self, scope: Scope, eqn) -> Override | None:
    """The override of ``eqn`` in a body at ``scope``: the one matching deepest (a pattern by
    the scope it ends at, past the enclosing ones; a class by its call's depth), the later in
    the mapping on a tie; else the enclosing eqns' own."""
    return _decide(self, scope, place(eqn), self._codes(eqn))

  def enter(self, scope: Scope, eqn) -> Scope:
    """The scope of ``eqn``'s bodies: its override, and the scopes a pattern may continue from."""
    own = place(eqn)
    if not own:
      return scope
    full = scope.tail + own
    reach = max((_partial(e.pattern, full) for e in self.entries if e.code is None), default=0)
    inherited = _decide(self, scope, own, self._codes(eqn))
    return Scope(full[len(full) - reach :], inherited)

  def _codes(self, eqn) -> tuple:
    if not any(entry.code is not None for entry in self.entries):
      return ()
    return tuple(code for code, _ in compat.traceback_code_frames(eqn))

  @property
  def by_scope(self) -> bool:
    """Whether some override names a scope (nnx modules then trace under their paths)."""
    return any(entry.code is None for entry in self.entries)


def place(eqn) -> tuple[str, ...]:
  """The scopes of ``eqn``'s name stack that name a place of the model, outermost first."""
  return tuple(s for s in compat.name_scopes(eqn) if not s.startswith(_OWN_SCOPES))


@caches.lru_cache("overrides.decide", maxsize=4096)
def _decide(
  overrides: Overrides, scope: Scope, own: tuple[str, ...], codes: tuple
) -> Override | None:
  path, outer = scope.tail + own, len(scope.tail)
  best, depth = None, -1
  for entry in overrides.entries:
    found = _depth(entry, path, codes)
    if found is not None and found >= depth and (entry.code is not None or found > outer):
      best, depth = entry, found
  return best if best is not None else scope.inherited


def _depth(entry: Override, path: tuple[str, ...], codes: tuple) -> int | None:
  """How deep ``entry`` matches: the index after the scopes its pattern matched (the deepest
  match), or the number of frames outside its class's call (codes are innermost first)."""
  if entry.code is not None:
    return len(codes) - codes.index(entry.code) if entry.code in codes else None
  size = len(entry.pattern)
  for end in range(len(path), size - 1, -1):
    window = path[end - size : end]
    if all(fnmatch.fnmatchcase(s, p) for s, p in zip(window, entry.pattern, strict=True)):
      return end
  return None


def _partial(pattern: tuple[str, ...], path: tuple[str, ...]) -> int:
  """The most scopes at the end of ``path`` that match the start of ``pattern``, short of all of
  it: how much of ``path`` a match continuing past it needs."""
  for size in range(min(len(pattern) - 1, len(path)), 0, -1):
    window = path[len(path) - size :]
    if all(fnmatch.fnmatchcase(s, p) for s, p in zip(window, pattern, strict=False)):
      return size
  return 0


def make(overrides: Mapping | None, base: Policy) -> Overrides | None:
  """``autocast``'s ``overrides`` argument, validated; None for none."""
  if overrides is None:
    return None
  if not isinstance(overrides, Mapping):
    raise TypeError(
      "`overrides` is a mapping {scope pattern or module class: dtype, None or jaxamp.Policy}, "
      f'e.g. {{"router": jnp.float32}}; got {type(overrides).__name__}.'
    )
  entries = tuple(_entry(key, value, base) for key, value in overrides.items())
  return Overrides(entries) if entries else None


def _entry(key: Any, value: Any, base: Policy) -> Override:
  policy = _policy(key, value, base)
  if isinstance(key, str):
    pattern = tuple(key.split("/"))
    while len(pattern) > 1 and pattern[-1] in ("*", "**"):
      pattern = pattern[:-1]  # "block_3/*" is everything inside block_3
    if not key or "" in pattern:
      raise ValueError(
        f"An override pattern names scopes separated by '/' (globs allowed: 'block_*', "
        f"'decoder/block_3'); got {key!r}."
      )
    return Override(key, pattern, None, policy)
  if isinstance(key, type):
    try:
      code = regions.code_of(key.__call__)
    except (AttributeError, TypeError):
      code = None
    if code is None or key.__call__ is object.__call__:
      raise TypeError(f"An override's class must define `__call__` (a module); got {key!r}.")
    return Override(key, (), code, policy)
  raise TypeError(
    "An override's key is a scope pattern (a str: a flax or Haiku module name, a "
    "jax.named_scope) or a module class (Equinox, nnx); "
    f"got {key!r} of type {type(key).__name__}."
  )


def _policy(key: Any, value: Any, base: Policy) -> Policy | None:
  """An override's value as a policy: None (and float32) is autocast off; a lower-precision
  dtype is ``base`` with that dtype (its matmuls too, not float8); a policy is itself (with
  ``base``'s cast cache setting)."""
  if value is None:
    return None
  if isinstance(value, Policy):
    return dataclasses.replace(value, cache_enabled=base.cache_enabled)
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype == jnp.float32:
    return None
  if dtype in LOW_DTYPES:  # matmuls too: a float8 base's float8 matmuls are not kept there
    return dataclasses.replace(base.without_float8(), dtype=canonical_dtype(dtype))
  names = ", ".join(f"jnp.{d.name}" for d in LOW_DTYPES)
  raise ValueError(
    f"The override of {key!r} must be None or jnp.float32 (autocast off there), {names} "
    f"(autocast to that dtype there) or a jaxamp.Policy; got {value!r}."
  )


# --- every override matches something -------------------------------------------------------------

_checked = caches.weak_key_dict("overrides.checked")


def check_matched(overrides: Overrides, closed) -> None:
  """Raises a ``ValueError`` for an override that matches no eqn of ``closed`` (a traced
  function), listing the scopes, or module classes, that exist; once per jaxpr and overrides."""
  seen = _checked.setdefault(closed, set())
  if overrides in seen:
    return
  places, codes = set(), set()
  by_type = any(entry.code is not None for entry in overrides.entries)
  for path, eqn in _walk(closed.jaxpr, ()):
    places.add(path)
    if by_type:
      codes.update(code for code, _ in compat.traceback_code_frames(eqn))
  for entry in overrides.entries:
    if entry.code is not None:
      if entry.code not in codes:
        raise ValueError(_no_call(entry, codes))
    elif not any(_depth(entry, path, ()) is not None for path in places):
      raise ValueError(_no_scope(entry, places))
  seen.add(overrides)


def _walk(jaxpr, scope: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
  """(scopes, eqn) of every eqn of ``jaxpr`` and its sub-jaxprs, scopes from the outermost."""
  for eqn in jaxpr.eqns:
    path = scope + place(eqn)
    yield path, eqn
    for sub in compat.sub_jaxprs(eqn):
      yield from _walk(sub, path)


def _no_scope(entry: Override, places: set) -> str:
  scopes = sorted({"/".join(path[: i + 1]) for path in places for i in range(len(path))})
  if not scopes:
    return (
      f"The override {entry.key!r} matches no scope: the function traces none (plain JAX code, "
      "an nnx model it closes over rather than takes as an argument, or nnx modules that an nnx "
      "transform inside it rebuilds, as nnx.scan over layers does). Name a part with "
      "jax.named_scope, or key the override by a module's class (overrides={nnx.Linear: "
      "jnp.float32}: what its __call__ traces)."
    )
  nearest = difflib.get_close_matches(entry.key, scopes, n=len(scopes), cutoff=0.0)[:12]
  more = f" (and {len(scopes) - len(nearest)} more)" if len(scopes) > len(nearest) else ""
  return (
    f"The override {entry.key!r} matches no scope of the function. Scopes that exist, nearest "
    f"first: {', '.join(map(repr, nearest))}{more}. A pattern matches consecutive scopes "
    "anywhere in the name stack ('router' or 'block_3/router'), with globs ('block_*')."
  )


def _no_call(entry: Override, codes: set) -> str:
  called = sorted(
    {code.co_qualname.rsplit(".", 1)[0] for code in codes if code.co_name == "__call__"}
  )
  nearest = difflib.get_close_matches(entry.key.__qualname__, called, n=12, cutoff=0.0)
  return (
    f"The override {entry.key.__qualname__} matches nothing: no eqn was traced inside its "
    f"__call__. Module classes whose __call__ ran, nearest first: {', '.join(nearest) or 'none'}."
  )
