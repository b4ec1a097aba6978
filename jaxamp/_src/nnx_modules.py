"""Flax nnx modules as autocast arguments: their state updates must survive the transform.

autocast flattens its arguments to arrays, so a module would be rebuilt inside the traced
function and its updates (BatchNorm statistics, RNG counters) would land on that copy. As
``nnx.jit`` does, arguments holding modules are split into a graph definition and state, merged
inside, and the state the function leaves behind is written back to the caller's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _nnx():
  from flax import nnx

  return nnx


def contains_modules(tree: Any) -> bool:
  """Whether ``tree`` holds an nnx graph node (a Module, Rngs, Optimizer, ...)."""
  is_node = _nnx().graph.is_graph_node
  return any(is_node(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_node))


def call_keeping_state(call: Callable, fun: Callable, args: tuple, kwargs: dict) -> Any:
  """``call(pure_fun, args, kwargs)`` for a ``fun`` that may update nnx modules in its args."""
  nnx = _nnx()
  is_node = nnx.graph.is_graph_node
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
  is_module = [is_node(leaf) for leaf in leaves]
  modules = [leaf for leaf, m in zip(leaves, is_module, strict=True) if m]
  others = [leaf for leaf, m in zip(leaves, is_module, strict=True) if not m]
  graphdef, state = nnx.split(modules)

  def pure_fun(state, others):
    inner_modules, inner_others = iter(nnx.merge(graphdef, state)), iter(others)
    inner = [next(inner_modules) if m else next(inner_others) for m in is_module]
    inner_args, inner_kwargs = jax.tree.unflatten(treedef, inner)
    out = fun(*inner_args, **inner_kwargs)
    return out, nnx.state([leaf for leaf, m in zip(inner, is_module, strict=True) if m])

  out, new_state = call(pure_fun, (state, others), {})
  nnx.update(modules, new_state)
  return out
