"""``jaxamp.autocast``: torch.amp's autocast as a JAX function transformation.

``autocast(f)`` traces ``f`` to a jaxpr once per input signature (array types plus the values of
non-array arguments such as ``train=True``) and evaluates that jaxpr with the autocast
interpreter in the caller's trace, so it composes with ``jit``, ``grad``, ``vmap`` and the rest
in either order. The eqns it emits carry a *kept* mark: an enclosing autocast leaves them alone,
so an inner ``autocast(g, dtype=...)`` region keeps its own dtype.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxamp._src import (
    compat,
    higher_order,
    interpreter,
    library_ops,
    nnx_modules,
    policy,
    regions,
)

del library_ops  # imported for its registrations

_TRACE_CACHE_SIZE = 512
_traces: collections.OrderedDict = collections.OrderedDict()


def autocast(fun: Callable | None = None, *, device_type: str | None = None, dtype=None,
             enabled: bool = True, cache_enabled: bool = True) -> Callable:
  """Runs ``fun`` with torch.amp's autocast policy for ``device_type``.

  Usable as a transform, ``autocast(f, device_type="cuda")``, and as a decorator,
  ``@autocast(device_type="cpu")``.

  Args:
    fun: the function to transform; its arguments are pytrees of arrays and static values.
    device_type: "cuda" (float16 by default) or "cpu" (bfloat16 by default); None picks the
      device type of ``jax.default_backend()``.
    dtype: the lower-precision dtype, ``jnp.float16`` or ``jnp.bfloat16``; None: the device
      type's default.
    enabled: False runs ``fun`` as written, also inside an enclosing autocast function.
    cache_enabled: cast each value to a dtype at most once per trace (torch's weight cast cache).

  Returns:
    A function with ``fun``'s signature whose outputs have the dtypes the policy produced.
  """
  settings = policy.make_policy(device_type, dtype, cache_enabled)
  if not isinstance(enabled, bool):
    raise TypeError(f"`enabled` must be a bool; got {enabled!r}.")
  if fun is None:
    return functools.partial(autocast, device_type=device_type, dtype=dtype, enabled=enabled,
                             cache_enabled=cache_enabled)
  if not callable(fun):
    raise TypeError(f"autocast transforms a callable; got {fun!r} of type {type(fun).__name__}.")
  return _wrap(fun, settings if enabled else None)


def _wrap(fun: Callable, settings: policy.Policy | None) -> Callable:
  @functools.wraps(fun)
  def autocast_fun(*args, **kwargs):
    with regions.kept_region(regions.AUTOCAST_MARK):
      if settings is None:
        return fun(*args, **kwargs)
      if nnx_modules.contains_modules((args, kwargs)):
        run = lambda pure_fun, a, k: call(pure_fun, settings, a, k)
        return nnx_modules.call_keeping_state(run, fun, args, kwargs)
      return call(fun, settings, args, kwargs)

  return autocast_fun


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | np.generic)


def call(fun: Callable, settings: policy.Policy, args: tuple, kwargs: dict) -> Any:
  """Calls ``fun`` on ``args`` and ``kwargs`` with ``settings``' autocast."""
  leaves, in_tree = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not _is_array(leaf))
  arrays = [leaves[i] for i in dynamic]
  in_avals = tuple(compat.typeof(x) for x in arrays)
  closed, (out_tree, static_outs) = _trace(fun, in_tree, tuple(dynamic), static, in_avals)
  ctx = interpreter.Context(settings)
  outs = iter(interpreter.evaluate(closed.jaxpr, closed.consts, arrays, ctx))
  return jax.tree.unflatten(out_tree, [next(outs) if leaf is _TRACED else leaf
                                       for leaf in static_outs])


_TRACED = object()  # marks the outputs that come from the jaxpr


def _trace(fun, in_tree, dynamic: tuple, static: tuple, in_avals: tuple):
  """``fun``'s jaxpr for this signature: traced once, reused while nothing it closes over traces."""
  try:
    key = (fun, in_tree, dynamic, static, in_avals)
    hash(key)
  except TypeError:
    key = None  # unhashable static arguments: trace every call
  if key is not None and key in _traces:
    _traces.move_to_end(key)
    return _traces[key]
  out_tree_box = []

  def flat_fun(*arrays):
    leaves = [None] * (len(arrays) + len(static))
    for i, x in zip(dynamic, arrays, strict=True):
      leaves[i] = x
    for i, x in static:
      leaves[i] = x
    args, kwargs = jax.tree.unflatten(in_tree, leaves)
    out = fun(*args, **kwargs)
    out_leaves, out_tree = jax.tree.flatten(out)
    # Outputs that are not traced values (strings, Python numbers, numpy constants) are returned
    # as they are, like the static arguments.
    traced = [isinstance(leaf, jax.core.Tracer) for leaf in out_leaves]
    out_tree_box.append((out_tree, [_TRACED if t else leaf
                                    for leaf, t in zip(out_leaves, traced, strict=True)]))
    return [leaf for leaf, t in zip(out_leaves, traced, strict=True) if t]

  closed = compat.trace(flat_fun, in_avals)
  result = (closed, out_tree_box[0])
  if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
    _traces[key] = result
    if len(_traces) > _TRACE_CACHE_SIZE:
      _traces.popitem(last=False)
  return result


def custom_fwd(fun: Callable | None = None, *, device_type: str | None = None,
               cast_inputs=None) -> Callable:
  """torch.amp.custom_fwd for the forward function of a ``jax.custom_vjp``.

  With ``cast_inputs`` (a float dtype), inside an autocast function the floating inputs are cast
  to it and the function body runs with autocast disabled; outside autocast nothing changes.
  Without it, the body is autocast like any other code.
  """
  if device_type is not None:
    policy.get_table(device_type)  # torch's signature; validated, the cast applies everywhere
  if fun is None:
    return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
  if _is_dtype(fun):
    raise TypeError(f"custom_fwd takes the dtype as a keyword: custom_fwd(cast_inputs={fun!r}); "
                    "its positional argument is the function to decorate.")
  if not callable(fun):
    raise TypeError(f"custom_fwd decorates a callable; got {fun!r}.")
  if cast_inputs is None:
    return fun
  target = policy.canonical_cast_dtype(cast_inputs)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    with regions.op_region(regions.custom_fwd_name(target)):
      return fun(*args, **kwargs)

  return wrapped


def _is_dtype(x: Any) -> bool:
  """A dtype or scalar type (np.float32, jnp.bfloat16), not a function to decorate."""
  if isinstance(x, np.dtype) or isinstance(x, type) and issubclass(x, np.generic):
    return True
  return isinstance(getattr(x, "dtype", None), np.dtype) and not hasattr(x, "shape")


def custom_bwd(fun: Callable | None = None, *, device_type: str | None = None) -> Callable:
  """torch.amp.custom_bwd for the backward function of a ``jax.custom_vjp``.

  The backward runs under the autocast policy its forward ran under (by default a custom_vjp's
  backward runs in the dtypes of its residuals and cotangents, as torch runs backward passes).
  """
  if device_type is not None:
    policy.get_table(device_type)  # torch's signature; the forward's policy is used
  if fun is None and device_type is not None:
    return functools.partial(custom_bwd, device_type=device_type)
  if not callable(fun):
    raise TypeError(f"custom_bwd decorates a callable; got {fun!r}.")

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    settings = higher_order.backward_policy()
    if settings is None:
      return fun(*args, **kwargs)
    return call(fun, settings, args, kwargs)

  return wrapped
