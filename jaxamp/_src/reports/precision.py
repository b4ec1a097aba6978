"""``jaxamp.precision_report``: where an autocast function loses precision, primitive by primitive.

``precision_report(f, device_type="cuda")(*args)`` evaluates ``f``'s jaxpr twice on ``args``,
eagerly and primitive by primitive: once as written (the float32 program, for float32 inputs)
and once with the autocast interpreter. Sub-jaxprs are evaluated on concrete values too (jit,
checkpoint and the primal bodies of custom_jvp/custom_vjp directly, cond by its branch taken,
scan and while_loop as Python loops), so every primitive inside them is seen; the other higher-order
primitives (shard_map, custom_linear_solve), and any in an ``autocast_disabled()`` block, are
reported as one primitive each. For each primitive of the autocast program it reports

* its *local* error: its autocast outputs against the same primitive run in float32 on the same
  inputs (the values it ran on, the float16/bfloat16 ones converted to float32), the precision
  the primitive itself loses (for a cast to 16 bits, its rounding);
* its *accumulated* error: its autocast outputs against the float32 program's values of the same
  variables, the precision lost by everything up to and including it.

An error is the max-norm relative error ``max|a - b| / max|b|`` of the autocast outputs ``a``
against the reference ``b`` (``b``'s finite values; ``max|b|`` at least float32's smallest normal
number), the largest over the eqn's floating outputs: float16 rounding is about ``2**-11``,
bfloat16 rounding ``2**-8``. Equal values (infinities and NaN included) differ by 0, an Inf or NaN
where the reference has another value by Inf. Integer, boolean and key outputs are ignored.

The numbers are those of the unfused program, one primitive at a time; under ``jit`` XLA may keep
some fused 16-bit intermediates in float32 and do a little better. Both programs run on the
given arrays (keep the batch small: the float32 program's intermediates are held until compared),
and effectful primitives (callbacks, prints) run once per program.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import pathlib
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import lax

from jaxamp._src import compat
from jaxamp._src.autocast import context, higher_order, interpreter, rules
from jaxamp._src.autocast import overrides as overrides_lib
from jaxamp._src.autocast import transform as autocast_lib
from jaxamp._src.integrations import nnx_modules
from jaxamp._src.policies.policy import Policy
from jaxamp._src.policies.table import LOW_DTYPES
from jaxamp._src.reports import explain

prims = compat.primitives
_FLOAT32 = np.dtype(np.float32)
_TINY = float(np.finfo(np.float32).tiny)
_ORDERS = ("accumulated", "local", "max_abs")


class PrecisionEntry(NamedTuple):
  """The precision one primitive of the autocast program loses.

  An eqn evaluated several times (in a loop body, or a traced function called twice) is one
  entry: its errors and ``max_abs`` are the largest over its evaluations, ``count`` their number.

  Attributes:
    path: where the eqn sits, as ``explain``'s ``Decision.path``: "" at top level, else e.g.
      "jit(layer)", "scan" or "while.body/cond.branch1".
    primitive: the JAX primitive's name.
    source: "file:line" of the innermost frame of the user's code the eqn was traced from (not
      JAX, jaxamp or an installed library; one of theirs when no other frame is left).
    name_stack: the ``jax.named_scope`` names (flax module paths) it was traced under, "/"-joined
      (jaxamp's own region marks left out: ``rule`` says what they did).
    torch_ops: the torch ops of the policy row that decided its dtype (as ``explain``'s).
    rule: the rule that decided its dtype, as ``explain``'s ``Decision.rule``.
    compute_dtype: the dtype it ran in: the widest dtype of its floating inputs (of its floating
      outputs if it has none), None if neither.
    local_error: its autocast outputs against itself run in float32 on the same inputs; None where
      it cannot be rerun (effects) or has no floating outputs.
    accumulated_error: its autocast outputs against the float32 program's values; None where the
      float32 program did not evaluate it (a cond that took another branch, fewer loop steps) or it
      has no floating outputs.
    max_abs: the largest magnitude of its floating autocast outputs (Inf: an overflow; NaN values
      ignored), None without floating outputs.
    count: how many times it was evaluated.
  """

  path: str
  primitive: str
  source: str
  name_stack: str
  torch_ops: tuple[str, ...]
  rule: str
  compute_dtype: str | None
  local_error: float | None
  accumulated_error: float | None
  max_abs: float | None
  count: int


class PrecisionReport(NamedTuple):
  """The precision an autocast function loses, per primitive, worst first.

  ``str(report)`` is a table that fits 100 columns; ``table(full=True)`` adds the name stacks
  and torch ops and writes every cell in full; ``report.entries`` the data (``to_dicts()`` as
  dicts); ``sorted_by("local")`` reorders by local error; ``worst(n)`` keeps the first ``n``
  entries; ``where_error_starts()`` keeps the primitives that lose precision themselves.

  Attributes:
    device_type: the policy's device type.
    dtype: its lower-precision dtype's name.
    entries: one ``PrecisionEntry`` per eqn evaluated, in ``order``.
    order: what the entries are sorted by, descending: "accumulated" (ties by local error),
      "local" (ties by accumulated error) or "max_abs". Missing values sort last.
  """

  device_type: str
  dtype: str
  entries: tuple[PrecisionEntry, ...]
  order: str = "accumulated"

  def sorted_by(self, order: str = "accumulated") -> PrecisionReport:
    """The report sorted by ``order``: "accumulated", "local" or "max_abs", worst first."""
    if order not in _ORDERS:
      raise ValueError(f"`order` must be one of {_ORDERS}; got {order!r}.")
    return self._replace(entries=_sort(self.entries, order), order=order)

  def worst(self, n: int = 10) -> PrecisionReport:
    """The report cut to its ``n`` worst entries (in its order)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
      raise ValueError(f"`n` must be a non-negative int; got {n!r}.")
    return self._replace(entries=self.entries[:n])

  def to_dicts(self) -> list[dict[str, Any]]:
    """The entries as dicts, one per ``PrecisionEntry`` (its fields as keys)."""
    return [e._asdict() for e in self.entries]

  def where_error_starts(self, n: int = 10, at_least: float = 0.0) -> PrecisionReport:
    """Where the error starts: the ``n`` primitives with the largest *local* error (above
    ``at_least``), worst first.

    The accumulated error of a primitive includes what its inputs carry, so the float32
    primitives downstream of a lossy one rank high in the default order although they lose
    nothing themselves; their local error (the primitive run in float32 on the same inputs) is 0.
    This view keeps the primitives that lose precision themselves (a 16-bit dot, a cast to 16 bits,
    an overflow), which is where a fix (``autocast_disabled``, a float32 op) would go.
    """
    if isinstance(at_least, bool) or not isinstance(at_least, int | float) or at_least < 0:
      raise ValueError(f"`at_least` must be a non-negative number; got {at_least!r}.")
    starts = tuple(
      e
      for e in self.entries
      if e.local_error is not None and (math.isnan(e.local_error) or e.local_error > at_least)
    )
    return self._replace(entries=starts).sorted_by("local").worst(n)

  def __str__(self) -> str:
    return self.table()

  def table(self, full: bool = False) -> str:
    """The entries as a table: by default one that fits ``explain.WIDTH`` columns (short dtype
    names, long cells cut, no name stacks or torch ops); ``full=True``: every column in full."""
    order = {"local": "local error (where the error starts)"}.get(
      self.order, self.order.replace("_", " ") + " error"
    )
    title = (
      f"precision_report({self.device_type!r}, {self.dtype}): {len(self.entries)} primitives, "
      f"worst {order} first"
    )
    note = "error = max|autocast - float32| / max|float32|"
    if full:
      header = ("path", "primitive", "rule", "dtype", "local", "accumulated", "max |out|")
      header += ("runs", "source", "name stack", "torch ops")
      rows = [
        (
          e.path or ".",
          e.primitive,
          e.rule,
          e.compute_dtype or "-",
          _number(e.local_error),
          _number(e.accumulated_error),
          _number(e.max_abs),
          str(e.count),
          _short_source(e.source),
          e.name_stack,
          ", ".join(e.torch_ops[:3]) + (", ..." if len(e.torch_ops) > 3 else ""),
        )
        for e in self.entries
      ]
      return explain.text_table(f"{title}; {note}", header, rows)
    header = ("path", "primitive", "rule", "dtype", "local", "accumulated", "max |out|", "source")
    rows = [
      (
        e.path or ".",
        e.primitive,
        e.rule,
        explain.short_dtype(e.compute_dtype or "-"),
        _short_number(e.local_error),
        _short_number(e.accumulated_error),
        _short_number(e.max_abs),
        _short_source(e.source),
      )
      for e in self.entries
    ]
    cut = {0: ("left", 10), 1: ("right", 11), 2: ("right", 12), 7: ("left", 22)}
    table = explain.text_table(title, header, rows, width=explain.WIDTH, cut=cut)
    return f"{table}\n{note}; local: the op's own; table(full=True): all columns"


def _number(value: float | None) -> str:
  return "-" if value is None else f"{value:.1e}"


def _short_number(value: float | None) -> str:
  """``_number`` with a one-digit exponent where it has one: "3.8e-4", "1.0e+12"."""
  text = _number(value)
  return text.replace("e-0", "e-").replace("e+0", "e+")


def _short_source(source: str) -> str:
  return os.path.basename(source) if source else "-"


def _sort(entries, order: str) -> tuple[PrecisionEntry, ...]:
  def value(x: float | None) -> float:
    return -math.inf if x is None or math.isnan(x) else x

  if order == "accumulated":
    key = lambda e: (value(e.accumulated_error), value(e.local_error))
  elif order == "local":
    key = lambda e: (value(e.local_error), value(e.accumulated_error))
  else:
    key = lambda e: (value(e.max_abs), value(e.accumulated_error))
  return tuple(sorted(entries, key=key, reverse=True))


def precision_report(
  fun: Callable,
  device_type: str | None = None,
  *,
  dtype=None,
  policy: Policy | None = None,
  overrides: Mapping | None = None,
) -> Callable:
  """A function taking ``fun``'s arguments and returning the ``PrecisionReport`` of its autocast
  (with ``autocast``'s ``device_type`` and ``dtype``, or ``policy``, and ``overrides``).

  The arguments must be concrete (call it outside ``jit``); non-array leaves are static, as for
  ``autocast``. ``fun`` is traced afresh on every call, so helpers redefined since are seen.

  Example::

    report = jaxamp.precision_report(loss_fn, device_type="cuda")(params, batch)
    print(report.worst(5))
  """
  amp_policy = autocast_lib.given_policy(policy, device_type, dtype)
  amp_overrides = overrides_lib.make(overrides, amp_policy)
  if not callable(fun):
    raise TypeError(f"precision_report takes a callable; got {fun!r} of type {type(fun).__name__}.")

  def reported(*args, **kwargs) -> PrecisionReport:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
      raise TypeError(
        "precision_report evaluates the function on concrete arrays; call it outside jit, "
        "grad and vmap."
      )
    # Traced afresh (a new function is a new key of autocast's trace cache, dropped with it): a
    # helper redefined since the last call is seen.
    fun_called, module_args = nnx_modules.module_as_argument(fun, args)
    traced = autocast_lib.trace(lambda *a, **k: fun_called(*a, **k), module_args, kwargs)
    closed, arrays = traced.jaxpr, traced.arrays
    run = _Run()
    _evaluate_as_written(run, closed.jaxpr, closed.consts, arrays, "")
    run.seen.clear()
    if amp_overrides is not None:
      overrides_lib.check_matched(amp_overrides, closed)
    ctx = context.Context(amp_policy, _autocast_rules(run), overrides=amp_overrides)
    with context.recording(run.record):
      interpreter.evaluate(closed.jaxpr, closed.consts, arrays, ctx, env=_env(ctx, ""))
    entries = _sort([site.entry() for site in run.sites.values()], "accumulated")
    return PrecisionReport(amp_policy.device_type, amp_policy.requested_dtype.name, entries)

  return reported


# --- the two evaluations -------------------------------------------------------------------------


class _Site:
  """One eqn of the autocast program (at one path), over its evaluations."""

  def __init__(self, path: str, eqn, source: str, rule: str, torch_ops: tuple[str, ...]):
    self.path, self.eqn, self.source, self.rule, self.torch_ops = path, eqn, source, rule, torch_ops
    self.compute_dtype: str | None = None
    self.local: list[float | None] = []
    self.accumulated: list[float | None] = []
    self.max_abs: list[float | None] = []

  def entry(self) -> PrecisionEntry:
    return PrecisionEntry(
      self.path,
      self.eqn.primitive.name,
      self.source,
      "/".join(s for s in compat.name_scopes(self.eqn) if not s.startswith(_OWN_SCOPES)),
      self.torch_ops,
      self.rule,
      self.compute_dtype,
      _largest(self.local),
      _largest(self.accumulated),
      _largest(self.max_abs),
      len(self.local),
    )


def _largest(values: Sequence[float | None]) -> float | None:
  known = [v for v in values if v is not None]
  if not known:
    return None
  return math.nan if any(math.isnan(v) for v in known) else max(known)


class _Run:
  """One report's state: where the evaluation is, the float32 program's values, the sites.

  Attributes:
    loops: the step of each loop (scan, while) being evaluated, outermost first.
    seen: how often each (path, eqn, loop steps) was evaluated so far in this pass.
    reference: (path, eqn id, loop steps, occurrence) -> the float32 program's outputs.
    sites: (path, eqn id) -> the autocast program's eqn, in evaluation order.
    outer: the higher-order eqns whose bodies are being evaluated, outermost first.
  """

  def __init__(self):
    self.loops: list[int] = []
    self.seen: collections.Counter = collections.Counter()
    self.reference: dict[tuple, list] = {}
    self.sites: dict[tuple, _Site] = {}
    self.outer: list = []

  @contextlib.contextmanager
  def entered(self, eqn, step: int | None) -> Iterator[None]:
    """Within: a body of ``eqn`` is evaluated (at loop step ``step``, None outside loops)."""
    self.outer.append(eqn)
    if step is not None:
      self.loops.append(step)
    try:
      yield
    finally:
      if step is not None:
        self.loops.pop()
      self.outer.pop()

  def key(self, path: str, eqn) -> tuple:
    """The eqn's evaluation now, the same in both programs while they take the same branches."""
    where = (path, id(eqn), tuple(self.loops))
    occurrence = self.seen[where]
    self.seen[where] += 1
    return (*where, occurrence)

  def record(self, path, eqn, ruling, ran_on, outs, casts, amp_policy, override=None) -> None:
    """The interpreter's recorder: compares one eqn of the autocast program."""
    if any(isinstance(v, jax.core.Tracer) for v in outs):
      return  # inside a body traced by a higher-order rule not evaluated eagerly (shard_map)
    if eqn.primitive in higher_order.EAGER_BODIES and ruling.rule is not rules.Decider.KEPT:
      return  # its body's eqns are reported one by one
    reference = self.reference.pop(self.key(path, eqn), None)
    site = self.sites.get((path, id(eqn)))
    if site is None:
      source = _source([eqn, *reversed(self.outer)])
      site = self.sites[(path, id(eqn))] = _Site(
        path, eqn, source, ruling.describe(), explain.torch_ops_of(amp_policy.table, eqn, ruling)
      )
    fp8 = ruling.rule is rules.Decider.FP8
    site.compute_dtype = amp_policy.matmul_dtype.name if fp8 else _compute_dtype(ran_on, outs)
    site.local.append(_error(outs, _in_float32(eqn, ran_on)))
    site.accumulated.append(None if reference is None else _error(outs, reference))
    site.max_abs.append(_max_abs(outs))


def _env(ctx: context.Context, path: str) -> context.Env:
  # A float32-inside softmax is not put under jax.checkpoint (which would trace it): the values
  # are the same, and its eqns are evaluated one by one.
  return context.Env(ctx, path, checkpoint_ops=False)


def _evaluate_as_written(run: _Run, jaxpr, consts, args, path: str) -> list:
  """Evaluates ``jaxpr`` as written, keeping each eqn's outputs in ``run.reference``."""
  values: dict[Any, Any] = {}
  read = lambda atom: atom.val if compat.is_literal(atom) else values[atom]
  values.update(zip(jaxpr.constvars, consts, strict=True))
  values.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    invals = [read(a) for a in eqn.invars]
    eager = higher_order.EAGER_BODIES.get(eqn.primitive)
    outs = None
    if eager is not None:
      outs = eager(eqn, invals, _as_written_bodies(run, path, eqn))
    if outs is None:
      outs = compat.bind(eqn, invals)
    run.reference[run.key(path, eqn)] = outs
    values.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _as_written_bodies(run: _Run, path: str, eqn) -> higher_order.BodyEvaluator:
  """The body evaluator of ``higher_order.EAGER_BODIES`` for the program as written."""

  def evaluate(body, consts, args, part, out_dtypes=None, inputs=None, step=None):
    with run.entered(eqn, step):
      return _evaluate_as_written(run, body, consts, args, higher_order.sub_path(path, eqn, part))

  return evaluate


def _autocast_rules(run: _Run) -> context.RuleSet:
  """The interpreter's rules with the higher-order rules in eager mode
  (``higher_order.eager_body_rules``): each body evaluated on concrete values, its eqns recorded
  one by one, at the loop step and inside the eqns ``run`` tracks."""
  return rules.rule_set(higher_order.eager_body_rules(_env, run.entered))


# --- errors --------------------------------------------------------------------------------------


def _is_float(value) -> bool:
  dtype = getattr(value, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _in_float32(eqn, ran_on: list) -> list | None:
  """``eqn`` bound on ``ran_on`` with its 16-bit floats converted to float32 (and a 16-bit result
  type it fixes made float32); None where it cannot run again."""
  if eqn.effects:
    return None
  upcast = [
    lax.convert_element_type(v, _FLOAT32) if _is_float(v) and v.dtype in LOW_DTYPES else v
    for v in ran_on
  ]
  params = dict(eqn.params)
  if eqn.primitive is prims.convert_element_type_p and params["new_dtype"] in LOW_DTYPES:
    params["new_dtype"] = _FLOAT32  # a cast to 16 bits is the rounding it introduces
  preferred = params.get("preferred_element_type")
  if eqn.primitive in rules.MATMULS and preferred is not None and preferred in LOW_DTYPES:
    params["preferred_element_type"] = _FLOAT32
  try:
    return compat.bind(eqn, upcast, params)
  except Exception:  # params typed for 16-bit inputs (the function was written in 16 bits)
    pass
  try:  # then in the dtypes it was traced with
    as_traced = [
      lax.convert_element_type(v, a.aval.dtype) if _is_float(v) and v.dtype != a.aval.dtype else v
      for v, a in zip(ran_on, eqn.invars, strict=True)
    ]
    return compat.bind(eqn, as_traced)
  except Exception:
    return None


def _error(outs: Sequence[Any], reference: Sequence[Any] | None) -> float | None:
  """The largest max-norm relative error of the floating ``outs`` against ``reference``."""
  if reference is None or len(reference) != len(outs):
    return None
  errors = [_relative_error(a, b) for a, b in zip(outs, reference, strict=True) if _is_float(a)]
  errors = [e for e in errors if e is not None]
  return max(errors) if errors else None


def _host(value) -> np.ndarray:
  value = np.asarray(value)
  return value.astype(np.complex128 if np.iscomplexobj(value) else np.float64)


def _relative_error(a, b) -> float | None:
  """``max|a - b| / max|b|`` over ``b``'s finite values (equal values differ by 0, an Inf or NaN
  where ``b`` has another value by Inf)."""
  if not _is_float(b) or np.shape(a) != np.shape(b):
    return None
  a, b = _host(a), _host(b)
  if a.size == 0:
    return 0.0
  with np.errstate(invalid="ignore", over="ignore"):
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
  diff = np.where(np.isnan(diff), np.inf, diff)
  finite = np.abs(b[np.isfinite(b)])
  scale = max(float(finite.max()) if finite.size else 0.0, _TINY)
  return float(diff.max()) / scale


def _max_abs(outs: Sequence[Any]) -> float | None:
  magnitudes = [np.abs(_host(v)) for v in outs if _is_float(v)]
  magnitudes = [m[~np.isnan(m)] for m in magnitudes]
  if not magnitudes:
    return None
  return max((float(m.max()) for m in magnitudes if m.size), default=0.0)


def _compute_dtype(ran_on: Sequence[Any], outs: Sequence[Any]) -> str | None:
  floats = [v.dtype for v in ran_on if _is_float(v)] or [v.dtype for v in outs if _is_float(v)]
  if not floats:
    return None
  widest = floats[0]
  for dtype in floats[1:]:
    widest = jnp.promote_types(widest, dtype)
  return jnp.dtype(widest).name


# --- where an eqn comes from ---------------------------------------------------------------------

_OWN_SCOPES = "jaxamp."  # jaxamp's own region marks: the rule says what they did
_OWN = tuple(
  str(pathlib.Path(file).parent) + os.sep
  for file in (jax.__file__, jaxlib.__file__, np.__file__, pathlib.Path(__file__).parent)
)
_LIBRARIES = (
  os.sep + "site-packages" + os.sep,
  os.sep + "dist-packages" + os.sep,
  sysconfig.get_paths()["stdlib"] + os.sep,
)


def _source(eqns: Sequence[Any]) -> str:
  """ "file:line" of the innermost user frame (see ``PrecisionEntry``) of the first of ``eqns``
  (an eqn, then the higher-order eqns around it) whose traceback has one: a body traced by JAX
  (a custom_jvp's) may keep only JAX's frames."""
  fallback = ""
  for eqn in eqns:
    frames = [f for f in compat.traceback_frames(eqn) if not f[0].startswith(_OWN)]
    for file, _, line in frames:
      if not any(part in file or file.startswith(part) for part in _LIBRARIES):
        return f"{file}:{line}"
    if frames and not fallback:
      fallback = f"{frames[0][0]}:{frames[0][2]}"
  return fallback
