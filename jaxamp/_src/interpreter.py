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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src import compat, regions
from jaxamp._src.policy import ELIGIBLE_DTYPES, Category, Policy


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

_LOWER_PRIMITIVES = ("dot_general", "conv_general_dilated")
_FLOAT32_OPS = (Category.FLOAT32, Category.FLOAT32_INSIDE)
_BROADCASTS = ("broadcast_in_dim", "reshape", "expand_dims", "squeeze")


def _variant(eqn) -> str | None:
  """A finer key for primitives whose torch op depends on how they are used."""
  name = eqn.primitive.name
  if name == "div":
    numerator = eqn.invars[0]
    if not numerator.aval.shape and (compat.is_literal(numerator) or numerator.aval.weak_type):
      return "rdiv"  # python_scalar / tensor: torch's __rdiv__ / __rtruediv__
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
  source = env.broadcast_source.get(atom)
  return atom in env.weak or source is not None and not source.aval.shape


def _is_eligible(dtype) -> bool:
  return dtype in ELIGIBLE_DTYPES


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
    self.op_run: tuple[str | None, str | None] = (None, None)  # (op, instance) of the last eqn
    self.op_runs = 0  # op instances opened so far
    self.exits: dict[str, tuple[Any, frozenset]] = {}  # FLOAT32_INSIDE op -> main input, shapes
    self.values: dict[Any, Any] = {}
    self.region: dict[Any, str | None] = {}
    self.casts: dict[tuple[Any, np.dtype], Any] = dict(precast or {})
    self.lowered: set[Any] = set()  # outputs of low-precision dots/convs
    self.broadcast_source: dict[Any, Any] = {}  # var -> the var it was broadcast from
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
      return np.asarray(atom.val, dtype)
    key = (atom, dtype)
    if key in self.casts:
      return self.casts[key]
    if atom in self.hoistable and key not in self.hoisted:
      self.hoisted.append(key)
    if atom in self.fills:  # fill in the target dtype: no convert, no float32 copy kept
      fill = self.fills[atom]
      converted = compat.bind(fill, [np.asarray(fill.invars[0].val, dtype)])[0]
    else:
      converted = self.convert(value, dtype)
    if self.ctx.policy.cache_enabled:
      self.casts[key] = converted
    return converted

  def convert(self, value, dtype: np.dtype) -> Any:
    self.converts += 1
    return lax.convert_element_type(value, dtype)

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
             env: Env | None = None, path: str = "") -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` in the current trace, casting as ``ctx``'s policy says."""
  env = env if env is not None else Env(ctx, hoistable, precast, path)
  inherited = ctx.op.instance if ctx.op is not None else None
  for var, value in zip(jaxpr.constvars, consts, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  for var, value in zip(jaxpr.invars, args, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  last_read = _last_reads(jaxpr)
  last_use = _dying_at(last_read, len(jaxpr.eqns))
  marks = [regions.marks_of(eqn) for eqn in jaxpr.eqns]
  runs = {} if env.in_checkpointed_op else _recomputed_runs(marks, ctx)
  index = 0
  while index < len(jaxpr.eqns):
    segment = _segment(jaxpr.eqns, index, runs[index], last_read) if index in runs else None
    if segment is not None and _upcasts_16_bit(segment, env):
      stop = runs[index]
      outs = _eval_recomputed(segment, env, ctx)
      for var, value in zip(segment.outvars, outs, strict=True):
        env.values[var] = value
        env.region[var] = None
      env.op_run = (None, None)
    else:
      stop = index + 1
      _eval_one(jaxpr.eqns[index], marks[index], env, ctx)
    for dead in range(index, stop):
      for var in last_use.get(dead, ()):
        env.values.pop(var, None)  # dead: let eager evaluation free it, as eval_jaxpr does
    index = stop
  # An op's exit casts point at the op's source line.
  with compat.traceback_of(jaxpr.eqns[-1]) if jaxpr.eqns else contextlib.nullcontext():
    _leave_ops(env, jaxpr.outvars, inherited)
  return [env.read(v) for v in jaxpr.outvars]


def _eval_one(eqn, marks: regions.Marks, env: Env, ctx: Context) -> None:
  with compat.traceback_of(eqn):  # the casts an eqn needs point at its source line
    if env.recorder is not None:
      outs, region = _eval_recorded(eqn, marks, env, ctx)
    else:
      outs, region = _eval_eqn(eqn, marks, env, ctx)
  for var, value in zip(eqn.outvars, outs, strict=True):
    env.values[var] = value
    env.region[var] = region


def _eval_recorded(eqn, marks: regions.Marks, env: Env,
                   ctx: Context) -> tuple[list[Any], str | None]:
  env.rule, env.ran_on, converts = "", None, env.converts
  outs, region = _eval_eqn(eqn, marks, env, ctx)
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


def _recomputed_runs(marks: Sequence[regions.Marks], ctx: Context) -> dict[int, int]:
  """Start -> stop of each run of consecutive eqns forming one instance of a recomputed op."""
  if ctx.op is not None:
    return {}
  runs: dict[int, int] = {}
  start, current = 0, None
  for index, eqn_marks in enumerate(marks):
    instance = _recomputed_instance(eqn_marks, ctx.policy)
    if instance != current:
      if current is not None:
        runs[start] = index
      start, current = index, instance
  if current is not None:
    runs[start] = len(marks)
  return runs


def _recomputed_instance(marks: regions.Marks, policy: Policy) -> str | None:
  """The instance of the RECOMPUTED_OPS op (FLOAT32_INSIDE) an eqn with these marks is in, if any.

  The op is found as ``_enclosing_op`` finds it: the outermost one the policy gives a category.
  """
  if marks.kept:
    return None
  for op in marks.ops:
    category = _op_category(op, policy)
    if category is not None:
      recomputed = category is Category.FLOAT32_INSIDE and op.name in RECOMPUTED_OPS
      return op.instance if recomputed else None
  return None


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
      if atom in env.broadcast_source:
        inner.broadcast_source[atom] = env.broadcast_source[atom]
    return evaluate(segment, (), values, ctx, env=inner)

  return jax.checkpoint(op)(*[env.read(atom) for atom in segment.invars])


def _eval_eqn(eqn, marks: regions.Marks, env: Env, ctx: Context) -> tuple[list[Any], str | None]:
  if marks.kept:
    env.rule = "kept"
    env.op_run = (None, None)
    _leave_ops(env, eqn.invars, None)
    return _bind_traced_dtypes(eqn, env), None
  op, instance, category = _enclosing_op(marks, ctx, env)
  _leave_ops(env, eqn.invars, instance)
  if op is not None:
    env.rule = f"op {op.name}: {category.value}"
    return _eval_in_op(eqn, env, ctx, op, instance, category), instance
  return _eval_by_primitive(eqn, env, ctx), None


def _enclosing_op(marks: regions.Marks, ctx: Context, env: Env):
  """The outermost op region around the eqn that the policy gives a category, and that category.

  An op the table does not list is a plain composition (torch decomposes it into listed ops):
  the search goes on inward, and without any listed op the eqn follows its primitive's rule.
  Consecutive eqns of one op form one instance of it (the value-tracking key returned with
  it); any other eqn in between ends it.
  """
  if ctx.op is not None:
    return ctx.op, ctx.op.instance, _op_category(ctx.op, ctx.policy)
  for op in marks.ops:
    category = _op_category(op, ctx.policy)
    if category is not None:
      previous_op, instance = env.op_run
      if previous_op != op.instance:
        env.op_runs += 1
        instance = f"{op.instance}#{env.op_runs}"
      env.op_run = (op.instance, instance)
      return op, instance, category
  env.op_run = (None, None)
  return None, None, None


def _leave_ops(env: Env, atoms, instance: str | None) -> None:
  """Values leaving a FLOAT32_INSIDE op get its main input's dtype back, as torch's kernels do.

  Values shaped like another input of the op are its state, not its result, and stay float32:
  BatchNorm's running mean and variance are shaped like its scale and bias.
  """
  for atom in atoms:
    if compat.is_literal(atom):
      continue
    region = env.region.get(atom)
    if region is None or region == instance or region not in env.exits:
      continue
    main, state_shapes = env.exits[region]
    shape = atom.aval.shape
    if atom in env.values and _is_eligible(env.dtype(atom)) \
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


def _eval_in_op(eqn, env: Env, ctx: Context, op: regions.OpRegion, instance: str,
                category: Category) -> list[Any]:
  """Values entering the op are cast by its category; inside, everything runs natively."""
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
    _note_main_input(env, instance, eqn.invars, entering)
  name = eqn.primitive.name
  if name == "convert_element_type" and category in _FLOAT32_OPS and op.cast_to is None \
      and _is_eligible(eqn.params["new_dtype"]):
    # The library's own casts (jnp.sum's upcast-then-restore, an identity matrix made in the
    # input's dtype) stay in float32 inside a float32 op.
    return [env.cast(eqn.invars[0], jnp.dtype(jnp.float32))]
  if _keeps_dtypes(eqn):
    return _bind_traced_dtypes(eqn, env)
  if category is Category.LOWER and name in _LOWER_PRIMITIVES:
    entering = None  # a low-precision op's own products run low too, not only what enters
  invals = _cast_for(category, eqn, env, ctx.policy, select=entering, cast_to=op.cast_to)
  return _bind_native(eqn, env, ctx._replace(op=op), invals)


def _note_main_input(env: Env, instance: str, atoms, entering) -> None:
  """Remembers the largest floating value entering an op instance, and the others' shapes."""
  main, shapes = env.exits.get(instance, (None, frozenset()))
  for atom, enters in zip(atoms, entering, strict=True):
    if not enters or not _is_eligible(env.dtype(atom)):
      continue
    aval = compat.aval_with_dtype(atom.aval, env.dtype(atom))
    if main is None or aval.size > main.size:
      main, aval = aval, main
    if aval is not None:
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
  if name in _BROADCASTS and not compat.is_literal(eqn.invars[0]):
    env.broadcast_source[eqn.outvars[0]] = env.broadcast_source.get(eqn.invars[0],
                                                                    eqn.invars[0])
    if eqn.invars[0] in env.weak:
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
    strong = [compat.typeof(invals[i]).dtype for i in members
              if not is_weak(eqn.invars[i], invals[i], env)]
    target = _widest(strong or sorted(dtypes, key=str))
    for i in members:
      if compat.typeof(invals[i]).dtype != target:
        invals[i] = env.convert(invals[i], target)
  return invals


def _bias_add(eqn, env: Env) -> list | None:
  """``add(dot_or_conv_out, broadcast(bias))`` runs in the dot's low dtype, as torch's linear."""
  a, b = eqn.invars
  if compat.is_literal(a) or compat.is_literal(b):
    return None
  for out, bias in ((a, b), (b, a)):
    if out in env.lowered and bias in env.broadcast_source:
      out_dtype, bias_dtype = env.dtype(out), env.dtype(bias)
      if out_dtype != bias_dtype and _is_eligible(bias_dtype):
        source = env.broadcast_source[bias]
        if source.aval.ndim < out.aval.ndim:  # a bias vector: flax's Dense/Conv, batch 1 too
          values = {out: env.read(out), bias: env.cast(bias, out_dtype)}
          return env.bind(eqn, [values[a], values[b]])
  return None


def _retype_combiner(jaxpr, consts, dtype) -> Any:
  """A scalar combiner jaxpr (e.g. scatter-add's ``add``) re-traced for ``dtype`` operands."""
  closed = compat.ClosedJaxpr(jaxpr, list(consts))
  avals = [compat.aval_with_dtype(v.aval, dtype) for v in jaxpr.invars]
  return compat.trace(compat.jaxpr_as_fun(closed), avals).jaxpr
