"""``jaxamp.explain``: what autocast does to a function, eqn by eqn, as data and as a table.

``explain(f, device_type="cuda")(*args)`` runs the autocast interpreter once with a recorder
installed (the rewrite caches are bypassed, so every sub-jaxpr is visited) and returns one
``Decision`` per primitive, inside jit, scan, cond and the other higher-order primitives too.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxamp._src import autocast as autocast_lib
from jaxamp._src import compat, context, policy, rules
from jaxamp._src.table import Table


class Decision(NamedTuple):
  """What autocast did to one eqn.

  Attributes:
    path: where the eqn sits: "" at top level, else e.g. "jit(log_softmax)" or "scan/cond.branch1".
    primitive: the JAX primitive's name.
    rule: the rule applied, as one line: a category ("lower", "float32", "promote", "native"),
      an op region ("op softmax: float32"), "kept" (a region run as written), a bias add, or a
      higher-order primitive whose body was rewritten.
    torch_ops: the torch ops the policy row that decided it realises (empty for unlisted ops).
    traced: the input dtypes when the function was traced.
    inputs: the input dtypes the primitive ran on.
    outputs: its output dtypes.
    casts: converts inserted for this eqn (0 when a cached cast was reused).
    category: the category applied ("lower", "float32", ...), None where the rule applies none
      (kept regions, traced dtypes, higher-order primitives, Python scalars).
    op: the op region the eqn belongs to, None outside op calls.
  """

  path: str
  primitive: str
  rule: str
  torch_ops: tuple[str, ...]
  traced: tuple[str, ...]
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  casts: int
  category: str | None = None
  op: str | None = None


class Explanation(NamedTuple):
  """All decisions autocast made for one call, in evaluation order.

  ``str(explanation)`` is a table; ``explanation.decisions`` the data; ``summary()`` counts by
  rule; ``changed()`` the decisions whose inputs or outputs differ from the traced dtypes.
  """

  device_type: str
  dtype: str
  decisions: tuple[Decision, ...]

  def summary(self) -> dict[str, int]:
    return dict(collections.Counter(d.rule for d in self.decisions))

  def changed(self) -> tuple[Decision, ...]:
    return tuple(d for d in self.decisions if d.inputs != d.traced or d.casts)

  def to_dicts(self) -> list[dict[str, Any]]:
    return [d._asdict() for d in self.decisions]

  def __str__(self) -> str:
    header = ("path", "primitive", "rule", "traced -> inputs", "outputs", "casts", "torch ops")
    rows = [
      (
        d.path or ".",
        d.primitive,
        d.rule,
        f"{_dtypes(d.traced)} -> {_dtypes(d.inputs)}",
        _dtypes(d.outputs),
        str(d.casts),
        ", ".join(d.torch_ops[:4]) + (", ..." if len(d.torch_ops) > 4 else ""),
      )
      for d in self.decisions
    ]
    title = (
      f"autocast({self.device_type!r}, {self.dtype}): {len(rows)} primitives, "
      f"{sum(d.casts for d in self.decisions)} casts"
    )
    return text_table(title, header, rows)


def text_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  """``title``, then ``header`` and ``rows`` in left-aligned columns (explain's and
  precision_report's tables)."""
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  lines = [title]
  for row in [header, *rows]:
    cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines)


def _dtypes(dtypes: tuple[str, ...]) -> str:
  return "(" + ", ".join(dtypes) + ")"


def _names(values) -> tuple[str, ...]:
  return tuple(str(getattr(compat.typeof(v), "dtype", "?")) for v in values)


def torch_ops_of(table: Table, eqn, ruling: rules.Ruling) -> tuple[str, ...]:
  if ruling.op is not None:
    return table.op_rows.get(ruling.op, ())
  return table.primitive_rows.get(eqn.primitive, ())


def explain(fun: Callable, *, device_type: str | None = None, dtype=None) -> Callable:
  """A function taking ``fun``'s arguments and returning the ``Explanation`` of its autocast.

  Example::

    print(jaxamp.explain(loss_fn, device_type="cuda")(params, batch))
  """
  settings = policy.make_policy(device_type, dtype)
  if not callable(fun):
    raise TypeError(f"explain takes a callable; got {fun!r} of type {type(fun).__name__}.")

  def explained(*args, **kwargs) -> Explanation:
    decisions: list[Decision] = []

    def record(path, eqn, ruling, ran_on, outs, casts, active):
      traced = tuple(str(a.aval.dtype) for a in eqn.invars)
      category = ruling.category.value if ruling.category is not None else None
      decisions.append(
        Decision(
          path,
          eqn.primitive.name,
          ruling.describe(),
          torch_ops_of(active.table, eqn, ruling),
          traced,
          _names(ran_on),
          _names(outs),
          casts,
          category,
          ruling.op,
        )
      )

    # Arrays are abstracted; other leaves (a module's string field, flags) stay static, as
    # autocast takes them.
    leaves, tree = jax.tree.flatten((args, kwargs))
    is_array = [autocast_lib.is_array(leaf) for leaf in leaves]
    arrays = [leaf for leaf, array in zip(leaves, is_array, strict=True) if array]

    def run(arrays):
      given = iter(arrays)
      a, k = jax.tree.unflatten(
        tree, [next(given) if array else leaf for leaf, array in zip(leaves, is_array, strict=True)]
      )
      autocast_lib.call(fun, settings, a, k)

    with context.recording(record):
      jax.eval_shape(run, arrays)
    return Explanation(settings.device_type, settings.dtype.name, tuple(decisions))

  return explained
