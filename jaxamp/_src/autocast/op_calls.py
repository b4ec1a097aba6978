"""Calls of op regions in a jaxpr: which eqns form one call, and what leaves it in which dtype.

An op region (``regions.py``) marks eqns traced inside a registered or recognised function; the
policy gives the op a category. ``op_calls`` groups consecutive eqns into calls, ``OpExits``
remembers each FLOAT32_INSIDE call's main input so its float32 results leave in that dtype, and
``recomputed_runs`` finds the softmax calls evaluated under ``jax.checkpoint``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import export

from jaxamp._src import compat
from jaxamp._src.autocast import casting, regions
from jaxamp._src.policies import shared
from jaxamp._src.policies.policy import Policy
from jaxamp._src.policies.table import Category

# Ops whose outputs include state shaped like a non-main input (BatchNorm's running statistics):
# those outputs keep their traced dtype (float32, or a 16-bit layer's own) when they leave the op.
STATEFUL_OPS = frozenset({"batch_norm"})

# FLOAT32_INSIDE ops that are torch elementwise kernels (TensorIterator): their result dtype is
# the promotion of their tensor operands' (``xlogy(bf16, f32)`` is float32), a 0-dim tensor
# taking part only beside no other, where a norm's or a pool's is its main input's.
PROMOTING_OPS = frozenset({*shared.ACTIVATION_OPS, *shared.ELEMENTWISE_FUNCTION_OPS})

# These FLOAT32_INSIDE ops run under ``jax.checkpoint`` when a 16-bit tensor enters them: torch's
# softmax kernels save a 16-bit tensor (their output) for the backward, and its activation and
# elementwise function kernels their 16-bit inputs, while differentiating the float32
# computation would keep its float32 ``exp`` or ``tanh``, twice the bytes. Recomputing the
# elementwise inside costs little.
# Norms are not recomputed: their backward would recompute ``x - mean`` over the whole
# activation, which cost more step time on XLA:CPU (+8-17% on the benchmark conv net) than the
# float32 copies it saves are worth.
RECOMPUTED_OPS = frozenset(
  {"softmax", "log_softmax", "softmin", *shared.ACTIVATION_OPS, *shared.ELEMENTWISE_FUNCTION_OPS}
)

# LOWER ops whose torch kernels take 16-bit inputs but compute in float32 inside: SDPA's flash
# kernels (CUDA and CPU) multiply 16-bit operands with float32 accumulation, take the softmax of
# the float32 scores and round the probabilities to 16 bits for the second product; its math
# fallback upcasts everything. A composite's 16-bit softmax would overflow where they do not
# (float16 scores past 65504) and lose precision at long sequences. Inside these ops a matmul
# returns float32 (``rules._matmul_in_op``), what follows computes on it, and the op's results
# leave it in the low dtype.
ACCUMULATING_OPS = frozenset({"scaled_dot_product_attention"})


class OpCall(NamedTuple):
  """One call of an op region: the region, the instance telling calls apart, its category, and
  the table key that gave it (a variant's, ``avg_pool[3d]``; None for the region's name)."""

  region: regions.OpRegion
  instance: str
  category: Category
  row: str | None = None


def op_category(
  op: regions.OpRegion, policy: Policy, variant: str | None = None
) -> Category | None:
  """The op's category under ``policy`` (for a call of that ``variant``); None for a plain
  composition (no row, no default)."""
  if op.cast_to is not None:  # custom_fwd(cast_inputs=...): cast on entry, autocast off inside;
    # under another device type's autocast a plain composition, as torch's
    return Category.NATIVE if op.casts_under(policy.device_type) else None
  return policy.op_category(op.name, op.default, variant)


# Window reductions: a pooling's kernel, whose torch op (avg_pool2d or avg_pool3d, ...) is named
# by how many dimensions it pools.
WINDOW_REDUCTIONS = frozenset(
  {
    compat.primitives.reduce_window_sum_p,
    compat.primitives.reduce_window_max_p,
    compat.primitives.reduce_window_min_p,
    compat.primitives.reduce_window_p,
  }
)


# Reductions that pool where no window reduction does: Equinox's adaptive pools reduce one axis at a
# time with ``jnp.mean``/``jnp.max``. They count as pooling only in these ops (a norm's mean and
# variance are no pooling).
PLAIN_REDUCTIONS = frozenset(
  {
    compat.primitives.reduce_sum_p,
    compat.primitives.reduce_max_p,
    compat.primitives.reduce_min_p,
  }
)
POOLS_OF_PLAIN_REDUCTIONS = frozenset({"adaptive_pool"})


def windowed_dims(eqn) -> int:
  """How many dimensions the window reduction ``eqn`` pools over: those with a window or a
  stride above 1. Not the rank, which a batch dimension (``vmap``, Equinox's unbatched layers'
  added axis) changes."""
  sizes = zip(eqn.params["window_dimensions"], eqn.params["window_strides"], strict=True)
  return sum(window > 1 or stride > 1 for window, stride in sizes)


def chained_pooled_dims(eqns, plain_reductions: bool = False) -> int | None:
  """How many dimensions the pooling steps of ``eqns`` pool over along their longest chain of
  dataflow: an adaptive pool pools one dimension after another (Keras's 3-D one with three
  1-D window reductions, Equinox's with three means). Window reductions count the dimensions
  they pool; with ``plain_reductions``, so do reductions, by their axes. None without a step."""
  depth: dict = {}
  deepest = None
  for eqn in eqns:
    step = _pooling_step(eqn, plain_reductions)
    reached = max((depth.get(v, 0) for v in eqn.invars if not compat.is_literal(v)), default=0)
    if step is not None:
      reached += step
      deepest = max(deepest or 0, reached)
    depth.update((v, reached) for v in eqn.outvars)
  return deepest


def _pooling_step(eqn, plain_reductions: bool) -> int | None:
  if eqn.primitive in WINDOW_REDUCTIONS:
    return windowed_dims(eqn)
  if plain_reductions and eqn.primitive in PLAIN_REDUCTIONS and eqn.params["axes"]:
    return len(eqn.params["axes"])
  inner = [chained_pooled_dims(body.eqns, plain_reductions) for body in compat.sub_jaxprs(eqn)]
  return max((dims for dims in inner if dims is not None), default=None)


# Pads whose torch op (reflection_pad2d or reflection_pad3d) is named by how many dimensions they
# pad: jnp.pad's reflect and symmetric modes concatenate along each padded axis.
PADS = frozenset({"reflection_pad"})


def padded_dims(eqns) -> int | None:
  """How many axes the concatenates of ``eqns`` join along (each pads one); None for none."""
  axes = {
    eqn.params["dimension"] for eqn in eqns if eqn.primitive is compat.primitives.concatenate_p
  }
  return len(axes) or None


def pooling_variant(dims: int | None) -> str | None:
  """The table key of a pooling over ``dims`` dimensions: ``"3d"`` (torch's ``avg_pool3d``,
  ``max_pool3d``), else None."""
  return "3d" if dims == 3 else None


# What makes a loss's call the with-logits form (torch's binary_cross_entropy_with_logits, the
# variant ``logits``): eqns inside these inner ops (Keras's binary_crossentropy with
# from_logits=True takes ``jax.nn.log_sigmoid``), or a sigmoid the loss applies to its own input
# (Keras's binary_focal_crossentropy with from_logits=True, as torchvision's sigmoid_focal_loss).
LOGIT_OPS = frozenset({"log_sigmoid"})
LOGIT_PRIMITIVES = frozenset({compat.primitives.logistic_p})


def _call_variant(op: regions.OpRegion, span, span_marks) -> str | None:
  """The variant of ``op``'s call made of the eqns ``span``, for an op some row lists with one:
  that of the pooling or padding its eqns make, ``logits`` for a loss computed from logits, or
  ``dtype`` for a call given an explicit dtype; None for none of these."""
  if op.name in PADS:
    return pooling_variant(padded_dims(span))
  dims = chained_pooled_dims(span, plain_reductions=op.name in POOLS_OF_PLAIN_REDUCTIONS)
  if dims is not None:
    return pooling_variant(dims)
  if any(map(_takes_logits, span, span_marks)):
    return "logits"
  return "dtype" if _sets_result_dtype(span) else None


def _sets_result_dtype(eqns) -> bool:
  """Whether the call made of ``eqns`` chose its result's dtype: it returns a floating dtype
  none of its floating inputs has (an integer or boolean input's sum has none), or ends by
  converting to a dtype its main input (the largest) does not have. JAX's reductions and scans
  given ``dtype=`` convert to it on entry and never back; Keras's layers of a 16-bit ``dtype=``
  convert their float32 result to it. Without one they return their input's dtype (computing a
  16-bit input in float32 inside)."""
  produced: set = set()
  entering = []
  for eqn in eqns:
    entering += [v.aval for v in eqn.invars if not compat.is_literal(v) and v not in produced]
    produced.update(eqn.outvars)
  floating = [aval for aval in entering if _floating_dtype(aval) is not None]
  results = {_floating_dtype(v.aval) for v in eqns[-1].outvars} - {None}
  if results and results.isdisjoint(aval.dtype for aval in floating):
    return True
  last = eqns[-1]
  return (
    last.primitive is compat.primitives.convert_element_type_p
    and _floating_dtype(last.outvars[0].aval) is not None
    and bool(floating)
    and max(floating, key=_ordering_size).dtype != last.params["new_dtype"]
  )


# What a symbolic dimension (``jax.export``) counts as when sizes are ordered: more than any static
# one, as a batch or a sequence length is; Python compares symbolic sizes only for equality.
_SYMBOLIC_SIZE = 2**40


def _ordering_size(aval) -> int:
  """``aval``'s size, for choosing the largest of several values."""
  return math.prod(_SYMBOLIC_SIZE if export.is_symbolic_dim(d) else d for d in aval.shape)


def _floating_dtype(aval) -> np.dtype | None:
  dtype = getattr(aval, "dtype", None)
  return dtype if dtype is not None and jnp.issubdtype(dtype, jnp.floating) else None


def _takes_logits(eqn, eqn_marks: regions.Marks) -> bool:
  """Whether ``eqn`` is one of the ``LOGIT_PRIMITIVES`` or lies in one of the ``LOGIT_OPS``, or
  its bodies (``jax.nn.log_sigmoid``'s jit) hold such an eqn."""
  if eqn.primitive in LOGIT_PRIMITIVES or any(op.name in LOGIT_OPS for op in eqn_marks.ops):
    return True
  return any(
    _takes_logits(inner, regions.marks_of(inner))
    for body in compat.sub_jaxprs(eqn)
    for inner in body.eqns
  )


def op_calls(
  eqns,
  marks: Sequence[regions.Marks],
  inside: OpCall | None,
  policy: Policy,
  numbers: Iterator[int],
  policies: Sequence[Policy] | None = None,
) -> list[OpCall | None]:
  """The op call each eqn belongs to: the outermost op region the policy gives a category.

  Inside an op (``inside``) every eqn belongs to it. An op the table does not list is a plain
  composition (torch decomposes it into listed ops): the search goes on inward, and without any
  listed op the eqn follows its primitive's rule. A call is a run of consecutive eqns of one
  call site (``_call_stop``). ``numbers`` numbers the calls. ``policies`` gives each eqn its own
  policy (overrides by place); a change of policy ends a call.
  """
  if inside is not None:
    return [inside] * len(marks)
  calls: list[OpCall | None] = [None] * len(eqns)
  index = 0
  while index < len(eqns):
    eqn_policy = policies[index] if policies is not None else policy
    stop = index + 1
    for op in () if marks[index].kept else marks[index].ops:
      call, call_stop = _op_call(eqns, marks, policies, index, op, eqn_policy, numbers)
      if call is not None:
        stop = call_stop
        calls[index:stop] = [call] * (stop - index)
        break
    index = stop
  return calls


def _op_call(eqns, marks, policies, start, op, policy, numbers) -> tuple[OpCall | None, int]:
  """The call of ``op`` starting at ``eqns[start]`` and where it stops; None when the policy
  gives that call no category."""
  stop, variant = None, None
  if op.name in policy.table.ops_with_variants:
    stop = _call_stop(eqns, marks, policies, start, op)
    variant = _call_variant(op, eqns[start:stop], marks[start:stop])
  category = op_category(op, policy, variant)
  if category is None:
    return None, start
  if stop is None:  # an op without variants: its call's extent matters only once it has a row
    stop = _call_stop(eqns, marks, policies, start, op)
  row = policy.op_row(op.name, variant)
  return OpCall(op, f"{op.instance}#{next(numbers)}", category, row), stop


def _call_stop(eqns, marks, policies, start: int, op: regions.OpRegion) -> int:
  """Where the call of ``op`` starting at ``eqns[start]`` stops.

  The call's eqns lie in ``op``'s instance under one policy, within the same outer ops. The
  next call from the same site (a loop, a linen module's wrapper) begins where the position
  inside the op does not move on and nothing after it in the run reads a value computed before
  it: an inlined ``jit`` (``jnp.mean``) gives all its eqns one position, and a part computed
  apart (the count of ``where=`` elements) is read again by the eqn that ends the call.
  """
  depth = marks[start].ops.index(op)
  outer = marks[start].ops[:depth]
  positions = []
  stop = start
  while stop < len(eqns) and _in_call(marks[stop], op.instance, outer):
    if policies is not None and policies[stop] is not policies[start]:
      break
    eqn_marks = marks[stop]
    positions.append(eqn_marks.positions[depth])
    stop += 1
  earliest_read = _earliest_reads(eqns[start:stop])
  for offset in range(1, stop - start):
    at, before = positions[offset], positions[offset - 1]
    moves_on = at is None or before is None or at > before
    if not moves_on and earliest_read[offset] >= offset:
      return start + offset
  return stop


def _in_call(eqn_marks: regions.Marks, instance: str, outer: tuple) -> bool:
  depth = len(outer)
  ops = eqn_marks.ops
  return (
    not eqn_marks.kept
    and len(ops) > depth
    and ops[depth].instance == instance
    and ops[:depth] == outer
  )


def _earliest_reads(eqns) -> list[int]:
  """For each eqn, the earliest position among it and the eqns after it of an eqn whose value
  one of them reads (``len(eqns)`` for none)."""
  producers: dict = {}
  reads = []
  for index, eqn in enumerate(eqns):
    read = [producers[v] for v in eqn.invars if not compat.is_literal(v) and v in producers]
    reads.append(min(read, default=len(eqns)))
    producers.update((v, index) for v in eqn.outvars)
  earliest = len(eqns)
  for index in reversed(range(len(eqns))):
    earliest = min(earliest, reads[index])
    reads[index] = earliest
  return reads


def accumulates(call: OpCall) -> bool:
  """Whether ``call`` is a LOWER op computing in float32 inside (``ACCUMULATING_OPS``)."""
  return (
    call.category is Category.LOWER
    and call.region.cast_to is None
    and call.region.name in ACCUMULATING_OPS
  )


class OpExits:
  """What each FLOAT32_INSIDE call returns its float32 results in: its main input's dtype, or
  for an elementwise kernel (``PROMOTING_OPS``) its operands' promoted dtype; and each
  accumulating LOWER call (``ACCUMULATING_OPS``): the policy's low dtype.

  torch's kernels return the dtype of their main input; values leaving in another dtype were
  chosen explicitly (``dtype=``) and keep it. A stateful op's (``STATEFUL_OPS``) outputs shaped
  like another of its inputs are its state, not its result, and leave in the dtype they were
  traced in: BatchNorm's running mean and variance, shaped like its scale (float32, or a 16-bit
  layer's own dtype).
  """

  def __init__(self):
    self._exits: dict[str, tuple[Any, frozenset]] = {}  # instance -> main input aval, shapes
    self._low: dict[str, Any] = {}  # accumulating instance -> its low dtype

  def note_low(self, instance: str, dtype) -> None:
    """Every float32 result of ``instance`` leaves it in ``dtype``."""
    self._low[instance] = dtype

  def note_entering(
    self, instance: str, avals: Sequence[Any], stateful: bool, promotes: bool = False
  ) -> None:
    """Remembers the largest floating value entering ``instance`` (and, for a stateful op, the
    others' shapes: those of its state), typed with the promoted dtype of all of them where the
    op ``promotes``: of the tensors with dims, or of the 0-dim ones where none has any."""
    main, shapes = self._exits.get(instance, (None, frozenset()))
    for aval in avals:
      if not casting.is_eligible(aval.dtype):
        continue
      if promotes and main is not None and (aval.ndim > 0) == (main.ndim > 0):
        dtype = casting.widest([main.dtype, aval.dtype])
        main, aval = compat.aval_with_dtype(main, dtype), compat.aval_with_dtype(aval, dtype)
      if main is None or _ordering_size(aval) > _ordering_size(main):
        main, aval = aval, main
      if aval is not None and stateful:
        shapes |= {aval.shape}
    if main is not None:
      self._exits[instance] = (main, shapes - {main.shape})

  def exit_dtype(self, instance: str, aval, dtype) -> Any | None:
    """The dtype a value traced as ``aval`` and computed in ``dtype`` in ``instance`` leaves it
    in; None when it leaves as it is. State leaves in its traced dtype (a float16 layer's
    float16 running statistics)."""
    if dtype != jnp.float32:
      return None
    if instance in self._low:
      return self._low[instance]
    if instance not in self._exits:
      return None
    main, state_shapes = self._exits[instance]
    if aval.shape == main.shape or aval.shape not in state_shapes:
      return main.dtype
    return aval.dtype if casting.is_eligible(aval.dtype) and aval.dtype != dtype else None


class Segment(NamedTuple):
  """Consecutive eqns of one op call as a jaxpr ``interpreter.evaluate`` can run on its own."""

  constvars: tuple
  invars: list
  eqns: list
  outvars: list


def recomputed_runs(calls: Sequence[OpCall | None]) -> dict[int, int]:
  """Start -> stop of each run of consecutive eqns forming one call of a recomputed op."""
  runs: dict[int, int] = {}
  start, current = 0, None
  for index, call in enumerate(calls):
    recomputed = (
      call is not None
      and call.category is Category.FLOAT32_INSIDE
      and call.region.name in RECOMPUTED_OPS
    )
    instance = call.instance if recomputed else None
    if instance != current:
      if current is not None:
        runs[start] = index
      start, current = index, instance
  if current is not None:
    runs[start] = len(calls)
  return runs


def segment(eqns, start: int, stop: int, last_read: dict[Any, int]) -> Segment | None:
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
