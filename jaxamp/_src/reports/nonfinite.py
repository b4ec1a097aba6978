"""``jaxamp.nonfinite_report``: where the Inf and NaN values of a pytree are, leaf by leaf.

When the scaler skips a step, ``found_inf`` says only that some gradient overflowed.
``nonfinite_report(tree)`` counts, for every array leaf of any pytree (gradients, activations,
parameters), its NaN, +Inf and -Inf values and its largest finite magnitude. It is plain ``jnp``
code, one variadic reduction (a single pass) over each leaf, so it runs under ``jit``, ``vmap`` and
``shard_map``, and costs about as much as the scaler's ``jnp.all(jnp.isfinite(g))`` check. Its
result is a pytree of ten arrays (the per-leaf numbers stacked, the paths static), cheap to return
from a jitted train step. On the host, ``str(report)`` lists the non-finite leaves by path, worst
first::

  2 of 4 leaves non-finite: 12 inf (+inf 12, -inf 0), 0 nan; max finite 6.55e4
  params/Dense_1/kernel: 8 inf, 0 nan, max finite 6.1e4 (+inf 8, -inf 0; 48 values)
  params/Dense_1/bias: 4 inf, 0 nan, max finite 0 (+inf 4, -inf 0; 4 values)

Counts are int32. A leaf's counts are exact (leaves of 2**31 or more elements are counted in
chunks, saturating at ``2**31 - 1``); totals over leaves saturate at ``2**31 - 1`` instead of
wrapping. Under ``shard_map`` the report is about the device's shard, like any ``jnp`` reduction:
``lax.psum`` the counts and ``lax.pmax`` ``max_finite`` over the mesh axes for a global one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.integrations import state_tree

_INT32_MAX = int(np.iinfo(np.int32).max)
_MAX_EXACT = _INT32_MAX  # masks with more elements than this are counted in chunks
_CHUNK = 2**30  # elements per chunk; a chunk's int32 count never overflows


class LeafStats(NamedTuple):
  """The non-finite values of one array leaf.

  Attributes:
    nan: the number of NaN values, int32 scalar.
    posinf: the number of +Inf values, int32 scalar.
    neginf: the number of -Inf values, int32 scalar.
    max_finite: the largest magnitude among the finite values (0 when there are none): float32
      for float8, float16, bfloat16 and float32 leaves (exact: each is a float32), float64
      for float64 leaves, float32 0 for integer, bool and other non-float leaves.
    size: the number of elements of the leaf (saturating at ``2**31 - 1``), int32 scalar.

  Complex leaves count their real and imaginary parts as separate values. In
  ``NonfiniteReport.per_leaf`` each field is a vector with one entry per leaf.
  """

  nan: jax.Array
  posinf: jax.Array
  neginf: jax.Array
  max_finite: jax.Array
  size: jax.Array

  inf = property(lambda self: _inf(self), doc="The number of +Inf and -Inf values.")
  nonfinite = property(lambda self: _nonfinite(self), doc="The number of NaN, +Inf, -Inf values.")


@jax.tree_util.register_static
class LeafPaths:
  """The leaves a report covers: their paths and the tree they came from (static, no arrays)."""

  def __init__(self, paths: tuple[str, ...], treedef: Any) -> None:
    self.paths = paths
    self.treedef = treedef  # of the tree of ``LeafStats`` placeholders, one per array leaf

  def __hash__(self) -> int:
    return hash((self.paths, self.treedef))

  def __eq__(self, other: Any) -> bool:
    return (
      isinstance(other, LeafPaths) and self.paths == other.paths and self.treedef == other.treedef
    )

  def __repr__(self) -> str:
    return f"LeafPaths({len(self.paths)} leaves)"


class NonfiniteReport(NamedTuple):
  """The non-finite values of a pytree: per leaf and in total.

  ``str(report)`` (also ``report.format()``, ``print(report)``) lists the non-finite leaves worst
  first; ``report.debug_print()`` prints that from inside ``jit``; ``report.any_nonfinite`` is a
  bool array usable in ``jit``; ``report.nonfinite_paths()`` the non-finite leaves' paths;
  ``report.leaves`` the ``LeafStats`` of every leaf in a pytree of the input's structure. The
  host methods need an unbatched report (not one returned from ``vmap``).

  The per-leaf numbers are kept stacked, one vector per statistic, so that returning a report
  from ``jit`` costs a few output buffers rather than five per leaf.

  Attributes:
    per_leaf: a ``LeafStats`` of vectors: entry ``i`` is about the leaf ``paths[i]``. Array leaves
      are covered (an ``nnx.Variable`` as the array it holds); ``None`` and non-array leaves,
      e.g. the functions in an Equinox module, are left out.
    nan: NaN values over all leaves, int32 scalar (saturating at ``2**31 - 1``).
    posinf: +Inf values over all leaves, int32 scalar (saturating).
    neginf: -Inf values over all leaves, int32 scalar (saturating).
    max_finite: the largest finite magnitude over all leaves, float32 (float64 if a leaf is).
    nonfinite_leaves: the number of leaves holding a NaN or an Inf, int32 scalar.
    structure: the leaves' paths and tree structure (static: no arrays, part of the treedef).
  """

  per_leaf: LeafStats
  nan: jax.Array
  posinf: jax.Array
  neginf: jax.Array
  max_finite: jax.Array
  nonfinite_leaves: jax.Array
  structure: LeafPaths

  @property
  def paths(self) -> tuple[str, ...]:
    """The "/"-joined key paths of the leaves, in tree order, e.g. ``params/Dense_0/kernel``."""
    return self.structure.paths

  @property
  def num_leaves(self) -> int:
    """The number of array leaves the report covers."""
    return len(self.structure.paths)

  @property
  def leaves(self) -> Any:
    """A ``LeafStats`` of scalars for every leaf, in a pytree of the input tree's structure."""
    return jax.tree.unflatten(
      self.structure.treedef, [self.leaf(i) for i in range(self.num_leaves)]
    )

  def leaf(self, index: int) -> LeafStats:
    """The ``LeafStats`` of the leaf ``paths[index]``."""
    return LeafStats(*(field[..., index] for field in self.per_leaf))

  inf = property(lambda self: _inf(self), doc="+Inf and -Inf values over all leaves (saturating).")
  nonfinite = property(lambda self: _nonfinite(self), doc="NaN, +Inf and -Inf values (saturating).")

  @property
  def any_nonfinite(self) -> jax.Array:
    """Whether any leaf holds a NaN or an Inf, as a bool scalar array (usable inside ``jit``)."""
    return jnp.asarray(self.nonfinite_leaves) > 0

  def items(self) -> list[tuple[str, LeafStats]]:
    """``(path, stats)`` of every leaf, in tree order."""
    return [(path, self.leaf(i)) for i, path in enumerate(self.paths)]

  def nonfinite_paths(self) -> tuple[str, ...]:
    """The paths of the leaves holding a NaN or an Inf, worst first (host only)."""
    return tuple(path for path, _ in _worst_first(self))

  def format(self, limit: int | None = None) -> str:
    """The report as text (host only): a summary line, then one line per non-finite leaf.

    Leaves are ordered by their number of non-finite values, most first, ties by path; ``limit``
    caps the number of leaf lines. When every leaf is finite the text is one line,
    ``all N leaves finite, max finite M``.
    """
    if _is_traced(self):
      raise TypeError(
        "a `NonfiniteReport` can be formatted on the host only; inside `jit` call "
        "`report.debug_print()`, or return the report from the jitted function."
      )
    if np.ndim(self.nan):
      raise TypeError(
        f"this `NonfiniteReport` is batched (from `vmap`: shape {np.shape(self.nan)}); format "
        "one example's, `jax.tree.map(lambda x: x[i], report)`."
      )
    worst = _worst_first(self)
    max_finite = _fmt(float(np.asarray(self.max_finite)))
    if not worst:
      return f"all {self.num_leaves} leaves finite, max finite {max_finite}"
    pos, neg, nan = (int(np.asarray(v)) for v in (self.posinf, self.neginf, self.nan))
    lines = [
      f"{len(worst)} of {self.num_leaves} leaves non-finite: {pos + neg} inf "
      f"(+inf {pos}, -inf {neg}), {nan} nan; max finite {max_finite}"
    ]
    shown = worst if limit is None else worst[:limit]
    for path, s in shown:
      pos, neg, nan, size = (int(np.asarray(v)) for v in (s.posinf, s.neginf, s.nan, s.size))
      lines.append(
        f"{path}: {pos + neg} inf, {nan} nan, max finite "
        f"{_fmt(float(np.asarray(s.max_finite)))} "
        f"(+inf {pos}, -inf {neg}; {size} values)"
      )
    if len(shown) < len(worst):
      lines.append(f"... and {len(worst) - len(shown)} more non-finite leaves")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.format()

  def debug_print(self, limit: int | None = None) -> None:
    """Prints ``format(limit)`` from inside ``jit`` (a ``jax.debug.callback``), or right away."""
    jax.debug.callback(lambda report: print(report.format(limit)), self)


def nonfinite_report(tree: Any) -> NonfiniteReport:
  """Counts the NaN, +Inf and -Inf values and the largest finite magnitude of every leaf.

  Works on any pytree of arrays: gradients, activations, parameters, optimizer states, nnx
  ``State`` objects. Floating leaves (float16, bfloat16, float32, float64, complex) are
  inspected; integer and bool leaves are finite (zero counts, ``max_finite`` 0). jit-, vmap- and
  shard_map-compatible; the result is a pytree of arrays.

  Example::

    grads = jax.grad(loss_fn)(params, batch)
    report = jaxamp.nonfinite_report(grads)     # inside or outside jit
    print(report)                               # on the host: the non-finite leaves, worst first
    report.any_nonfinite                        # bool array

  Args:
    tree: a pytree whose leaves are arrays or Python scalars. Leaves of other types are left out.

  Returns:
    A ``NonfiniteReport``: per-leaf ``LeafStats`` and totals.
  """
  tree_of_stats = jax.tree.map(_leaf_stats, tree, is_leaf=state_tree.is_variable)
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree_of_stats, is_leaf=_is_stats)
  structure = LeafPaths(tuple(path_name(path) for path, _ in with_paths), treedef)
  stats = [s for _, s in with_paths]
  zero = jnp.zeros([], jnp.int32)
  if not stats:
    empty, no_max = jnp.zeros([0], jnp.int32), jnp.zeros([0], jnp.float32)
    return NonfiniteReport(
      LeafStats(empty, empty, empty, no_max, empty),
      zero,
      zero,
      zero,
      jnp.zeros([], jnp.float32),
      zero,
      structure,
    )
  # one vector per statistic (max_finite promotes to float64 if a leaf is float64)
  per_leaf = LeafStats(*(jnp.stack(values) for values in zip(*stats, strict=True)))
  return NonfiniteReport(
    per_leaf=per_leaf,
    nan=_saturating_sum(per_leaf.nan),
    posinf=_saturating_sum(per_leaf.posinf),
    neginf=_saturating_sum(per_leaf.neginf),
    max_finite=jnp.max(per_leaf.max_finite),
    nonfinite_leaves=jnp.sum(per_leaf.nonfinite > 0, dtype=jnp.int32),
    structure=structure,
  )


# --- per leaf ------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex)


def _leaf_stats(x: Any) -> LeafStats | None:
  """The ``LeafStats`` of one leaf (an ``nnx.Variable``'s array), None for a non-array leaf."""
  x = state_tree.tree_unwrap(x)
  if not _is_array(x):
    return None
  size = jnp.asarray(min(int(np.size(x)), _INT32_MAX), jnp.int32)
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.inexact):  # ints, bools, float0 gradients, PRNG keys
    zero = jnp.zeros([], jnp.int32)
    return LeafStats(zero, zero, zero, jnp.zeros([], jnp.float32), size)
  x = lax.stop_gradient(jnp.asarray(x))  # counts have no derivative; the report may be an aux
  if jnp.issubdtype(dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)])
  x = x.ravel()
  if x.size <= _MAX_EXACT:
    nan, posinf, neginf, max_finite = _reduce_stats(x, axis=0)
  else:  # chunks whose int32 counts cannot wrap; the zero padding is finite and small
    rows = -(-x.size // _CHUNK)
    x = jnp.pad(x, (0, rows * _CHUNK - x.size)).reshape(rows, _CHUNK)
    nan, posinf, neginf, max_finite = _reduce_stats(x, axis=1)
    nan, posinf, neginf = (_saturating_sum(c) for c in (nan, posinf, neginf))
    max_finite = jnp.max(max_finite)
  # float32 holds every narrower float exactly (float8 has no implicit promotion to it).
  wide = jnp.float64 if x.dtype.itemsize > 4 else jnp.float32
  return LeafStats(nan, posinf, neginf, max_finite.astype(wide), size)


def _reduce_stats(x: jax.Array, axis: int) -> tuple[jax.Array, ...]:
  """NaN, +Inf and -Inf counts (int32) and the largest finite magnitude along ``axis`` of ``x``.

  One variadic reduction: a single pass over ``x``. Separate ``jnp.sum``s and a ``jnp.max`` are
  not always fused by XLA: on CPU each one materialised its mask, 14x the cost of
  ``jnp.all(jnp.isfinite(x))``, where this costs about as much as that check.
  """
  as_count = lambda mask: mask.astype(jnp.int32)
  operands = (
    as_count(jnp.isnan(x)),
    as_count(x == jnp.inf),
    as_count(x == -jnp.inf),
    jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.zeros([], x.dtype)),
  )
  zero = jnp.zeros([], jnp.int32)
  inits = (zero, zero, zero, jnp.zeros([], x.dtype))
  return tuple(lax.reduce(operands, inits, _add_counts_max_finite, (axis,)))


def _add_counts_max_finite(a: tuple, b: tuple) -> tuple:
  return a[0] + b[0], a[1] + b[1], a[2] + b[2], jnp.maximum(a[3], b[3])


def _inf(counts: LeafStats | NonfiniteReport) -> jax.Array:
  """The +Inf and -Inf values of ``counts`` (saturating)."""
  return _saturating_add(counts.posinf, counts.neginf)


def _nonfinite(counts: LeafStats | NonfiniteReport) -> jax.Array:
  """The NaN, +Inf and -Inf values of ``counts`` (saturating)."""
  return _saturating_add(counts.nan, _inf(counts))


def _saturating_add(a: Any, b: Any) -> jax.Array:
  """``a + b`` for non-negative int32 counts, ``2**31 - 1`` where the sum would wrap."""
  a, b = jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32)
  return jnp.where(a > _INT32_MAX - b, jnp.int32(_INT32_MAX), a + b)


def _saturating_sum(counts: jax.Array) -> jax.Array:
  """The sum of a vector of non-negative int32 counts, saturating at ``2**31 - 1``."""
  return lax.reduce(counts, jnp.int32(0), _saturating_add, (0,))


# --- paths and host formatting -------------------------------------------------------------------


def _is_stats(x: Any) -> bool:
  return isinstance(x, LeafStats)


def _key_name(entry: Any) -> str:
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key)
  return str(entry)


def path_name(path: tuple) -> str:
  """A key path as "/"-joined names: ``params/Dense_0/kernel``, ``layers/0/weight``; "." for ()."""
  return "/".join(_key_name(entry) for entry in path) or "."


def _worst_first(report: NonfiniteReport) -> list[tuple[str, LeafStats]]:
  """The non-finite leaves' ``(path, stats)``, most non-finite values first, ties by path."""
  stats = report.per_leaf
  totals = sum(np.asarray(c, np.int64) for c in (stats.nan, stats.posinf, stats.neginf))
  rows = sorted(
    (-int(total), path, i)
    for i, (path, total) in enumerate(zip(report.paths, np.atleast_1d(totals), strict=True))
    if total
  )
  return [(path, report.leaf(i)) for _, path, i in rows]


def _is_traced(report: NonfiniteReport) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(report))


def _fmt(value: float) -> str:
  """Three significant digits, exponents without padding: 6.1e4, 0.5, 1e-5, 0, inf."""
  text = f"{value:.3g}"
  if "e" in text:
    mantissa, exponent = text.split("e")
    text = f"{mantissa}e{int(exponent)}"
  return text
