"""Flax nnx modules as autocast arguments: their state updates must survive the transform.

autocast flattens its arguments to arrays, so a module would be rebuilt inside the traced
function and its updates (BatchNorm statistics, RNG counters) would land on that copy. As
``nnx.jit`` does, arguments holding modules are split into a graph definition and state, merged
inside, and the state the function leaves behind is written back to the caller's modules.

flax stays off autocast's path until the user imports it: no nnx object exists before
``flax.nnx`` is in ``sys.modules``, so the checks here look there instead of importing it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax


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


def call_module(module: Any, *args: Any, **kwargs: Any) -> Any:
  """``module(*args, **kwargs)``: what ``autocast(module)`` runs, with the module an argument."""
  return module(*args, **kwargs)


def _pure_call(
  fun: Callable, graphdef: Any, is_module: tuple, treedef: Any, state: Any, others: list
) -> tuple[Any, Any]:
  """``fun`` on the modules rebuilt from ``state``; its output and the modules' new state."""
  nnx = _nnx()
  inner_modules, inner_others = iter(nnx.merge(graphdef, state)), iter(others)
  inner = [next(inner_modules) if m else next(inner_others) for m in is_module]
  inner_args, inner_kwargs = jax.tree.unflatten(treedef, inner)
  out = fun(*inner_args, **inner_kwargs)
  return out, nnx.state([leaf for leaf, m in zip(inner, is_module, strict=True) if m])


def call_keeping_state(call: Callable, fun: Callable, args: tuple, kwargs: dict) -> Any:
  """``call(pure_fun, args, kwargs)`` for a ``fun`` that may update nnx modules in its args.

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
  pure_fun = functools.partial(_pure_call, fun, graphdef, is_module, treedef)
  out, new_state = call(pure_fun, (state, others), {})
  old = dict(nnx.to_flat_state(state))
  changed = [
    (path, var)
    for path, var in nnx.to_flat_state(new_state)
    if path not in old or not _same(var, old[path])
  ]
  if changed:
    nnx.update(modules, nnx.from_flat_state(changed))
  return out


def _same(new: Any, old: Any) -> bool:
  """Whether a Variable of the new state holds the very value (and type) it was passed in."""
  return type(new) is type(old) and new.get_value() is old.get_value()
