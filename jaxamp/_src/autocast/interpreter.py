"""The autocast interpreter: evaluates a jaxpr, choosing each eqn's compute dtype from a policy.

The loop is JAX's ``eval_jaxpr`` with one step added before each bind: the eqn's rule
(``rules.py``) casts its inputs. Which rule applies comes from the eqn's *region*
(``regions.py``): kept regions run as written, op calls (``op_calls.py``) cast the values
entering them by the op's category and run their inside natively, and every other eqn is cast
by the category the policy table gives its primitive. Higher-order primitives (jit, scan, cond,
...) are rewritten by the rules of ``higher_order.py``, handed in through ``Context.rules``.

Casts are cached per (variable, dtype) (``casting.CastCache``), so a value is converted at most
once per trace; the facts the rules read about values (a bias, a Python scalar, an activation)
are kept in ``dataflow.Provenance``; and a softmax computed in float32 on a 16-bit input runs
under ``jax.checkpoint``, so that its backward keeps the 16-bit input rather than float32
intermediates (``op_calls.RECOMPUTED_OPS``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax

from jaxamp._src import compat
from jaxamp._src.autocast import casting, dataflow, op_calls, regions, rules
from jaxamp._src.autocast.context import Context, Env
from jaxamp._src.autocast.overrides import Override
from jaxamp._src.policies.table import Category


def evaluate(
  jaxpr,
  consts: Sequence[Any],
  args: Sequence[Any],
  ctx: Context,
  env: Env | None = None,
  path: str = "",
  computed: Sequence[bool] = (),
  constants: Sequence[Any] = (),
  weak: Sequence[bool] = (),
  discrete: Sequence[bool] = (),
) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` in the current trace, casting as ``ctx``'s policy says.

  ``computed`` flags the invars that are activations computed outside (the others, like the
  constvars, are parameters or constants, or a residual's input where what they are added to
  is computed with them, ``dataflow.InputReads``);
  ``constants`` gives the values of invars known while tracing (Python scalars; None if not);
  ``weak`` flags the invars that follow their partner's dtype outside (fills, scalars);
  ``discrete`` those that receive converted booleans or integers (``Provenance.is_discrete``).
  """
  env = env if env is not None else Env(ctx, path)
  inherited = ctx.op.instance if ctx.op is not None else None
  for var, value in zip(jaxpr.constvars, consts, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  for var, value in zip(jaxpr.invars, args, strict=True):
    env.values[var] = value
    env.region[var] = inherited
  env.facts.computed.update(var for var, flag in zip(jaxpr.invars, computed, strict=False) if flag)
  env.facts.weak.update(var for var, flag in zip(jaxpr.invars, weak, strict=False) if flag)
  env.facts.masks.update(var for var, flag in zip(jaxpr.invars, discrete, strict=False) if flag)
  env.facts.constants.update(
    (var, value) for var, value in zip(jaxpr.invars, constants, strict=False) if value is not None
  )
  env.facts.reads = (*env.facts.reads, dataflow.body_input_reads(jaxpr))
  env.facts.selected.update(dataflow.body_selected(jaxpr))
  last_read = _last_reads(jaxpr)
  last_use = _dying_at(last_read, len(jaxpr.eqns))
  marks = [regions.marks_of(eqn) for eqn in jaxpr.eqns]
  if ctx.recomputed is not None:
    marks = [_recomputing(eqn, m, ctx) for eqn, m in zip(jaxpr.eqns, marks, strict=True)]
  inside = None
  if ctx.op is not None:
    category = ctx.op_category or op_calls.op_category(ctx.op, ctx.policy)
    inside = op_calls.OpCall(ctx.op, ctx.op.instance, category)
  decided = _overridden(jaxpr.eqns, marks, ctx) if inside is None else None
  policies = None
  if decided is not None:  # an override's policy, or a kept region where it turns autocast off
    marks = [m if d is None or d.policy else _KEPT for m, d in zip(marks, decided, strict=True)]
    policies = [d.policy if d is not None and d.policy else ctx.policy for d in decided]
  calls = op_calls.op_calls(jaxpr.eqns, marks, inside, ctx.policy, env.op_numbers, policies)
  runs = {} if not env.checkpoint_ops or inside is not None else op_calls.recomputed_runs(calls)
  gradients = dataflow.body_gradient_exits(jaxpr)
  index = 0
  while index < len(jaxpr.eqns):
    segment = None
    if index in runs:
      segment = op_calls.segment(jaxpr.eqns, index, runs[index], last_read)
    if segment is not None and _upcasts_16_bit(segment, env):
      stop = runs[index]
      with compat.eqn_context(jaxpr.eqns[index]):
        outs = _eval_recomputed(segment, env, ctx)
      for var, value in zip(segment.outvars, outs, strict=True):
        env.values[var] = value
        env.region[var] = None
      env.facts.computed.update(segment.outvars)
    else:
      stop = index + 1
      override, eqn_ctx = None, ctx
      if decided is not None:
        override, eqn_ctx = decided[index], ctx._replace(policy=policies[index])
      with compat.eqn_context(jaxpr.eqns[index]):
        _eval_one(jaxpr.eqns[index], marks[index], calls[index], env, eqn_ctx, override)
    for done in range(index, stop):
      for var in gradients.get(done, ()):
        env.values[var] = _gradient(env, var)
    for dead in range(index, stop):
      for var in last_use.get(dead, ()):
        env.values.pop(var, None)  # dead: let eager evaluation free it, as eval_jaxpr does
    index = stop
  # An op's exit casts point at the op's source line.
  with compat.traceback_of(jaxpr.eqns[-1]) if jaxpr.eqns else contextlib.nullcontext():
    _leave_ops(env, jaxpr.outvars, inherited)
  return [env.read(v) for v in jaxpr.outvars]


_KEPT = regions.Marks(True, ())


def _gradient(env: Env, var) -> Any:
  """A gradient leaving the backward pass that computed it, in its traced dtype: the dtype of
  what it is the gradient of, as torch's autograd casts a gradient back through autocast's
  casts (a float32 input's gradient is float32, its matmul's bfloat16)."""
  return env.cast(var, var.aval.dtype)


def _recomputing(eqn, marks: regions.Marks, ctx: Context) -> regions.Marks:
  """An eqn's marks in a custom_vjp's backward: kept (run as written, as torch runs a custom
  backward) unless it recomputes the forward (its site is one of the forward's) or holds bodies
  that may (a loop, a call), which are evaluated eqn by eqn."""
  if eqn.primitive in ctx.rules.higher_order or regions.site_of(eqn) in ctx.recomputed:
    return marks
  return _KEPT


def _overridden(eqns, marks: list[regions.Marks], ctx: Context) -> list[Override | None] | None:
  """The override deciding each eqn (None where none does, or inside a kept region); None
  without overrides."""
  if ctx.overrides is None:
    return None
  decide = ctx.overrides.decide
  return [None if m.kept else decide(ctx.scope, e) for e, m in zip(eqns, marks, strict=True)]


def _eval_one(
  eqn,
  marks: regions.Marks,
  call: op_calls.OpCall | None,
  env: Env,
  ctx: Context,
  override: Override | None = None,
) -> None:
  converts = env.casts.converts
  if marks.kept:
    call = None
  with compat.traceback_of(eqn):  # the casts an eqn needs point at its source line
    region = call.instance if call is not None else None
    _leave_ops(env, eqn.invars, region)
    if call is not None:
      _enter_op(eqn, env, ctx, call)
    env.call = call
    rule = ctx.rules.dispatch(eqn, kept=marks.kept, in_op=call is not None)
    applied = rule(eqn, env, ctx)
  if env.recorder is not None:
    env.recorder(
      env.path,
      eqn,
      applied.ruling,
      applied.ran_on,
      applied.outs,
      env.casts.converts - converts,
      ctx.policy,
      override.name if override is not None else None,
    )
  for var, value in zip(eqn.outvars, applied.outs, strict=True):
    env.values[var] = value
    env.region[var] = region
  rules.record_facts(eqn, env, applied)


def _forbidden_message(name: str, device_type: str) -> str:
  """Why op ``name`` refuses to run under ``device_type``'s policy, and what to run instead."""
  disabled = "call it in a jaxamp.autocast_disabled() block on float32 inputs"
  if name != "binary_cross_entropy":  # a user's row or registration made it FORBIDDEN
    return (
      f"`{name}` is FORBIDDEN under autocast in this {device_type!r} policy (its registration "
      f"or a with_rules row says so): {disabled}, or give it another category."
    )
  return (
    f"`{name}` is unsafe to autocast under the {device_type!r} policy, as in torch: its "
    "backward pass may produce gradients float16 cannot represent. Use the with-logits form "
    "(jaxamp.functional.binary_cross_entropy_with_logits, optax.sigmoid_binary_cross_entropy, "
    f"Keras's BinaryCrossentropy(from_logits=True)) on logits, or {disabled}."
  )


def _enter_op(eqn, env: Env, ctx: Context, call: op_calls.OpCall) -> None:
  """What an op call's eqn owes the call whatever its rule: a FORBIDDEN op raises, a
  FLOAT32_INSIDE op notes the types of the values entering it (its exits follow them), and an
  accumulating LOWER op notes the low dtype its results leave in."""
  if call.category is Category.FORBIDDEN:
    raise RuntimeError(_forbidden_message(call.region.name, ctx.policy.device_type))
  if call.category is Category.FLOAT32_INSIDE:
    entering = [  # arrays: a Ref or an nnx hijax Variable read inside has no dtype to follow
      compat.aval_with_dtype(a.aval, env.dtype(a))
      for a in eqn.invars
      if not compat.is_literal(a)
      and env.region.get(a) != call.instance
      and isinstance(a.aval, jax.core.ShapedArray)
    ]
    name = call.region.name
    env.exits.note_entering(
      call.instance, entering, name in op_calls.STATEFUL_OPS, name in op_calls.PROMOTING_OPS
    )
  elif op_calls.accumulates(call):
    env.exits.note_low(call.instance, ctx.policy.dtype)


def _leave_ops(env: Env, atoms, instance: str | None) -> None:
  """Values read outside the op call that computed them leave it (``OpExits``)."""
  for atom in atoms:
    if compat.is_literal(atom) or atom not in env.values:
      continue
    region = env.region.get(atom)
    if region is None or region == instance:
      continue
    dtype = env.exits.exit_dtype(region, atom.aval, env.dtype(atom))
    if dtype is not None:
      env.values[atom] = env.cast(atom, dtype)
      env.region[atom] = None


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


def _upcasts_16_bit(segment: op_calls.Segment, env: Env) -> bool:
  """Whether a 16-bit tensor enters the op, which computes in float32 inside."""
  return any(atom.aval.shape and env.dtype(atom) in casting.LOW_DTYPES for atom in segment.invars)


def _eval_recomputed(segment: op_calls.Segment, env: Env, ctx: Context) -> list[Any]:
  """Runs one op call under ``jax.checkpoint``: its backward recomputes the float32 inside.

  The op's 16-bit inputs are all it keeps; the dataflow facts about them carry over, so the
  op computes exactly as it would outside the checkpoint.
  """
  path = f"{env.path}/checkpoint" if env.path else "checkpoint"  # ``explain`` shows it
  computed = [env.facts.is_computed(atom) for atom in segment.invars]

  def op(*values):
    inner = Env(
      ctx,
      path,
      facts=env.facts.carried(segment.invars),
      record=env.recorder is not None,
      checkpoint_ops=False,
    )
    return evaluate(segment, (), values, ctx, env=inner, computed=computed)

  return jax.checkpoint(op)(*[env.read(atom) for atom in segment.invars])
