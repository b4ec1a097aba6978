"""Finding and replacing one node type anywhere inside an optimizer state tree.

Optimizer states nest: ``optax.chain`` makes tuples, ``optax.MultiSteps`` and
``optax.inject_hyperparams`` wrap the inner state in NamedTuples, flax's ``TrainState`` keeps it in
``.opt_state`` and ``nnx.Optimizer`` keeps it in ``.opt_state`` with every array wrapped in an
``nnx.OptState`` Variable. All of them are pytrees, so one ``jax.tree`` walk that stops at the
wanted node type finds it in any of them; the helpers here add the Variable (un)wrapping.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

SEARCHED = (
  "every node of the pytree, including `optax.chain` tuples, "
  "`MultiStepsState.inner_opt_state`, `InjectHyperparamsState.inner_state`, "
  "flax `TrainState.opt_state` and `nnx.Optimizer.opt_state`"
)


def _nnx() -> Any:
  """``flax.nnx`` if the program already imported it (only then can its objects be here)."""
  return sys.modules.get("flax.nnx")


def is_variable(x: Any) -> bool:
  """Whether ``x`` is an ``nnx.Variable`` (e.g. the ``nnx.OptArray`` of ``nnx.Optimizer``)."""
  nnx = _nnx()
  return nnx is not None and isinstance(x, nnx.Variable)


def tree_unwrap(x: Any) -> Any:
  """The array inside an ``nnx.Variable``, or ``x`` itself."""
  return x.get_value() if is_variable(x) else x


def tree_find_nodes(tree: Any, node_type: type) -> list[Any]:
  """Every node of ``tree`` that is an instance of ``node_type`` (outermost ones only)."""
  is_node = lambda x: isinstance(x, node_type)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_node) if is_node(x)]


def tree_find_one(tree: Any, node_type: type, tree_name: str) -> Any:
  """The single ``node_type`` node in ``tree``; a ValueError if there is none or several."""
  nodes = tree_find_nodes(tree, node_type)
  if not nodes:
    raise ValueError(
      f"`{tree_name}` contains no `{node_type.__name__}`: searched {SEARCHED}; got a "
      f"{type(tree).__name__}. Create the optimizer with `jaxamp.dynamic_loss_scale(...)` and "
      "pass its state (or the TrainState / nnx.Optimizer holding it)."
    )
  if len(nodes) > 1:
    raise ValueError(
      f"`{tree_name}` contains {len(nodes)} `{node_type.__name__}` nodes, expected exactly one; "
      "pass the sub-tree of the scaler you mean."
    )
  return nodes[0]


def tree_replace_nodes(tree: Any, node_type: type, fn: Callable[[Any], Any]) -> Any:
  """``tree`` with each ``node_type`` node ``n`` replaced by ``fn(n)``, same structure elsewhere.

  An ``nnx.Optimizer`` (anything nnx with an ``opt_state``) is updated in place and returned, as
  nnx objects are mutable: its ``opt_state`` attribute is replaced by the new tree.
  """
  is_node = lambda x: isinstance(x, node_type)
  replace = lambda t: jax.tree.map(lambda x: fn(x) if is_node(x) else x, t, is_leaf=is_node)
  nnx = _nnx()
  if nnx is not None and isinstance(tree, nnx.Pytree) and hasattr(tree, "opt_state"):
    tree.opt_state = nnx.data(replace(tree.opt_state))
    return tree
  return replace(tree)


def tree_replace_one(tree: Any, node_type: type, fn: Callable[[Any], Any], tree_name: str) -> Any:
  """``tree_replace_nodes`` for a tree holding exactly one ``node_type`` node (else ValueError)."""
  tree_find_one(tree, node_type, tree_name)
  return tree_replace_nodes(tree, node_type, fn)
