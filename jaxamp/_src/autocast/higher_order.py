"""Autocast rules for higher-order primitives: each rewrites its bodies and re-binds itself.

Bodies are rewritten by tracing the interpreter over them (``rewrite``), cached on the body, its
input types and the context, so a layer jitted once and called many times is rewritten once.
Loop carries and branch outputs keep the types they were declared with; casts of loop
invariants (scan and while consts, i.e. the weights) are hoisted out of the loop body.
Custom derivative rules are kept: the primal body and the rule are both autocast, and the
cotangents a custom_vjp's backward returns come back in its inputs' dtypes. The rules see what
JAX shows them: a custom_vjp's ``fwd`` which inputs are perturbed, ``symbolic_zeros`` rules their
symbolic zeros. A custom_vjp whose ``fwd`` rule or primal is a ``custom_fwd(cast_inputs=...)``
function is that one region as a whole.

In eager mode (``eager_body_rules``, for ``precision_report``) the same rules evaluate the bodies
on concrete values instead of rewriting them: a scan or while step by step, a cond by the branch
taken, with the inputs ``body_inputs`` gives either mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._src import caches, compat
from jaxamp._src.autocast import casting, context, regions, rules
from jaxamp._src.autocast.context import Context, Env
from jaxamp._src.autocast.interpreter import evaluate

prims = compat.primitives

_CACHE_SIZE = 1024
# Rewritten bodies, held while their source jaxpr lives (it is in the key weakly).
_rewrites = caches.weak_lru_cache("higher_order.rewrites", _CACHE_SIZE)


def body_avals(invars, values, weak: Sequence[bool] = ()) -> tuple:
  """The avals of a body's invars with the dtypes of the values now flowing into them, weakly
  typed where the value follows its partner's dtype outside (``weak``: Python scalars, fills
  like ``zeros_like``), so ``jnp.where(m, x, jnp.zeros_like(x))``'s jit does not promote. The
  body reads its weak invars from these types (``rewrite``); an array JAX typed weakly for
  other reasons (``-1e9 * mask``) is a tensor in torch and strong inside too.
  """
  return avals_with_dtypes(invars, [compat.typeof(value).dtype for value in values], weak)


def avals_with_dtypes(invars, dtypes, weak: Sequence[bool] = ()) -> tuple:
  """``body_avals`` for values of ``dtypes``."""
  avals = []
  weak = tuple(weak) or (False,) * len(invars)
  for var, dtype, follows in zip(invars, dtypes, weak, strict=True):
    if dtype != var.aval.dtype:
      avals.append(compat.aval_with_dtype(var.aval, dtype))
    elif jnp.issubdtype(dtype, jnp.inexact) and var.aval.weak_type != follows:
      avals.append(var.aval.update(weak_type=follows))
    else:
      avals.append(var.aval)
  return tuple(avals)


def weak_inputs(atoms, env: Env) -> list[bool]:
  """Which of ``atoms`` follow their partner's dtype outside (``Provenance.is_weak``)."""
  return [not compat.is_literal(a) and env.facts.is_weak(a) for a in atoms]


def discrete_inputs(atoms, env: Env) -> list[bool]:
  """Which of ``atoms`` are converted booleans or integers outside (``Provenance.is_discrete``):
  inside, they follow their partner as outside (a one-hot passed into a ``custom_jvp``)."""
  return [not compat.is_literal(a) and env.facts.is_discrete(a) for a in atoms]


def _weak_flags(avals) -> tuple[bool, ...]:
  """Which of a body's invars are weak: those ``body_avals`` typed weakly."""
  return tuple(bool(getattr(aval, "weak_type", False)) for aval in avals)


def known_constants(atoms) -> tuple:
  """The values of the Python scalars (rank-0 literals) among ``atoms`` (None for every other
  atom): inside the body they stay scalars, which yield to a rank-0 tensor as torch's do
  (``jnp.where(p, loss, 0.0)``), and one that does not fit the 16-bit dtype makes arithmetic
  compute in float32, as outside (``rules.SCALAR_OPMATH``)."""
  constants = tuple(_scalar_value(atom) for atom in atoms)
  return constants if any(c is not None for c in constants) else ()


def _scalar_value(atom) -> float | None:
  """A real rank-0 literal's value (one NaN object for every NaN, so it keys a cache)."""
  if not compat.is_literal(atom) or atom.aval.shape:
    return None
  dtype = atom.aval.dtype
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    return None
  value = float(atom.val)
  return math.nan if math.isnan(value) else value


def computed_inputs(env: Env, atoms) -> tuple[bool, ...]:
  """Which of ``atoms`` are activations computed outside the body (``is_computed``)."""
  return tuple(env.facts.is_computed(a) for a in atoms)


def rewrite(
  jaxpr,
  consts: Sequence[Any],
  in_avals: tuple,
  ctx: Context,
  out_dtypes: tuple | None = None,
  hoist: int = 0,
  path: str = "",
  computed: tuple[bool, ...] = (),
  constants: tuple = (),
  discrete: tuple[bool, ...] = (),
) -> tuple[compat.ClosedJaxpr, tuple]:
  """``jaxpr`` rewritten for ``in_avals`` under ``ctx``, and the casts hoisted out of it.

  Args:
    jaxpr: an open jaxpr; ``consts`` are the values of its constvars.
    in_avals: the types of its invars now.
    out_dtypes: dtypes its outputs must keep (None entries are free).
    hoist: the leading ``hoist`` invars are loop invariants: casts of them are returned as
      ``((invar index, dtype), ...)`` and taken as extra leading inputs of the result (placed
      after the ``hoist`` invariants), to be computed once outside the loop.
    computed: which invars are activations computed outside (``evaluate``'s argument).
    constants: the values of invars known while tracing (``known_constants``).
    discrete: which invars receive converted booleans or integers (``discrete_inputs``).
  """
  # Consts by id: a cached rewrite holds the consts it uses, so their ids stay theirs meanwhile.
  key = (
    caches.key_part(jaxpr, by_identity=True),
    regions.version(),  # a rewrite follows the op registrations made before it
    tuple(map(id, consts)),
    in_avals,
    ctx,
    out_dtypes,
    hoist,
    computed,
    constants,
    discrete,
  )
  recording = context.current_recorder() is not None
  hit = None if recording else _rewrites.get(key)
  if hit is not None:
    return hit
  weak = _weak_flags(in_avals)
  hoisted: tuple = ()
  if hoist:
    discovery = Env(
      ctx, casts=casting.CastCache(hoistable=frozenset(jaxpr.invars[:hoist])), record=False
    )
    compat.trace(
      lambda *args: evaluate_body(
        jaxpr, consts, args, ctx, discovery, out_dtypes, computed, constants, weak, discrete
      ),
      in_avals,
    )
    hoisted = tuple((jaxpr.invars.index(var), dtype) for var, dtype in discovery.casts.hoisted)
  extra_avals = tuple(compat.aval_with_dtype(in_avals[i], dtype) for i, dtype in hoisted)

  def body(*args):
    invariants, extras, rest = (
      args[:hoist],
      args[hoist : hoist + len(hoisted)],
      args[hoist + len(hoisted) :],
    )
    precast = {
      (jaxpr.invars[i], dtype): extra for (i, dtype), extra in zip(hoisted, extras, strict=True)
    }
    env = Env(ctx, path, casts=casting.CastCache(precast=precast))
    args = (*invariants, *rest)
    return evaluate_body(
      jaxpr, consts, args, ctx, env, out_dtypes, computed, constants, weak, discrete
    )

  closed = compat.trace(body, (*in_avals[:hoist], *extra_avals, *in_avals[hoist:]))
  if recording:
    return closed, hoisted
  _rewrites.put(key, (closed, hoisted))
  return closed, hoisted


def evaluate_body(
  jaxpr,
  consts,
  args,
  ctx: Context,
  env: Env,
  out_dtypes=None,
  computed=(),
  constants=(),
  weak=(),
  discrete=(),
) -> list:
  """``jaxpr`` evaluated by the interpreter in ``env``, its outputs cast to ``out_dtypes`` (None
  entries, or None: as they come)."""
  outs = evaluate(
    jaxpr,
    consts,
    args,
    ctx,
    env=env,
    computed=computed,
    constants=constants,
    weak=weak,
    discrete=discrete,
  )
  if out_dtypes is None:
    return outs
  return [casting.as_dtype(v, d) for v, d in zip(outs, out_dtypes, strict=True)]


def sub_path(path: str, eqn, part: str = "") -> str:
  """Where a sub-jaxpr of ``eqn`` evaluated at ``path`` sits, for ``explain``: e.g.
  ``jit(log_softmax)/scan``."""
  name = eqn.params.get("name") or ""
  label = f"{eqn.primitive.name}({name})" if name else eqn.primitive.name
  label += f".{part}" if part else ""
  return f"{path}/{label}" if path else label


def declared_dtypes(atoms) -> tuple:
  return tuple(a.aval.dtype for a in atoms)


def restore_carries(env: Env, atoms, values: list) -> list:
  """Values of ``atoms`` with their traced dtypes (for loop carries)."""
  return [
    env.cast(a, jnp.dtype(a.aval.dtype))
    if not compat.is_literal(a) and jnp.issubdtype(a.aval.dtype, jnp.inexact)
    else v
    for a, v in zip(atoms, values, strict=True)
  ]


class BodyInputs(NamedTuple):
  """What a higher-order eqn hands its bodies, as every mode of its rule sees it.

  Attributes:
    values: the eqn's input values, loop carries in their traced dtypes (a carry keeps the type
      it was declared with, whatever autocast made of its initial value outside).
    computed: which inputs are activations computed outside (``is_computed``); loop carries are,
      by the body itself.
    weak: which inputs follow their partner's dtype outside (fills and Python scalars,
      ``weak_inputs``): they stay weak inside. Loop carries never do.
    discrete: which inputs are converted booleans or integers outside (``discrete_inputs``):
      they follow their partner inside too. Loop carries never do.
  """

  values: list
  computed: tuple[bool, ...]
  weak: tuple[bool, ...]
  discrete: tuple[bool, ...]


def _carries(eqn) -> slice | None:
  """Where a loop's carries are among its inputs; None for an eqn that is not a loop."""
  params = eqn.params
  if eqn.primitive is prims.scan_p:
    return slice(params["num_consts"], params["num_consts"] + params["num_carry"])
  if eqn.primitive is prims.while_p:
    return slice(params["cond_nconsts"] + params["body_nconsts"], len(eqn.invars))
  return None


def body_inputs(eqn, invals: Sequence[Any], env: Env) -> BodyInputs:
  """The ``BodyInputs`` of ``eqn`` on ``invals``: one definition for rewriting its bodies and
  for evaluating them eagerly (``precision_report``)."""
  values, computed = list(invals), list(computed_inputs(env, eqn.invars))
  weak, discrete = weak_inputs(eqn.invars, env), discrete_inputs(eqn.invars, env)
  carries = _carries(eqn)
  if carries is not None:
    values[carries] = restore_carries(env, eqn.invars[carries], values[carries])
    computed[carries] = [True] * len(values[carries])
    weak[carries] = discrete[carries] = [False] * len(values[carries])
  return BodyInputs(values, tuple(computed), tuple(weak), tuple(discrete))


def _rewrite_call(closed, eqn, invals, env, ctx):
  """The closed jaxpr ``eqn`` calls on ``invals`` (all of its inputs), rewritten for them."""
  inputs = body_inputs(eqn, invals, env)
  new, _ = rewrite(
    closed.jaxpr,
    closed.consts,
    body_avals(closed.jaxpr.invars, inputs.values, inputs.weak),
    ctx,
    path=sub_path(env.path, eqn),
    computed=inputs.computed,
    constants=known_constants(eqn.invars),
    discrete=inputs.discrete,
  )
  return new


def _jit_rule(eqn, invals, env, ctx):
  new = _rewrite_call(eqn.params["jaxpr"], eqn, invals, env, ctx)
  return compat.bind(eqn, invals, dict(eqn.params, jaxpr=new))


def _composite_rule(eqn, invals, env, ctx):
  """A ``lax.composite`` is autocast like any call; its name and attributes stay."""
  new = _rewrite_call(eqn.params["jaxpr"], eqn, invals, env, ctx)
  return compat.bind(eqn, invals, dict(eqn.params, jaxpr=new))


def _closed_call_rule(eqn, invals, env, ctx):
  new = _rewrite_call(eqn.params["call_jaxpr"], eqn, invals, env, ctx)
  return compat.bind(eqn, invals, dict(eqn.params, call_jaxpr=new))


def _remat_rule(eqn, invals, env, ctx):
  jaxpr = eqn.params["jaxpr"]
  inputs = body_inputs(eqn, invals, env)
  new, _ = rewrite(
    jaxpr,
    (),
    body_avals(jaxpr.invars, invals, inputs.weak),
    ctx,
    path=sub_path(env.path, eqn),
    computed=inputs.computed,
    discrete=inputs.discrete,
  )
  body, consts = compat.open_jaxpr(new)
  prevent_cse = eqn.params["prevent_cse"]
  if isinstance(prevent_cse, tuple):
    prevent_cse = (False,) * len(consts) + prevent_cse
  return compat.bind(eqn, [*consts, *invals], dict(eqn.params, jaxpr=body, prevent_cse=prevent_cse))


def scan_out_dtypes(eqn) -> tuple:
  """The dtypes a scan body's outputs must keep: its carries' declared ones (stacked outputs
  are free)."""
  outvars = eqn.params["jaxpr"].jaxpr.outvars
  n_carry = eqn.params["num_carry"]
  return declared_dtypes(outvars[:n_carry]) + (None,) * (len(outvars) - n_carry)


def _scan_rule(eqn, invals, env, ctx):
  params = eqn.params
  n_consts = params["num_consts"]
  closed = params["jaxpr"]
  inputs = body_inputs(eqn, invals, env)
  invals = inputs.values
  new, hoisted = rewrite(
    closed.jaxpr,
    closed.consts,
    body_avals(closed.jaxpr.invars, invals, inputs.weak),
    ctx,
    scan_out_dtypes(eqn),
    hoist=n_consts,
    path=sub_path(env.path, eqn),
    computed=inputs.computed,
    discrete=inputs.discrete,
  )
  extras = [env.cast(eqn.invars[i], dtype) for i, dtype in hoisted]
  new_params = dict(params, jaxpr=new, num_consts=n_consts + len(extras))
  return compat.bind(eqn, [*invals[:n_consts], *extras, *invals[n_consts:]], new_params)


def _while_rule(eqn, invals, env, ctx):
  params = eqn.params
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  inputs = body_inputs(eqn, invals, env)
  invals = inputs.values
  cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
  carry = invals[n_cond + n_body :]
  cond, body = params["cond_jaxpr"], params["body_jaxpr"]
  new_cond, _ = rewrite(
    cond.jaxpr,
    cond.consts,
    body_avals(
      cond.jaxpr.invars,
      [*cond_consts, *carry],
      inputs.weak[:n_cond] + inputs.weak[n_cond + n_body :],
    ),
    ctx,
    declared_dtypes(cond.jaxpr.outvars),
    path=sub_path(env.path, eqn, "cond"),
  )
  new_body, hoisted = rewrite(
    body.jaxpr,
    body.consts,
    body_avals(body.jaxpr.invars, [*body_consts, *carry], inputs.weak[n_cond:]),
    ctx,
    declared_dtypes(body.jaxpr.outvars),
    hoist=n_body,
    path=sub_path(env.path, eqn, "body"),
    computed=inputs.computed[n_cond:],
    discrete=inputs.discrete[n_cond:],
  )
  extras = [env.cast(eqn.invars[n_cond + i], dtype) for i, dtype in hoisted]
  new_params = dict(
    params, cond_jaxpr=new_cond, body_jaxpr=new_body, body_nconsts=n_body + len(extras)
  )
  return compat.bind(eqn, [*cond_consts, *body_consts, *extras, *carry], new_params)


def _cond_rule(eqn, invals, env, ctx):
  """Branches on data keep their declared output dtypes; the branches of a platform-dependent
  cond (alternative implementations of one op, as ``jnp.diagonal``'s) give the dtypes of the one
  the default backend takes."""
  branches = eqn.params["branches"]
  operands = invals[1:]
  inputs = body_inputs(eqn, invals, env)
  # The index is not an operand.
  computed, weak, discrete = inputs.computed[1:], inputs.weak[1:], inputs.discrete[1:]

  def rewritten(index: int, out_dtypes: tuple | None) -> compat.ClosedJaxpr:
    branch = branches[index]
    return rewrite(
      branch.jaxpr,
      branch.consts,
      body_avals(branch.jaxpr.invars, operands, weak),
      ctx,
      out_dtypes,
      path=sub_path(env.path, eqn, f"branch{index}"),
      computed=computed,
      discrete=discrete,
    )[0]

  taken = compat.platform_branch(eqn)
  if taken is None:
    out_dtypes, free = declared_dtypes(branches[0].jaxpr.outvars), None
  else:
    free = rewritten(taken, None)  # its output dtypes are the ones every branch gives
    out_dtypes = declared_dtypes(free.jaxpr.outvars)
  new = tuple(
    free if index == taken else rewritten(index, out_dtypes) for index in range(len(branches))
  )
  return compat.bind(eqn, invals, dict(eqn.params, branches=new))


def _shard_map_rule(eqn, invals, env, ctx):
  """Re-binds through ``jax.shard_map``, which traces the body in the mesh's axis context."""
  params = eqn.params
  body = params["jaxpr"]
  path = sub_path(env.path, eqn)
  weak, discrete = weak_inputs(eqn.invars, env), discrete_inputs(eqn.invars, env)
  mapped = jax.shard_map(
    lambda *args: tuple(evaluate(body, (), args, ctx, path=path, weak=weak, discrete=discrete)),
    mesh=params["mesh"],
    in_specs=params["in_specs"],
    out_specs=params["out_specs"],
    axis_names=compat.shard_map_axis_names(params),
    check_vma=params["check_vma"],
  )
  return list(mapped(*invals))


def _linear_solve_rule(eqn, invals, env, ctx):
  """Each of the solve's functions (matvec, solve, ...) maps vectors of ``b``'s dtype to it: its
  declared one, so the solution keeps it as a loop's carry does (an iterative solve is a loop),
  or inside an op call (``jnp.linalg.solve`` as a float32 op) the one the op gave ``b``."""
  lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
  n_consts = sum(lengths)
  if ctx.op is None:
    invals = [*invals[:n_consts], *restore_carries(env, eqn.invars[n_consts:], invals[n_consts:])]
  b = invals[n_consts:]
  b_dtypes = tuple(compat.typeof(v).dtype for v in b)
  new, start = [], 0
  for length, closed in zip(lengths, jaxprs, strict=True):
    consts = invals[start : start + length]
    atoms = eqn.invars[start : start + length]
    weak = weak_inputs(atoms, env) + [False] * len(b)
    discrete = tuple(discrete_inputs(atoms, env) + [False] * len(b))
    start += length
    if closed is None:
      new.append(None)
      continue
    new.append(
      rewrite(
        closed.jaxpr,
        closed.consts,
        body_avals(closed.jaxpr.invars, [*consts, *b], weak),
        ctx,
        b_dtypes,
        path=sub_path(env.path, eqn),
        discrete=discrete,
      )[0]
    )
  return compat.bind(eqn, invals, dict(eqn.params, jaxprs=type(jaxprs)(*new)))


# --- custom derivatives --------------------------------------------------------------------------


def _match(values, dtypes) -> list:
  """``values`` cast to ``dtypes`` where both are real floating dtypes (float0 tangents,
  integers and complex values left alone: a custom rule's complex cotangent for a real input,
  as netket's ``expect`` returns, is the rule's answer)."""
  out = []
  for value, dtype in zip(values, dtypes, strict=True):
    current = compat.typeof(value).dtype
    if (
      current == dtype
      or not jnp.issubdtype(current, jnp.floating)
      or not jnp.issubdtype(dtype, jnp.floating)
    ):
      out.append(value)
    else:
      out.append(lax.convert_element_type(value, dtype))
  return out


def _autocast_primal(eqn, invals, env, ctx) -> tuple[compat.ClosedJaxpr, list]:
  """A custom-derivative call's primal body, autocast, and the dtypes of its outputs now."""
  body = _rewrite_call(eqn.params["call_jaxpr"], eqn, invals, env, ctx)
  return body, [aval.dtype for aval in body.out_avals]


def _custom_jvp_rule(eqn, invals, env, ctx):
  """The primal autocast, and the JVP rule autocast and traced for the tangents JAX gives it.

  A ``symbolic_zeros`` rule sees the inputs whose tangent is a symbolic zero as JAX shows
  them; any other rule gets zeros for them, as JAX gives it. Values the primal closes over
  (consts) get no tangent, as in JAX. Under a float8 policy the rule's matmuls run in
  bfloat16: JAX transposes the rule's tangent matmuls, and a float8 matmul (a custom_vjp)
  cannot be transposed.
  """
  num_consts = eqn.params["num_consts"]
  sees_zeros = eqn.params["symbolic_zeros"]
  body, out_dtypes = _autocast_primal(eqn, invals, env, ctx)
  rule = compat.custom_jvp_rule(eqn)
  path = sub_path(env.path, eqn, "jvp")
  primals_weak = weak_inputs(eqn.invars[num_consts:], env)
  primals_discrete = discrete_inputs(eqn.invars[num_consts:], env)
  rule_ctx = ctx._replace(policy=ctx.policy.without_float8())

  @jax.custom_jvp
  def autocast_fun(*xs):
    return compat.jaxpr_as_fun(body)(*xs)

  def autocast_fun_jvp(primals, tangents):
    primals, tangents = list(primals[num_consts:]), list(tangents[num_consts:])
    if not sees_zeros:
      tangents = [
        _instantiate_tangent(primal, t) for primal, t in zip(primals, tangents, strict=True)
      ]
    zeros = [compat.is_symbolic_zero(t) for t in tangents]
    jaxpr, consts, out_zeros = rule(zeros)
    nonzero = [t for t, zero in zip(tangents, zeros, strict=True) if not zero]
    n = len(out_zeros)

    # Tangents are computed values: cast as such (never clipped), the rule stays linear in them.
    computed = (False,) * len(primals) + (True,) * len(nonzero)
    outs = evaluate(
      jaxpr,
      consts,
      [*primals, *nonzero],
      rule_ctx,
      path=path,
      computed=computed,
      weak=primals_weak,
      discrete=primals_discrete,
    )
    outs, nonzero_out = outs[:n], outs[n:]
    outs = _match(outs, out_dtypes)
    nonzero_dtypes = [d for d, zero in zip(out_dtypes, out_zeros, strict=True) if not zero]
    nonzero_out = iter(_match(nonzero_out, nonzero_dtypes))
    out_tangents = [
      jax.custom_derivatives.SymbolicZero.from_primal_value(out) if zero else next(nonzero_out)
      for out, zero in zip(outs, out_zeros, strict=True)
    ]
    return outs, out_tangents

  autocast_fun.defjvp(autocast_fun_jvp, symbolic_zeros=True)
  return list(autocast_fun(*invals))


def _instantiate_tangent(primal, tangent):
  """A tangent as JAX gives it to a rule without ``symbolic_zeros``: a symbolic zero becomes
  zeros (float0 ones for an integer primal)."""
  if compat.is_symbolic_zero(tangent):
    return jax.custom_derivatives.zero_from_primal(primal)
  return tangent


_backward_policy: contextvars.ContextVar = contextvars.ContextVar(
  "jaxamp_backward_policy", default=None
)


def backward_policy():
  """The policy of the forward pass whose custom_vjp backward is being traced; None when that
  forward ran with autocast off (a ``custom_fwd(cast_inputs=...)`` region) or outside autocast."""
  return _backward_policy.get()


def _custom_fwd_region(jaxpr, device_type: str) -> regions.OpRegion | None:
  """The ``custom_fwd(cast_inputs=...)`` region casting under ``device_type`` that every eqn of
  ``jaxpr`` was traced in, if one."""
  found = None
  for eqn in jaxpr.eqns:
    marks = regions.marks_of(eqn)
    casting_ops = (op for op in marks.ops if op.casts_under(device_type))
    region = None if marks.kept else next(casting_ops, None)
    if region is None or (found is not None and region.instance != found.instance):
      return None
    found = region
  return found


def _enter_custom_fwd(eqn, invals, env, ctx, fwd_jaxpr) -> tuple[list, Context]:
  """A custom_vjp whose ``fwd`` rule (torch's spelling) or primal (JAX's) is a
  ``custom_fwd(cast_inputs=...)`` function is that region as a whole: its floating inputs are
  cast to the region's dtype, and primal, ``fwd`` and ``custom_bwd`` all run with autocast off.

  torch's ``autograd.Function`` has one forward; a custom_vjp has two, the primal (run when
  nothing is differentiated) and ``fwd`` (run under ``grad``/``vjp``), which must agree in
  dtypes. Inside an op call (``ctx.op``) everything already runs natively: nothing changes.
  ``fwd`` is looked at as JAX would call it now: with the inputs a differentiation under way
  perturbs flagged (none when nothing is differentiated now).
  """
  if ctx.op is not None:
    return invals, ctx
  device_type = ctx.policy.device_type
  region = _custom_fwd_region(eqn.params["call_jaxpr"].jaxpr, device_type)
  if region is None:
    perturbed = tuple(compat.perturbed(v) for v in invals[eqn.params["num_consts"] :])
    region = _custom_fwd_region(fwd_jaxpr(perturbed)[0], device_type)
  if region is None:
    return invals, ctx
  cast = [
    env.cast(atom, region.cast_to) if casting.is_eligible(env.dtype(atom)) else value
    for atom, value in zip(eqn.invars, invals, strict=True)
  ]
  return cast, ctx._replace(op=region)


def _custom_vjp_rule(eqn, invals, env, ctx):
  """The primal autocast, and ``fwd`` autocast and traced for the inputs JAX says are perturbed.

    The autocast custom_vjp takes its ``fwd``'s inputs with their perturbed flags
    (``symbolic_zeros``) and traces the original ``fwd`` with them, so a rule that checks them
    (Equinox's ``filter_custom_vjp`` asserts its non-differentiable inputs are not perturbed)
    sees what it would see without autocast. ``bwd`` gets zero cotangents as its
  ``symbolic_zeros`` asks: as ``SymbolicZero`` or as zeros.
  """
  num_consts = eqn.params["num_consts"]
  sees_zeros = eqn.params["symbolic_zeros"]
  fwd_jaxpr, split, bwd = compat.custom_vjp_rules(eqn)
  invals, ctx = _enter_custom_fwd(eqn, invals, env, ctx, fwd_jaxpr)
  # The backward runs on what the forward saved and cotangents in the outputs' dtypes, as torch's
  # does: in a custom_fwd(cast_inputs=...) region (custom_bwd or not) with autocast off; elsewhere
  # traced for the residuals' and cotangents' traced dtypes and evaluated natively on the values
  # as they come (recomputations of the forward autocast), custom_bwd under the forward's policy.
  as_saved = ctx.op is not None and ctx.op.cast_to is not None
  bwd_policy = None if as_saved else ctx.policy
  body, out_dtypes = _autocast_primal(eqn, invals, env, ctx)
  ct_avals = body.out_avals if as_saved else [v.aval for v in eqn.outvars]
  in_avals = [compat.typeof(v) for v in invals]
  path = sub_path(env.path, eqn, "fwd")
  fwd_weak = weak_inputs(eqn.invars[num_consts:], env)
  fwd_discrete = discrete_inputs(eqn.invars[num_consts:], env)
  bwd_path = sub_path(env.path, eqn, "bwd")

  @jax.custom_vjp
  def autocast_fun(*xs):
    return compat.jaxpr_as_fun(body)(*xs)

  def autocast_fwd(*xs):
    if any(x.perturbed for x in xs[:num_consts]):
      raise compat.closed_over_perturbed()  # as JAX does, rather than a zero gradient
    values = [x.value for x in xs]
    jaxpr, consts = fwd_jaxpr(tuple(x.perturbed for x in xs[num_consts:]))
    res_and_outs = evaluate(
      jaxpr, consts, values[num_consts:], ctx, path=path, weak=fwd_weak, discrete=fwd_discrete
    )
    residuals, residual_dtypes, outs = split(jaxpr, res_and_outs, values)
    # The dtypes bwd expects, as zero-size arrays: they depend on the flags fwd ran with.
    expected = () if as_saved else tuple(map(_dtype_marker, residual_dtypes))
    return _match(outs, out_dtypes), (tuple(residuals), expected)  # a list, like the primal's

  def cotangent(ct, aval):
    """An output cotangent for ``bwd``: in ``aval``'s dtype, a zero as ``bwd`` takes zeros."""
    if compat.is_symbolic_zero(ct):
      return compat.symbolic_zero(aval) if sees_zeros else compat.instantiate(ct, aval)
    return _match([ct], [aval.dtype])[0]

  def autocast_bwd(saved, cts):
    residuals, expected = saved
    if as_saved:
      cts = [cotangent(ct, aval) for ct, aval in zip(cts, ct_avals, strict=True)]
    else:  # zeros instantiated as traced, the rest as they come
      cts = [
        cotangent(ct, aval) if compat.is_symbolic_zero(ct) else ct
        for ct, aval in zip(cts, ct_avals, strict=True)
      ]
    token = _backward_policy.set(bwd_policy)
    try:
      args = [*residuals, *cts]
      if as_saved:
        in_cts = bwd(*args)
      else:  # the forward's sites, found once the backward runs: none without differentiation
        forward = ctx._replace(recomputed=_sites(eqn.params["call_jaxpr"].jaxpr))
        traced = [*(compat.typeof(m).dtype for m in expected), *(a.dtype for a in ct_avals)]
        in_cts = _backward(bwd, args, traced, forward, bwd_path)
    finally:
      _backward_policy.reset(token)
    # No cotangent (a symbolic zero) for consts, as in JAX, nor where bwd gives none.
    in_cts = [None] * num_consts + [None if compat.is_symbolic_zero(ct) else ct for ct in in_cts]
    return tuple(
      ct if ct is None else _match([ct], [aval.dtype])[0]
      for ct, aval in zip(in_cts, in_avals, strict=True)
    )

  autocast_fun.defvjp(autocast_fwd, autocast_bwd, symbolic_zeros=True)
  return list(autocast_fun(*invals))


def _remat_opt_rule(eqn, invals, env, ctx):
  """A ``custom_vjp``'s ``fwd`` defined with ``optimize_remat=True``: the forward autocast, and
  the primal JAX runs instead where no residual is used autocast alike, its outputs in the
  forward's dtypes."""
  params = eqn.params
  fwd = _rewrite_call(params["fwd_jaxpr"], eqn, invals, env, ctx)
  out_dtypes = tuple(aval.dtype for aval in fwd.out_avals[params["num_res"] :])
  args = slice(params["num_consts"], None)  # the primal's inputs: the fwd's but its consts
  inputs = body_inputs(eqn, invals, env)
  dtypes = [compat.typeof(value).dtype for value in inputs.values[args]]
  atoms = eqn.invars[args]
  primal_thunk, path = params["fun_jaxpr_thunk"], sub_path(env.path, eqn)

  @functools.cache
  def fun_jaxpr_thunk():
    jaxpr, consts = primal_thunk()
    new, _ = rewrite(
      jaxpr,
      consts,
      avals_with_dtypes(jaxpr.invars, dtypes, inputs.weak[args]),
      ctx,
      out_dtypes,
      path=path,
      computed=inputs.computed[args],
      constants=known_constants(atoms),
      discrete=inputs.discrete[args],
    )
    return new.jaxpr, new.consts

  return compat.bind(eqn, invals, dict(params, fwd_jaxpr=fwd, fun_jaxpr_thunk=fun_jaxpr_thunk))


def _custom_vmap_rule(eqn, invals, env, ctx):
  """The function autocast, and its vmap rule autocast when a vmap calls it: the dtypes are
  the same whether ``vmap`` comes before or after autocast (``jax.custom_batching``'s
  ``custom_vmap`` and ``sequential_vmap``)."""
  body = _rewrite_call(eqn.params["call"], eqn, invals, env, ctx)
  rule, in_tree = eqn.params["rule"], eqn.params["in_tree"]
  path = sub_path(env.path, eqn, "rule")

  @jax.custom_batching.custom_vmap
  def autocast_fun(*xs):
    return compat.jaxpr_as_fun(body)(*xs)

  @autocast_fun.def_vmap
  def autocast_rule(axis_size, in_batched, *xs):
    out_batched = []

    def traced_rule(*values):
      # the rule as JAX calls it: (axis_size, (consts', args' batched), consts, args)
      all_batched = jax.tree.unflatten(in_tree, list(in_batched))
      outs, batched = rule(axis_size, all_batched, *jax.tree.unflatten(in_tree, list(values)))
      out_batched.append(jax.tree.leaves(batched))
      return jax.tree.leaves(outs)

    closed = compat.trace(traced_rule, [compat.typeof(x) for x in xs])
    outs = evaluate(closed.jaxpr, closed.consts, list(xs), ctx, path=path)
    return _match(outs, [aval.dtype for aval in body.out_avals]), out_batched[0]

  return list(autocast_fun(*invals))


def _backward(bwd: Callable, args: list, traced: list, ctx: Context, path: str) -> list:
  """``bwd(*args)``, a custom_vjp's backward, traced for ``args`` in their ``traced`` dtypes and
  evaluated on them as they come: the eqns that recompute its forward (traced from the forward's
  sites, ``ctx.recomputed``) run autocast as the forward did, and the rest natively on what they
  are given (``rules.kept`` in a backward), as torch runs a custom backward on the tensors its
  forward saved, with autocast off. torch.utils.checkpoint recomputes a forward under the
  autocast state it ran in: Equinox's checkpointed loops (diffrax's default adjoint) recompute
  their body in the backward, and a float32 recomputation of a float16 forward takes other
  steps, so the gradient is of another function. A backward that recomputes forward quantities
  from the residuals in its own code (implicit differentiation: ott's Sinkhorn) computes them in
  the dtypes the forward saved, as the forward did."""
  dynamic = [i for i, x in enumerate(args) if isinstance(x, jax.Array)]
  outs_of_bwd = []

  def traced_bwd(*values):
    full = list(args)
    for i, value in zip(dynamic, values, strict=True):
      full[i] = value
    outs = list(bwd(*full))
    outs_of_bwd.append(outs)
    return [out for out in outs if _is_array_ct(out)]

  avals = [_traced_aval(compat.typeof(args[i]), traced[i]) for i in dynamic]
  closed = compat.trace(traced_bwd, avals)
  computed = iter(evaluate(closed.jaxpr, closed.consts, [args[i] for i in dynamic], ctx, path=path))
  return [next(computed) if _is_array_ct(out) else out for out in outs_of_bwd[0]]


def _traced_aval(aval, dtype):
  """``aval`` with the traced ``dtype`` where both are floating (other values keep theirs)."""
  floating = jnp.issubdtype(aval.dtype, jnp.inexact) and jnp.issubdtype(dtype, jnp.inexact)
  return compat.aval_with_dtype(aval, dtype) if floating else aval


def _is_array_ct(ct) -> bool:
  """Whether a cotangent ``bwd`` returned is an array (not None, not a symbolic zero)."""
  return ct is not None and not compat.is_symbolic_zero(ct)


_forward_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sites(jaxpr) -> frozenset:
  """The source sites (``regions.site_of``) of ``jaxpr``'s eqns and its bodies'."""
  sites = _forward_sites.get(jaxpr)
  if sites is None:
    found = set()
    for eqn in jaxpr.eqns:
      found.add(regions.site_of(eqn))
      for body in compat.sub_jaxprs(eqn):
        found |= _sites(body)
    found.discard(())
    sites = _forward_sites.setdefault(jaxpr, frozenset(found))
  return sites


def _dtype_marker(dtype) -> jax.Array:
  """A zero-size array that carries ``dtype`` from ``fwd`` to ``bwd`` (a residual's leaves are
  arrays); a dtype autocast never casts to is carried as bool."""
  return jnp.zeros((0,), dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.bool_)


# --- eager mode: bodies evaluated on concrete values (precision_report) ---------------------------
#
# ``EAGER_BODIES[primitive](eqn, values, evaluate)`` evaluates ``eqn``'s bodies on the concrete
# ``values`` of its inputs, as the primitive would run them (a scan or while step by step, a cond
# by the branch taken), and returns its outputs, or None where there is nothing to evaluate (an
# empty scan). ``evaluate`` (a ``BodyEvaluator``) evaluates one body: as written, or autocast by
# ``eager_body_rules``.


class BodyEvaluator(Protocol):
  def __call__(
    self, body, consts, args, part: str, out_dtypes=None, inputs=None, step: int | None = None
  ) -> list:
    """``body`` (an open jaxpr) on ``args``: at ``part`` of the eqn (for paths), its outputs
    cast to ``out_dtypes``, its invars being the eqn inputs ``inputs`` (indices), at loop step
    ``step``."""


def _eager_call(param: str):
  def call(eqn, values, evaluate: BodyEvaluator) -> list:
    body = eqn.params[param]
    consts = ()
    if isinstance(body, compat.ClosedJaxpr):
      body, consts = body.jaxpr, body.consts
    return evaluate(body, consts, values, "", inputs=range(len(values)))

  return call


def _eager_scan(eqn, values, evaluate: BodyEvaluator) -> list | None:
  params = eqn.params
  n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
  if length == 0:
    return None
  body = params["jaxpr"]
  consts, carry = values[:n_consts], values[n_consts : n_consts + n_carry]
  xs = values[n_consts + n_carry :]
  ys: list = [None] * length
  for step in reversed(range(length)) if params["reverse"] else range(length):
    args = [*consts, *carry, *(x[step] for x in xs)]
    outs = evaluate(
      body.jaxpr, body.consts, args, "", scan_out_dtypes(eqn), range(len(values)), step
    )
    carry, ys[step] = outs[:n_carry], outs[n_carry:]
  return [*carry, *(jnp.stack(column) for column in zip(*ys, strict=True))]


def _eager_while(eqn, values, evaluate: BodyEvaluator) -> list:
  params = eqn.params
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  cond, body = params["cond_jaxpr"], params["body_jaxpr"]
  cond_consts, body_consts = values[:n_cond], values[n_cond : n_cond + n_body]
  carry = values[n_cond + n_body :]
  step = 0
  while True:
    args = [*cond_consts, *carry]
    out_dtypes = declared_dtypes(cond.jaxpr.outvars)
    (go,) = evaluate(cond.jaxpr, cond.consts, args, "cond", out_dtypes, step=step)
    if not bool(go):
      return list(carry)
    args = [*body_consts, *carry]
    out_dtypes = declared_dtypes(body.jaxpr.outvars)
    inputs = range(n_cond, len(values))
    carry = evaluate(body.jaxpr, body.consts, args, "body", out_dtypes, inputs, step)
    step += 1


def _eager_cond(eqn, values, evaluate: BodyEvaluator) -> list:
  branches = eqn.params["branches"]
  index = min(max(int(values[0]), 0), len(branches) - 1)
  branch = branches[index]
  platform_dependent = compat.platform_branch(eqn) is not None
  out_dtypes = None if platform_dependent else declared_dtypes(branches[0].jaxpr.outvars)
  inputs = range(1, len(values))
  return evaluate(branch.jaxpr, branch.consts, values[1:], f"branch{index}", out_dtypes, inputs)


# The primal body of a custom derivative is what runs (and what autocast rewrites) when nothing
# is differentiated.
EAGER_BODIES: dict[Any, Callable[..., list | None]] = {
  prims.jit_p: _eager_call("jaxpr"),
  prims.closed_call_p: _eager_call("call_jaxpr"),
  prims.remat_p: _eager_call("jaxpr"),
  prims.scan_p: _eager_scan,
  prims.while_p: _eager_while,
  prims.cond_p: _eager_cond,
  prims.custom_jvp_call_p: _eager_call("call_jaxpr"),
  prims.custom_vjp_call_p: _eager_call("call_jaxpr"),
}


def eager_body_rules(
  make_env: Callable[[Context, str], Env],
  entered: Callable[[Any, int | None], contextlib.AbstractContextManager],
) -> dict[Any, rules.BodyRule]:
  """``BODY_RULES`` in eager mode: the bodies of ``EAGER_BODIES``' primitives evaluated by the
  interpreter on concrete values, given the ``body_inputs`` the rewriting rules give them; the
  other primitives (shard_map, linear_solve) rewritten as usual. ``make_env(ctx, path)`` makes
  each body's ``Env``; ``entered(eqn, step)`` is entered around each body's evaluation."""

  def eager_rule(eager):
    def rule(eqn, invals, env, ctx):
      given = body_inputs(eqn, invals, env)

      def evaluate(body, consts, args, part, out_dtypes=None, inputs=None, step=None):
        inner = make_env(ctx, sub_path(env.path, eqn, part))
        computed = ()
        if inputs is not None:  # which eqn inputs the body's invars are, for facts about them
          inputs = list(inputs)
          computed = tuple(given.computed[i] for i in inputs)
          weak = (v for v, i in zip(body.invars, inputs, strict=True) if given.weak[i])
          inner.facts.weak.update(weak)
          masks = (v for v, i in zip(body.invars, inputs, strict=True) if given.discrete[i])
          inner.facts.masks.update(masks)
        with entered(eqn, step):
          return evaluate_body(body, consts, args, ctx, inner, out_dtypes, computed)

      outs = eager(eqn, given.values, evaluate)
      return BODY_RULES[eqn.primitive](eqn, invals, env, ctx) if outs is None else outs

    return rule

  return {**BODY_RULES, **{primitive: eager_rule(e) for primitive, e in EAGER_BODIES.items()}}


# Higher-order primitive -> its body rule: each rewrites its bodies and re-binds the primitive.
BODY_RULES: dict[Any, rules.BodyRule] = {
  prims.jit_p: _jit_rule,
  prims.closed_call_p: _closed_call_rule,
  prims.composite_p: _composite_rule,
  prims.remat_p: _remat_rule,
  prims.scan_p: _scan_rule,
  prims.while_p: _while_rule,
  prims.cond_p: _cond_rule,
  prims.shard_map_p: _shard_map_rule,
  prims.linear_solve_p: _linear_solve_rule,
  prims.custom_jvp_call_p: _custom_jvp_rule,
  prims.custom_vjp_call_p: _custom_vjp_rule,
  prims.custom_vmap_p: _custom_vmap_rule,
  prims.remat_opt_p: _remat_opt_rule,
}

# The rules autocast evaluates with: ``rules.py``'s and these.
RULES = rules.rule_set(BODY_RULES)
