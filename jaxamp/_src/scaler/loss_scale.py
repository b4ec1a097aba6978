"""Dynamic loss scaling: torch's ``GradScaler`` update rule as an optax ``GradientTransformation``.

``dynamic_loss_scale(inner)`` wraps the real optimizer. Its ``update`` receives the gradients of
the *scaled* loss and does what ``scaler.step(optimizer); scaler.update()`` does in torch:

1. one finite check over the whole gradient tree, a single flag (reduced over ``axis_name`` when
   given): one read of every gradient, the check's floor on a memory-bound backend;
2. unscale in float32 with ``inv = f32(1 / f64(scale))``;
3. on overflow skip the inner step (-0.0 updates: params and inner state stay bit-identical),
   else run it;
4. back off or grow the scale, rounding ``f64(scale) * factor`` to float32 as torch does (and,
   only if ``min_scale`` is given, never backing off below it).

The products and the inverse round exactly as torch's C++ does (``exact_f64``); the arguments are
validated in ``scaler_checks``. The rest of ``GradScaler`` (``scale``, ``unscale_``, the getters
and setters, ``state_dict``) is in ``grad_scaler``, as functions of the optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src import compat
from jaxamp._src.integrations import state_tree
from jaxamp._src.scaler import checks, exact_f64

# ------------------------------------------------------------------------------------------------
# State.


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class LossScaleHyperparams:
  """The scaler's static hyperparameters, kept in its state so checkpoints can restore them.

  They are Python numbers, as in torch's ``GradScaler``: a pytree node with no leaves, so ``jit``
  sees them as compile-time constants and the float64 factors keep every bit (a float32 array
  could not hold 1.1 or 0.3 exactly). Changing them (``load_state_dict``) changes the treedef.

  Attributes:
    growth_factor: factor the scale is multiplied by after ``growth_interval`` finite steps.
    backoff_factor: factor the scale is multiplied by after a non-finite step.
    growth_interval: number of consecutive finite steps before the scale grows.
    enabled: ``False`` makes the scaler a pass-through of the inner optimizer.
    axis_name: the mapped axis name(s) the finite check is reduced over (``update`` and
      ``unscale``), or ``None``. Part of the program, not of its state: checkpoints leave it out.
    min_scale: the floor a backoff stops at, or ``None`` for none (torch's behaviour).
  """

  growth_factor: float
  backoff_factor: float
  growth_interval: int
  enabled: bool = True
  axis_name: Any = None
  min_scale: float | None = None


def _hyperparams_to_state_dict(hp: LossScaleHyperparams) -> dict[str, Any]:
  state = {
    "growth_factor": hp.growth_factor,
    "backoff_factor": hp.backoff_factor,
    "growth_interval": hp.growth_interval,
    "enabled": hp.enabled,
  }
  if hp.min_scale is not None:  # saved only when set: a checkpoint without it keeps the program's
    state["min_scale"] = hp.min_scale
  return state


def _hyperparams_from_state_dict(
  target: LossScaleHyperparams, state: dict[str, Any]
) -> LossScaleHyperparams:
  """The hyperparameters a flax checkpoint restores into ``target``, as torch's
  ``load_state_dict``: ``enabled`` and the axis name are the program's (``target``'s); a disabled
  target ignores the checkpoint, and an enabled one refuses a disabled scaler's checkpoint."""
  if not state or not target.enabled:
    return target
  if not state["enabled"]:
    raise checks.EmptyStateDictError(
      "the checkpoint holds the state of a disabled loss scaler (scale 1.0), restored into an "
      'enabled one (torch: "The source state dict is empty, possibly because it was saved '
      'from a disabled instance of GradScaler."). Restore into a target made with '
      "`dynamic_loss_scale(..., enabled=False)`, or start the scaler afresh from `tx.init`."
    )
  return dataclasses.replace(
    target,
    growth_factor=float(state["growth_factor"]),
    backoff_factor=float(state["backoff_factor"]),
    growth_interval=int(state["growth_interval"]),
    min_scale=float(state["min_scale"]) if "min_scale" in state else target.min_scale,
  )


@functools.cache
def _register_flax_serialization() -> None:
  """Lets ``flax.serialization`` (``to_bytes``, msgpack checkpoints) save the hyperparameters."""
  try:
    from flax import serialization
  except ImportError:  # without flax there is nothing to register
    return
  serialization.register_serialization_state(
    LossScaleHyperparams,
    _hyperparams_to_state_dict,
    _hyperparams_from_state_dict,
    override=True,
  )


class DynamicLossScaleState(NamedTuple):
  """State of the ``GradientTransformation`` returned by ``dynamic_loss_scale``.

  Attributes:
    scale: the current loss scale, a float32 scalar whatever the gradient dtypes (1.0 when the
      scaler is disabled).
    growth_tracker: int32 number of consecutive finite steps since the last growth or skipped
      step (torch's ``_growth_tracker``).
    found_inf: bool scalar, whether the last update found an Inf or NaN and was skipped.
    skipped_steps: int32 number of updates skipped since ``init`` (saturates, never wraps).
    inner_state: the state of the wrapped optimizer.
    hyperparams: the static ``LossScaleHyperparams`` (growth/backoff factors, growth interval,
      enabled flag, axis name, min scale); also readable as ``state.growth_factor`` etc.
  """

  scale: Any
  growth_tracker: Any
  found_inf: Any
  skipped_steps: Any
  inner_state: Any
  hyperparams: LossScaleHyperparams

  @property
  def growth_factor(self) -> float:
    """The growth factor, a Python float."""
    return self.hyperparams.growth_factor

  @property
  def backoff_factor(self) -> float:
    """The backoff factor, a Python float."""
    return self.hyperparams.backoff_factor

  @property
  def growth_interval(self) -> int:
    """The growth interval, a Python int."""
    return self.hyperparams.growth_interval

  @property
  def enabled(self) -> bool:
    """Whether loss scaling is enabled."""
    return self.hyperparams.enabled

  @property
  def min_scale(self) -> float | None:
    """The floor of the scale, a Python float, or ``None`` for none (torch's behaviour)."""
    return self.hyperparams.min_scale


# ------------------------------------------------------------------------------------------------
# The transform.


# The most leaves one reduction kernel of the finite check reads: XLA:CPU's compile time grows
# faster than linearly with a kernel's size (500 leaves of a transformer's shapes: 200 of them
# in one kernel compiled ~1 s slower than in kernels of 8), and the reads are the same either way.
_CHECK_LEAVES_PER_KERNEL = 8
# Leaves with fewer elements than this (biases, norm scales) are checked flattened and
# concatenated, up to _CHECK_CONCAT_SIZE elements a vector: one kernel for dozens of them
# instead of one (or, for small ones, three) per group of a shape. A transformer step or a plain
# adam step, 50 or 500 leaves, compiled 3-4% faster; copying them costs a few thousandths of a
# pass over the parameters' bytes.
_CHECK_CONCAT_BELOW = 4096
_CHECK_CONCAT_SIZE = 1 << 16


def _tree_found_inf(tree: Any) -> jax.Array:
  """One bool: whether any inexact leaf of ``tree`` holds an Inf or NaN.

  ``x * 0`` is 0 where ``x`` is finite and NaN where it is Inf or NaN, so one sum says it for a
  whole leaf, and up to ``_CHECK_LEAVES_PER_KERNEL`` leaves of one shape and dtype are summed
  elementwise first: one reduction (one XLA kernel to compile) per group instead of an
  ``isfinite`` and an ``all`` per leaf, which XLA:CPU compiled into four kernels a leaf. Each
  gradient is still read once; on one device, small leaves are checked together
  (``_concatenate_small``). Written in ``lax`` (no ``jnp`` wrappers): tracing costs one equation
  per op, for hundreds of leaves.
  """
  leaves = [_as_array(x) for x in jax.tree.leaves(tree)]
  leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
  if _one_device():
    leaves = _concatenate_small(leaves)
  groups: dict[tuple[Any, tuple[int, ...]], list[jax.Array]] = {}
  for x in leaves:
    groups.setdefault((x.dtype, x.shape), []).append(lax.mul(x, _zero(x.dtype)))
  found = []
  for zeros in groups.values():
    for start in range(0, len(zeros), _CHECK_LEAVES_PER_KERNEL):
      total = functools.reduce(lax.add, zeros[start : start + _CHECK_LEAVES_PER_KERNEL])
      total = lax.reduce_sum(total, tuple(range(total.ndim)))
      found.append(lax.ne(total, _zero(total.dtype)))
  return functools.reduce(lax.bitwise_or, found) if found else jnp.array(False)


def _one_device() -> bool:
  """Whether JAX sees one device in all (every process's together), so that no array can be
  sharded: the finite check's concatenation and the row-major constraint would make GSPMD
  gather sharded gradients."""
  return jax.device_count() == 1


def _concatenate_small(leaves: list[jax.Array]) -> list[jax.Array]:
  """``leaves``, those below ``_CHECK_CONCAT_BELOW`` elements flattened and concatenated per
  dtype into vectors of up to ``_CHECK_CONCAT_SIZE`` elements.

  Only on one device (``_one_device``): a concatenation of sharded leaves makes GSPMD gather each
  one (a 50-leaf FSDP step: 30 all-gathers), where the sums of all leaves need one all-reduce.
  """
  large, small = [], {}
  for x in leaves:
    if x.size >= _CHECK_CONCAT_BELOW:
      large.append(x)
    else:
      small.setdefault(x.dtype, []).append(lax.reshape(x, (x.size,)))
  vectors = []
  for flat in small.values():
    run, size = [], 0
    for x in flat:
      if run and size + x.size > _CHECK_CONCAT_SIZE:
        vectors.append(run)
        run, size = [], 0
      run.append(x)
      size += x.size
    vectors.append(run)
  return large + [lax.concatenate(run, 0) if len(run) > 1 else run[0] for run in vectors]


def _row_major_on_cpu(tree: Any) -> Any:
  """``tree``, its traced gradients of two or more dimensions laid out row-major, on XLA:CPU.

  A gradient can leave the backward pass as a transposed dot (an attention layer's kernels):
  bare adam reads the transpose inside its update kernel, but the finite check's reduction
  (YNNPACK) needs it row-major and the ``lax.cond`` needs its operand materialized, so XLA:CPU
  wrote it twice, once in the dot's layout, and copied that to row-major inside the taken
  branch. Constrained, it is written once, row-major, for both: on a 54-leaf transformer step
  1.07 fewer passes over the parameters' bytes and 24 fewer kernels to compile. Other backends
  choose their own layouts; gradients already row-major are unchanged. Only on one device
  (``_one_device``): GSPMD gathered every sharded gradient given a layout constraint.
  """
  if jax.default_backend() != "cpu" or not _one_device():
    return tree

  def constrain(g: Any) -> Any:
    traced = isinstance(g, jax.core.Tracer)
    if traced and g.ndim >= 2 and jnp.issubdtype(g.dtype, jnp.inexact):
      return compat.row_major(g)
    return g

  return jax.tree.map(constrain, tree)


def _as_array(x: Any) -> jax.Array:
  """``x`` as a JAX array (a tracer is one already)."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _zero(dtype: Any) -> np.ndarray:
  """A ``dtype`` zero that ``lax`` ops broadcast: a NumPy scalar, a literal in the jaxpr."""
  return np.zeros((), dtype)


def _unscale_factors(scale: jax.Array) -> jax.Array:
  """``exact_f64.unscale_factors``' ``(a, b)`` as one float32[2], computed once however many
  leaves use them.

  XLA fuses cheap scalar producers into every consumer, so the ~100 integer ops of the factors
  were compiled into each leaf's kernel. It never duplicates an integer division by a
  non-constant (``_opaque_identity``), so behind one they run once, in the division's kernel.
  Both factors go behind the same division (behind one each, XLA compiled the shared integer ops
  into both kernels), and stay one array: each leaf's kernel takes one parameter for both, and
  with two scalar parameters a 50-leaf adam step compiled ~10% slower. (``optimization_barrier``
  does not do this: XLA:CPU removes it before fusion.)
  """
  a, b, _ = exact_f64.unscale_factors(scale)
  return _opaque_identity(lax.concatenate([a[None], b[None]], 0), _opaque_one(scale))


def _opaque_one(source: jax.Array) -> jax.Array:
  """A uint32 1 computed from the float32 scalar ``source``: ``(bits >> 31) | 1`` is 1 for every
  float32, which XLA does not know, so it folds nothing divided by it (nor ``one != 0``)."""
  bits = lax.bitcast_convert_type(source, np.uint32)
  return lax.bitwise_or(lax.shift_right_logical(bits, np.uint32(31)), np.uint32(1))


def _opaque_identity(x: jax.Array, one: jax.Array) -> jax.Array:
  """The float32 ``x`` bit for bit, as its bits divided by ``one`` (``_opaque_one``): computed,
  and neither folded nor duplicated by XLA."""
  bits = lax.bitcast_convert_type(x, np.uint32)
  return lax.bitcast_convert_type(lax.div(bits, one), np.float32)


def _leaf_unscaler(factors: jax.Array) -> Callable[[Any], Any]:
  """``g -> g * a * b`` (``_unscale_factors``) in (at least) float32, cast back to ``g``'s dtype.

  ``a`` and ``b`` are sliced out of ``factors`` here: inside the cond's taken branch XLA slices
  them in each leaf's kernel, one parameter for both.
  """
  in_dtype: dict[Any, tuple[jax.Array, jax.Array]] = {}  # the factors, converted once per dtype

  def unscale(g: Any) -> Any:
    g = _as_array(g)
    if not jnp.issubdtype(g.dtype, jnp.inexact):
      return g
    compute = jnp.promote_types(g.dtype, jnp.float32)
    if compute not in in_dtype:
      f = lax.convert_element_type(factors, compute)
      in_dtype[compute] = tuple(lax.squeeze(lax.slice_in_dim(f, i, i + 1), (0,)) for i in (0, 1))
    a, b = in_dtype[compute]
    unscaled = lax.mul(lax.mul(lax.convert_element_type(g, compute), a), b)
    return lax.convert_element_type(unscaled, g.dtype)

  return unscale


def _tree_unscale_by(tree: Any, factors: jax.Array) -> Any:
  """Every leaf of ``tree`` unscaled by ``factors`` (``_leaf_unscaler``)."""
  return jax.tree.map(_leaf_unscaler(factors), tree)


def _narrower_than_float32(g: Any) -> bool:
  """Whether ``g`` is a floating leaf narrower than float32 (float16, bfloat16)."""
  dtype = _as_array(g).dtype
  return jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize < 4


def unscale_and_check(grads: Any, scale: jax.Array, axis_name: Any) -> tuple[Any, jax.Array]:
  """torch's ``_amp_foreach_non_finite_check_and_unscale_``: ``(unscaled grads, found_inf)``.

  ``found_inf`` is about the *scaled* gradients, as in torch (those narrower than float32: the
  unscaled ones, ``_found_inf``), reduced over ``axis_name``. ``update`` and ``unscale`` share
  this, so both give the same bits.
  """
  checks.check_no_float8(grads, "grads")
  factors = _unscale_factors(scale)
  return _tree_unscale_by(grads, factors), _found_inf(grads, axis_name, factors)


def _found_inf(grads: Any, axis_name: Any, factors: jax.Array) -> jax.Array:
  """Whether any gradient is Inf or NaN, on any device of ``axis_name``: one bool for the tree.

  A gradient narrower than float32 (which torch refuses to unscale) is checked unscaled: below
  a scale of 1 its unscaling multiplies, and a finite float16 value can round to Inf on the way
  back, which the inner optimizer would apply. A positive factor keeps an Inf or NaN what it is,
  so the unscaled check finds everything the scaled one does. float32 and wider gradients are
  checked scaled, as torch checks them.
  """
  unscale = _leaf_unscaler(factors)
  checked = jax.tree.map(lambda g: unscale(g) if _narrower_than_float32(g) else g, grads)
  found_inf = _tree_found_inf(checked)
  if axis_name is not None:
    _check_axes_bound(axis_name)
    found_inf = lax.pmax(found_inf.astype(jnp.int32), axis_name) > 0
  return found_inf


def _check_axes_bound(axis_name: Any) -> None:
  """Raises JAX's ``NameError`` for an axis of ``axis_name`` that no enclosing ``shard_map`` or
  ``pmap`` binds (a misspelling, or a step run outside them), saying what to pass: under
  ``shard_map`` ``lax.pmax`` would fail with a bare assertion."""
  for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
    try:
      lax.axis_size(name)
    except NameError as error:
      raise NameError(
        f"dynamic_loss_scale(axis_name={axis_name!r}): {name!r} is not an axis of an enclosing "
        "shard_map or pmap here. Pass the mesh axis names the step is mapped over (the "
        "`axis_names` of shard_map's mesh, pmap's `axis_name`), or axis_name=None outside "
        f"them. ({error})"
      ) from None


def _no_op_update(shape: Any) -> jax.Array:
  """The update of a skipped step: -0.0, for ``param + -0.0`` is ``param`` bit for bit (``+0.0``
  would turn a ``-0.0`` parameter into ``+0.0``). Sharded like ``shape`` (an Explicit mesh types
  it) and varying over the manual axes it varies over. A ``float0`` gradient (of an integer
  leaf, ``jax.grad(allow_int=True)``) has the ``float0`` zero, as it has no values."""
  if shape.dtype == jax.dtypes.float0:
    return np.zeros(shape.shape, jax.dtypes.float0)
  update = lax.full(
    shape.shape, no_op_fill(shape.dtype), shape.dtype, sharding=getattr(shape, "sharding", None)
  )
  return _vary_like(update, shape)


def no_op_fill(dtype: Any) -> np.generic:
  """The ``dtype`` value that adds to any parameter without changing a bit: -0.0, with a -0.0
  imaginary part for complex dtypes (a +0.0 one turns a -0.0 imaginary part into +0.0); integer
  zero."""
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.asarray(complex(-0.0, -0.0), dtype)[()]
  return np.asarray(-0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0, dtype)[()]


def _aval(x: Any) -> Any:
  """The abstract value of ``x`` (a value, or already a ``ShapeDtypeStruct`` or aval)."""
  return x if isinstance(x, jax.ShapeDtypeStruct | jax.core.AbstractValue) else jax.typeof(x)


def _varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes over which ``x`` (a value or a ``ShapeDtypeStruct``) varies.

  Empty outside ``shard_map`` and under ``check_vma=False``: there nothing is typed as varying.
  """
  aval = _aval(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # the name before jax 0.10


def _vary_like(x: Any, like: Any) -> Any:
  """``x``, cast to vary also over the manual axes ``like`` varies over (the values unchanged).

  Under ``shard_map`` (``check_vma=True``) the two branches of a ``cond`` must have the same
  varying axes: a constant or an unchanged state is invariant where the computed one varies.
  """
  missing = _varying_axes(like) - _varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def _typed_like(old: Any, taken: Any) -> Any:
  """A skipped step's ``old`` state leaf in the dtype and varying axes of the taken step's.

  An inner update may promote its state on its first step (optax's adam keeps ``mu`` in the
  parameters' dtype at ``init``; bfloat16 parameters given float32 gradients, or an integer leaf,
  make it float32): the skipped branch keeps the old values in the promoted dtype, as plain optax
  would hold them after that step.
  """
  if _aval(old).dtype != _aval(taken).dtype:
    old = lax.convert_element_type(old, _aval(taken).dtype)
  return _vary_like(old, taken)


# Leaves smaller than this are left to XLA's copy before the cond: a kernel for each in the
# skipped branch cost more compile time (a 50-leaf adam step: 1.26x of apply_if_finite's instead
# of 1.19x) than their copies cost to run.
_FRESH_FROM_SIZE = 4096


def _shared_no_op_updates() -> Callable[[Any], jax.Array]:
  """``_no_op_update`` made once per shape, dtype, sharding and varying axes, however many leaves
  share them (a 500-leaf tree has a dozen shapes): the skipped branch's fills."""
  fills: dict[Any, jax.Array] = {}

  def no_op_update(like: Any) -> jax.Array:
    aval = _aval(like)
    key = (aval.shape, aval.dtype, getattr(aval, "sharding", None), _varying_axes(aval))
    if key not in fills:
      fills[key] = _no_op_update(aval)
    return fills[key]

  return no_op_update


def _fresh(x: Any, keep: jax.Array, fill: Callable[[Any], jax.Array]) -> Any:
  """``x`` bit for bit, computed (``select(keep, x, fill)`` with a ``keep`` XLA cannot prove
  true), so not an alias of ``x``.

  A ``lax.cond`` branch that returns its operand unchanged makes XLA copy the operand before the
  cond, on every step: the skipped branch's old inner state was copied (a read and a write of
  every moment) on finite steps too. Computed in the branch, the copy happens only when it runs.
  Small leaves (biases, norms, counts) are left as they are: their copies cost little to run,
  and so are leaves of extended dtypes (PRNG keys), which have no -0.0 to select against.
  """
  x = _as_array(x)
  if x.size < _FRESH_FROM_SIZE or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return x  # copied before the cond
  return lax.select(keep, x, fill(x))


def _skip_if(
  found_inf: jax.Array, do_update: Any, old_state: Any, one: jax.Array
) -> tuple[Any, Any]:
  """``do_update(None)``, or where ``found_inf`` -0.0 updates and ``old_state``: one ``lax.cond``.

  The skipped branch needs the shapes of the taken one's outputs. ``lax.cond`` traces its true
  branch first, so the taken branch records them as it is traced, and the inner update is traced
  once (``jax.eval_shape`` traced it a second time); the fallback covers other orders. The
  skipped branch returns a computed copy of the old state (``_fresh``, a select on ``one != 0``,
  which XLA cannot fold), not the old state itself, and one ``-0.0`` fill per shape.

  Under ``shard_map`` the branches must agree on the axes each output varies over: a skipped
  step's -0.0 updates vary like the taken step's updates, and each inner state leaf varies
  over the axes of its old and its new value in both branches (sharded gradients make the new
  updates and moments vary where the constants and the old state need not).
  """
  traced = []

  def take_update(_: None) -> tuple[Any, Any]:
    out = do_update(None)
    traced.append(jax.tree.map(jax.typeof, out))  # avals: shape, dtype, varying axes
    new_updates, inner_state = out
    if jax.tree.structure(inner_state) == jax.tree.structure(old_state):  # else cond reports it
      inner_state = jax.tree.map(_vary_like, inner_state, old_state)
    return new_updates, inner_state

  def skip_update(_: None) -> tuple[Any, Any]:
    out_updates, out_state = traced[0] if traced else jax.eval_shape(do_update, None)
    no_op_update, keep = _shared_no_op_updates(), lax.ne(one, np.uint32(0))  # XLA: unknown
    inner_state = jax.tree.map(lambda x: _fresh(x, keep, no_op_update), old_state)
    if jax.tree.structure(out_state) == jax.tree.structure(old_state):
      inner_state = jax.tree.map(_typed_like, inner_state, out_state)
    return jax.tree.map(no_op_update, out_updates), inner_state

  return lax.cond(jnp.logical_not(found_inf), take_update, skip_update, None)


def _next_scale(
  scale: jax.Array, growth_tracker: jax.Array, found_inf: jax.Array, hp: LossScaleHyperparams
) -> tuple[jax.Array, jax.Array]:
  """torch's ``_amp_update_scale_``: back off on overflow, grow after ``growth_interval`` steps.

  With a ``min_scale`` the backoff is ``max(product, min(scale, min_scale))``: it stops at the
  floor, and never raises a scale already below it (``set_scale``).
  """
  successful = growth_tracker + 1
  grow = successful == hp.growth_interval
  # One exact product serves both branches: the factor is chosen first.
  product = exact_f64.mul_f32_f64(scale, (hp.growth_factor, hp.backoff_factor), found_inf)
  grown = jnp.where(jnp.isfinite(product), product, scale)  # never grow past float32 to inf
  backed_off = product
  if hp.min_scale is not None:  # static: without a floor the program is torch's, bit for bit
    backed_off = jnp.maximum(product, jnp.minimum(scale, jnp.float32(hp.min_scale)))
  new_scale = jnp.where(found_inf, backed_off, jnp.where(grow, grown, scale))
  new_tracker = jnp.where(found_inf | grow, 0, successful).astype(jnp.int32)
  return new_scale, new_tracker


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  init_scale: float = 2.0**16,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  enabled: bool = True,
  axis_name: Any = None,
  min_scale: float | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` with torch's dynamic loss scaling (``torch.amp.GradScaler``).

  ``update`` expects the gradients of the loss scaled by ``scale_loss``. It checks them for
  Inf/NaN into one flag, unscales them in float32 by ``float32(1 / float64(scale))``, and
  then either runs ``inner`` on the unscaled gradients or, on overflow, skips it: ``-0.0`` updates
  (``apply_updates`` leaves every parameter bit-identical, ``-0.0`` ones too) and an inner state
  left bit-identical (step counts and schedules do not advance). Finally the scale
  is multiplied by ``backoff_factor`` after an overflow, or by ``growth_factor`` after
  ``growth_interval`` consecutive finite steps (unless that would overflow float32), rounding the
  float64 product to float32 exactly as torch's kernel does. Everything runs under ``jit``.

  Args:
    inner: the optimizer to wrap; put gradient clipping inside it so it sees unscaled gradients.
    init_scale: the initial scale, > 0 and finite in float32.
    growth_factor: the factor (> 1) the scale grows by.
    backoff_factor: the factor (in (0, 1)) the scale backs off by.
    growth_interval: the number (>= 1) of consecutive finite steps before the scale grows.
    enabled: ``False`` makes the wrapper an exact pass-through of ``inner`` (scale 1.0).
    axis_name: a mapped axis name (``shard_map``, ``pmap``) or tuple of names over which the
      finite check is reduced, so that every shard skips the same steps. Needed whenever shards
      see different gradients (e.g. sharded parameters, or gradients not yet averaged). Sharded
      gradients, updates and optimizer states work under ``shard_map``'s ``check_vma``.
    min_scale: a floor for the scale (> 0, finite in float32, at most ``init_scale``): a backoff
      gives ``max(scale * backoff_factor, min_scale)``, so a run of overflows (a NaN loss) cannot
      drive the scale to zero, as in jmp and flax. ``None`` (the default): no floor, as in torch.

  Returns:
    A ``GradientTransformationExtraArgs``. Its ``update(grads, state, params, **extra_args)``
    forwards the extra arguments to ``inner``, except ``found_inf``: passing the ``found_inf``
    returned by ``unscale`` says that ``grads`` are already unscaled (torch's ``unscale_`` before
    ``step``), so ``update`` neither unscales nor checks them again and skips the step exactly when
    ``found_inf`` is true; and ``new_scale`` (a float or 1-element float32 array): torch's
    ``step(); update(new_scale)``, the step as usual and then the scale set to ``new_scale`` in
    place of growing or backing off, the growth tracker untouched.
  """
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  checks.check_args(
    inner, init_scale, growth_factor, backoff_factor, growth_interval, enabled, axis_name
  )
  checks.check_min_scale(min_scale, init_scale)
  inner = optax.with_extra_args_support(inner)
  hyperparams = LossScaleHyperparams(
    growth_factor=float(growth_factor),
    backoff_factor=float(backoff_factor),
    growth_interval=int(growth_interval),
    enabled=bool(enabled),
    axis_name=axis_name,
    min_scale=None if min_scale is None else float(min_scale),
  )

  def init_fn(params: optax.Params) -> DynamicLossScaleState:
    _register_flax_serialization()
    return DynamicLossScaleState(
      scale=jnp.asarray(init_scale if enabled else 1.0, jnp.float32),
      growth_tracker=jnp.zeros([], jnp.int32),
      found_inf=jnp.array(False),
      skipped_steps=jnp.zeros([], jnp.int32),
      inner_state=_inner_init(inner, params),
      hyperparams=hyperparams,
    )

  def update_fn(
    updates: optax.Updates,
    state: DynamicLossScaleState,
    params: optax.Params | None = None,
    *,
    found_inf: Any = None,
    new_scale: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, DynamicLossScaleState]:
    if not isinstance(state, DynamicLossScaleState):
      raise TypeError(
        "`state` must be the DynamicLossScaleState made by this transform's init(), got "
        f"{type(state).__name__}; initialise with the dynamic_loss_scale wrapper, not the "
        "inner optimizer."
      )
    if new_scale is not None:
      new_scale = checks.as_new_scale(new_scale)
    if not state.hyperparams.enabled:  # found_inf is ignored: unscale returned False
      updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return updates, state._replace(inner_state=inner_state)

    checks.check_no_float8(updates, "updates")
    if found_inf is None:
      _refuse_objective_functions(extra_args)
    updates = _row_major_on_cpu(updates)  # the check's and the cond's operands: one layout
    # The factors (~100 scalar integer ops) are computed before the cond: inside its branch
    # XLA fuses them into every leaf's update, which tripled the compile time at 516 leaves.
    unscale_first = found_inf is None
    if unscale_first:
      factors = _unscale_factors(state.scale)
      found_inf = _found_inf(updates, state.hyperparams.axis_name, factors)
    else:  # already unscaled by `unscale` (torch's unscale_ before step): used as given
      factors, found_inf = None, checks.check_found_inf(found_inf)

    def do_update(_: None) -> tuple[optax.Updates, optax.OptState]:
      # Unscaling inside the taken branch lets XLA fuse it into the inner update instead of
      # writing a float32 copy of every gradient as the cond's operand.
      grads = _tree_unscale_by(updates, factors) if unscale_first else updates
      return inner.update(grads, state.inner_state, params, **extra_args)

    # A cond, not a select per leaf. Selects let XLA fuse the step into apply_updates (12 passes
    # over the parameters' bytes against the cond's 13, adam's 10), but XLA:CPU then recomputes
    # the moments inside the parameter kernel and its vector and scalar loops round them apart:
    # sharded and unsharded steps differed by an ulp. They also compiled 2-4x slower at 500 leaves.
    new_updates, inner_state = _skip_if(
      found_inf, do_update, state.inner_state, _opaque_one(state.scale)
    )
    if new_scale is None:
      scale, growth_tracker = _next_scale(
        state.scale, state.growth_tracker, found_inf, state.hyperparams
      )
    else:  # torch's update(new_scale): the scale given, the growth tracker untouched
      scale = jnp.broadcast_to(jnp.asarray(new_scale, jnp.float32), jnp.shape(state.scale))
      growth_tracker = state.growth_tracker
    return new_updates, DynamicLossScaleState(
      scale=scale,
      growth_tracker=growth_tracker,
      found_inf=found_inf,
      skipped_steps=jnp.where(
        found_inf, optax.safe_increment(state.skipped_steps), state.skipped_steps
      ),
      inner_state=inner_state,
      hyperparams=state.hyperparams,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _inner_init(inner: optax.GradientTransformation, params: optax.Params) -> optax.OptState:
  """``inner``'s state; a ValueError if it holds a loss scaler already (every update would be
  unscaled twice, by each scaler, and come out ``scale`` times too small)."""
  state = inner.init(params)
  if state_tree.tree_find_nodes(state, DynamicLossScaleState):
    raise ValueError(
      "dynamic_loss_scale wraps an optimizer that holds a dynamic_loss_scale already: every "
      "update would be unscaled twice. Wrap the optimizer once, outermost: "
      "jaxamp.dynamic_loss_scale(optax.chain(...)), as torch has one GradScaler per model."
    )
  return state


# Extra arguments that hand the inner optimizer the objective itself, which it evaluates or
# differentiates on its own: what it computes from them is of the scaled loss, neither unscaled
# nor checked for inf/NaN (torch's GradScaler.step refuses a closure for the same reason).
_OBJECTIVE_ARGUMENTS = {
  "value_fn": (
    "a line-search optimizer (optax.lbfgs, optax.scale_by_zoom_linesearch)",
    "it stores the loss value and gradient of one step's loss scale and compares them with the "
    "next step's, so each change of the scale misleads the search",
    "Run line searches without dynamic_loss_scale (on a float32 or bfloat16 objective)",
  ),
  "grad_fn": (
    "optax.contrib.sam(opaque_mode=True)",
    "the gradients it takes at the adversarial parameters are of the scaled loss, neither "
    "unscaled nor checked for inf/NaN",
    "Use sam's default opaque_mode=False, whose every gradient passes through the scaler",
  ),
  "obj_fn": (
    "optax.contrib.sophia",
    "its Hessian estimate of the scaled loss is `scale` times too large and never checked for "
    "inf/NaN",
    "Run sophia without dynamic_loss_scale (on a float32 or bfloat16 objective)",
  ),
}


def _refuse_objective_functions(extra_args: dict) -> None:
  """A ValueError for an extra argument of ``_OBJECTIVE_ARGUMENTS`` given without ``found_inf``."""
  for name, (optimizer, reason, alternative) in _OBJECTIVE_ARGUMENTS.items():
    if name in extra_args:
      raise ValueError(
        f"dynamic_loss_scale cannot give `{name}` to {optimizer}: {reason}. {alternative}, "
        "or unscale first with `jaxamp.unscale` and pass its `found_inf=` with a "
        f"`{name}` of the unscaled loss."
      )
