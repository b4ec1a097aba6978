"""``jaxamp.explain``: what autocast does to a function, eqn by eqn, as data and as a table.

``explain(f, device_type="cuda")(*args)`` runs the autocast interpreter once with a recorder
installed (the rewrite caches are bypassed, so every sub-jaxpr is visited) and returns one
``Decision`` per primitive, inside jit, scan, cond and the other higher-order primitives too.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from jaxamp._src import compat
from jaxamp._src.autocast import context, rules
from jaxamp._src.autocast import overrides as overrides_lib
from jaxamp._src.autocast import transform as autocast_lib
from jaxamp._src.integrations import nnx_modules
from jaxamp._src.policies import policy as policy_lib
from jaxamp._src.policies.table import Table


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
    override: the key of ``autocast``'s ``overrides`` that decided the eqn (its scope pattern,
      or its class's name), None where none did.
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
  override: str | None = None


class Explanation(NamedTuple):
  """All decisions autocast made for one call, in evaluation order.

  ``str(explanation)`` is a table that fits 100 columns (each rule's torch ops listed once, below
  it); ``table(full=True)`` the table with every column in full; ``explanation.decisions`` the
  data; ``summary()`` counts by rule; ``changed()`` the decisions whose inputs or outputs differ
  from the traced dtypes.

  Attributes:
    device_type: the policy's device type.
    dtype: its lower-precision dtype's name.
    decisions: one ``Decision`` per eqn, in evaluation order.
  """

  device_type: str
  dtype: str
  decisions: tuple[Decision, ...]

  def summary(self) -> dict[str, int]:
    """The number of decisions per ``Decision.rule``."""
    return dict(collections.Counter(d.rule for d in self.decisions))

  def changed(self) -> tuple[Decision, ...]:
    """The decisions that cast: inputs in other dtypes than traced, or converts inserted."""
    return tuple(d for d in self.decisions if d.inputs != d.traced or d.casts)

  def to_dicts(self) -> list[dict[str, Any]]:
    """The decisions as dicts, one per ``Decision`` (its fields as keys)."""
    return [d._asdict() for d in self.decisions]

  def __str__(self) -> str:
    return self.table()

  def table(self, full: bool = False) -> str:
    """The decisions as a table: by default one that fits ``WIDTH`` columns (short dtype names,
    long cells cut, each rule's torch ops once below the table); ``full=True``: every cell in full
    and the torch ops on every row."""
    title = (
      f"autocast({self.device_type!r}, {self.dtype}): {len(self.decisions)} primitives, "
      f"{sum(d.casts for d in self.decisions)} casts"
    )
    if full:
      header = ("path", "primitive", "rule", "traced -> inputs", "outputs", "casts", "torch ops")
      rows = [
        (
          d.path or ".",
          d.primitive,
          _rule(d),
          f"{_dtypes(d.traced)} -> {_dtypes(d.inputs)}",
          _dtypes(d.outputs),
          str(d.casts),
          ", ".join(d.torch_ops[:4]) + (", ..." if len(d.torch_ops) > 4 else ""),
        )
        for d in self.decisions
      ]
      return text_table(title, header, rows)
    header = ("path", "primitive", "rule", "inputs (traced->ran)", "outputs", "casts")
    rows = [
      (
        d.path or ".",
        d.primitive,
        _rule(d),
        _short_dtypes(
          t if t == r else f"{t}->{r}"
          for t, r in zip(map(short_dtype, d.traced), map(short_dtype, d.inputs), strict=True)
        ),
        _short_dtypes(map(short_dtype, d.outputs)),
        str(d.casts),
      )
      for d in self.decisions
    ]
    cut = {0: ("left", 8), 2: ("right", 12), 3: ("right", len(header[3]))}
    table = text_table(title, header, rows, width=WIDTH, cut=cut)
    return "\n".join([table, *_torch_ops_lines(self.decisions)])


# The width of the default tables of ``explain`` and ``precision_report``.
WIDTH = 100


def text_table(
  title: str,
  header: tuple[str, ...],
  rows: list[tuple[str, ...]],
  *,
  width: int | None = None,
  cut: dict[int, tuple[str, int]] | None = None,
) -> str:
  """``title``, then ``header`` and ``rows`` in left-aligned columns (explain's and
  precision_report's tables).

  With ``width``, the columns of ``cut`` (index -> (the side of a long cell that is cut, "left"
  or "right", marked "..."; the least width)) are narrowed, the widest first, until every line
  fits ``width`` characters where their least widths allow it.
  """
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  cut = cut or {}
  if width is not None:
    while sum(widths) + 2 * (len(widths) - 1) > width:
      narrowable = [i for i, (_, least) in cut.items() if widths[i] > max(least, 4)]
      if not narrowable:
        break
      widths[max(narrowable, key=lambda i: widths[i])] -= 1
  lines = [title]
  for row in [header, *rows]:
    cells = (
      _cut(cell, w, cut[i][0] if i in cut else None).ljust(w)
      for i, (cell, w) in enumerate(zip(row, widths, strict=True))
    )
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines)


def _cut(cell: str, width: int, side: str | None) -> str:
  if side is None or len(cell) <= width:
    return cell
  return "..." + cell[len(cell) - width + 3 :] if side == "left" else cell[: width - 3] + "..."


def short_dtype(name: str) -> str:
  """A dtype's name as the default tables write it: "f32", "bf16", "i32", "u8", "c64"."""
  for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
    if name.startswith(long) and name[len(long) :].isdigit():
      return short + name[len(long) :]
  if name.startswith("complex") and name[7:].isdigit():
    return "c" + name[7:]
  return name


def _short_dtypes(names) -> str:
  return ", ".join(names)


def _torch_ops_lines(decisions) -> list[str]:
  """One line per distinct torch op list of ``decisions`` (the first rule that has it names it),
  cut to ``WIDTH`` characters."""
  seen: dict[tuple[str, ...], str] = {}
  for d in decisions:
    if d.torch_ops and d.torch_ops not in seen:
      seen[d.torch_ops] = d.rule
  if not seen:
    return []
  lines = ["torch ops of each rule (table(full=True) lists them on every row):"]
  for ops, rule in seen.items():
    lines.append(_fit(f"  {rule}: ", ops, WIDTH))
  return lines


def _fit(prefix: str, items: tuple[str, ...], width: int) -> str:
  """``prefix`` and as many of ``items`` as fit ``width`` characters, then how many are left."""
  for n in range(len(items), 0, -1):
    rest = f", ... ({len(items) - n} more)" if n < len(items) else ""
    line = prefix + ", ".join(items[:n]) + rest
    if len(line) <= width:
      return line
  return (prefix + f"{len(items)} ops")[:width]


def _rule(decision: Decision) -> str:
  """The rule column: the rule, after the override that decided it ("[router] kept")."""
  if decision.override is None:
    return decision.rule
  return f"[{decision.override}] {decision.rule}"


def _dtypes(dtypes: tuple[str, ...]) -> str:
  return "(" + ", ".join(dtypes) + ")"


def _names(values) -> tuple[str, ...]:
  return tuple(str(getattr(compat.typeof(v), "dtype", "?")) for v in values)


def torch_ops_of(table: Table, eqn, ruling: rules.Ruling) -> tuple[str, ...]:
  if ruling.op is not None:
    return table.op_rows.get(ruling.op, ())
  return table.primitive_rows.get(eqn.primitive, ())


def explain(
  fun: Callable,
  device_type: str | None = None,
  *,
  dtype=None,
  policy: policy_lib.Policy | None = None,
  overrides: Mapping | None = None,
) -> Callable:
  """A function taking ``fun``'s arguments and returning the ``Explanation`` of its autocast
  (with ``autocast``'s ``device_type`` and ``dtype``, or ``policy``, and ``overrides``).

  Example::

    print(jaxamp.explain(loss_fn, device_type="cuda")(params, batch))
  """
  amp_policy = autocast_lib.given_policy(policy, device_type, dtype)
  amp_overrides = overrides_lib.make(overrides, amp_policy)
  named = amp_overrides is not None and amp_overrides.by_scope
  if not callable(fun):
    raise TypeError(f"explain takes a callable; got {fun!r} of type {type(fun).__name__}.")

  def explained(*args, **kwargs) -> Explanation:
    decisions: list[Decision] = []
    fun_called, args = nnx_modules.module_as_argument(fun, args)

    def record(path, eqn, ruling, ran_on, outs, casts, amp_policy, override):
      traced = tuple(str(a.aval.dtype) for a in eqn.invars)
      category = ruling.category.value if ruling.category is not None else None
      decisions.append(
        Decision(
          path,
          eqn.primitive.name,
          ruling.describe(),
          torch_ops_of(amp_policy.table, eqn, ruling),
          traced,
          _names(ran_on),
          _names(outs),
          casts,
          category,
          ruling.op,
          override,
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
      traced = fun_called
      if named and nnx_modules.contains_modules((a, k)):
        traced = nnx_modules.naming_calls(fun_called)  # nnx submodules named by their paths
      autocast_lib.call(traced, amp_policy, a, k, amp_overrides)

    with context.recording(record):
      jax.eval_shape(run, arrays)
    return Explanation(amp_policy.device_type, amp_policy.requested_dtype.name, tuple(decisions))

  return explained
