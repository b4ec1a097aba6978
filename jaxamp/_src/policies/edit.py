"""A table changed by a user's rules (``Policy.with_rules``), and tables shown as rows of text.

A rule's key names what a row covers: a torch op as the tables name it (``"softmax"``,
``"layer_norm"``, ``"exp"``), an op region (``"log_sigmoid"``), a JAX primitive object
(``lax.exp_p``) or a library function recognised as an op region (``jax.nn.gelu``,
``flax.linen.LayerNorm``). Its value is a ``Category`` or a dtype: float32 is ``FLOAT32`` and the
policy's own lower-precision dtype ``LOWER``. The result is a new table; the built-in one and
every registration are left as they are.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxamp._src import compat
from jaxamp._src.policies.table import LOW_DTYPES, Category, LazyPrimitive, Row, Table, Variant

# Categories only an op region can have: FORBIDDEN refuses the op on entering it. (A
# FLOAT32_INSIDE primitive computes in float32 and returns its widest floating input's dtype.)
_OP_ONLY = {
  Category.FORBIDDEN: "raises on entering an op region; a primitive has none",
}


class OpNames(NamedTuple):
  """How autocast names op regions, handed in by ``regions.py`` (the tables import nothing of
  the interpreter): the op regions a function is recognised as, and every op region it knows."""

  of_function: Callable[[Callable], tuple[str, ...]]
  known: Callable[[], frozenset[str]]


_op_names: list[OpNames] = []


def install_op_names(names: OpNames) -> None:
  """Makes ``names`` answer which op regions a rule's key names (done once, by ``regions``)."""
  _op_names[:] = [names]


def _known_op_regions() -> frozenset[str]:
  return _op_names[0].known() if _op_names else frozenset()


class Target(NamedTuple):
  """What one rule changes: the torch ops it names, the primitives and op regions it covers."""

  torch_ops: tuple[str, ...]
  primitives: tuple[Any, ...] = ()
  ops: tuple[str, ...] = ()


def with_rules(table: Table, rules: Mapping, low: np.dtype, tables: Iterable[Table]) -> Table:
  """``table`` with the rows ``rules`` name given their new categories (``low``: the policy's
  lower-precision dtype; ``tables``: every device type's, whose torch op names a key may use)."""
  if not isinstance(rules, Mapping):
    raise TypeError(
      "`with_rules` takes a mapping {torch op name, JAX primitive or library function: "
      f"jaxamp.Category or dtype}}; got {type(rules).__name__}."
    )
  rows = list(table.rows)
  decided: dict[Any, tuple[Any, Category]] = {}  # primitive or op region -> (key, category)
  for key, value in rules.items():
    target = resolve(key, rows, tables)
    category = category_of(value, low, key)
    for part in (*target.primitives, *target.ops):
      earlier, earlier_category = decided.setdefault(part, (key, category))
      if earlier_category != category:
        what = f"op region {part!r}" if isinstance(part, str) else f"primitive {_name(part)!r}"
        raise ValueError(
          f"The rules for {_rule_key(earlier)} (jaxamp.{earlier_category}) and {_rule_key(key)} "
          f"(jaxamp.{category}) both set {what}; keep one of them."
        )
    if target.primitives and category in _OP_ONLY:
      names = ", ".join(_name(p) for p in target.primitives)
      what = _key(key) if isinstance(key, compat.Primitive) else f"{_key(key)} (primitive {names})"
      raise ValueError(f"{category} cannot apply to {what}: it {_OP_ONLY[category]}.")
    rows = _changed(rows, target, category)
  return Table(table.device_type, table.default_dtype, tuple(rows))


def category_of(value: Any, low: np.dtype, key: Any) -> Category:
  """A rule's value as a category: a ``Category`` (or its value, "float32"), or a dtype."""
  if isinstance(value, Category):
    return value
  if isinstance(value, str) and value in {c.value for c in Category}:
    return Category(value)
  try:
    dtype = None if value is None else jnp.dtype(value)  # jnp.dtype(None) is the default float
  except TypeError:
    dtype = None
  if dtype == jnp.float32:
    return Category.FLOAT32
  if dtype == low:
    return Category.LOWER
  categories = ", ".join(f"jaxamp.{c}" for c in Category)
  hint = ""
  if value is None:
    hint = (
      " For an op that runs in the dtypes of its inputs (torch's unlisted ops) use "
      "jaxamp.Category.NATIVE; to run a part of the model as written, give `autocast` "
      "`overrides={place: None}` or wrap it in `jaxamp.autocast_disabled()`."
    )
  elif dtype in LOW_DTYPES:
    hint = (
      f" This policy's lower-precision dtype is {low.name}; to run a part of the model in "
      f"{dtype.name}, give it its own policy with `overrides=` (by scope or module type), or "
      f"use `jaxamp.policy(device_type, dtype=jnp.{dtype.name})`."
    )
  elif dtype is not None and jnp.issubdtype(dtype, jnp.floating):
    hint = f" autocast runs ops in float32 at most; {dtype.name} values pass through as they are."
  raise ValueError(
    f"The rule for {_key(key)} must be one of {categories}, jnp.float32 (FLOAT32) or "
    f"jnp.{low.name} (LOWER); got {f'jnp.{dtype.name}' if dtype is not None else repr(value)}."
    f"{hint}"
  )


def resolve(key: Any, rows: list[Row], tables: Iterable[Table]) -> Target:
  """What ``key`` names: a torch op or op region (its row here, or in another device type's
  table, or a known op region), a primitive, or a library function's op regions."""
  if isinstance(key, compat.Primitive | Variant):
    key = _row_key(key, rows)
    return Target(_torch_ops_of(key, rows), primitives=(key,))
  if isinstance(key, str):
    return _named(key, rows, tables)
  if callable(key):
    names = _op_names[0].of_function(key) if _op_names else ()
    if not names:
      function = f"{_key(key)}.__call__" if isinstance(key, type) else _key(key)
      raise ValueError(
        f"{_key(key)} is not a function autocast recognises as an op. Name the op instead "
        f'(a torch op name such as "layer_norm"), or register it first: '
        f'`jaxamp.register_op({function}, name="my_op")` and then a rule for "my_op".'
      )
    return Target(names, ops=names)
  raise TypeError(
    "A rule's key is a torch op name (str), a JAX primitive (jax.lax.exp_p) or a library "
    f"function (jax.nn.gelu, flax.linen.LayerNorm); got {key!r} of type {type(key).__name__}."
  )


def _named(name: str, rows: list[Row], tables: Iterable[Table]) -> Target:
  for row in rows:
    if name in row.torch_ops:
      return Target(row.torch_ops, row.primitives, row.ops)
  for row in rows:
    if name in row.ops:
      return Target((name,), ops=(name,))
  for table in tables:  # a torch op another device type lists, realised by the same keys
    for row in table.rows:
      if name in row.torch_ops:
        return Target((name,), row.primitives, row.ops)
  if name in _known_op_regions():
    return Target((name,), ops=(name,))
  choices = sorted(
    {n for t in tables for row in t.rows for n in row.torch_ops + row.ops} | _known_op_regions()
  )
  close = difflib.get_close_matches(name, choices, n=5, cutoff=0.6)
  suggestion = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
  raise ValueError(
    f"{name!r} is neither a torch op of jaxamp's tables nor an op region it knows.{suggestion} "
    f"The {len(choices)} valid names are the torch ops of docs/coverage.md and the op regions "
    "of jaxamp.functional, jax.nn, optax, flax, Haiku and Equinox functions and of "
    "jaxamp.register_op; print(jaxamp.policy(device_type)) lists a table's rows."
  )


def _row_key(primitive: Any, rows: list[Row]) -> Any:
  """How the rows name ``primitive``: itself, or the ``LazyPrimitive`` that resolves to it."""
  for row in rows:
    for key in row.primitives:
      if isinstance(key, LazyPrimitive) and key.resolve() is primitive:
        return key
  return primitive


def _torch_ops_of(key: Any, rows: list[Row]) -> tuple[str, ...]:
  for row in rows:
    if key in row.primitives:
      return row.torch_ops
  return ()


def _changed(rows: list[Row], target: Target, category: Category) -> list[Row]:
  """``rows`` with ``target``'s keys in one row of ``category``: the row covering exactly them
  changed in place, else taken out of the rows covering them and given a row of their own."""
  keys = (set(target.primitives), set(target.ops))
  for index, row in enumerate(rows):
    if (set(row.primitives), set(row.ops)) == keys:
      return [*rows[:index], row._replace(category=category), *rows[index + 1 :]]
  kept = []
  for row in rows:
    row = row._replace(
      primitives=tuple(p for p in row.primitives if p not in keys[0]),
      ops=tuple(o for o in row.ops if o not in keys[1]),
    )
    if row.primitives or row.ops:
      kept.append(row)
  return [*kept, Row(target.torch_ops, category, target.primitives, target.ops)]


def _name(key: Any) -> str:
  """A primitive's, variant's or op region's name."""
  if isinstance(key, str):
    return key
  return str(key) if isinstance(key, Variant | LazyPrimitive) else key.name


def _key(key: Any) -> str:
  if isinstance(key, compat.Primitive | Variant):
    return f"primitive {_name(key)!r}"
  if isinstance(key, str):
    return repr(key)
  return getattr(key, "__qualname__", repr(key))


def _rule_key(key: Any) -> str:
  """A rule's key as a user wrote it: a name, a primitive, or a function or class."""
  return _key(key) if isinstance(key, str | compat.Primitive | Variant) else f"function {_key(key)}"


# --- tables as text ------------------------------------------------------------------------------


def places(row: Row) -> str:
  """Where a row applies: "primitive `exp`, op region `softmax`"."""
  parts = [f"primitive `{_name(p)}`" for p in row.primitives]
  return ", ".join(parts + [f"op region `{o}`" for o in row.ops])


class Change(NamedTuple):
  """A key whose category differs between two tables (None: no row, so NATIVE or the op's
  registered default)."""

  key: str
  torch_ops: tuple[str, ...]
  before: Category | None
  after: Category | None

  def __str__(self) -> str:
    before = self.before.value if self.before is not None else "(no row)"
    after = self.after.value if self.after is not None else "(no row)"
    ops = ", ".join(self.torch_ops)
    return f"{self.key}: {before} -> {after}" + (f"  (torch: {ops})" if ops else "")


@dataclasses.dataclass(frozen=True)
class Diff:
  """The changes from one table to another, one per primitive or op region; iterable, and
  printed one change a line."""

  changes: tuple[Change, ...]

  def __iter__(self) -> Iterator[Change]:
    return iter(self.changes)

  def __str__(self) -> str:
    if not self.changes:
      return "no changes"
    return "\n".join(map(str, self.changes))

  def __bool__(self) -> bool:
    return bool(self.changes)

  def __len__(self) -> int:
    return len(self.changes)


def diff(table: Table, base: Table) -> Diff:
  """What ``table`` changes of ``base``: every primitive and op region whose category differs."""
  changes = []
  for kind, ours, theirs, named in (
    ("primitive", table.primitive_categories, base.primitive_categories, "primitive_rows"),
    ("op region", table.op_categories, base.op_categories, "op_rows"),
  ):
    for key in sorted(set(ours) | set(theirs), key=_name):
      if ours.get(key) != theirs.get(key):
        torch_ops = getattr(table, named).get(key) or getattr(base, named).get(key, ())
        changes.append(Change(f"{kind} `{_name(key)}`", torch_ops, theirs.get(key), ours.get(key)))
  return Diff(tuple(changes))


def text(table: Table, dtype: np.dtype, title: str) -> str:
  """``table``'s rows as markdown, one per torch op as ``docs/coverage.md`` writes them."""
  lines = [title, "", "| torch op | category | jaxamp |", "|---|---|---|"]
  for row in table.rows:
    for op in row.torch_ops or (places(row),):
      lines.append(f"| `{op}` | {row.category.value} | {places(row)} |")
  return "\n".join(lines)
