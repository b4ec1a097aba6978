"""The autocast interpreter: evaluates a jaxpr, choosing each eqn's compute dtype from a policy.

The loop is JAX's ``eval_jaxpr`` with one step added before each bind: the inputs are cast as
the eqn's rule asks. Rules come from the eqn's *region* (``regions.py``) and, outside regions,
from the policy table's category for the primitive:

* LOWER / FLOAT32 / PROMOTE cast the eligible floating inputs (float32, float16, bfloat16);
* NATIVE runs on the incoming dtypes, only making inputs that had equal dtypes when traced
  equal again (torch's native type promotion: the widest wins, Python scalars follow);
* kept regions get the traced dtypes back and run as written;
* op regions cast the values entering them by the op's category and run their inside natively;
* higher-order primitives (jit, scan, cond, ...) are rewritten by ``higher_order.py``.

Casts are cached per (variable, dtype), so a value is converted at most once per trace;
``add(dot(x, w), broadcast(b))`` keeps the dot's low dtype (torch's ``linear(x, w, b)``); and a
softmax computed in float32 on a 16-bit input runs under ``jax.checkpoint``, so that its backward
keeps the 16-bit input rather than float32 intermediates (``RECOMPUTED_OPS``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import compat, regions
from jaxamp._src.policy import ELIGIBLE_DTYPES, LOW_DTYPES, NO_16_BIT_KERNELS, Category, Policy


class Context(NamedTuple):
  """What an eqn inherits from the eqns around it. Hashable: it keys the rewrite cache.

  Attributes:
    policy: the active policy.
    op: the enclosing op region, whose inside runs natively.
  """

  policy: Policy
  op: regions.OpRegion | None = None


# A higher-order rule: (eqn, input values, context of its body, interpreter) -> outputs.
HigherOrderRule = Callable[..., list[Any]]
HIGHER_ORDER_RULES: dict[str, HigherOrderRule] = {}


def register_higher_order(*names: str) -> Callable[[HigherOrderRule], HigherOrderRule]:
  def register(rule: HigherOrderRule) -> HigherOrderRule:
    for name in names:
      HIGHER_ORDER_RULES[name] = rule
    return rule

  return register


# Primitives whose meaning depends on their input dtypes: they always get the traced ones back.
KEEP_DTYPES = {
    "bitcast_convert_type", "reduce", "reduce_window", "select_and_scatter",
    "select_and_gather_add", "pure_callback", "io_callback", "ffi_call", "pallas_call",
    "linear_solve", "run_state", "mosaic_gpu_call", "tpu_custom_call",
}

# Primitives with a scalar combiner jaxpr typed like the operand, re-typed after a cast.
_COMBINER_PARAM = {"scatter-add": "update_jaxpr", "scatter_add": "update_jaxpr",
                   "scatter-mul": "update_jaxpr", "scatter_mul": "update_jaxpr",
                   "scatter-min": "update_jaxpr", "scatter_min": "update_jaxpr",
                   "scatter-max": "update_jaxpr", "scatter_max": "update_jaxpr",
                   "scatter": "update_jaxpr"}

_LOWER_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")
_FLOAT32_OPS = (Category.FLOAT32, Category.FLOAT32_INSIDE)
# Primitives that move or copy a value without computing: what comes out has the provenance of
# what went in (a parameter stays a parameter, a dot's output stays a dot's output).
_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "expand_dims", "squeeze", "transpose", "copy",
                     "copy_p"})
# ... and casts, which keep where a value comes from too (a cast parameter is a parameter).
_KEEPS_PROVENANCE = _LAYOUT | {"convert_element_type"}
# Ops whose outputs include state shaped like a non-main input (BatchNorm's running statistics):
# those outputs keep float32 when they leave the op.
STATEFUL_OPS = frozenset({"batch_norm"})


def _variant(eqn) -> str | None:
  """A finer key for primitives whose torch op depends on how they are used."""
  name = eqn.primitive.name
  if name == "div":
    numerator = eqn.invars[0]
    if not numerator.aval.shape and (compat.is_literal(numerator) or numerator.aval.weak_type):
      return "rdiv"  # python_scalar / tensor: torch's __rdiv__ / __rtruediv__
  if name == "dot_general" and all(atom.aval.ndim == 1 for atom in eqn.invars):
    return "vector"  # vector . vector: torch's dot / vdot, not mm
  if name in ("reduce_window_sum", "reduce_window_max") and eqn.invars[0].aval.ndim == 5:
    return "3d"  # (N, D, H, W, C) pooling: torch's avg_pool3d / max_pool3d
  return None


def primitive_category(eqn, policy: Policy) -> Category:
  variant = _variant(eqn)
  if variant is not None:
    keyed = policy.table.primitive_categories.get(f"{eqn.primitive.name}[{variant}]")
    if keyed is not None:
      return keyed
  return policy.primitive_category(eqn.primitive.name)


def is_weak(atom, value=None, env=None) -> bool:
  """A scalar that follows the other operand's dtype instead of promoting it.

  Python scalars (literals, weakly typed values, also once passed into a jit or converted
  there, as in ``jnp.clip(x, 0)``) and, as torch's 0-dim tensors, rank-0 values and broadcasts
  of them (``jnp.where(m, x, jnp.finfo(jnp.float32).min)``, relu's zeros).
  """
  if compat.is_literal(atom) or getattr(atom.aval, "weak_type", False) or not atom.aval.shape:
    return True
  if value is not None and getattr(compat.typeof(value), "weak_type", False):
    return True
  if env is None:
    return False
  source = env.layout_source.get(atom)
  return atom in env.weak or source is not None and not source.aval.shape


def _is_eligible(dtype) -> bool:
  return dtype in ELIGIBLE_DTYPES


def saturating_constant(value, dtype: np.dtype) -> np.ndarray:
  """A constant in ``dtype``, finite values clipped to its range (infinities and NaN kept).

  torch takes ``finfo(x.dtype).min`` of the run-time dtype for masks; a ``finfo(float32).min``
  taken at trace time and moved into float16 must not become ``-inf``.
  """
  value = np.asarray(value)
  if jnp.dtype(dtype) in LOW_DTYPES and jnp.issubdtype(value.dtype, jnp.floating):
    info = jnp.finfo(dtype)
    value = np.where(np.isfinite(value), np.clip(value, float(info.min), float(info.max)), value)
  return np.asarray(value, dtype)


def saturating_convert(value, dtype: np.dtype) -> Any:
  """``value`` converted to ``dtype``, finite values clipped to its range as constants are."""
  source = compat.typeof(value).dtype
  if jnp.dtype(dtype) not in LOW_DTYPES or jnp.finfo(source).max <= jnp.finfo(dtype).max:
    return lax.convert_element_type(value, dtype)
  if not isinstance(value, jax.core.Tracer):  # known now: clipped here, nothing traced
    return saturating_constant(value, dtype)
  info = jnp.finfo(dtype)
  clipped = lax.clamp(np.asarray(info.min, source), value, np.asarray(info.max, source))
  return lax.convert_element_type(jnp.where(jnp.isinf(value), value, clipped), dtype)


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
  widest = dtypes[0]
  for dtype in dtypes[1:]:
    widest = jnp.promote_types(widest, dtype)
  return jnp.dtype(widest)


class Env:
  """The state of one jaxpr's evaluation: values, their region, and the cast cache."""

  def __init__(self, ctx: Context, hoistable: frozenset = frozenset(),
               precast: dict | None = None, path: str = ""):
    self.ctx = ctx
    self.path = path  # where this jaxpr sits, for ``explain``
    self.recorder = current_recorder() if not hoistable else None  # not in discovery passes
    self.converts = 0  # converts emitted so far
    self.rule = ""  # the rule the current eqn ran under, for ``explain``
    self.ran_on: list | None = None  # the values the current eqn's primitive was bound on
    self.op_runs = 0  # op instances opened so far
    self.exits: dict[str, tuple[Any, frozenset]] = {}  # FLOAT32_INSIDE op -> main input, shapes
    self.values: dict[Any, Any] = {}
    self.region: dict[Any, str | None] = {}
    self.casts: dict[tuple[Any, np.dtype], Any] = dict(precast or {})
    self.lowered: set[Any] = set()  # outputs of low-precision dots/convs (and their layouts)
    self.layout_source: dict[Any, Any] = {}  # var -> the var it is a layout change or cast of
    self.computed: set[Any] = set()  # vars computed from others (not parameters or constants)
    self.activations: set[Any] = set()  # uncomputed vars read by computations other than adds
    self.hoistable = hoistable  # loop-invariant invars whose casts may move out of the loop
    self.weak: set[Any] = set()  # vars holding a converted Python scalar: they follow others
    self.fills: dict[Any, Any] = {}  # var -> the broadcast_in_dim of a literal that made it
    self.hoisted: list[tuple[Any, np.dtype]] = []  # casts asked of hoistable invars
    self.in_checkpointed_op = False  # evaluating one RECOMPUTED_OPS instance in a checkpoint

  def read(self, atom) -> Any:
    return atom.val if compat.is_literal(atom) else self.values[atom]

  def dtype(self, atom) -> np.dtype:
    if compat.is_literal(atom):
      return atom.aval.dtype
    return compat.typeof(self.values[atom]).dtype

  def cast(self, atom, dtype: np.dtype) -> Any:
    """The value of ``atom`` in ``dtype``, converted at most once per (variable, dtype)."""
    value = self.read(atom)
    if self.dtype(atom) == dtype:
      return value
    if compat.is_literal(atom):
      return saturating_constant(atom.val, dtype)
    key = (atom, dtype)
    if key in self.casts:
      return self.casts[key]
    if atom in self.hoistable and key not in self.hoisted:
      self.hoisted.append(key)
    if atom in self.fills:  # fill in the target dtype: no convert, no float32 copy kept
      fill = self.fills[atom]
      converted = compat.bind(fill, [saturating_constant(fill.invars[0].val, dtype)])[0]
    else:
      converted = self.convert(value, dtype, saturate=is_weak(atom, value, self))
    if self.ctx.policy.cache_enabled:
      self.casts[key] = converted
    return converted

  def convert(self, value, dtype: np.dtype, saturate: bool = False) -> Any:
    """``value`` in ``dtype``; a constant (``saturate``) keeps finite values finite."""
    self.converts += 1
    if saturate:
      return saturating_convert(value, dtype)
    return lax.convert_element_type(value, dtype)

  def is_parameter(self, atom) -> bool:
    """Whether ``atom`` is (a layout change of) a parameter or constant: read, not computed,
    and read by nothing but adds here, as a bias is."""
    root = self.layout_source.get(atom, atom)
    return root not in self.computed and root not in self.activations

  def is_computed(self, atom) -> bool:
    """Whether ``atom`` was computed from other values (an activation), not passed in."""
    return not compat.is_literal(atom) and self.layout_source.get(atom, atom) in self.computed

  def bind(self, eqn, invals: list, params: dict | None = None) -> list[Any]:
    self.ran_on = invals
    return compat.bind(eqn, invals, params)


# ``explain`` installs a recorder: (path, eqn, rule, values run on, outputs, converts) per eqn.
_recorder: list = [None]


def current_recorder():
  return _recorder[0]


def set_recorder(recorder) -> Any:
  previous, _recorder[0] = _recorder[0], recorder
  return previous


def evaluate(jaxpr, consts: Sequence[Any], args: Sequence[Any], ctx: Context,
             hoistable: frozenset = frozenset(), precast: dict | None = None,
             env: Env | None = None, path: str = "",
             computed: Sequence[bool] = ()) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` in the current trace, casting as ``ctx``'s policy says.

  ``computed`` flags the invars that are activations computed outside (the others, like the
  constvars, are parameters or constants, unless the jaxpr itself reads them as activations).
  """
  env = env if env is not None else Env(ctx, hoistable, precast, path)
  inherited = ctx.op.instance if ctx.op is not None else None
  for var, value in zip(jaxpr.constvars, consts, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  for var, value in zip(jaxpr.invars, args, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  env.computed.update(var for var, flag in zip(jaxpr.invars, computed, strict=False) if flag)
  env.activations.update(_activation_reads(jaxpr))
  last_read = _last_reads(jaxpr)
  last_use = _dying_at(last_read, len(jaxpr.eqns))
  marks = [regions.marks_of(eqn) for eqn in jaxpr.eqns]
  calls = _op_calls(jaxpr.eqns, marks, ctx, env)
  runs = {} if env.in_checkpointed_op else _recomputed_runs(calls, ctx)
  index = 0
  while index < len(jaxpr.eqns):
    segment = _segment(jaxpr.eqns, index, runs[index], last_read) if index in runs else None
    if segment is not None and _upcasts_16_bit(segment, env):
      stop = runs[index]
      outs = _eval_recomputed(segment, env, ctx)
      for var, value in zip(segment.outvars, outs, strict=True):
        env.values[var] = value
        env.region[var] = None
      env.computed.update(segment.outvars)
    else:
      stop = index + 1
      _eval_one(jaxpr.eqns[index], marks[index], calls[index], env, ctx)
    for dead in range(index, stop):
      for var in last_use.get(dead, ()):
        env.values.pop(var, None)  # dead: let eager evaluation free it, as eval_jaxpr does
    index = stop
  # An op's exit casts point at the op's source line.
  with compat.traceback_of(jaxpr.eqns[-1]) if jaxpr.eqns else contextlib.nullcontext():
    _leave_ops(env, jaxpr.outvars, inherited)
  return [env.read(v) for v in jaxpr.outvars]


class OpCall(NamedTuple):
  """One call of an op region: the region, the instance telling calls apart, its category."""

  region: regions.OpRegion
  instance: str
  category: Category


def _op_calls(eqns, marks: Sequence[regions.Marks], ctx: Context,
              env: Env) -> list[OpCall | None]:
  """The op call each eqn belongs to: the outermost op region the policy gives a category.

  An op the table does not list is a plain composition (torch decomposes it into listed ops):
  the search goes on inward, and without any listed op the eqn follows its primitive's rule.
  Consecutive eqns of one call site form one call until an eqn that reads nothing the call
  computed comes at a position inside the op that does not move on (the next call from the same
  site: a loop, a linen module's wrapper); any other eqn in between ends the call.
  """
  if ctx.op is not None:
    inside = OpCall(ctx.op, ctx.op.instance, _op_category(ctx.op, ctx.policy))
    return [inside] * len(marks)
  calls: list[OpCall | None] = []
  site, position, produced = None, None, set()  # of the current call
  for eqn, eqn_marks in zip(eqns, marks, strict=True):
    call = None
    for op, at in zip(eqn_marks.ops, eqn_marks.positions, strict=True):
      category = None if eqn_marks.kept else _op_category(op, ctx.policy)
      if category is None:
        continue
      moves_on = at is None or position is None or at > position
      if site == op.instance and (moves_on or _reads_any(eqn, produced)):
        call = calls[-1]
      else:
        env.op_runs += 1
        call = OpCall(op, f"{op.instance}#{env.op_runs}", category)
        produced = set()
      site, position = op.instance, at
      produced.update(eqn.outvars)
      break
    if call is None:
      site = None
    calls.append(call)
  return calls


def _reads_any(eqn, values: set) -> bool:
  return any(not compat.is_literal(a) and a in values for a in eqn.invars)


def _activation_reads(jaxpr) -> set[Any]:
  """The values (through layout changes) that eqns other than adds read: activations, which
  a bias never is (``x + W @ x`` is a residual, ``W @ x + b`` a bias add). A value passed into
  a sub-jaxpr (a layer's jit or remat, a scan over layers) counts as its body reads it."""
  roots: dict[Any, Any] = {}
  read = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _KEEPS_PROVENANCE:
      if not compat.is_literal(eqn.invars[0]):
        roots[eqn.outvars[0]] = roots.get(eqn.invars[0], eqn.invars[0])
      continue
    if name == "add":
      continue
    for atom in _activation_inputs(eqn):
      if not compat.is_literal(atom):
        read.add(roots.get(atom, atom))
  return read


def _activation_inputs(eqn) -> list:
  """The inputs ``eqn`` reads as activations: all of them, but for the sub-jaxprs that
  ``compat.sub_jaxpr_inputs`` can match to the eqn's inputs, those their bodies read so."""
  bodies = compat.sub_jaxpr_inputs(eqn)
  if bodies is None:
    return list(eqn.invars)
  inputs = []
  for body, atoms in bodies:
    read = _body_activations(body)
    inputs.extend(atom for atom, var in zip(atoms, body.invars, strict=True) if var in read)
  return inputs


_body_reads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _body_activations(jaxpr) -> set[Any]:
  """``_activation_reads`` of a sub-jaxpr, computed once per jaxpr object."""
  read = _body_reads.get(jaxpr)
  if read is None:
    read = _body_reads[jaxpr] = _activation_reads(jaxpr)
  return read


def _eval_one(eqn, marks: regions.Marks, call: OpCall | None, env: Env, ctx: Context) -> None:
  with compat.traceback_of(eqn):  # the casts an eqn needs point at its source line
    if env.recorder is not None:
      outs, region = _eval_recorded(eqn, marks, call, env, ctx)
    else:
      outs, region = _eval_eqn(eqn, marks, call, env, ctx)
  for var, value in zip(eqn.outvars, outs, strict=True):
    env.values[var] = value
    env.region[var] = region
  _note_provenance(eqn, env)


def _note_provenance(eqn, env: Env) -> None:
  """Layout changes and casts keep their input's provenance; everything else is computed."""
  name = eqn.primitive.name
  if name in _KEEPS_PROVENANCE:
    source = eqn.invars[0]
    if not compat.is_literal(source):
      env.layout_source[eqn.outvars[0]] = env.layout_source.get(source, source)
      if name in _LAYOUT and source in env.lowered:
        env.lowered.add(eqn.outvars[0])
    return
  env.computed.update(eqn.outvars)


def _eval_recorded(eqn, marks: regions.Marks, call: OpCall | None, env: Env,
                   ctx: Context) -> tuple[list[Any], str | None]:
  env.rule, env.ran_on, converts = "", None, env.converts
  outs, region = _eval_eqn(eqn, marks, call, env, ctx)
  ran_on = env.ran_on if env.ran_on is not None else [env.read(a) for a in eqn.invars]
  env.recorder(env.path, eqn, env.rule, ran_on, outs, env.converts - converts, ctx.policy)
  return outs, region


def _last_reads(jaxpr) -> dict[Any, int]:
  """Variable -> the index of the last eqn reading it (the eqn count for the jaxpr's outputs)."""
  last: dict[Any, int] = {}
  for index, eqn in enumerate(jaxpr.eqns):
    for atom in eqn.invars:
      if not compat.is_literal(atom):
        last[atom] = index
  for atom in jaxpr.outvars:
    if not compat.is_literal(atom):
      last[atom] = len(jaxpr.eqns)
  return last


def _dying_at(last_read: dict[Any, int], num_eqns: int) -> dict[int, list]:
  """Eqn index -> the variables read for the last time by that eqn (outputs excluded)."""
  by_eqn: dict[int, list] = {}
  for var, index in last_read.items():
    if index < num_eqns:
      by_eqn.setdefault(index, []).append(var)
  return by_eqn


# --- softmax keeps only its 16-bit input for the backward pass ---------------------------------

# These FLOAT32_INSIDE ops run under ``jax.checkpoint`` when a 16-bit tensor enters them: torch's
# softmax kernels save a 16-bit tensor (their output) for the backward, while differentiating
# the float32 computation would keep its float32 ``exp``, twice the bytes. Recomputing the
# elementwise inside costs little. Norms are not recomputed: their backward would recompute
# ``x - mean`` over the whole activation, which cost more step time on XLA:CPU (+8-17% on the
# benchmark conv net) than the float32 copies it saves are worth.
RECOMPUTED_OPS = frozenset({"softmax", "log_softmax", "softmin"})


class Segment(NamedTuple):
  """Consecutive eqns of one op instance as a jaxpr ``evaluate`` can run on its own."""

  constvars: tuple
  invars: list
  eqns: list
  outvars: list


def _recomputed_runs(calls: Sequence[OpCall | None], ctx: Context) -> dict[int, int]:
  """Start -> stop of each run of consecutive eqns forming one call of a recomputed op."""
  if ctx.op is not None:
    return {}
  runs: dict[int, int] = {}
  start, current = 0, None
  for index, call in enumerate(calls):
    recomputed = call is not None and call.category is Category.FLOAT32_INSIDE \
        and call.region.name in RECOMPUTED_OPS
    instance = call.instance if recomputed else None
    if instance != current:
      if current is not None:
        runs[start] = index
      start, current = index, instance
  if current is not None:
    runs[start] = len(calls)
  return runs


def _segment(eqns, start: int, stop: int, last_read: dict[Any, int]) -> Segment | None:
  """``eqns[start:stop]`` with the variables it reads from outside and those read after it."""
  body = eqns[start:stop]
  if any(eqn.effects for eqn in body):
    return None
  defined, invars = set(), {}
  for eqn in body:
    for atom in eqn.invars:
      if not compat.is_literal(atom) and atom not in defined:
        invars.setdefault(atom, None)
    defined.update(eqn.outvars)
  outvars = [var for eqn in body for var in eqn.outvars if last_read.get(var, -1) >= stop]
  return Segment((), list(invars), body, outvars)


def _upcasts_16_bit(segment: Segment, env: Env) -> bool:
  """Whether a 16-bit tensor enters the op, which computes in float32 inside."""
  return any(atom.aval.shape and env.dtype(atom) in (jnp.bfloat16, jnp.float16)
             for atom in segment.invars)


def _eval_recomputed(segment: Segment, env: Env, ctx: Context) -> list[Any]:
  """Runs one op instance under ``jax.checkpoint``: its backward recomputes the float32 inside.

  The op's 16-bit inputs are all it keeps; the weak/fill facts about them carry over, so the
  op computes exactly as it would outside the checkpoint.
  """
  path = f"{env.path}/checkpoint" if env.path else "checkpoint"  # ``explain`` shows it

  def op(*values):
    inner = Env(ctx, path=path)
    inner.recorder, inner.in_checkpointed_op = env.recorder, True
    for atom in segment.invars:
      if atom in env.weak:
        inner.weak.add(atom)
      if atom in env.fills:
        inner.fills[atom] = env.fills[atom]
      if atom in env.layout_source:
        inner.layout_source[atom] = env.layout_source[atom]
    computed = [env.is_computed(atom) for atom in segment.invars]
    return evaluate(segment, (), values, ctx, env=inner, computed=computed)

  return jax.checkpoint(op)(*[env.read(atom) for atom in segment.invars])


def _eval_eqn(eqn, marks: regions.Marks, call: OpCall | None, env: Env,
              ctx: Context) -> tuple[list[Any], str | None]:
  if marks.kept:
    env.rule = "kept"
    _leave_ops(env, eqn.invars, None)
    return _bind_traced_dtypes(eqn, env), None
  instance = call.instance if call is not None else None
  _leave_ops(env, eqn.invars, instance)
  if call is not None:
    env.rule = f"op {call.region.name}: {call.category.value}"
    return _eval_in_op(eqn, env, ctx, call), instance
  return _eval_by_primitive(eqn, env, ctx), None


def _leave_ops(env: Env, atoms, instance: str | None) -> None:
  """float32 values leaving a FLOAT32_INSIDE op get its main input's dtype back, as torch's
  kernels return it; values in another dtype were chosen explicitly (``dtype=``) and keep it.

  A stateful op's (``STATEFUL_OPS``) outputs shaped like another of its inputs are its state, not
  its result, and stay float32: BatchNorm's running mean and variance, shaped like its scale.
  """
  for atom in atoms:
    if compat.is_literal(atom):
      continue
    region = env.region.get(atom)
    if region is None or region == instance or region not in env.exits:
      continue
    main, state_shapes = env.exits[region]
    shape = atom.aval.shape
    if atom in env.values and env.dtype(atom) == jnp.float32 \
        and (shape == main.shape or shape not in state_shapes):
      env.values[atom] = env.cast(atom, main.dtype)
      env.region[atom] = None


def _op_category(op: regions.OpRegion, policy: Policy) -> Category | None:
  if op.cast_to is not None:
    return Category.NATIVE  # custom_fwd(cast_inputs=...): cast on entry, autocast off inside
  return policy.op_category(op.name, op.default)


def _bind_traced_dtypes(eqn, env: Env) -> list[Any]:
  """Binds ``eqn`` on its inputs cast back to the dtypes they had when traced."""
  invals = [env.cast(a, a.aval.dtype) if _is_float(a) else env.read(a) for a in eqn.invars]
  return env.bind(eqn, invals)


def _is_float(atom) -> bool:
  return _is_eligible(atom.aval.dtype)


def _eval_in_op(eqn, env: Env, ctx: Context, call: OpCall) -> list[Any]:
  """Values entering the op are cast by its category; inside, everything runs natively."""
  op, instance, category = call
  if category is Category.FORBIDDEN:
    raise RuntimeError(
        f"`{op.name}` is unsafe to autocast under the {ctx.policy.device_type!r} policy, as in "
        "torch: its backward pass may produce gradients float16 cannot represent. Use the "
        "with-logits form (jaxamp.functional.binary_cross_entropy_with_logits or "
        "optax.sigmoid_binary_cross_entropy) on logits, or call it in a "
        "jaxamp.autocast_disabled() block on float32 inputs."
    )
  entering = [not compat.is_literal(a) and env.region.get(a) != instance for a in eqn.invars]
  if category is Category.FLOAT32_INSIDE:
    _note_main_input(env, instance, eqn.invars, entering, op.name in STATEFUL_OPS)
  name = eqn.primitive.name
  if name == "convert_element_type" and category in _FLOAT32_OPS and op.cast_to is None \
      and _is_eligible(eqn.params["new_dtype"]):
    if _is_explicit_dtype(eqn, env, instance):
      return [env.cast(eqn.invars[0], eqn.params["new_dtype"])]
    # The library's own casts (jnp.sum's upcast-then-restore, an identity matrix made in the
    # input's dtype) stay in float32 inside a float32 op.
    return [env.cast(eqn.invars[0], jnp.dtype(jnp.float32))]
  if _keeps_dtypes(eqn):
    return _bind_traced_dtypes(eqn, env)
  if category is Category.LOWER and name in _LOWER_PRIMITIVES:
    entering = None  # a low-precision op's own products run low too, not only what enters
  if op.cast_to is None and primitive_category(eqn, ctx.policy) is Category.FLOAT32 \
      and name in NO_16_BIT_KERNELS:  # float32 inside any op region too
    category, entering = Category.FLOAT32, None  # svd inside jnp.linalg.norm: no 16-bit kernel
  invals = _cast_for(category, eqn, env, ctx.policy, select=entering, cast_to=op.cast_to)
  return _bind_native(eqn, env, ctx._replace(op=op), invals)


def _is_explicit_dtype(eqn, env: Env, instance: str) -> bool:
  """Whether a cast inside a float32 op is the caller's ``dtype=``: a narrowing cast of a value
  entering the op (``jnp.sum(x, dtype=jnp.float16)``), not the op's own restoring cast."""
  source = eqn.invars[0]
  if compat.is_literal(source) or eqn.params["new_dtype"] not in LOW_DTYPES \
      or source.aval.dtype != jnp.float32:
    return False
  return env.region.get(env.layout_source.get(source, source)) != instance


def _note_main_input(env: Env, instance: str, atoms, entering, stateful: bool) -> None:
  """Remembers the largest floating value entering an op instance (and, for a stateful op, the
  others' shapes: those of its state)."""
  main, shapes = env.exits.get(instance, (None, frozenset()))
  for atom, enters in zip(atoms, entering, strict=True):
    if not enters or not _is_eligible(env.dtype(atom)):
      continue
    aval = compat.aval_with_dtype(atom.aval, env.dtype(atom))
    if main is None or aval.size > main.size:
      main, aval = aval, main
    if aval is not None and stateful:
      shapes |= {aval.shape}
  if main is not None:
    env.exits[instance] = (main, shapes - {main.shape})


def _eval_by_primitive(eqn, env: Env, ctx: Context) -> list[Any]:
  name = eqn.primitive.name
  if name in HIGHER_ORDER_RULES:
    env.rule = "higher-order: body rewritten"
    return HIGHER_ORDER_RULES[name](eqn, [env.read(a) for a in eqn.invars], env, ctx)
  if _keeps_dtypes(eqn):
    env.rule = "traced dtypes (unknown or dtype-sensitive primitive)"
    return _bind_traced_dtypes(eqn, env)
  if name == "convert_element_type" and is_weak(eqn.invars[0], env.read(eqn.invars[0]), env):
    # A Python scalar made concrete inside a jit (jnp.where(x, y, 0.0), jnp.clip(x, 0)): the
    # dtype it was traced to is its partner's, which autocast may change; it stays weak.
    env.rule = "native: a Python scalar follows the other operand"
    env.weak.update(eqn.outvars)
    if eqn.params["new_dtype"] == eqn.invars[0].aval.dtype:
      return [env.read(eqn.invars[0])]
  category = primitive_category(eqn, ctx.policy)
  env.rule = category.value
  if category is Category.NATIVE and name == "add":
    outs = _bias_add(eqn, env)
    if outs is not None:
      env.rule = "lower: bias add of a low-precision dot/conv"
      return outs
  invals = _cast_for(category, eqn, env, ctx.policy)
  outs = _bind_native(eqn, env, ctx, invals)
  if category is Category.LOWER and name in _LOWER_PRIMITIVES:
    env.lowered.update(eqn.outvars)
  if name == "broadcast_in_dim" and compat.is_literal(eqn.invars[0]):
    env.fills[eqn.outvars[0]] = eqn  # zeros_like & co: a fill follows the other operand
    env.weak.update(eqn.outvars)
  if name in _LAYOUT and not compat.is_literal(eqn.invars[0]) and eqn.invars[0] in env.weak:
    env.weak.update(eqn.outvars)
  return outs


def _keeps_dtypes(eqn) -> bool:
  """Listed primitives, and unknown ones carrying jaxprs, callables or avals, keep their dtypes."""
  name = eqn.primitive.name
  if name in KEEP_DTYPES:
    return True
  if name in _COMBINER_PARAM or name in HIGHER_ORDER_RULES:
    return False
  return any(compat.is_typed_param(item)
             for value in eqn.params.values()
             for item in (value if isinstance(value, tuple | list) else (value,)))


def _cast_for(category: Category, eqn, env: Env, policy: Policy,
              select: Sequence[bool] | None = None, cast_to: np.dtype | None = None) -> list:
  """The eqn's input values, the eligible floating ones cast as ``category`` says."""
  atoms = eqn.invars
  select = [True] * len(atoms) if select is None else select
  floats = [s and _is_eligible(env.dtype(a)) for a, s in zip(atoms, select, strict=True)]
  if cast_to is not None:
    target = cast_to
  elif category is Category.LOWER:
    if any(not _is_eligible(env.dtype(a)) and jnp.issubdtype(env.dtype(a), jnp.floating)
           for a in atoms):
      return [env.read(a) for a in atoms]  # float64 operands: not eligible, as in torch
    target = policy.dtype
  elif category in _FLOAT32_OPS:
    target = jnp.dtype(jnp.float32)
  elif category is Category.PROMOTE:
    strong = [env.dtype(a) for a, f in zip(atoms, floats, strict=True)
              if f and not is_weak(a, env.read(a), env)]
    if not strong:
      return [env.read(a) for a in atoms]
    target = _widest(strong)
  else:
    return [env.read(a) for a in atoms]
  return [env.cast(a, target) if f else env.read(a) for a, f in zip(atoms, floats, strict=True)]


def _result_type_params(eqn, invals) -> dict | None:
  """dot/conv params whose result dtype follows the new inputs, unless the caller fixed it.

  ``preferred_element_type`` equal to the traced inputs' dtype is JAX's default and follows the
  inputs; any other value was chosen explicitly and is kept.
  """
  if eqn.primitive.name not in _LOWER_PRIMITIVES:
    return None
  preferred = eqn.params.get("preferred_element_type")
  traced_inputs = _widest([jnp.dtype(a.aval.dtype) for a in eqn.invars])
  new_inputs = _widest([compat.typeof(v).dtype for v in invals])
  if preferred is None or jnp.dtype(preferred) != traced_inputs or new_inputs == traced_inputs:
    return None
  return dict(eqn.params, preferred_element_type=new_inputs)


def _bind_native(eqn, env: Env, ctx: Context, invals: list) -> list:
  """Binds with inputs that were equal-typed when traced made equal again (widest wins)."""
  name = eqn.primitive.name
  if name in HIGHER_ORDER_RULES:
    return HIGHER_ORDER_RULES[name](eqn, invals, env, ctx)
  invals = _equalize(eqn, invals, env)
  params = _result_type_params(eqn, invals) or dict(eqn.params)
  combiner = _COMBINER_PARAM.get(name)
  if combiner and params.get(combiner) is not None:
    operand_dtype = compat.typeof(invals[0]).dtype
    if operand_dtype != eqn.invars[0].aval.dtype:
      params[combiner] = _retype_combiner(params[combiner], params.get("update_consts", ()),
                                          operand_dtype)
  return env.bind(eqn, invals, params)


def _equalize(eqn, invals: list, env: Env) -> list:
  groups: dict[np.dtype, list[int]] = {}
  for i, atom in enumerate(eqn.invars):
    traced = atom.aval.dtype
    if _is_eligible(traced) and _is_eligible(compat.typeof(invals[i]).dtype):
      groups.setdefault(traced, []).append(i)
  invals = list(invals)
  for members in groups.values():
    dtypes = {compat.typeof(invals[i]).dtype for i in members}
    if len(dtypes) < 2:
      continue
    weak = {i: is_weak(eqn.invars[i], invals[i], env) for i in members}
    refs = [compat.typeof(invals[i]).dtype for i in members if compat.is_ref(invals[i])]
    strong = [compat.typeof(invals[i]).dtype for i in members if not weak[i]]
    target = refs[0] if refs else _widest(strong or sorted(dtypes, key=str))  # a Ref keeps its
    # dtype: what is stored into it is cast instead
    for i in members:
      if compat.typeof(invals[i]).dtype == target:
        continue
      atom = eqn.invars[i]
      if not compat.is_literal(atom) and invals[i] is env.read(atom):
        invals[i] = env.cast(atom, target)  # cached, and a fill is made in the target dtype
      else:
        invals[i] = env.convert(invals[i], target, saturate=weak[i])
  return invals


def _bias_add(eqn, env: Env) -> list | None:
  """``dot_or_conv(x, W) + b`` runs in the dot's low dtype, as torch's ``linear(x, W, b)``,
  ``addmm``, ``addmv`` and ``conv`` with a bias do.

  ``b`` is a bias when it is a parameter or constant (``Env.is_parameter``), whatever its rank:
  flax's ``Dense`` (a broadcast vector), Equinox's ``Linear`` (``W @ x + b``) and ``Conv2d`` (a
  ``(C, 1, 1)`` bias), under ``vmap`` too (layout changes in between keep the dot's output). A
  computed addend is a residual (``h + linear(x)``) and promotes, as in torch.
  """
  a, b = eqn.invars
  if compat.is_literal(a) or compat.is_literal(b):
    return None
  for out, bias in ((a, b), (b, a)):
    if out in env.lowered and env.is_parameter(bias):
      out_dtype, bias_dtype = env.dtype(out), env.dtype(bias)
      if out_dtype != bias_dtype and _is_eligible(bias_dtype):
        values = {out: env.read(out), bias: env.cast(bias, out_dtype)}
        return env.bind(eqn, [values[a], values[b]])
  return None


def _retype_combiner(jaxpr, consts, dtype) -> Any:
  """A scalar combiner jaxpr (e.g. scatter-add's ``add``) re-traced for ``dtype`` operands."""
  closed = compat.ClosedJaxpr(jaxpr, list(consts))
  avals = [compat.aval_with_dtype(v.aval, dtype) for v in jaxpr.invars]
  return compat.trace(compat.jaxpr_as_fun(closed), avals).jaxpr
