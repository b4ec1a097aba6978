"""Regions: parts of a traced program that autocast treats as a whole.

A region is marked with a JAX name scope, which every eqn traced inside it carries in its
``source_info.name_stack`` (through jit, jvp and transpose alike). Three kinds exist:

* *kept* regions run exactly as written: ``autocast_disabled()`` blocks, ``autocast(enabled=False)``
  calls and nested ``autocast`` calls, whose eqns were already rewritten by their own policy;
* *op* regions stand for one torch op made of several primitives (softmax, mse_loss, ...): the
  values entering them are cast by the op's category, the eqns inside run as they are;
* library functions recognised by identity (their code object among the frames of their eqns'
  tracebacks) are op regions too, so optax, flax, Haiku, Equinox and ``jax.nn`` composites are
  found without wrapping them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import itertools
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import caches, compat
from jaxamp._src.autocast import library_ops
from jaxamp._src.policies import edit
from jaxamp._src.policies.table import Category

# Name scopes of eqns autocast runs exactly as written: what an autocast call emitted (the scope
# profiles show around autocast code) and the inside of autocast_disabled() blocks.
AUTOCAST_MARK = "jaxamp.autocast"
KEPT_MARK = "jaxamp.kept"
_KEPT_MARKS = frozenset({AUTOCAST_MARK, KEPT_MARK})
_OP_PREFIX = "jaxamp.op:"
# Trace -> the numbers of the op calls traced in it so far: the same function traced twice is
# numbered alike (``jaxamp.op:mse_loss#0`` in both lowerings' metadata).
_op_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class OpRegion(NamedTuple):
  """A named op region.

  Attributes:
    name: the op's name, which keys the policy tables.
    instance: tells two calls of the op apart.
    default: the category where the table has no row for ``name``.
    cast_to: a dtype every entering floating value is cast to, whatever the policy
      (``custom_fwd(cast_inputs=...)``).
    cast_under: the device type whose policies make that cast (``custom_fwd``'s
      ``device_type``); None for every one.
  """

  name: str
  instance: str
  default: Category | None
  cast_to: np.dtype | None = None
  cast_under: str | None = None

  def casts_under(self, device_type: str) -> bool:
    """Whether this ``custom_fwd(cast_inputs=...)`` region casts under a policy of
    ``device_type``: torch casts only where autocast is on for the decorator's device type."""
    return self.cast_to is not None and self.cast_under in (None, device_type)


_user_defaults: dict[str, Category | None] = {}
# Bumped by every registration (an op's category, a library function): the lookups of scopes and
# tracebacks are cached per version, so a registration reaches ops looked up before it.
_version = 0


def version() -> int:
  """The registrations' version: what is derived from them is stale once it changes."""
  return _version


def _registered() -> None:
  global _version
  _version += 1


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
  trace = compat.current_trace()
  numbers = _op_numbers.get(trace)
  if numbers is None:
    numbers = _op_numbers[trace] = itertools.count()
  with jax.named_scope(f"{_OP_PREFIX}{name}#{next(numbers)}"):
    yield


def call_as_op(name: str, fun: Callable, args: tuple, kwargs: dict) -> Any:
  """``fun(*args, **kwargs)`` as one call of op ``name``. An input it returns unchanged leaves
  through an identity eqn of the op, so it takes the op's dtype like its other results (torch's
  op returns the input it was given after autocast's cast)."""
  with op_region(name):
    out = fun(*args, **kwargs)
    inputs = {id(leaf) for leaf in jax.tree.leaves((args, kwargs)) if _floating_tracer(leaf)}
    if inputs and any(id(leaf) in inputs for leaf in jax.tree.leaves(out)):
      out = jax.tree.map(lambda leaf: op_output_p.bind(leaf) if id(leaf) in inputs else leaf, out)
    return out


def _floating_tracer(leaf: Any) -> bool:
  return isinstance(leaf, jax.core.Tracer) and jnp.issubdtype(leaf.dtype, jnp.inexact)


# The identity: an input an op region returns unchanged, as the op's result.
op_output_p = compat.identity_primitive("jaxamp_op_output")


_CUSTOM_FWD = "custom_fwd:"


def custom_fwd_name(dtype: np.dtype, device_type: str | None = None) -> str:
  """The op-region name of a ``custom_fwd(device_type=..., cast_inputs=dtype)`` function."""
  return f"{_CUSTOM_FWD}{device_type or ''}:{np.dtype(dtype).name}"


def register_op(
  op: str | Callable, name: str | None = None, *, category: Category | str | None = None
) -> Callable:
  """Makes a function one autocast op region named ``name``: a row of the policy tables.

  The policy's table decides the category of ``name``; ``category`` is used where the table has
  no row for it (for your own ops). Without either, the op runs in its inputs' dtypes, as torch
  runs the ops its lists leave out. Two forms:

  * ``register_op("my_loss", category="float32")`` is a decorator that wraps the function;
  * ``register_op(their_norm, name="layer_norm")`` recognises a function you cannot edit (a
    third-party library's) by identity, its code object in the traceback of the eqns traced
    inside it, and returns it unchanged.

  Example::

    @jaxamp.register_op("my_loss", category="float32")
    def my_loss(pred, target): ...

    jaxamp.register_op(other_lib.rms_norm, name="rms_norm")
  """
  if callable(op) and not isinstance(op, str):
    if not isinstance(name, str) or not name:
      raise TypeError(
        f"`name` must be a non-empty string; got {op!r} with name={name!r} "
        "(register_op(fun, name=...) recognises fun as op `name`)."
      )
    _set_default(name, category)
    register_library_op(op, name)
    return op
  if not isinstance(op, str) or not op:
    raise TypeError(f"`name` must be a non-empty string or the function to register; got {op!r}.")
  if name is not None:
    raise TypeError(f"register_op({op!r}) takes the op's name once; got name={name!r} too.")
  name = op
  _set_default(name, category)

  def decorate(fun: Callable) -> Callable:
    if not callable(fun):
      raise TypeError(f"register_op({name!r}) decorates a callable; got {fun!r}.")

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
      return call_as_op(name, fun, args, kwargs)

    setattr(wrapped, _OP_NAME, name)  # a rule keyed by the function names its op
    return wrapped

  return decorate


# The attribute naming the op of a function ``register_op``'s decorator made.
_OP_NAME = "_jaxamp_op_name"


def _set_default(name: str, category: Category | str | None) -> None:
  """Records ``name``'s fallback category. None adds nothing to an earlier registration; another
  category than an earlier one raises rather than silently changing every call of the op."""
  default, earlier = _as_category(category), _user_defaults.get(name)
  if default is not None and earlier is not None and default != earlier:
    raise ValueError(
      f"op {name!r} is registered with category {earlier.value!r}; registering "
      f"it again with {default.value!r} would silently change it."
    )
  _user_defaults[name] = default if default is not None else earlier
  _registered()  # named and library regions of ``name`` take this default too


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


# Functions recognised as op regions by identity: the code object of each, looked for among the
# frames of an eqn's traceback, -> the op names (policy-table rows) it stands for.
_library_codes: dict[types.CodeType, tuple[str, ...]] = {}
# Functions of libraries not imported yet: module -> [(attribute path, op name)], resolved once
# the module is in sys.modules (so registering Haiku's layers does not import Haiku).
_pending: dict[str, list[tuple[str, str, bool]]] = {}


def code_of(fun: Callable | types.CodeType) -> types.CodeType:
  """The code object a call of ``fun`` runs: through ``functools.wraps`` and ``jax.jit``
  wrappers (``inspect.unwrap``), of the function of a method; a code object is its own."""
  if isinstance(fun, types.CodeType):
    return fun
  inner = inspect.unwrap(fun)
  inner = getattr(inner, "__func__", inner)
  code = getattr(inner, "__code__", None)
  if not isinstance(code, types.CodeType):
    raise TypeError(
      f"{fun!r} has no Python code object to recognise in a traceback; register "
      "the Python function it runs (for a class, its `__call__`)."
    )
  return code


def register_library_op(fun: Callable, name: str) -> None:
  """Treats eqns traced inside ``fun`` (recognised by its code object) as op ``name``."""
  code = code_of(fun)
  if name not in _library_codes.get(code, ()):
    _library_codes[code] = (*_library_codes.get(code, ()), name)
    _registered()


def library_op_names(fun: Callable) -> tuple[str, ...]:
  """The op regions ``fun`` is recognised as (by its code object; a class by its ``__call__``, or
  Keras's ``call``), or that ``register_op``'s decorator made it; () for none."""
  if _pending:
    _resolve_pending()
  if isinstance(getattr(fun, _OP_NAME, None), str):
    return (getattr(fun, _OP_NAME),)
  if isinstance(fun, type):
    methods = (getattr(fun, attribute, None) for attribute in ("__call__", "call"))
    return next((names for m in methods if m and (names := library_op_names(m))), ())
  try:
    code = code_of(fun)
  except TypeError:
    return ()
  return _library_codes.get(code, ())


def known_op_regions() -> frozenset[str]:
  """Op regions autocast can recognise: library functions' and ``register_op``'s."""
  return frozenset(name for *_, name in library_ops.LIBRARY_OPS) | set(_user_defaults)


def resolve(module: str, path: str) -> Callable | types.CodeType:
  """The object at attribute ``path`` (``"LayerNorm.__call__"``) of imported ``module``; after
  ``<locals>`` (``"transform_with_state.<locals>.init_fn"``), the code of that nested function,
  which every closure it makes runs."""
  found = importlib.import_module(module)
  attributes, _, local = path.partition(".<locals>.")
  for attribute in attributes.split("."):
    found = getattr(found, attribute)
  if local:
    nested = (c for c in code_of(found).co_consts if isinstance(c, types.CodeType))
    found = next((c for c in nested if c.co_qualname == f"{attributes}.<locals>.{local}"), None)
    if found is None:
      raise AttributeError(f"{module}.{attributes} defines no function {local!r}")
  return found


def register_library_op_lazily(module: str, path: str, name: str, optional: bool = False) -> None:
  """``register_library_op`` of ``module``'s ``path`` now if ``module`` is imported, or else at
  the first trace after it is; an ``optional`` one only where that version of the module has it."""
  _pending.setdefault(module, []).append((path, name, optional))
  _resolve_pending()


def _resolve_pending() -> None:
  for module in [m for m in _pending if m in sys.modules]:
    spec = getattr(sys.modules[module], "__spec__", None)
    if getattr(spec, "_initializing", False):
      continue  # still being imported: wait for the next trace
    for path, name, optional in _pending.pop(module):
      try:
        register_library_op(resolve(module, path), name)
      except (AttributeError, TypeError) as error:
        if not (optional and isinstance(error, AttributeError)):  # optional: a newer version's
          warnings.warn(
            f"jaxamp cannot recognise {module}.{path} as op {name!r} ({error}); its "
            "eqns follow per-primitive rules.",
            RuntimeWarning,
            stacklevel=2,
          )


def _recognise_library_ops() -> None:
  """Recognises ``library_ops``' functions: jax's and optax's now (a rename fails at import),
  the optional libraries' once they are imported."""
  for module, path, name in library_ops.EAGER_OPS:
    register_library_op(resolve(module, path), name)
  for module, path, name in library_ops.EAGER_OPS_IF_PRESENT:
    try:
      register_library_op(resolve(module, path), name)
    except AttributeError:  # an older jax
      pass
  for module, path, name in library_ops.LAZY_OPS:
    register_library_op_lazily(module, path, name)
  for module, path, name in library_ops.LAZY_OPS_IF_PRESENT:
    register_library_op_lazily(module, path, name, optional=True)


class Marks(NamedTuple):
  """What an eqn's provenance says: kept, and the op regions around it, outermost first.

  ``positions`` holds, for each op, where inside the op's call the eqn was traced (the bytecode
  offsets of the frames from the op's function inward; None for named regions, which are unique
  per call). Within one call, positions of consecutive eqns do not go back.
  """

  kept: bool
  ops: tuple[OpRegion, ...]
  positions: tuple[tuple[int, ...] | None, ...] = ()


NO_MARKS = Marks(False, ())


# Calls of functions with custom derivatives: a registered function that is itself a custom_jvp
# or custom_vjp (jax.scipy.special.log_ndtr) is bound outside its Python code, and JAX traces its
# rules with the call's traceback, so only the primal body's eqns are traced inside it.
_CUSTOM_DERIVATIVE_CALLS = frozenset(
  {compat.primitives.custom_jvp_call_p, compat.primitives.custom_vjp_call_p}
)


def marks_of(eqn) -> Marks:
  """The region marks of one eqn, from its name stack and its traceback. A custom-derivative
  call lies also in the ops every eqn of its primal body lies in: it is that op's call, and its
  rules run inside the op, as its primal does."""
  own = _own_marks(eqn)
  if own.kept or eqn.primitive not in _CUSTOM_DERIVATIVE_CALLS:
    return own
  body = [marks_of(inner) for inner in eqn.params["call_jaxpr"].jaxpr.eqns]
  if not body or any(m.kept for m in body):
    return own
  first = body[0]
  wrapped = [
    (op, at)
    for op, at in zip(first.ops, first.positions, strict=True)
    if op not in own.ops and all(op in m.ops for m in body[1:])
  ]
  if not wrapped:
    return own
  return Marks(
    False, own.ops + tuple(op for op, _ in wrapped), own.positions + tuple(at for _, at in wrapped)
  )


def _own_marks(eqn) -> Marks:
  """The region marks of one eqn, from its name stack and its traceback."""
  scopes = compat.name_scopes(eqn)
  if not _KEPT_MARKS.isdisjoint(scopes):
    return Marks(True, ())
  if _pending:
    _resolve_pending()
  named = tuple(_named_op(scope, _version) for scope in scopes if scope.startswith(_OP_PREFIX))
  library, positions = _library_ops_of(compat.traceback_code_frames(eqn), _version)
  if not named and not library:
    return NO_MARKS
  return Marks(False, named + library, (None,) * len(named) + positions)


def site_of(eqn) -> tuple:
  """Where ``eqn`` was traced: its Python frames (code, offset), innermost first; () unknown.

  JAX keeps an eqn's traceback when it evaluates, differentiates or transposes the eqn, so the
  eqns of a recomputation (an Equinox closure-converted body evaluated again in a custom_vjp's
  backward) and their transposes share the site of the forward eqn they repeat."""
  return compat.traceback_code_frames(eqn)


@caches.lru_cache("regions.named_ops", maxsize=4096)
def _named_op(scope: str, version: int) -> OpRegion:
  """The op region a ``jaxamp.op:`` scope names, under registrations of ``version``."""
  name = scope[len(_OP_PREFIX) :].rpartition("#")[0]
  if not name.startswith(_CUSTOM_FWD):
    return OpRegion(name, scope, _user_defaults.get(name))
  device_type, _, dtype = name[len(_CUSTOM_FWD) :].rpartition(":")
  return OpRegion(name, scope, None, np.dtype(jnp.dtype(dtype)), device_type or None)


@caches.lru_cache("regions.library_ops", maxsize=4096)
def _library_ops_of(
  frames: tuple[tuple[types.CodeType, int], ...], version: int
) -> tuple[tuple[OpRegion, ...], tuple[tuple[int, ...], ...]]:
  """The recognised library functions among ``frames`` (innermost first), outermost first,
  under registrations of ``version``.

  Returned with each one's position inside its call: the bytecode offsets of the frames from
  the function's own inward, which grow (compared as tuples) as the call runs on. The instance
  names the call site (the caller's frame); two calls from one site (a loop, a linen module's
  wrapper) are told apart by the position going back (``op_calls.op_calls``).
  """
  found, positions = [], []
  for index, (code, offset) in enumerate(frames):
    for name in _library_codes.get(code, ()):
      caller, at = frames[index + 1] if index + 1 < len(frames) else (None, 0)
      site = f"{caller.co_filename}:{caller.co_qualname}" if caller is not None else ""
      found.append(OpRegion(name, f"{name}@{site}:{at}", _user_defaults.get(name)))
      positions.append(tuple(offset for _, offset in reversed(frames[: index + 1])))
  return tuple(reversed(found)), tuple(reversed(positions))


_recognise_library_ops()
edit.install_op_names(edit.OpNames(library_op_names, known_op_regions))
