"""Flax nnx modules as autocast arguments: their state updates must survive the transform.

autocast flattens its arguments to arrays, so a module would be rebuilt inside the traced
function and its updates (BatchNorm statistics, RNG counters) would land on that copy. As
``nnx.jit`` does, arguments holding modules are split into a graph definition and state, merged
inside, and the state the function leaves behind is written back to the caller's modules.

flax stays off autocast's path until the user imports it: no nnx object exists before
``flax.nnx`` is in ``sys.modules``, so the checks here look there instead of importing it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxamp._src import compat


def _nnx():
  from flax import nnx

  return nnx


def _imported_nnx():
  """``flax.nnx`` if it is imported, else None (then no nnx object exists)."""
  return sys.modules.get("flax.nnx")


def contains_modules(tree: Any) -> bool:
  """Whether ``tree`` holds an nnx graph node (a Module, Rngs, Optimizer, ...)."""
  nnx = _imported_nnx()
  if nnx is None:
    return False
  is_node = nnx.graph.is_graph_node
  return any(is_node(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_node))


def is_module(fun: Any) -> bool:
  """Whether ``fun`` is a callable nnx Module."""
  nnx = _imported_nnx()
  return nnx is not None and isinstance(fun, nnx.Module) and callable(fun)


def register_data_type(type_: type) -> None:
  """Makes nnx Modules take ``type_`` values as data attributes (once flax.nnx is imported).

  nnx decides on assignment whether an attribute is data (state, traversed by ``nnx.split``) or
  static; a pytree of an unregistered type holding a module is an error there.
  """
  nnx = _imported_nnx()
  if nnx is not None:
    nnx.register_data_type(type_)


def with_call(module: Any, call: Callable) -> Any:
  """nnx ``module`` with ``call`` as its ``__call__``: an instance of a subclass of its class that
  shares its attributes (``__dict__``), what ``autocast(module)`` returns.

  It is a module of the user's class, so in a model it keeps the paths of ``nnx.state``
  (``block/linear/kernel``: a float32 checkpoint loads with ``nnx.update``), ``nnx.Optimizer``
  trains it, and nnx's traversals (``nnx.capture``, ``model.eval()``) see it. Sharing the
  attributes, it and ``module`` see each other's updates, Variables and submodules made in
  ``__call__`` included."""
  wrapped = object.__new__(_subclass_with_call(type(module), call))
  object.__setattr__(wrapped, "__dict__", vars(module))
  return wrapped


@functools.cache
def _subclass_with_call(module_type: type, call: Callable) -> type:
  # A subclass of a Module declares whether it is a pytree; it stays what its base is.
  options = (
    {"pytree": module_type._pytree__is_pytree} if hasattr(module_type, "_pytree__is_pytree") else {}
  )
  name = f"Autocast{module_type.__name__}"
  namespace = {"__call__": call, "__module__": module_type.__module__, "__qualname__": name}
  return types.new_class(name, (module_type,), options, lambda ns: ns.update(namespace))


def call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
  """``module(*args, **kwargs)``: what ``autocast(module)`` runs, with the module an argument."""
  return module(*args, **kwargs)


def module_as_argument(fun: Callable, args: tuple) -> tuple[Callable, tuple]:
  """``(fun, args)``, or for an nnx module ``fun`` (``explain(model)(x)``) ``call_module`` with the
  module its first argument: traced as an argument, a closed-over module's state writes would
  meet concrete Variables."""
  if is_module(fun):
    return call_module, (fun, *args)
  return fun, args


# The tag of the nnx update context that carries a call's graph changes back to its modules.
_UPDATE_TAG = "jaxamp.autocast"


def _pure_call(
  fun: Callable,
  graphdef: Any,
  is_module: tuple,
  treedef: Any,
  scoped: bool,
  in_update_context: bool,
  state: Any,
  others: list,
) -> tuple[Any, Any, Any]:
  """``fun`` on the modules rebuilt from ``state``: its output, the modules' new state and their
  new graph definition.

  With ``in_update_context``, the modules are rebuilt and split in ``_UPDATE_TAG``'s nnx update
  context, so that the new graph can be merged back into the caller's modules. With ``scoped``,
  each submodule's calls are traced under a ``jax.named_scope`` of its attribute path
  (``named_calls``)."""
  nnx = _nnx()
  tagged = lambda split_or_merge, *inner: (
    split_or_merge(_UPDATE_TAG, *inner) if in_update_context else contextlib.nullcontext(nnx)
  )
  with tagged(nnx.merge_context, True) as ctx:
    merged = ctx.merge(graphdef, state)
  inner_modules, inner_others = iter(merged), iter(others)
  inner = [next(inner_modules) if m else next(inner_others) for m in is_module]
  inner_args, inner_kwargs = jax.tree.unflatten(treedef, inner)
  with named_calls(merged) if scoped else contextlib.nullcontext():
    out = fun(*inner_args, **inner_kwargs)
  with tagged(nnx.split_context) as ctx:
    new_graphdef, new_state = ctx.split(merged)
  # A Variable kept as a Ref (``nnx.var_defaults(ref=True)``) was written in place; a trace
  # cannot return a Ref.
  held = [(path, var) for path, var in nnx.to_flat_state(new_state) if not _holds_ref(var)]
  return out, nnx.from_flat_state(held), new_graphdef


def _holds_ref(leaf: Any) -> bool:
  """Whether ``leaf`` is a Variable whose value is a mutable array reference."""
  raw = getattr(leaf, "get_raw_value", None)
  return raw is not None and compat.is_ref(raw())


# Module instance id -> its attribute path, while ``named_calls`` is active.
_paths: dict[int, tuple[str, ...]] = {}
# The paths of the scoped module calls being traced, innermost last (per thread).
_calling = threading.local()


@contextlib.contextmanager
def named_calls(modules: list) -> Iterator[None]:
  """Traces each submodule's calls under ``jax.named_scope``s of its attribute path in its
  argument (``blocks``, ``0``, ``attn``), so that ``overrides`` can name nnx modules by place
  ("linear2", "blocks/0/attn", "blocks/*/mlp").

  nnx puts no module names on the name stack; the classes' ``__call__`` are wrapped for the
  duration of the trace and restored after it (the wrapper only adds scopes)."""
  nnx = _nnx()
  found = {}
  for path, node in nnx.iter_graph(modules):
    if isinstance(node, nnx.Module) and len(path) > 1:
      found[id(node)] = tuple(map(str, path[1:]))
  wrapped = {}
  for cls in {type(m) for _, m in nnx.iter_graph(modules) if id(m) in found}:
    call = cls.__dict__.get("__call__") or cls.__call__
    if getattr(call, "_jaxamp_scoped", False) or not callable(call):
      continue
    wrapped[cls] = cls.__dict__.get("__call__")
    cls.__call__ = _scoped(call)
  _paths.update(found)
  try:
    yield
  finally:
    for cls, original in wrapped.items():
      if original is None:
        del cls.__call__
      else:
        cls.__call__ = original
    for key in found:
      _paths.pop(key, None)


def naming_calls(fun: Callable) -> Callable:
  """``fun`` with the calls of the nnx modules among its arguments traced under scopes of their
  attribute paths (``named_calls``)."""

  @functools.wraps(fun)
  def named(*args, **kwargs):
    is_node = _nnx().graph.is_graph_node
    modules = [x for x in jax.tree.leaves((args, kwargs), is_leaf=is_node) if is_node(x)]
    with named_calls(modules):
      return fun(*args, **kwargs)

  return named


def _scoped(call: Callable) -> Callable:
  @functools.wraps(call)
  def scoped_call(self, *args, **kwargs):
    path = _paths.get(id(self))
    if path is None:
      return call(self, *args, **kwargs)
    calling = _calling.__dict__.setdefault("paths", [])
    with contextlib.ExitStack() as scopes:
      for name in _relative(path, calling[-1] if calling else ()):
        scopes.enter_context(jax.named_scope(name))
      calling.append(path)
      try:
        return call(self, *args, **kwargs)
      finally:
        calling.pop()

  scoped_call._jaxamp_scoped = True
  return scoped_call


def _relative(path: tuple[str, ...], outer: tuple[str, ...]) -> tuple[str, ...]:
  """The scopes a call of the module at ``path`` adds inside a call of the one at ``outer``: the
  rest of its path below that module's, or all of it where it is not below (a sibling called
  from outside its parent)."""
  return path[len(outer) :] if path[: len(outer)] == outer else path


def call_keeping_state(
  call: Callable, fun: Callable, args: tuple, kwargs: dict, scoped: bool = False
) -> Any:
  """``call(pure_fun, args, kwargs)`` for a ``fun`` that may update nnx modules in its args
  (with ``scoped``, their submodules' calls traced under scopes of their attribute paths).

  Only Variables whose value changed are written back: a module that ``fun`` only reads may be
  one closed over from an enclosing ``jit`` or ``grad``, where nnx forbids writes.
  """
  nnx = _nnx()
  is_node = nnx.graph.is_graph_node
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
  is_module = tuple(is_node(leaf) for leaf in leaves)
  modules = [leaf for leaf, m in zip(leaves, is_module, strict=True) if m]
  others = [leaf for leaf, m in zip(leaves, is_module, strict=True) if not m]
  graphdef, state = nnx.split(modules)
  # A partial of module-level values, so autocast's trace cache finds it again on the next call.
  pure_fun = functools.partial(_pure_call, fun, graphdef, is_module, treedef, scoped, False)
  out, new_state, _ = call(pure_fun, (state, others), {})
  old = dict(nnx.to_flat_state(state))
  changed = [
    (path, var)
    for path, var in nnx.to_flat_state(new_state)
    if path not in old or not _same(var, old[path])
  ]
  if not all(_can_update(modules, path) for path, _ in changed):
    return _call_changing_graph(call, fun, modules, others, is_module, treedef, scoped)
  if changed:
    nnx.update(modules, nnx.from_flat_state(changed))
  return out


_ABSENT = object()


def _can_update(modules: list, path: tuple) -> bool:
  """Whether ``nnx.update`` can write a Variable at ``path`` of ``modules``: the nodes above it
  exist, and it holds a Variable or nothing yet (``sow``). A Variable in place of another value
  (``self.scale = nnx.Param(...)`` over a ``None``) or in a new submodule needs a graph change."""
  graph = _nnx().graph
  node = modules
  for key in path:
    impl = graph.get_node_impl(node)
    if impl is None or isinstance(node, _nnx().Variable):
      return False
    node = impl.node_dict(node).get(key, _ABSENT)
    if node is _ABSENT:
      return key == path[-1]
  return isinstance(node, _nnx().Variable) or compat.is_ref(node)


def _call_changing_graph(
  call: Callable,
  fun: Callable,
  modules: list,
  others: list,
  is_module: tuple,
  treedef: Any,
  scoped: bool,
) -> Any:
  """``call_keeping_state`` for a call that changes its modules' graph (a submodule or Variable
  made in ``__call__``): ``nnx.update`` cannot add a subgraph, so the call runs again in an nnx
  update context, as ``nnx.jit`` runs, and its new graph is merged into the modules."""
  nnx = _nnx()
  with nnx.update_context(_UPDATE_TAG):
    with nnx.split_context(_UPDATE_TAG) as ctx:
      graphdef, state = ctx.split(modules)
    pure_fun = functools.partial(_pure_call, fun, graphdef, is_module, treedef, scoped, True)
    out, new_state, new_graphdef = call(pure_fun, (state, others), {})
    with nnx.merge_context(_UPDATE_TAG, False) as ctx:
      ctx.merge(new_graphdef, new_state)
  return out


def _same(new: Any, old: Any) -> bool:
  """Whether a leaf of the new state (a Variable, or an array a module holds as a plain attribute:
  ``nnx.Conv(mask=...)``) holds the very value (and type) it was passed in."""
  value = lambda leaf: leaf.get_value() if isinstance(leaf, _nnx().Variable) else leaf
  return type(new) is type(old) and value(new) is value(old)
