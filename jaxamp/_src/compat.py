"""Every use of JAX internals in jaxamp, in one place.

jaxamp reads jaxprs (public in ``jax.extend.core``) and re-binds primitives. A few things have no
public API: tracing a Python function to a jaxpr over given avals, re-binding an eqn with its
source information, reading an eqn's name stack and traceback, and the parameters of the
custom-derivative primitives. They live here, each behind a small function, so that a JAX
upgrade breaks one module, loudly (``tests/project/test_compat.py`` checks each of them).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import api_util as _api_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.state import types as _state_types
from jax.experimental import layout as _layout
from jax.extend import core as jex_core
from jax.extend.core import primitives as _exported

from jaxamp._src import caches

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Primitive = jex_core.Primitive
Literal = jex_core.Literal
jaxpr_as_fun = jex_core.jaxpr_as_fun

# The internals jaxamp needs, checked by tests/project/test_compat.py.
REQUIRED_INTERNALS = {
  "jax._src.api_util.debug_info": lambda: _api_util.debug_info,
  "jax._src.config.trace_context": lambda: _config.trace_context,
  "jax._src.core.typeof": lambda: _core.typeof,
  "jax._src.lax.lax.canonicalize_precision": lambda: _lax.canonicalize_precision,
  "jax._src.core.eval_jaxpr": lambda: _core.eval_jaxpr,
  "jax._src.linear_util.wrap_init": lambda: _lu.wrap_init,
  "jax._src.source_info_util.user_context": lambda: _source_info.user_context,
  "jax._src.source_info_util.current_name_stack": lambda: _source_info.current_name_stack,
  "jax._src.source_info_util.Scope": lambda: _source_info.Scope,
  "jax._src.interpreters.partial_eval.trace_to_jaxpr_dynamic": lambda: _pe.trace_to_jaxpr_dynamic,
  "jax._src.interpreters.partial_eval.convert_constvars_jaxpr": lambda: _pe.convert_constvars_jaxpr,
  "jax._src.state.types.AbstractRef": lambda: _state_types.AbstractRef,
  "jax._src.core.trace_ctx": lambda: _core.trace_ctx.trace,
  "jax._src.interpreters.ad.LinearizeTrace": lambda: _ad.LinearizeTrace,
  "jax._src.interpreters.ad.LinearizeTracer": lambda: _ad.LinearizeTracer,
  "jax._src.interpreters.ad.primitive_jvps": lambda: _ad.primitive_jvps,
  "jax._src.interpreters.ad.primitive_linearizations": lambda: _ad.primitive_linearizations,
  "jax._src.interpreters.ad.JVPTracer": lambda: _ad.JVPTracer,
  "jax._src.interpreters.ad.Zero": lambda: _ad.Zero,
  "jax._src.interpreters.ad.CustomVJPException": lambda: _ad.CustomVJPException,
  "jax._src.interpreters.partial_eval.DynamicJaxprTracer": lambda: _pe.DynamicJaxprTracer,
  "jax._src.core.Tracer._contents": lambda: _core.Tracer._contents,
  "jax._src.dispatch.apply_primitive": lambda: _dispatch.apply_primitive,
  "jax._src.interpreters.mlir._lowerings": lambda: _mlir._lowerings,
  "jax._src.interpreters.mlir._platform_specific_lowerings": lambda: (
    _mlir._platform_specific_lowerings
  ),
  "jax._src.interpreters.mlir.lower_per_platform": lambda: _mlir.lower_per_platform,
  "jax.experimental.layout.with_layout_constraint": lambda: _layout.with_layout_constraint,
}


def _unexported_primitives() -> dict[str, Any]:
  """Primitives jaxamp has rules for that ``jax.extend.core.primitives`` does not export."""
  from jax._src import callback, custom_batching, custom_derivatives, ffi, pjit, shard_map
  from jax._src.lax import control_flow, linalg
  from jax._src.lax import lax as lax_internal
  from jax._src.state import discharge
  from jax._src.state import primitives as state_primitives

  return {
    "ragged_dot_general_p": lax_internal.ragged_dot_general_p,
    "cholesky_update_p": linalg.cholesky_update_p,
    "geqp3_p": linalg.geqp3_p,
    "geqrf_p": linalg.geqrf_p,
    "ormqr_p": linalg.ormqr_p,
    "symmetric_product_p": linalg.symmetric_product_p,
    "pure_callback_p": callback.pure_callback_p,
    "io_callback_p": callback.io_callback_p,
    "ffi_call_p": ffi.ffi_call_p,
    "run_state_p": discharge.run_state_p,
    "shard_map_p": shard_map.shard_map_p,
    "composite_p": lax_internal.composite_p,
    "custom_vmap_p": custom_batching.custom_vmap_p,  # jax.custom_batching.custom_vmap's call
    "remat_opt_p": custom_derivatives.remat_opt_p,  # a custom_vjp fwd's, with optimize_remat
    "optimization_barrier_p": control_flow.optimization_barrier_p,
    "ref_get_p": state_primitives.get_p,
    "pvary_p": _core.pvary_p,  # shard_map's cast of a replicated value to varying
    "reshard_p": pjit.reshard_p,  # jax.sharding.reshard
    "layout_constraint_p": pjit.layout_constraint_p,  # jax.experimental.layout's constraint
  }


# Every primitive object jaxamp's registries and tables are keyed by: JAX's exported ones
# (``primitives.dot_general_p``) and the few it does not export.
primitives = types.SimpleNamespace(
  **{name: getattr(_exported, name) for name in dir(_exported) if name.endswith("_p")},
  **_unexported_primitives(),
)


# JAX's primitives, found in its modules (``is_jax_primitive``), and the modules count they
# were found at; jaxamp's own are added as they are made.
_jax_primitives: set[Any] = set()
_modules_scanned = [0]


def is_jax_primitive(primitive) -> bool:
  """Whether ``primitive`` is JAX's own (or jaxamp's), not one a library defines (K-FAC's tags):
  one that a module of ``jax`` or ``jaxlib`` holds."""
  if primitive in _jax_primitives:
    return True
  if len(sys.modules) != _modules_scanned[0]:  # JAX modules imported since: scan again
    _modules_scanned[0] = len(sys.modules)
    for name, module in list(sys.modules.items()):
      if name.split(".", 1)[0] in ("jax", "jaxlib") and module is not None:
        _jax_primitives.update(
          value for value in list(vars(module).values()) if isinstance(value, jex_core.Primitive)
        )
  return primitive in _jax_primitives


def configured_matmul_precision() -> Any:
  """The precision JAX records on a matmul whose caller gave none: the process's
  ``jax_default_matmul_precision`` (or its ``jax.default_matmul_precision`` context),
  canonicalized; None where unset."""
  return _lax.canonicalize_precision(None)


def _own(primitive) -> Any:
  """Registers one of jaxamp's primitives as JAX's own (``is_jax_primitive``)."""
  _jax_primitives.add(primitive)
  return primitive


def typeof(x) -> Any:
  """The abstract value (aval) of a value or tracer."""
  return _core.typeof(x)


def trace_context() -> Any:
  """What a trace depends on besides the function and its avals, as JAX's own trace caches key
  it: the configuration, the axis environment (a ``vmap`` axis's size, which ``pmean`` and
  ``lax.axis_size`` read) and the context mesh (which a bare ``PartitionSpec`` resolves
  against). Hashable."""
  return _config.trace_context()


def current_trace() -> Any:
  """The trace JAX is tracing into now (the eval trace outside any transformation)."""
  return _core.trace_ctx.trace


def row_major(x: jax.Array) -> jax.Array:
  """``x``, laid out row-major (XLA's default layout) where it is computed: a layout constraint,
  an experimental JAX API. The values are unchanged."""
  return _layout.with_layout_constraint(x, _layout.Layout(tuple(range(x.ndim))))


def is_literal(atom) -> bool:
  return isinstance(atom, Literal)


def name_scopes(eqn) -> tuple[str, ...]:
  """The ``jax.named_scope`` names an eqn was traced under, outermost first."""
  stack = getattr(eqn.source_info.name_stack, "stack", ())
  return tuple(s.name for s in stack if isinstance(s, _source_info.Scope))


def is_transposed(eqn) -> bool:
  """Whether ``eqn`` was traced by a transposition: the backward pass of a ``jax.grad``,
  ``jax.vjp`` or ``jax.linear_transpose`` taken inside the traced function."""
  stack = getattr(eqn.source_info.name_stack, "stack", ())
  return any(isinstance(s, _source_info.Transform) and s.name == "transpose" for s in stack)


def traceback_frames(eqn) -> tuple[tuple[str, str, int], ...]:
  """(file, function, line) of the Python frames an eqn was traced from, innermost first."""
  traceback = eqn.source_info.traceback
  if traceback is None:
    return ()
  return tuple((f.file_name, f.function_name, f.line_num) for f in traceback.frames)


def traceback_code_frames(eqn) -> tuple[tuple[Any, int], ...]:
  """(code object, bytecode offset) of the Python frames an eqn was traced from, innermost
  first. Offsets grow as a function runs on, also within one multi-line statement."""
  traceback = eqn.source_info.traceback
  if traceback is None:
    return ()
  codes, offsets = traceback.raw_frames()
  return tuple(zip(codes, offsets, strict=True))


def _promotion_codes() -> frozenset:
  """The code objects of jnp's implicit dtype promotion: ``promote_dtypes`` & co, and a jnp
  ufunc's call (inlined, its eqns carry the call's traceback, not the promotion's)."""
  from jax._src.numpy import ufunc_api, util

  functions = [
    util.promote_dtypes,
    util.promote_dtypes_inexact,
    util.promote_dtypes_numeric,
    util.promote_dtypes_complex,
    ufunc_api.ufunc.__call__,
  ]
  return frozenset(inspect.unwrap(function).__code__ for function in functions)


PROMOTION_CODES = _promotion_codes()


def traced_inside(eqn, codes: frozenset) -> bool:
  """Whether ``eqn`` was traced inside a call of a function whose code object is in ``codes``."""
  return any(code in codes for code, _ in traceback_code_frames(eqn))


def is_implicit_promotion(eqn) -> bool:
  """Whether a ``convert_element_type`` eqn is jnp's promotion of an operand to a common dtype
  (``x_bf16 + y_f32``), not a conversion the caller asked for (``x.astype``)."""
  return traced_inside(eqn, PROMOTION_CODES)


def _cast_codes() -> frozenset:
  """The code objects every conversion a caller asks for passes through (``x.astype``,
  ``jnp.astype``, ``jnp.asarray(x, dtype)``, ``lax.convert_element_type``)."""
  from jax._src.lax import lax as lax_internal

  return frozenset({inspect.unwrap(lax_internal._convert_element_type).__code__})


CAST_CODES = _cast_codes()


def is_requested_cast(eqn) -> bool:
  """Whether a ``convert_element_type`` eqn is a conversion the caller asked for (``x.astype``),
  not jnp's promotion of an operand: jnp's inlined functions (``jnp.true_divide`` behind ``/``)
  leave their call's traceback on it, which shows neither."""
  return traced_inside(eqn, CAST_CODES) and not is_implicit_promotion(eqn)


def traceback_of(eqn):
  """A context in which traced operations get ``eqn``'s source location (name stack unchanged)."""
  return _source_info.user_context(eqn.source_info.traceback)


def eqn_context(eqn):
  """The context ``eqn`` was traced in (its mesh: ``auto_axes``/``explicit_axes`` regions), for
  the casts made for it to be typed as its operands are."""
  return eqn.ctx.manager


def bind(eqn, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
  """Binds ``eqn``'s primitive on ``invals`` with its source info kept; always a list of outputs.

  Under reverse-mode differentiation the bind goes through a cached ``jax.jit(inline=True)``,
  as ``jax.numpy``'s functions do (see ``staged``)."""
  params = eqn.params if params is None else params
  primitive = eqn.primitive
  bind_params = primitive.get_bind_params(params)
  name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
    staged = None if eqn.effects else _staged_primitive(primitive, bind_params, invals)
    out = staged(*invals) if staged is not None else primitive.bind(*invals, **bind_params)
  outs = list(out) if primitive.multiple_results else [out]
  return [_typed_as_traced(value, var) for value, var in zip(outs, eqn.outvars, strict=True)]


def _typed_as_traced(value, var) -> Any:
  """A concrete output made strongly typed where ``var``'s type is. jax 0.10.0 caches eager
  binds without the inputs' weak types: once a weak literal was broadcast, a strong one of the
  same shape (``jnp.full(s, jnp.finfo(jnp.float32).min)``) comes out weak, and autocast would
  let it follow a 16-bit operand (into -inf)."""
  if isinstance(value, _core.Tracer) or var.aval.weak_type:
    return value
  if not getattr(typeof(value), "weak_type", False):
    return value
  return jax.lax.convert_element_type(value, typeof(value).dtype)


def linearizing(values: Sequence[Any]) -> bool:
  """Whether JAX is linearizing (``grad``, ``vjp``) with respect to one of ``values`` now."""
  trace = _core.trace_ctx.trace
  return isinstance(trace, _ad.LinearizeTrace) and any(
    isinstance(v, _ad.LinearizeTracer) and v._trace is trace for v in values
  )


def staged(key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  """``jax.jit(make(), inline=True)``, one per ``key``.

  JAX linearizes a bound primitive by tracing its JVP rule into a jaxpr of its own, every time;
  a jit call it linearizes once per jaxpr (and transposes once), and inlines when staging. A
  deep model repeats the same few operations per layer, so binding them through one jit per
  operation makes its ``grad`` trace as fast as the same model written with ``jax.numpy``.
  Source info is unchanged: inlined eqns take the caller's.
  """
  fun = _staged_functions.get(key)
  if fun is None:
    with _staged_lock:
      if len(_staged_functions) >= _MAX_STAGED:
        del _staged_functions[next(iter(_staged_functions))]  # the oldest
      fun = _staged_functions.setdefault(key, jax.jit(make(), inline=True))
  return fun


def call_staged(key: Any, fun: Callable[..., Any], *args: Any) -> Any:
  """``fun(*args)``; through ``staged(key, ...)`` while linearizing with respect to ``args``.

  ``key`` names ``fun`` (its parameters included): the first ``fun`` given a key is the one
  staged for it.
  """
  if linearizing(args):
    return staged(key, lambda: fun)(*args)
  return fun(*args)


_MAX_STAGED = 4096
_staged_functions: dict[Any, Callable[..., Any]] = {}
_staged_lock = threading.Lock()


def clear_staged() -> None:
  with _staged_lock:
    _staged_functions.clear()


caches.register("compat.staged_functions", clear_staged, lambda: len(_staged_functions))


def _staged_primitive(primitive, bind_params: dict[str, Any], invals) -> Callable | None:
  """A staged bind of a first-order ``primitive`` that JAX would linearize by its JVP rule;
  None where a direct bind is as fast (no linearization now) or required (higher-order,
  unhashable parameters)."""
  if (
    primitive in _ad.primitive_linearizations
    or primitive not in _ad.primitive_jvps
    or not linearizing(invals)
    or any(is_typed_param(v) for v in bind_params.values())
  ):
    return None
  key = (primitive, tuple(sorted(bind_params.items())))
  try:
    hash(key)
  except TypeError:
    return None

  def make():
    def bind_primitive(*args):
      return primitive.bind(*args, **bind_params)

    bind_primitive.__name__ = bind_primitive.__qualname__ = primitive.name
    return bind_primitive

  return staged(key, make)


def trace(fun: Callable[..., Sequence[Any]], in_avals: Sequence[Any]) -> ClosedJaxpr:
  """Traces ``fun`` (flat arrays in, flat list out) to a closed jaxpr over ``in_avals``."""
  debug_info = _api_util.debug_info("jaxamp.autocast", fun, tuple(in_avals), {})
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
    _lu.wrap_init(fun, debug_info=debug_info), list(in_avals)
  )
  return ClosedJaxpr(jaxpr, consts)


def open_jaxpr(closed: ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
  """A jaxpr without constvars (they become leading invars) and the consts to pass for them."""
  if not closed.consts:
    return closed.jaxpr, []
  return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def is_typed_param(value) -> bool:
  """Whether an eqn parameter fixes types: a jaxpr, a callable or an abstract value (a scalar
  type such as ``jnp.float32``, callable but a dtype, is not one)."""
  if (
    isinstance(value, type)
    and issubclass(value, np.generic)
    or isinstance(getattr(value, "dtype", None), np.dtype)
    and not hasattr(value, "shape")
  ):
    return False
  return isinstance(
    value, Jaxpr | ClosedJaxpr | _core.AbstractValue | jax.ShapeDtypeStruct
  ) or callable(value)


def sub_jaxpr_inputs(eqn) -> list[tuple[Jaxpr, list]] | None:
  """The open sub-jaxprs of a higher-order eqn, each with the eqn inputs its invars receive;
  None for an eqn with no sub-jaxprs, or with ones whose inputs are not known here."""
  params, invars = eqn.params, list(eqn.invars)
  name = eqn.primitive.name
  if name == "while":
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    carry = invars[n_cond + n_body :]
    return [
      (params["cond_jaxpr"].jaxpr, invars[:n_cond] + carry),
      (params["body_jaxpr"].jaxpr, invars[n_cond : n_cond + n_body] + carry),
    ]
  if name == "cond":
    return [(branch.jaxpr, invars[1:]) for branch in params["branches"]]
  bodies = [value for value in params.values() if isinstance(value, Jaxpr | ClosedJaxpr)]
  if len(bodies) != 1:
    return None
  body = bodies[0].jaxpr if isinstance(bodies[0], ClosedJaxpr) else bodies[0]
  return [(body, invars)] if len(body.invars) == len(invars) else None


def sub_jaxprs(eqn) -> Iterator[Jaxpr]:
  """The open jaxprs among ``eqn``'s params (not descending into them)."""
  for sub in _core.jaxprs_in_params(eqn.params):
    yield sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub


def shard_map_axis_names(params: dict[str, Any]) -> set:
  """The mesh axes a ``shard_map`` eqn makes manual (``newly_manual_axes`` from jax 0.10.1)."""
  names = params.get("newly_manual_axes", params.get("manual_axes"))
  return set(names)


def platform_branch(eqn) -> int | None:
  """The branch a platform-dependent ``cond`` (``lax.platform_dependent``: its
  ``branches_platforms`` name each branch's platforms, None the default) takes when lowered for
  the default backend; None for a ``cond`` on data."""
  from jax._src import xla_bridge

  platforms = eqn.params.get("branches_platforms")
  if platforms is None:
    return None
  here = xla_bridge.canonicalize_platform(jax.default_backend())
  for index, names in enumerate(platforms):
    if names is not None and here in names:
      return index
  return platforms.index(None) if None in platforms else None


# flax nnx's read of a hijax Variable (``nnx.var_defaults(hijax=True)``), a primitive flax
# defines: known by name, so that importing jaxamp imports no flax.
_VARIABLE_READS = frozenset({"get_variable"})


def is_whole_read(eqn) -> bool:
  """Whether ``eqn`` reads the whole value of a reference (``ref[...]`` of a ``jax.new_ref``,
  an nnx Variable kept as a Ref or a hijax type): its output is the referenced array itself."""
  if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
    return False
  if eqn.primitive is primitives.ref_get_p:
    return eqn.outvars[0].aval.shape == getattr(eqn.invars[0].aval, "shape", None)
  return eqn.primitive.name in _VARIABLE_READS


def is_ref(value) -> bool:
  """Whether ``value`` is a mutable array reference (``jax.new_ref``), whose dtype is fixed; not
  for any other value, a pytree (an nnx Variable's sown tuple) included."""
  try:
    return isinstance(typeof(value), _state_types.AbstractRef)
  except TypeError:
    return False


def aval_with_dtype(aval, dtype):
  """``aval`` with another dtype (and no weak type)."""
  return aval.update(dtype=dtype, weak_type=False)


# --- custom derivatives -------------------------------------------------------------------------

SymbolicZero = jax.custom_derivatives.SymbolicZero


def perturbed(value) -> bool:
  """Whether ``value`` carries a nonzero tangent of a differentiation (jvp, grad, vjp) under way
  now: the flag JAX gives a custom_vjp's ``fwd`` rule for that input when it calls it now.

  A value being staged out (under ``jit``) is not: differentiation may come later, with flags
  not known yet. Tracers of other transformations (``vmap``) are looked through.
  """
  if not isinstance(value, _core.Tracer) or isinstance(value, _pe.DynamicJaxprTracer):
    return False
  if isinstance(value, _ad.JVPTracer | _ad.LinearizeTracer):
    return not isinstance(value.tangent, _ad.Zero) or perturbed(value.primal)
  return any(perturbed(part) for _, part in value._contents())


def is_symbolic_zero(tangent) -> bool:
  """Whether a tangent or cotangent handed to a custom rule is a symbolic zero (or None)."""
  return tangent is None or isinstance(tangent, SymbolicZero | _ad.Zero)


def symbolic_zero(aval) -> Any:
  """The symbolic zero tangent (or cotangent) of a value of type ``aval``."""
  return SymbolicZero(aval.to_tangent_aval())


def custom_jvp_rule(eqn) -> Callable[[Sequence[bool]], tuple[Jaxpr, list[Any], list[bool]]]:
  """The JVP rule of a ``custom_jvp_call`` eqn, traced for given symbolic-zero input tangents.

  ``rule(zeros)``, one flag per non-const input, is ``(jaxpr, consts, out_zeros)``: the jaxpr
  maps (*primals, *tangents that are not zeros) to (*outs, *out tangents that are not zeros),
  ``out_zeros`` flagging the outputs whose tangent the rule returned as a symbolic zero. A rule
  defined without ``symbolic_zeros`` sees no zeros: JAX calls it with all flags False.
  """
  jvp_jaxpr_fun = eqn.params["jvp_jaxpr_fun"]

  def rule(zeros: Sequence[bool]) -> tuple[Jaxpr, list[Any], list[bool]]:
    jaxpr, consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
    return jaxpr, list(consts), list(out_zeros)

  return rule


def custom_vjp_rules(eqn):
  """The rules of a ``custom_vjp_call`` eqn: ``(fwd_jaxpr, split, bwd)``.

  ``fwd_jaxpr(perturbed)`` is (jaxpr, consts) of the ``fwd`` rule traced for which non-const
  inputs are perturbed (JAX's ``fwd_jaxpr_thunk``, whose flags say which inputs have a nonzero
  tangent; a ``symbolic_zeros`` rule sees them as ``CustomVJPPrimal.perturbed``); it maps the
  non-const primals to the non-forwarded residuals followed by the outputs.
  ``split(jaxpr, res_and_outs, primals)`` splits what that jaxpr returned, given all the eqn's
  inputs (consts first), into (residuals as ``bwd`` takes them, the dtypes that jaxpr gives
  them, outputs): residual dtypes depend on the flags the ``fwd`` ran with. ``bwd(*residuals,
  *out_cotangents)`` returns one cotangent per non-const input.
  """
  params = eqn.params
  in_avals = [v.aval for v in eqn.invars]
  fwd_thunk, bwd, out_trees = params["fwd_jaxpr_thunk"], params["bwd"], params["out_trees"]

  def fwd_jaxpr(perturbed: Sequence[bool]) -> tuple[Jaxpr, list[Any]]:
    jaxpr, consts = fwd_thunk.call_wrapped(*perturbed)
    return jaxpr, list(consts)

  def split(jaxpr, res_and_outs, primals):
    _, res_tree, input_fwds = out_trees()
    num_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    res_out, outs = res_and_outs[:num_res_out], res_and_outs[num_res_out:]
    res_iter, dtype_iter = iter(res_out), iter(v.aval.dtype for v in jaxpr.outvars)
    residuals, dtypes = [], []
    for f in input_fwds:
      residuals.append(next(res_iter) if f is None else primals[f])
      dtypes.append(next(dtype_iter) if f is None else in_avals[f].dtype)
    return residuals, dtypes, list(outs)

  def backward(*args):
    return list(bwd.call_wrapped(*args))

  return fwd_jaxpr, split, backward


def closed_over_perturbed() -> Exception:
  """JAX's error for a custom_vjp differentiated with respect to a value its primal closes over
  (a const of the eqn), which its rules do not cover."""
  return _ad.CustomVJPException()


def instantiate(ct, aval) -> Any:
  """A cotangent as an array: symbolic zeros (and None) become zeros of ``aval``."""
  if is_symbolic_zero(ct):
    return jnp.zeros(aval.shape, aval.dtype)
  return ct


# --- a primitive of jaxamp's own: float32 cotangents of cast-down operands (weight_grads.py) ---


def bilinear_primitive(
  name: str,
  impl: Callable[..., Any],
  abstract_eval: Callable[..., Any],
  transpose_lhs: Callable[..., Any],
  transpose_rhs: Callable[..., Any],
  batch: Callable[..., tuple[Any, Any]],
) -> Any:
  """A new primitive, bilinear in its two operands as ``dot_general`` is.

  It is evaluated and lowered as ``impl(lhs, rhs, **params)`` and typed by
  ``abstract_eval(lhs_aval, rhs_aval, **params)``; JAX differentiates it as a bilinear map and
  transposes it by ``transpose_lhs`` / ``transpose_rhs`` (``rule(ct, lhs, rhs, **params)``, the
  operand transposed for given as something with its ``.aval``); ``batch(args, dims, **params)``
  returns ``(out, out_dim)`` under ``vmap``.
  """
  from jax.interpreters import ad, batching, mlir

  primitive = _own(jex_core.Primitive(name))
  primitive.def_impl(impl)
  primitive.def_abstract_eval(abstract_eval)
  mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=False))
  ad.defbilinear(primitive, transpose_lhs, transpose_rhs)
  batching.primitive_batchers[primitive] = batch
  return primitive


def identity_primitive(name: str) -> Any:
  """A new primitive of one operand: the identity, lowered as nothing. Linear, elementwise under
  ``vmap``: an eqn to mark a value with, which compiles away."""
  from jax.interpreters import ad, batching, mlir

  primitive = _own(jex_core.Primitive(name))
  primitive.def_impl(lambda x: x)
  primitive.def_abstract_eval(lambda aval: aval)
  mlir.register_lowering(primitive, lambda ctx, x: [x])
  ad.deflinear2(primitive, lambda ct, _: [primitive.bind(ct)])
  batching.defvectorized(primitive)
  return primitive


def platform_identity(name: str, platform: str, barrier: Any) -> Any:
  """A new primitive of one operand: the identity, but lowered as the one-operand primitive
  ``barrier`` (``optimization_barrier_p``) for ``platform`` (``"cpu"``). Linear, elementwise
  under ``vmap``; nothing is traced per platform, unlike ``lax.platform_dependent``."""
  from jax.interpreters import mlir

  def lowered(ctx, x):
    return lower_as(ctx, barrier, [x], ctx.avals_in, ctx.avals_out)

  primitive = identity_primitive(name)
  mlir.register_lowering(primitive, lowered, platform=platform)
  return primitive


def unary_primitive(
  name: str,
  lowering: Callable[..., Sequence[Any]],
  abstract_eval: Callable[..., Any],
  jvp: Callable[..., Any],
) -> Any:
  """A new elementwise primitive of one operand: lowered by ``lowering(ctx, x, **params)`` (a
  lowering rule, see ``lower_as``), typed by ``abstract_eval(aval, **params)``, its tangent
  ``jvp(t, x, **params)``; evaluated eagerly as lowered for the device.

  One eqn where ``lax`` ops would be several: JAX linearizes a primitive by tracing its JVP rule,
  so a deep model's many uses of it trace a few eqns each."""
  from jax.interpreters import ad, batching, mlir

  primitive = _own(jex_core.Primitive(name))
  primitive.def_impl(functools.partial(_dispatch.apply_primitive, primitive))
  primitive.def_abstract_eval(abstract_eval)
  mlir.register_lowering(primitive, lowering)
  ad.defjvp(primitive, jvp)
  batching.defvectorized(primitive)
  return primitive


def lower_as(ctx, primitive, args: Sequence[Any], avals_in, avals_out, **params) -> list[Any]:
  """Emits ``primitive`` on the IR values ``args`` (of types ``avals_in``, giving
  ``avals_out``) by JAX's own lowering rules, per platform being lowered for, inside the
  lowering rule whose context is ``ctx``. ``mlir.lower_fun`` would trace a jaxpr per shape."""
  platform_rules = {
    platform: entry.rule
    for platform, table in _mlir._platform_specific_lowerings.items()
    if (entry := table.get(primitive)) is not None
  }
  default = _mlir._lowerings.get(primitive)
  sub = ctx.replace(primitive=primitive, avals_in=list(avals_in), avals_out=list(avals_out))
  return list(
    _mlir.lower_per_platform(
      sub,
      str(primitive),
      platform_rules,
      default.rule if default is not None else None,
      jex_core.no_effects,
      *args,
      **params,
    )
  )


def lower_convert(ctx, value, aval_in, aval_out) -> Any:
  """``convert_element_type`` of an IR value from ``aval_in`` to ``aval_out``'s dtype."""
  (out,) = lower_as(
    ctx,
    _exported.convert_element_type_p,
    [value],
    [aval_in],
    [aval_out],
    new_dtype=aval_out.dtype,
    weak_type=False,
    sharding=None,
  )
  return out


def platform_result_dot(name: str, platform: str) -> Any:
  """A new primitive: ``dot_general`` (its params, plus ``platform_dtype``), lowered for
  ``platform`` (``"cpu"``) as the dot with a ``platform_dtype`` result converted to its
  ``preferred_element_type``, and as the plain dot elsewhere. Nothing is traced per platform,
  unlike ``lax.platform_dependent``: one eqn, no ``cond``. An optimization barrier sits
  between that dot and its convert: XLA:CPU drops a float32 -> bfloat16 -> float32 round trip,
  which would give the float32 result after all. Evaluated eagerly as lowered for the device.

  Bilinear; its transposes are JAX's of ``dot_general`` (plain dots), and under ``vmap`` it is
  batched as ``dot_general`` is, the batched dots bound as this primitive."""

  def lowered_platform_dot(ctx, lhs, rhs, *, platform_dtype, **params):
    (out_aval,) = ctx.avals_out
    low_aval = aval_with_dtype(out_aval, platform_dtype)
    low_params = dict(params, preferred_element_type=platform_dtype)
    dot_general, barrier = _exported.dot_general_p, primitives.optimization_barrier_p
    (low,) = lower_as(ctx, dot_general, [lhs, rhs], ctx.avals_in, [low_aval], **low_params)
    (low,) = lower_as(ctx, barrier, [low], [low_aval], [low_aval])
    return [lower_convert(ctx, low, low_aval, out_aval)]

  return _platform_dot(name, platform, lowered_platform_dot)


def platform_widened_dot(name: str, platform: str) -> Any:
  """A new primitive: ``dot_general`` (its params, plus ``operand_dtype``) of its operands
  rounded to ``operand_dtype`` (16 bits), with a wider ``preferred_element_type`` result. Lowered
  for ``platform`` (``"cpu"``) as the dot of the rounded operands widened back (exact, as the
  products of 16-bit values are: XLA:CPU has no kernel for some bfloat16 x bfloat16 -> float32
  dots), elsewhere as the dot of the rounded operands.

  An operand may be wider than ``operand_dtype`` (float32 probabilities): it is rounded inside, so
  its cotangent is the dot's wide result, unrounded, as flash attention's backward keeps ``dP``
  in float32; linearized, the operands are kept rounded (16-bit residuals). Bilinear; its
  transposes are this dot, and under ``vmap`` it is batched as ``dot_general`` is, the batched
  dots this primitive."""
  from jax.interpreters import ad, batching, mlir

  primitive = _own(jex_core.Primitive(name))
  dot_general, barrier = _exported.dot_general_p, primitives.optimization_barrier_p

  def rounded(ctx, operands, operand_dtype, separately: bool) -> tuple[list, list]:
    """The IR operands rounded to ``operand_dtype``, and their types; ``separately`` puts
    a barrier after each rounding, which XLA:CPU would drop before a widening convert."""
    values, avals = [], []
    for value, aval in zip(operands, ctx.avals_in, strict=True):
      low = aval_with_dtype(aval, operand_dtype)
      if aval.dtype != low.dtype:
        value = lower_convert(ctx, value, aval, low)
        if separately:
          (value,) = lower_as(ctx, barrier, [value], [low], [low])
      values.append(value)
      avals.append(low)
    return values, avals

  def lowered_dot(ctx, lhs, rhs, *, operand_dtype, **params):
    args, avals = rounded(ctx, (lhs, rhs), operand_dtype, separately=False)
    return lower_as(ctx, dot_general, args, avals, ctx.avals_out, **params)

  def lowered_widened_dot(ctx, lhs, rhs, *, operand_dtype, **params):
    args, avals = rounded(ctx, (lhs, rhs), operand_dtype, separately=True)
    (out_aval,) = ctx.avals_out
    wide = [aval_with_dtype(aval, out_aval.dtype) for aval in avals]
    args = [lower_convert(ctx, *lowered) for lowered in zip(args, avals, wide, strict=True)]
    return lower_as(ctx, dot_general, args, wide, ctx.avals_out, **params)

  def abstract_eval(lhs, rhs, *, operand_dtype, **params):
    low = [aval_with_dtype(aval, operand_dtype) for aval in (lhs, rhs)]
    out, _ = dot_general.abstract_eval(*low, **params)
    return out

  def transpose(linear: int) -> Callable[..., Any]:
    def rule(ct, lhs, rhs, *, operand_dtype, **params):
      operands = [lhs, rhs]
      undefined, other = operands[linear], operands[1 - linear]

      def transposed(ct, other):
        placed = [undefined, undefined]
        placed[1 - linear] = other
        return bilinear_transpose(dot_general, ct, placed, linear, params)

      return _dots_bound_as(primitive, {"operand_dtype": operand_dtype}, transposed, [ct, other])

    return rule

  def batch(args, dims, *, operand_dtype, **params):
    unbatched = lambda lhs, rhs: dot_general.bind(lhs, rhs, **params)
    batched = jax.vmap(unbatched, tuple(dims))
    return _dots_bound_as(primitive, {"operand_dtype": operand_dtype}, batched, args), 0

  def rounded_value(value, operand_dtype):
    if typeof(value).dtype == operand_dtype:
      return value
    return _exported.convert_element_type_p.bind(
      value, new_dtype=operand_dtype, weak_type=False, sharding=None
    )

  def lhs_jvp(tangent, lhs, rhs, *, operand_dtype, **params):
    return primitive.bind(
      tangent, rounded_value(rhs, operand_dtype), **params, operand_dtype=operand_dtype
    )

  def rhs_jvp(tangent, lhs, rhs, *, operand_dtype, **params):
    return primitive.bind(
      rounded_value(lhs, operand_dtype), tangent, **params, operand_dtype=operand_dtype
    )

  primitive.def_impl(functools.partial(_dispatch.apply_primitive, primitive))
  primitive.def_abstract_eval(abstract_eval)
  mlir.register_lowering(primitive, lowered_dot)
  mlir.register_lowering(primitive, lowered_widened_dot, platform=platform)
  ad.defbilinear(primitive, transpose(0), transpose(1))
  # Linearized against the rounded operands: the residuals are 16-bit, the tangents not rounded.
  ad.defjvp(primitive, lhs_jvp, rhs_jvp)
  batching.primitive_batchers[primitive] = batch
  return primitive


def _platform_dot(name: str, platform: str, lowered_platform_dot: Callable[..., Any]) -> Any:
  """A new primitive: ``dot_general`` with a ``platform_dtype`` param, lowered for ``platform``
  by ``lowered_platform_dot`` and as the plain dot elsewhere. Transposed by JAX's rule (plain
  dots) and batched as ``dot_general``, the batched dots this primitive."""
  from jax.interpreters import ad, batching, mlir

  primitive = _own(jex_core.Primitive(name))

  def lowered_dot(ctx, lhs, rhs, *, platform_dtype, **params):
    return lower_as(ctx, _exported.dot_general_p, [lhs, rhs], ctx.avals_in, ctx.avals_out, **params)

  def abstract_eval(lhs, rhs, *, platform_dtype, **params):
    out, _ = _exported.dot_general_p.abstract_eval(lhs, rhs, **params)
    return out

  def transpose(linear: int) -> Callable[..., Any]:
    def rule(ct, lhs, rhs, *, platform_dtype, **params):
      return bilinear_transpose(_exported.dot_general_p, ct, (lhs, rhs), linear, params)

    return rule

  def batch(args, dims, *, platform_dtype, **params):
    unbatched = lambda lhs, rhs: _exported.dot_general_p.bind(lhs, rhs, **params)
    batched = jax.vmap(unbatched, tuple(dims))
    return _dots_bound_as(primitive, {"platform_dtype": platform_dtype}, batched, args), 0

  primitive.def_impl(functools.partial(_dispatch.apply_primitive, primitive))
  primitive.def_abstract_eval(abstract_eval)
  mlir.register_lowering(primitive, lowered_dot)
  mlir.register_lowering(primitive, lowered_platform_dot, platform=platform)
  ad.defbilinear(primitive, transpose(0), transpose(1))
  batching.primitive_batchers[primitive] = batch
  return primitive


def _dots_bound_as(
  primitive, own_params: dict, fun: Callable[..., Any], args: Sequence[Any]
) -> Any:
  """``fun(*args)`` (one output), its ``dot_general`` eqns bound as ``primitive`` (a dot with
  ``own_params`` besides ``dot_general``'s)."""

  def bind_eqn(eqn, ins):
    if eqn.primitive is not _exported.dot_general_p:
      return eqn.primitive.bind(*ins, **eqn.params)
    return primitive.bind(*ins, **eqn.params, **own_params)

  closed = trace(lambda *values: [fun(*values)], [typeof(arg) for arg in args])
  return evaluate(closed, args, bind_eqn)


def evaluate(closed: ClosedJaxpr, args: Sequence[Any], bind: Callable[[Any, list], Any]) -> Any:
  """The single output of ``closed``, a jaxpr of one-output eqns, on ``args``, each eqn
  evaluated as ``bind(eqn, its input values)``."""
  jaxpr = closed.jaxpr
  values = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*closed.consts, *args), strict=True))
  for eqn in jaxpr.eqns:
    ins = [a.val if is_literal(a) else values[a] for a in eqn.invars]
    values[eqn.outvars[0]] = bind(eqn, ins)
  (out,) = jaxpr.outvars
  return out.val if is_literal(out) else values[out]


def bilinear_transpose(primitive, ct, operands: Sequence[Any], linear: int, params) -> Any:
  """The cotangent of operand ``linear`` of a bilinear ``primitive`` (``dot_general``,
  ``conv_general_dilated``) at ``ct``, by JAX's own transpose rule; of ``operands[linear]`` only
  the type (``.aval``) is read."""
  from jax.interpreters import ad

  args = list(operands)
  args[linear] = ad.UndefinedPrimal(args[linear].aval)
  return ad.primitive_transposes[primitive](ct, *args, **params)[linear]


def bind_like(eqn, fun: Callable[..., Any], args: Sequence[Any]) -> Any:
  """``fun(*args)``, traced with ``eqn``'s source line and name stack, as ``bind`` binds."""
  name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
    return fun(*args)


def traced_now(value) -> bool:
  """Whether ``value`` is a tracer of the transformation being traced now (for instance the
  ``vmap`` a custom JVP rule is batched by, whose unbatched inputs are plain values)."""
  return isinstance(value, _core.Tracer) and value._trace is _core.trace_ctx.trace
