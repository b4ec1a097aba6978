"""``jaxamp.autocast``: torch.amp's autocast as a JAX function transformation.

``autocast(f)`` traces ``f`` to a jaxpr once per input signature (array types plus the values of
non-array arguments such as ``train=True``) and evaluates that jaxpr with the autocast
interpreter in the caller's trace, so it composes with ``jit``, ``grad``, ``vmap`` and the rest
in either order. The eqns it emits carry a *kept* mark: an enclosing autocast leaves them alone,
so an inner ``autocast(g, dtype=...)`` region keeps its own dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import caches, compat
from jaxamp._src.autocast import context, higher_order, interpreter, regions, rules, snapshots
from jaxamp._src.autocast import overrides as overrides_lib
from jaxamp._src.autocast.overrides import Overrides
from jaxamp._src.integrations import nnx_modules
from jaxamp._src.policies import policy as policy_lib
from jaxamp._src.policies.table import ELIGIBLE_DTYPES, Variant

_TRACE_CACHE_SIZE = 512
# Traces by function and signature. The function, a bound method's instance and static
# arguments are held weakly: a trace (and the arrays it closes over) goes with them.
_traces = caches.weak_lru_cache("autocast.traces", _TRACE_CACHE_SIZE)


def autocast(
  fun: Callable | str | None = None,
  device_type: str | None = None,
  *,
  dtype=None,
  enabled: bool = True,
  cache_enabled: bool = True,
  policy: policy_lib.Policy | None = None,
  overrides: Mapping | None = None,
) -> Callable:
  """Runs ``fun`` with torch.amp's autocast policy for ``device_type``.

  Usable as a transform, ``autocast(f, device_type="cuda")`` or ``autocast(f, "cuda")``, and as a
  decorator, ``@autocast(device_type="cpu")`` or torch's spelling ``@autocast("cpu")`` (a device
  type first). Not a context manager: ``with autocast(...):`` raises a ``TypeError``.

  Args:
    fun: the function to transform; its arguments are pytrees of arrays and static values. A
      device-type string here (torch's first argument) makes ``autocast`` return a decorator.
    device_type: which policy, with its default ``dtype``: "cuda" (also "gpu", "rocm") float16,
      "xpu" float16, "cpu" bfloat16, "tpu" bfloat16. None picks the device type of
      ``jax.default_backend()``.
    dtype: the lower-precision dtype, ``jnp.float16`` or ``jnp.bfloat16``; None: the device
      type's default. ``jnp.float8_e4m3fn`` (``device_type="cuda"`` only): matmuls and convs with
      float8 operands and dynamic per-tensor scales, everything else in bfloat16.
    enabled: False runs ``fun`` as written, also inside an enclosing autocast function.
    cache_enabled: cast each value to a dtype at most once per trace (torch's weight cast cache).
    policy: a ``jaxamp.Policy`` (``jaxamp.policy("cuda").with_rules({...})``) instead of
      ``device_type`` and ``dtype``, which it carries.
    overrides: parts of ``fun`` run otherwise, without editing it: ``{place: value}``. A place
      is a scope pattern matched against the name stack (flax linen and Haiku module names, nnx
      attribute paths of modules passed as arguments, Equinox layer scopes,
      ``jax.named_scope``): ``"router"``, ``"decoder/block_3"``, globs ``"block_*"``, anywhere
      in the stack; or a module class, matching what its ``__call__`` traces. A value is None
      or ``jnp.float32`` (autocast off there, as ``autocast_disabled()``), a lower-precision
      dtype (autocast to it there) or a ``jaxamp.Policy``. Where several match, the deepest
      decides. A place that matches nothing raises a ``ValueError`` listing those that exist;
      ``explain`` shows which override decided each eqn.

  Returns:
    A function with ``fun``'s signature whose outputs have the dtypes the policy produced,
    except state threaded through (an ``eqx.nn.State``, linen collections, Haiku state, nnx
    Variables), which keeps the dtype it came in with. Every output computed from the traced
    arrays, constants and inputs returned as they are included, is a ``jax.Array``, eagerly too;
    static values ``fun`` returns (Python numbers, strings) come back as they are.

    For an nnx Module, the module under a subclass of its class sharing its attributes, whose
    calls are autocast: a model holding it keeps its ``nnx.state`` paths, and its state updates
    (BatchNorm statistics, RNG counters) are the module's. For a pytree holding arrays (an
    Equinox module), an ``AutocastModule``: a pytree node with the module's children and keys,
    so ``eqx.tree_at(lambda m: m.mlp, model, autocast(model.mlp))`` keeps them trainable
    (gradients, optimizers, ``eqx.filter``). Its other attributes are the module's.
  """
  if isinstance(fun, str):  # torch's spelling, autocast("cuda"): the device type comes first
    if device_type is not None and not isinstance(device_type, str):  # autocast("cuda", dtype)
      raise TypeError(
        f"autocast's dtype is a keyword argument: jaxamp.autocast({fun!r}, "
        f"dtype={_dtype_spelling(device_type)}) (torch's autocast({fun!r}, torch.bfloat16)); got "
        f"{device_type!r} as a second positional argument, which is the device type."
      )
    if device_type is not None and device_type != fun:
      raise TypeError(
        f"autocast got two device types, {fun!r} (positional) and device_type={device_type!r}; "
        "pass one."
      )
    fun, device_type = None, fun
  amp_policy = given_policy(policy, device_type, dtype, cache_enabled)
  amp_overrides = overrides_lib.make(overrides, amp_policy)
  if not isinstance(enabled, bool):
    raise TypeError(f"`enabled` must be a bool; got {enabled!r}.")
  if fun is None:
    options = dict(device_type=device_type, dtype=dtype, enabled=enabled)
    more = dict(cache_enabled=cache_enabled, policy=policy, overrides=overrides)
    return _AutocastDecorator(dict(options, **more))
  if not callable(fun):
    raise TypeError(f"autocast transforms a callable; got {fun!r} of type {type(fun).__name__}.")
  return _wrap(fun, amp_policy if enabled else None, amp_overrides)


def given_policy(
  amp_policy: policy_lib.Policy | None, device_type: str | None, dtype, cache_enabled: bool = True
) -> policy_lib.Policy:
  """The policy ``autocast``'s arguments choose: ``policy=``, or ``device_type`` and ``dtype``."""
  if amp_policy is None:
    return policy_lib.make_policy(device_type, dtype, cache_enabled)
  if not isinstance(amp_policy, policy_lib.Policy):
    raise TypeError(
      "`policy` must be a jaxamp.Policy (jaxamp.policy(device_type).with_rules({...})); "
      f"got {amp_policy!r}."
    )
  if device_type is not None or dtype is not None:
    raise TypeError(
      f"autocast got policy={amp_policy!r} and device_type={device_type!r}, dtype={dtype!r}: "
      "a policy carries its device type and dtype; pass either `policy=` or them, e.g. "
      "jaxamp.policy(device_type, dtype=...).with_rules({...})."
    )
  if not isinstance(cache_enabled, bool):
    raise TypeError(f"`cache_enabled` must be a bool; got {cache_enabled!r}.")
  for key in amp_policy.table.primitive_categories:
    reason = _uncategorised(key.primitive if isinstance(key, Variant) else key)
    if reason is not None:
      raise ValueError(f"The policy gives primitive {key} a category, but {reason}.")
  return dataclasses.replace(amp_policy, cache_enabled=cache_enabled)


def _uncategorised(primitive) -> str | None:
  """Why ``primitive`` takes no category from a table (None if it does)."""
  if primitive in higher_order.RULES.higher_order:
    return "it is higher-order: the eqns of its bodies follow their own rows"
  if primitive in rules.KEEP_DTYPES:
    return "it is dtype-sensitive and always runs in the dtypes it was traced with"
  return None


class _AutocastDecorator:
  """``autocast(device_type=...)`` without a function: a decorator, not a context manager.

  torch's ``with torch.autocast(...):`` switches a global mode on for a block of eager code; JAX
  traces functions, so jaxamp's autocast transforms a function. ``with`` raises a ``TypeError``
  that shows the two spellings.
  """

  def __init__(self, options: dict[str, Any]):
    self._options = options

  def __call__(self, fun: Callable) -> Callable:
    if isinstance(fun, str):  # a decorator applies to a function, not to a device type
      raise TypeError(f"autocast transforms a callable; got {fun!r} of type str.")
    return autocast(fun, **self._options)

  def __repr__(self) -> str:
    options = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
    return f"jaxamp.autocast({options})"

  def __enter__(self):
    device = f'device_type="{self._options["device_type"] or "cuda"}"'
    raise TypeError(
      "jaxamp.autocast is a function transformation, not a context manager: JAX traces "
      "functions, so autocast rewrites a function instead of switching a mode on for a block. "
      f"Wrap the function, `jaxamp.autocast(f, {device})(*args)`, or decorate it, "
      f"`@jaxamp.autocast({device})`. The one context manager is `jaxamp.autocast_disabled()`: "
      "inside an autocast function its block runs as written (torch's "
      "`autocast(enabled=False)`)."
    )

  def __exit__(self, *exc_info) -> bool:
    return False


def _wrap(
  fun: Callable, amp_policy: policy_lib.Policy | None, amp_overrides: Overrides | None = None
) -> Callable:
  if nnx_modules.is_module(fun):
    return nnx_modules.with_call(fun, _autocast_call(type(fun).__call__, amp_policy, amp_overrides))
  if _is_pytree_node(fun):
    nnx_modules.register_data_type(AutocastModule)  # an nnx Module may hold it as an attribute
    return AutocastModule(fun, amp_policy, amp_overrides)

  @functools.wraps(fun)
  def autocast_fun(*args, **kwargs):
    return _run(fun, amp_policy, args, kwargs, amp_overrides)

  return autocast_fun


def _run(
  fun: Callable,
  amp_policy: policy_lib.Policy | None,
  args: tuple,
  kwargs: dict,
  amp_overrides: Overrides | None = None,
) -> Any:
  """``fun(*args, **kwargs)`` in a kept region, autocast with ``amp_policy`` (None: as written)."""
  with regions.kept_region(regions.AUTOCAST_MARK):
    if amp_policy is None:
      return fun(*args, **kwargs)
    if nnx_modules.contains_modules((args, kwargs)):
      run = lambda pure_fun, a, k: call(pure_fun, amp_policy, a, k, amp_overrides)
      scoped = amp_overrides is not None and amp_overrides.by_scope
      return nnx_modules.call_keeping_state(run, fun, args, kwargs, scoped)
    return call(fun, amp_policy, args, kwargs, amp_overrides)


def _dtype_spelling(value: Any) -> str:
  """``value`` as JAX spells a dtype (``jnp.bfloat16``, for ``torch.bfloat16`` too), or its repr
  if it is none."""
  if str(value).startswith("torch."):
    return f"jnp.{str(value).removeprefix('torch.')}"
  try:
    return f"jnp.{jnp.dtype(value).name}"
  except TypeError:
    return repr(value)


def _is_pytree_node(fun: Any) -> bool:
  """Whether ``fun`` is a pytree node (an Equinox module or bound method, a ``tree_util.Partial``),
  arrays or not: its leaves (Dropout's ``inference`` flag) stay leaves where it stands.

  Functions, bound methods, ``functools.partial`` objects and jitted functions are pytree leaves
  themselves, so they are not.
  """
  treedef = jax.tree.structure(fun)
  return not (treedef.num_nodes == 1 and treedef.num_leaves == 1)


@jax.tree_util.register_pytree_with_keys_class
class AutocastModule:
  """``autocast(module)`` for a module that is a pytree (an Equinox module): a pytree node that
  stands for the module.

  Calling it runs ``module(*args, **kwargs)`` with the module passed to the autocast function as
  an argument, so its arrays are traced inputs rather than closure constants. It flattens to the
  module's own children under the module's own keys, so a model holding it has the leaves and
  key paths (``.mlp.layers[0].weight``) it had before, as torch's autocast leaves ``state_dict``
  keys alone: ``eqx.tree_at(lambda m: m.mlp, model, autocast(model.mlp))`` leaves the arrays
  visible to ``jax.grad``, ``eqx.filter``/``partition``, optimizers and checkpoints, and rebuilds
  the module around the new leaves that ``jax.tree.map`` or ``apply_updates`` give it. Other
  attributes are read from the module (``wrapper.layers`` is ``module.layers``).
  """

  __wrapped__: Any
  _policy: policy_lib.Policy | None
  _overrides: Overrides | None

  def __init__(
    self,
    module: Any,
    amp_policy: policy_lib.Policy | None,
    amp_overrides: Overrides | None = None,
  ):
    self.__wrapped__ = module
    self._policy = amp_policy
    self._overrides = amp_overrides

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    module_args = (self.__wrapped__, *args)
    return _run(nnx_modules.call_module, self._policy, module_args, kwargs, self._overrides)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):  # no copy/pickle protocol lookups
      raise AttributeError(name)
    return getattr(object.__getattribute__(self, "__wrapped__"), name)

  def __repr__(self) -> str:
    amp_policy = self._policy
    if amp_policy is None:
      return f"jaxamp.autocast({self.__wrapped__!r}, enabled=False)"
    return f"jaxamp.autocast({self.__wrapped__!r}, policy={amp_policy!r})"

  def tree_flatten_with_keys(self) -> tuple[list, tuple]:
    module = self.__wrapped__
    children, treedef = jax.tree_util.tree_flatten_with_path(
      module, is_leaf=lambda node: node is not module
    )
    keyed = [(path[0], child) for path, child in children]
    return keyed, (treedef, self._policy, self._overrides)

  @classmethod
  def tree_unflatten(cls, aux: tuple, children: tuple) -> AutocastModule:
    treedef, amp_policy, amp_overrides = aux
    return cls(treedef.unflatten(children), amp_policy, amp_overrides)


@functools.cache
def _autocast_call(
  module_call: Callable, amp_policy: policy_lib.Policy | None, amp_overrides: Overrides | None
) -> Callable:
  """The ``__call__`` of ``autocast(module)`` for an nnx module: ``module_call`` (its class's)
  with the module passed to the autocast function as an argument."""

  def __call__(self, *args, **kwargs):
    return _run(module_call, amp_policy, (self, *args), kwargs, amp_overrides)

  return __call__


def is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray | np.generic)


class Traced(NamedTuple):
  """``fun``'s jaxpr for some arguments, and how its inputs and outputs map to pytrees.

  Attributes:
    jaxpr: the closed jaxpr, taking the array arguments.
    arrays: the array leaves of the arguments, in order.
    in_tree: the treedef of ``(args, kwargs)``.
    dynamic: the positions of the array leaves among the argument leaves.
    in_avals: the avals of ``arrays``.
    out_tree: the treedef of the outputs.
    static_outs: the output leaves, ``_TRACED`` where a jaxpr output goes.
    state_outputs: ``(jaxpr output index, traced dtype)`` of the outputs that are threaded
      state (``_state_outputs``).
  """

  jaxpr: compat.ClosedJaxpr
  arrays: list
  in_tree: Any
  dynamic: tuple
  in_avals: tuple
  out_tree: Any
  static_outs: list
  state_outputs: tuple[tuple[int, Any], ...]


def trace(fun: Callable, args: tuple, kwargs: dict) -> Traced:
  """``fun`` traced for ``args`` and ``kwargs``: arrays abstracted, other leaves static (cached
  per signature, see ``_trace``)."""
  leaves, in_tree = jax.tree.flatten((args, kwargs))
  dynamic = tuple(i for i, leaf in enumerate(leaves) if is_array(leaf))
  static = tuple((i, leaf) for i, leaf in enumerate(leaves) if not is_array(leaf))
  arrays = [leaves[i] for i in dynamic]
  in_avals = tuple(compat.typeof(x) for x in arrays)
  closed, out_tree, static_outs, state_outputs = _trace(fun, in_tree, dynamic, static, in_avals)
  return Traced(closed, arrays, in_tree, dynamic, in_avals, out_tree, static_outs, state_outputs)


def call(
  fun: Callable,
  amp_policy: policy_lib.Policy,
  args: tuple,
  kwargs: dict,
  amp_overrides: Overrides | None = None,
) -> Any:
  """Calls ``fun`` on ``args`` and ``kwargs`` under ``amp_policy`` (and ``amp_overrides``).

  Outputs leave in the dtype the policy produced, except state threaded through (see
  ``_state_outputs``), which leaves in its traced dtype.
  """
  traced = trace(fun, args, kwargs)
  closed = traced.jaxpr
  if amp_overrides is not None:
    overrides_lib.check_matched(amp_overrides, closed)
  ctx = context.Context(amp_policy, higher_order.RULES, overrides=amp_overrides)
  outs = interpreter.evaluate(closed.jaxpr, closed.consts, traced.arrays, ctx)
  for i, dtype in traced.state_outputs:
    if getattr(outs[i], "dtype", None) != dtype:
      outs[i] = jax.lax.convert_element_type(outs[i], dtype)
  outs = iter(map(_as_array, outs, closed.out_avals))
  return jax.tree.unflatten(
    traced.out_tree, [next(outs) if leaf is _TRACED else leaf for leaf in traced.static_outs]
  )


def _as_array(value: Any, aval: Any) -> jax.Array:
  """A jaxpr output as a ``jax.Array``: of the dtype it has, else (a Python scalar) its traced one.

  A literal output (``jnp.array(True)``, ``jnp.zeros(())``) evaluates to a Python or numpy
  constant and an input returned as it is to whatever was passed (a numpy array); as arrays they
  stay dynamic for ``eqx.filter_jit`` and the like, which would make a Python ``bool`` static and
  retrace on it.
  """
  if isinstance(value, jax.Array | jax.core.Tracer):  # a hijax Variable's tracer is no Array
    return value
  array = jnp.asarray(value)  # a numpy value keeps its dtype, a Python scalar its weak type
  if hasattr(value, "dtype") or array.dtype == aval.dtype:
    return array
  return jnp.asarray(value, aval.dtype)


def _subtrees(treedef, offset: int = 0):
  """``(treedef, first leaf index)`` of ``treedef`` and of every node below it."""
  yield treedef, offset
  for child in treedef.children():
    yield from _subtrees(child, offset)
    offset += child.num_leaves


def _state_outputs(
  in_tree,
  dynamic: tuple,
  in_avals: tuple,
  out_tree,
  traced: tuple,
  out_avals: tuple,
  closed_over: tuple = (),
) -> tuple[tuple[int, Any], ...]:
  """``(jaxpr output index, traced dtype)`` of each floating output leaf that is threaded state.

  torch updates state in place (``copy_``), so buffers keep their dtype; in JAX state goes in as
  an argument, or is closed over, and comes back as an output. An output is taken to be such
  state when it sits in an output container (an ``eqx.nn.State``, Haiku state or linen
  collection dict, an ``nnx.State`` or Variable) that has exactly the pytree structure of a
  container inside one of the arguments or of the values in ``closed_over``, leaf shapes
  included: the ``state`` of ``(out, state)`` from ``model(x, state)``, the ``batch_stats`` of
  ``apply(variables, ..., mutable=...)``, also where the loss closes over the train state as
  flax's examples do. Such leaves get the dtype the function gives them without autocast, so
  the next call (or a float32 one) sees the state it expects. Bare arrays and plain tuples and
  lists (how functions return several results, an LSTM its carry) never count: activations,
  logits and losses keep the dtype the policy produced, as torch's outputs do.
  """
  in_pos = {leaf: k for k, leaf in enumerate(dynamic)}
  argument_shapes = [
    in_avals[in_pos[i]].shape if i in in_pos else None for i in range(in_tree.num_leaves)
  ]
  containers: dict[Any, list[tuple]] = {}
  offset = 0
  for arg in (arg for group in in_tree.children() for arg in group.children()):
    _add_containers(containers, arg, argument_shapes[offset : offset + arg.num_leaves])
    offset += arg.num_leaves
  for value in closed_over:
    try:
      leaves, treedef = jax.tree.flatten(value)
    except (TypeError, ValueError):  # a dict keyed by unorderable objects (a compiled Keras
      continue  # model's per-layer state): no output can have its structure
    _add_containers(containers, treedef, [np.shape(x) if is_array(x) else None for x in leaves])
  out_pos = list(itertools.accumulate(traced, initial=0))
  found = {}
  for node, start in _subtrees(out_tree):
    for shapes in containers.get(node, ()):
      outs = range(start, start + node.num_leaves)
      if all(traced[o] and out_avals[out_pos[o]].shape == shapes[j] for j, o in enumerate(outs)):
        found.update((out_pos[o], out_avals[out_pos[o]].dtype) for o in outs)
        break
  return tuple((k, dtype) for k, dtype in sorted(found.items()) if dtype in ELIGIBLE_DTYPES)


def _add_containers(containers: dict, treedef, shapes: list) -> None:
  """Records in ``containers`` (treedef -> leaf shapes) each state container in ``treedef``
  whose leaves (of ``shapes``; None: not an array) are all arrays."""
  for node, start in _subtrees(treedef):
    leaf_shapes = tuple(shapes[start : start + node.num_leaves])
    if node.num_leaves and _is_state_container(node) and None not in leaf_shapes:
      containers.setdefault(node, []).append(leaf_shapes)


def _closed_over(fun: Any, depth: int = 3) -> tuple:
  """The values ``fun`` closes over: its closure cells, a ``functools.partial``'s arguments, a
  bound method's instance and its attributes, and those of the functions among them, ``depth``
  levels down."""
  values: list = []
  seen: set[int] = set()

  def visit(f: Any, level: int) -> None:
    if id(f) in seen or level > depth:
      return
    seen.add(id(f))
    if isinstance(f, functools.partial):
      values.extend((*f.args, *f.keywords.values()))
      inner = [f.func, *f.args, *f.keywords.values()]
    elif isinstance(f, types.MethodType):
      instance = f.__self__
      values.extend((instance, *getattr(instance, "__dict__", {}).values()))
      inner = [f.__func__]
    else:
      cells = getattr(f, "__closure__", None) or ()
      contents = [cell.cell_contents for cell in cells if _filled(cell)]
      values.extend(contents)
      inner = [*contents, getattr(f, "__wrapped__", None)]
    for g in inner:
      if callable(g):
        visit(g, level + 1)

  visit(fun, 0)
  return tuple(values)


def _filled(cell) -> bool:
  try:
    cell.cell_contents  # noqa: B018 -- an empty cell raises
  except ValueError:
    return False
  return True


def _is_state_container(treedef) -> bool:
  """Whether a pytree node can hold state: any container but a plain tuple or list."""
  data = treedef.node_data()
  return data is not None and data[0] not in (tuple, list)


_TRACED = object()  # marks the outputs that come from the jaxpr


def _trace(fun, in_tree, dynamic: tuple, static: tuple, in_avals: tuple):
  """``fun``'s jaxpr for this signature in this trace context (``compat.trace_context``): traced
  once, reused while nothing it closes over traces."""
  try:
    key = (
      caches.key_part(fun),
      in_tree,
      dynamic,
      tuple((i, caches.key_part(leaf)) for i, leaf in static),
      in_avals,
      compat.trace_context(),
    )
    hash(key)
  except TypeError:
    key = None  # an unhashable function or static argument: trace every call
  roots = (fun, *(leaf for _, leaf in static))
  if key is not None:
    hit = _traces.get(key)
    if hit is not None and snapshots.holds(hit[1], roots):
      return hit[0]
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
    # Arrays, traced or constant, are jaxpr outputs; other leaves (strings, Python numbers) are
    # returned as they are, like the static arguments.
    traced = [_is_array_output(leaf) for leaf in out_leaves]
    out_tree_box.append(
      (out_tree, [_TRACED if t else leaf for leaf, t in zip(out_leaves, traced, strict=True)])
    )
    return [leaf for leaf, t in zip(out_leaves, traced, strict=True) if t]

  try:
    closed = compat.trace(flat_fun, in_avals)
  except Exception as error:
    if not _is_nnx_closure_write(error):
      raise
    raise TypeError(
      "autocast traces the function to a jaxpr, as jax.jit does, and a flax nnx module it "
      "closes over cannot write its state (BatchNorm statistics, Dropout RNG counts) from "
      "inside that trace. Pass the module in: `jaxamp.autocast(lambda m, x: m(x))(model, x)`, "
      "or make it the function: `jaxamp.autocast(model)(x)`."
    ) from error
  out_tree, static_outs = out_tree_box[0]
  is_traced = tuple(leaf is _TRACED for leaf in static_outs)
  state_outputs = _state_outputs(
    in_tree, dynamic, in_avals, out_tree, is_traced, tuple(closed.out_avals), _closed_over(fun)
  )
  result = (closed, out_tree, static_outs, state_outputs)
  if (
    key is not None
    and not any(isinstance(c, jax.core.Tracer) for c in closed.consts)
    and all(_is_value(leaf) for leaf in static_outs)
  ):
    _traces.put(key, (result, snapshots.take(roots)))
  return result


def _is_array_output(leaf: Any) -> bool:
  """Whether an output leaf of the traced function is an array (else a static value).

  Raises:
    TypeError: ``leaf`` is a generator or an object that is not a pytree yet holds a traced
      array: ``jax.jit`` rejects them as outputs, and the tracer would escape its trace.
  """
  if isinstance(leaf, jax.core.Tracer) or is_array(leaf):
    return True
  fix = (
    "autocast traces the function to a jaxpr, as jax.jit does, so what it returns must be a "
    "pytree of arrays and static values"
  )
  if isinstance(leaf, types.GeneratorType):
    raise TypeError(f"The autocast function returned a generator: {fix}; return a list or tuple.")
  where = snapshots.tracer_in(leaf)
  if where is not None:
    raise TypeError(
      f"The autocast function returned an object of type {type(leaf).__name__} that is not a "
      f"pytree yet holds a traced array (at {where or 'its top'}): {fix}. Register its class "
      "as a pytree (jax.tree_util.register_dataclass, flax.struct.dataclass, an equinox.Module) "
      "or return its arrays."
    )
  return False


_VALUES = (*caches.PLAIN, np.dtype, type, types.FunctionType, types.BuiltinFunctionType)


def _is_value(leaf: Any) -> bool:
  """Whether a static output can be returned from a cached trace: a value, not an object that
  could change or that the cache would keep alive."""
  return leaf is _TRACED or isinstance(leaf, _VALUES)


def _is_nnx_closure_write(error: Exception) -> bool:
  """Whether ``error`` is flax's ``TraceContextError``: a Variable written from a trace other
  than its own."""
  kind = type(error)
  return kind.__name__ == "TraceContextError" and kind.__module__.startswith("flax")


def custom_fwd(
  fun: Callable | None = None, *, device_type: str | None = None, cast_inputs=None
) -> Callable:
  """torch.amp.custom_fwd for the forward function of a ``jax.custom_vjp``.

  With ``cast_inputs`` (a float dtype), inside an autocast function the floating inputs are cast
  to it and the function body runs with autocast disabled; outside autocast nothing changes.
  Decorating a custom_vjp's ``fwd`` rule (torch's spelling) or its primal (JAX's) makes the whole
  custom_vjp that region: primal and ``fwd`` run on the cast inputs with autocast off, and a
  ``custom_bwd`` backward runs with autocast off too, as torch's does. With ``device_type``, only
  under a policy of that device type (torch casts only where that device's autocast is on);
  under another the body is autocast like any other code, as it is without ``cast_inputs``.
  """
  if device_type is not None:
    device_type = policy_lib.get_table(device_type).device_type  # "gpu" is "cuda"
  if fun is None:
    return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
  if _is_dtype(fun):
    raise TypeError(
      f"custom_fwd takes the dtype as a keyword: custom_fwd(cast_inputs={fun!r}); "
      "its positional argument is the function to decorate."
    )
  if not callable(fun):
    raise TypeError(f"custom_fwd decorates a callable; got {fun!r}.")
  if cast_inputs is None:
    return fun
  target = policy_lib.canonical_cast_dtype(cast_inputs)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    return regions.call_as_op(regions.custom_fwd_name(target, device_type), fun, args, kwargs)

  return wrapped


def _is_dtype(x: Any) -> bool:
  """A dtype or scalar type (np.float32, jnp.bfloat16), not a function to decorate."""
  if isinstance(x, np.dtype) or isinstance(x, type) and issubclass(x, np.generic):
    return True
  return isinstance(getattr(x, "dtype", None), np.dtype) and not hasattr(x, "shape")


def custom_bwd(fun: Callable | None = None, *, device_type: str | None = None) -> Callable:
  """torch.amp.custom_bwd for the backward function of a ``jax.custom_vjp``.

  The backward runs under the autocast state its forward ran under: the forward's policy, or
  autocast off after a ``custom_fwd(cast_inputs=...)`` forward (undecorated, a custom_vjp's
  backward runs in the dtypes of its residuals and cotangents, as torch runs backward passes).
  """
  if device_type is not None:
    policy_lib.get_table(device_type)  # torch's signature; the forward's policy is used
  if fun is None and device_type is not None:
    return functools.partial(custom_bwd, device_type=device_type)
  if not callable(fun):
    raise TypeError(f"custom_bwd decorates a callable; got {fun!r}.")

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    amp_policy = higher_order.backward_policy()
    if amp_policy is None:
      return fun(*args, **kwargs)
    return call(fun, amp_policy, args, kwargs)

  return wrapped
