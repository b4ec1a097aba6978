"""Where each value of a jaxpr comes from, as far as the cast rules care.

A bias is a parameter added to a dot's output that the output is not computed with; a Python
scalar or a fill follows the dtype of what it meets; an activation is computed. These facts are
gathered eqn by eqn (``Provenance.note``), what each value is computed with in one pass over
the jaxpr (``input_reads``) and, for values passed into a sub-jaxpr, from what its body does
with them (``activation_reads``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import caches, compat

prims = compat.primitives

# Primitives that move or copy a value without computing: what comes out has the provenance of
# what went in (a parameter stays a parameter, a dot's output stays a dot's output). ``pvary``
# only types a replicated value as varying over ``shard_map``'s manual axes (``check_vma``);
# sharding and layout constraints, reshards, ``stop_gradient`` and ``reduce_precision`` change
# where a value lives, how it differentiates or how it rounds, not what it is.
LAYOUT = frozenset(
  {
    prims.broadcast_in_dim_p,
    prims.reshape_p,
    prims.squeeze_p,
    prims.transpose_p,
    prims.copy_p,
    prims.pvary_p,
    prims.sharding_constraint_p,
    prims.reshard_p,
    prims.layout_constraint_p,
    prims.stop_gradient_p,
    prims.reduce_precision_p,
  }
)
# ... the same for each of several operands (operand i comes out as output i).
PASS_THROUGH = frozenset({prims.optimization_barrier_p, prims.device_put_p})
# What moves a value: layout changes of a dot's output are its output, of a fill a fill.
MOVES = LAYOUT | PASS_THROUGH
# Casts and slices keep where a value comes from too (a cast parameter is a parameter, and so is
# one layer's weights sliced from a stack), not that it is a dot's output.
KEEPS_PROVENANCE = MOVES | {prims.convert_element_type_p, prims.slice_p, prims.dynamic_slice_p}


def passed_through(eqn) -> list[tuple[Any, Any]]:
  """``(input, output)`` of each value a ``KEEPS_PROVENANCE`` eqn passes through (a dynamic
  slice's indices are read, not passed)."""
  if eqn.primitive in PASS_THROUGH:
    return list(zip(eqn.invars, eqn.outvars, strict=True))
  return [(eqn.invars[0], eqn.outvars[0])]


# What each dim of a value varies along: per dim, the origins of its extent. A value varies
# along its own dims ({"own"}; size-1 dims along nothing); a low-precision matmul's output
# along the free dims of one operand ({"lhs"} or {"rhs"}) or along both ({"other"}: a conv's
# batch and spatial dims); a dot's batch dims along {"batch"}, with "stacked lhs" / "stacked
# rhs" where that operand was passed in, not computed (a vmapped ensemble's stacked weights);
# layout changes move, merge and drop these, and a broadcast's new dims vary along nothing.
Dims = tuple[frozenset, ...]
OWN, OTHER = frozenset({"own"}), frozenset({"other"})
LHS, RHS = frozenset({"lhs"}), frozenset({"rhs"})
NOWHERE = frozenset()
BATCH = "batch"
STACKED = {"lhs": "stacked lhs", "rhs": "stacked rhs"}

# Where a fill (``jnp.zeros(shape)``, ``full``, ``ones``, ``zeros_like``: a literal broadcast to
# dims) stands for a scalar, as torch takes one: the values of a ``where`` / ``masked_fill``, the
# bounds of a ``clamp`` / ``relu``, a constant written into a slice (``cache[i] = 0``) or a pad.
# Elsewhere a fill is an array of the dtype it was traced in, as ``torch.zeros(shape)`` is
# float32: an accumulator, a buffer scattered or written into, a concatenated block; it promotes.
# Keyed by primitive: whether the operand at a position takes a fill as a scalar.
_UPDATES = lambda position: position == 2  # noqa: E731 (a scatter's updates)
FILL_AS_SCALAR: dict[Any, Callable[[int], bool]] = {
  prims.select_n_p: lambda position: position > 0,  # the cases, not the predicate
  prims.max_p: lambda position: True,
  prims.min_p: lambda position: True,
  prims.clamp_p: lambda position: position != 1,  # the bounds
  prims.pad_p: lambda position: position == 1,  # the padding value
  prims.dynamic_update_slice_p: lambda position: position == 1,  # the update
  prims.scatter_p: _UPDATES,
  prims.scatter_add_p: _UPDATES,
  prims.scatter_mul_p: _UPDATES,
  prims.scatter_min_p: _UPDATES,
  prims.scatter_max_p: _UPDATES,
}


# ``jnp.zeros_like``, ``ones_like``, ``full_like`` and ``empty_like`` make their fill here: the
# prototype's dtype, as torch's ``*_like`` take the prototype's run-time dtype.
_FULL_LIKE = frozenset({inspect.unwrap(jax.lax.full_like).__code__})


class Provenance:
  """The facts about one jaxpr's values that the cast rules read.

  Attributes:
    source: var -> the var it is a layout change or cast of (its root).
    computed: vars computed from others (not parameters or constants).
    reads: which inputs each value is computed with (``InputReads``), of the jaxpr and of
      the one it is a part of.
    lowered: outputs of low-precision dots and convs, and their layout changes.
    weak: vars holding a converted Python scalar or a fill (``is_weak``).
    fills: var -> the ``broadcast_in_dim`` of a literal that made it (remade in any dtype).
    likes: fills made by ``zeros_like`` & co, in the dtype of their prototype (``is_like``).
    masks: outputs of calls (a jit, a remat) that are boolean arrays converted to floats
      inside (``jax.nn.one_hot``), and a body's invars that receive converted booleans or
      integers from outside, for ``is_discrete``.
    promoted: integer arrays jnp converted to a float to compute with one (its implicit
      promotion, not an ``astype``), and their layout changes, for ``is_discrete``.
    dims: var -> what each of its dims varies along (``Dims``), for layout changes and
      matmul outputs; any other value varies along its own dims.
    constants: var -> its value, for rank-0 invars of a body that receive a Python scalar.
    selected: vars read only as ``jnp.where`` branches (``selected_reads``), for ``is_selected``.
  """

  def __init__(self):
    self.source: dict[Any, Any] = {}
    self.computed: set[Any] = set()
    self.reads: tuple[InputReads, ...] = ()
    self.lowered: set[Any] = set()
    self.weak: set[Any] = set()
    self.fills: dict[Any, Any] = {}
    self.likes: set[Any] = set()
    self.masks: set[Any] = set()
    self.promoted: set[Any] = set()
    self.dims: dict[Any, Dims] = {}
    self.constants: dict[Any, Any] = {}
    self.selected: set[Any] = set()

  def root(self, atom) -> Any:
    return self.source.get(atom, atom)

  def note(self, eqn) -> None:
    """Layout changes, casts and whole reads of a reference keep their input's provenance;
    everything else is computed."""
    if compat.is_whole_read(eqn):  # a parameter kept in a Ref or an nnx Variable is one
      return
    if eqn.primitive in KEEPS_PROVENANCE:
      for source, out in passed_through(eqn):
        if compat.is_literal(source):
          continue
        self.source[out] = self.root(source)
        if source in self.promoted or _promotes_integers(eqn):
          self.promoted.add(out)
        self.dims[out] = layout_dims(eqn, self.dims_of(source))
        if eqn.primitive in MOVES and source in self.lowered:
          self.lowered.add(out)
      return
    self.computed.update(eqn.outvars)
    body = _called_body(eqn)
    if body is not None:
      masks = body_mask_outputs(body)
      self.masks.update(out for out, mask in zip(eqn.outvars, masks, strict=True) if mask)

  def note_matmul(self, eqn) -> None:
    """A low-precision dot or conv: its output stays low under a bias add, and its dims vary
    along its operands' free dims (``matmul_dims``)."""
    self.lowered.update(eqn.outvars)
    passed_in = [not self.is_computed(atom) for atom in eqn.invars[:2]]
    self.dims[eqn.outvars[0]] = matmul_dims(eqn, passed_in)

  def dims_of(self, atom) -> Dims:
    """What each dim of ``atom`` varies along (``Dims``)."""
    found = None if compat.is_literal(atom) else self.dims.get(atom)
    if found is not None:
      return found
    return tuple(OWN if size != 1 else NOWHERE for size in atom.aval.shape)

  def constant(self, atom) -> Any | None:
    """The value of a rank-0 constant known while tracing (a Python scalar or literal), or None."""
    if atom.aval.shape:
      return None
    if compat.is_literal(atom):
      return atom.val
    return self.constants.get(self.root(atom))

  def note_weak_flow(self, eqn) -> None:
    """A broadcast literal is a fill, and a layout change of a weak value is weak."""
    source = eqn.invars[0] if eqn.invars else None
    if eqn.primitive is prims.broadcast_in_dim_p and compat.is_literal(source):
      self.fills[eqn.outvars[0]] = eqn  # zeros_like & co: a fill follows the other operand
      self.weak.update(eqn.outvars)
      if compat.traced_inside(eqn, _FULL_LIKE):
        self.likes.update(eqn.outvars)
    if eqn.primitive in MOVES:
      for source, out in passed_through(eqn):
        if not compat.is_literal(source) and source in self.weak:
          self.weak.add(out)
          if source in self.likes:
            self.likes.add(out)

  def note_like_flow(self, eqn) -> None:
    """What is computed from ``*_like`` fills and Python scalars alone is like them: torch
    computes it in the prototype's dtype (``jnp.tril(jnp.ones_like(h))``, a ``cumsum`` or
    window sum of one, ``2 * jnp.zeros_like(h)``, a slice of one)."""
    floats = [a for a in eqn.invars if _is_inexact(a)]
    likes = [self.is_like(a) for a in floats]
    if not any(likes):
      return
    if all(like or self.is_python_scalar(a) for a, like in zip(floats, likes, strict=True)):
      self.likes.update(v for v in eqn.outvars if _is_inexact(v))

  def is_parameter(self, atom) -> bool:
    """Whether ``atom`` is (a layout change of) a parameter or constant: read, not computed."""
    return self.root(atom) not in self.computed

  def is_added_parameter(self, atom, partner) -> bool:
    """Whether ``atom`` is a parameter (``is_parameter``) that ``partner`` is not computed
    with (``InputReads``), as a bias is to the matmul it is added to: ``x`` in ``x + W @ x``
    is a residual."""
    root = self.root(atom)
    return self.is_parameter(atom) and not any(
      reads.computes_with(partner, root) for reads in self.reads
    )

  def is_computed(self, atom) -> bool:
    """Whether ``atom`` was computed from other values (an activation), not passed in."""
    return not compat.is_literal(atom) and self.root(atom) in self.computed

  def is_weak(self, atom) -> bool:
    """A scalar or a fill: it may follow the other operand's dtype (``follows_partner``).

    Scalars, as torch's Python scalars and 0-dim tensors: literals (also once passed into a jit
    or converted there, as in ``jnp.clip(x, 0)``), rank-0 values, and broadcasts of them
    (``jnp.where(m, x, jnp.finfo(jnp.float32).min)``, relu's zeros). Fills (``is_fill``). An
    array with dims is a tensor in torch, of the default dtype where JAX calls it weakly typed
    (``1e9 * mask``, ``jnp.where(m, 0.0, -1e4)``, ``jnp.arange(n) * 0.5``): it promotes like any
    other.
    """
    if compat.is_literal(atom) or not atom.aval.shape:
      return True
    source = self.source.get(atom)
    return atom in self.weak or source is not None and not source.aval.shape

  def is_python_scalar(self, atom) -> bool:
    """A literal, or a value known while tracing (``constant``): a body's invar that receives
    one (``jnp.where(p, s, 0.0)``'s jit), and its casts and layout changes."""
    return compat.is_literal(atom) or self.constant(atom) is not None

  def is_fill(self, atom) -> bool:
    """A weak value with dims made from a literal, not from a traced scalar: ``jnp.zeros``,
    ``full``, ``ones_like`` and their layout changes, or one passed into a body."""
    if compat.is_literal(atom) or not atom.aval.shape:
      return False
    return bool(self.root(atom).aval.shape) and self.is_weak(atom)

  def is_discrete(self, atom) -> bool:
    """A boolean array converted to a float dtype, or an integer array jnp promoted to one (and
    layout changes of them). JAX converts it to the traced float32 to compute with a float (``m *
    h``, Haiku's ``dropout``, ``h * m.astype(h.dtype)``, ``h.sum(1) / lengths``, ``h +
    jnp.arange(n)``); torch's bool and integer tensors take their float partner's dtype, whatever
    their rank. An integer array converted by ``astype`` is a float32 tensor, as torch's
    ``.float()`` is."""
    if compat.is_literal(atom):
      return False
    root = self.root(atom)
    converted = root is not atom and (root.aval.dtype == np.bool_ or atom in self.promoted)
    return converted or root in self.masks

  def is_zero_dim_tensor(self, atom) -> bool:
    """A rank-0 value that is not a Python scalar, and its layout changes: torch's 0-dim tensor.
    Type promotion lets it follow a partner with dims; autocast's promote casts to the widest
    of every floating tensor, 0-dim ones included (``index_copy(h, 0, i, torch.tensor(2.5))``
    of a bfloat16 ``h`` is float32)."""
    if compat.is_literal(atom) or self.is_discrete(atom):
      return False
    root = self.root(atom)
    return not root.aval.shape and not self.is_python_scalar(root)

  def is_like(self, atom) -> bool:
    """A fill made by ``zeros_like``, ``ones_like``, ``full_like`` or ``empty_like`` (and layout
    changes of it): torch's ``*_like`` take their prototype's run-time dtype, which is the
    16-bit one where the prototype is a 16-bit activation (``jnp.concatenate([jnp.zeros_like(
    h[:1]), h[:-1]])``, ``h + jnp.ones_like(h)``)."""
    return not compat.is_literal(atom) and atom in self.likes

  def is_selected(self, atom) -> bool:
    """Whether ``atom`` is read only as a ``jnp.where`` branch (``selected_reads``): a mask's
    fill, which stands for a scalar however it was computed."""
    return not compat.is_literal(atom) and atom in self.selected

  def follows_partner(self, eqn, position: int) -> bool:
    """Whether operand ``position`` of ``eqn`` takes its partner's dtype instead of promoting
    it: a scalar, a converted boolean or integer array (``is_discrete``) and a ``*_like`` fill
    (``is_like``) always; another fill
    only where torch takes a scalar (``FILL_AS_SCALAR``)."""
    atom = eqn.invars[position]
    if self.is_discrete(atom) or self.is_like(atom):
      return True
    if not self.is_weak(atom):
      return False
    as_scalar = FILL_AS_SCALAR.get(eqn.primitive)
    return not self.is_fill(atom) or (as_scalar is not None and as_scalar(position))

  def saturates(self, atom) -> bool:
    """Whether a cast of ``atom`` into a 16-bit dtype keeps finite values finite: a Python
    scalar or fill (``is_weak``) that was not computed; a computed value overflows, as in
    torch."""
    return self.is_weak(atom) and not self.is_computed(atom)

  def carried(self, atoms) -> Provenance:
    """The facts about ``atoms`` alone, for a part of the jaxpr evaluated on its own."""
    facts = Provenance()
    facts.reads = self.reads
    for atom in atoms:
      root = self.root(atom)
      if root is not atom:
        facts.source[atom] = root
      for mine, theirs in (
        (self.computed, facts.computed),
        (self.lowered, facts.lowered),
        (self.weak, facts.weak),
        (self.likes, facts.likes),
        (self.masks, facts.masks),
        (self.promoted, facts.promoted),
      ):
        theirs.update(x for x in (atom, root) if x in mine)
      for mine, theirs in (
        (self.fills, facts.fills),
        (self.dims, facts.dims),
        (self.constants, facts.constants),
      ):
        theirs.update((x, mine[x]) for x in (atom, root) if x in mine)
    return facts


def is_bias_of(out: Dims, bias: Dims, shape: Sequence[int]) -> bool:
  """Whether an addend varying along ``bias``'s dims is the bias of the matmul output ``out``
  (of ``shape``): it varies along the free dims of one operand at most, as a linear or conv
  bias varies along the weight's output features only, and along the dot's batch dims only
  where that operand is a stack of weights passed in (a vmapped ensemble of linear layers, each
  with its bias). An addend with batch or sequence extent (an attention mask over queries and
  keys, a padding mask over the keys of computed ones, a positional embedding) is not a bias.
  A rank-0 addend, which lax broadcasts itself (``x @ w + a``), varies along no dim."""
  bias = bias or (NOWHERE,) * len(out)
  origins = frozenset().union(*(o for o, b in zip(out, bias, strict=True) if b))
  free = origins - {BATCH, *STACKED.values()}
  if BATCH not in origins:
    return any(free <= {side} for side in STACKED)
  # Each member's bias varies along its weight's output features (a per-member scalar added to
  # a bmm does not), so a weight with one output feature (an ensemble's value head) has one
  # value per member as its bias.
  return any(
    STACKED[side] in origins and (free == {side} or not free and _one_feature(out, shape, side))
    for side in STACKED
  )


def _one_feature(out: Dims, shape: Sequence[int], side: str) -> bool:
  """Whether the dims of ``out`` that vary along ``side``'s free dims are all of size one."""
  return all(size == 1 for dims, size in zip(out, shape, strict=True) if side in dims)


def matmul_dims(eqn, passed_in: list[bool]) -> Dims:
  """What each dim of a dot's or conv's output varies along: an operand's free dims along it
  (a conv's output features along the kernel), a dot's batch dims along "batch" (and "stacked"
  the operands ``passed_in``, not computed), a conv's batch and spatial dims along "other"."""
  ndim = eqn.outvars[0].aval.ndim
  if eqn.primitive is prims.dot_general_p:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs_free = eqn.invars[0].aval.ndim - len(lhs_contract) - len(lhs_batch)
    rhs_free = eqn.invars[1].aval.ndim - len(rhs_contract) - len(rhs_batch)
    stacked = {STACKED[side] for side, p in zip(STACKED, passed_in, strict=True) if p}
    batch = frozenset({BATCH, *stacked})
    return (batch,) * len(lhs_batch) + (LHS,) * lhs_free + (RHS,) * rhs_free
  if eqn.primitive is prims.conv_general_dilated_p:
    feature = eqn.params["dimension_numbers"].out_spec[1]
    return tuple(RHS if d == feature else OTHER for d in range(ndim))
  return (OTHER,) * (ndim - 1) + (RHS,)  # ragged dot: the last dim is the weight's


def layout_dims(eqn, dims: Dims) -> Dims:
  """``dims`` moved through a layout change or cast ``eqn``."""
  primitive, params = eqn.primitive, eqn.params
  out_shape = eqn.outvars[0].aval.shape
  if primitive is prims.transpose_p:
    return tuple(dims[d] for d in params["permutation"])
  if primitive is prims.squeeze_p:
    dropped = {d % len(dims) for d in params["dimensions"]}
    return tuple(d for i, d in enumerate(dims) if i not in dropped)
  if primitive is prims.broadcast_in_dim_p:
    out = [NOWHERE] * len(out_shape)
    in_shape = eqn.invars[0].aval.shape
    for i, d in enumerate(params["broadcast_dimensions"]):
      out[d] = dims[i] if in_shape[i] == out_shape[d] else NOWHERE
    return tuple(out)
  if primitive is prims.reshape_p:
    return _reshape_dims(eqn.invars[0].aval.shape, out_shape, dims, params.get("dimensions"))
  if primitive in (prims.slice_p, prims.dynamic_slice_p):  # a dim sliced to one entry: none
    return tuple(d if size != 1 else NOWHERE for d, size in zip(dims, out_shape, strict=True))
  return dims  # casts, copies and constraints


def _reshape_dims(in_shape, out_shape, dims: Dims, permutation) -> Dims:
  """A reshape's dims: each output dim varies along what the input dims it overlaps in the
  row-major layout vary along (a merge unites them, a split shares them)."""
  if permutation is not None or not _is_static(in_shape) or not _is_static(out_shape):
    # A transposing reshape, or one of a symbolic size (jax.export's "b, 8"), whose strides
    # cannot be ordered: every output dim may mix every input dim.
    everything = frozenset().union(*dims)
    return tuple(everything if size != 1 else NOWHERE for size in out_shape)
  in_spans, out_spans = _stride_spans(in_shape), _stride_spans(out_shape)
  return tuple(
    frozenset().union(
      *(d for d, (ilo, ihi) in zip(dims, in_spans, strict=True) if max(lo, ilo) < min(hi, ihi))
    )
    for lo, hi in out_spans
  )


def _is_static(shape) -> bool:
  return all(isinstance(size, int | np.integer) for size in shape)


def _stride_spans(shape) -> list[tuple[int, int]]:
  """Per dim, the range of row-major strides it spans: [stride, stride * size)."""
  spans, stride = [], 1
  for size in reversed(shape):
    spans.append((stride, stride * size))
    stride *= size
  return spans[::-1]


class InputReads(NamedTuple):
  """Which of a jaxpr's inputs each of its values is computed with: an input read on the way by
  something other than an add (``x`` in ``x + tanh(x) @ w``, a residual), not one only added
  upstream (a bias its unrolled steps share) nor one read beside (an L2 penalty on the bias).

  Attributes:
    bits: an input (invar, constvar, a whole read of a reference) -> its bit.
    read: a value -> the bits of the inputs it is computed with.
    activations: the bits of the inputs an eqn other than an add reads (``activation_reads``).
  """

  bits: dict[Any, int]
  read: dict[Any, int]
  activations: int

  def computes_with(self, value, source) -> bool:
    """Whether ``value`` is computed with the input ``source``."""
    return bool(self.read.get(value, 0) & self.bits.get(source, 0))


def input_reads(jaxpr) -> InputReads:
  """``InputReads`` of ``jaxpr``, in one pass: what an eqn computes is computed with what its
  inputs are and, but for an add, with the inputs it reads itself (those a sub-jaxpr's body
  reads so, ``activation_reads``); layout changes pass both on."""
  inputs = (*jaxpr.constvars, *jaxpr.invars)
  bits = {var: 1 << i for i, var in enumerate(inputs)}
  roots: dict[Any, Any] = {}
  read: dict[Any, int] = {}
  activations = 0
  for eqn in jaxpr.eqns:
    if compat.is_whole_read(eqn):  # reads a parameter, as a function argument is read
      bits.update((out, 1 << (len(bits) + i)) for i, out in enumerate(eqn.outvars))
      continue
    if eqn.primitive in KEEPS_PROVENANCE:
      for source, out in passed_through(eqn):
        if not compat.is_literal(source):
          roots[out] = roots.get(source, source)
          read[out] = read.get(source, 0)
      continue
    computed_with = 0
    for atom in eqn.invars:
      computed_with |= 0 if compat.is_literal(atom) else read.get(atom, 0)
    if eqn.primitive is not prims.add_p:
      direct = 0
      for atom in _activation_inputs(eqn):
        if not compat.is_literal(atom):
          direct |= bits.get(roots.get(atom, atom), 0)
      computed_with |= direct
      activations |= direct
    read.update((out, computed_with) for out in eqn.outvars)
  return InputReads(bits, read, activations)


def activation_reads(jaxpr) -> set[Any]:
  """The inputs (through layout changes) that eqns other than adds read: activations, which
  a bias never is (``x + W @ x`` is a residual, ``W @ x + b`` a bias add). An input passed into
  a sub-jaxpr (a layer's jit or remat, a scan over layers) counts as its body reads it."""
  reads = body_input_reads(jaxpr)
  return {var for var, bit in reads.bits.items() if reads.activations & bit}


def _activation_inputs(eqn) -> list:
  """The inputs ``eqn`` reads as activations: all of them, but for the sub-jaxprs that
  ``compat.sub_jaxpr_inputs`` can match to the eqn's inputs, those their bodies read so."""
  bodies = compat.sub_jaxpr_inputs(eqn)
  if bodies is None:
    return list(eqn.invars)
  inputs = []
  for body, atoms in bodies:
    read = body_activations(body)
    inputs.extend(atom for atom, var in zip(atoms, body.invars, strict=True) if var in read)
  return inputs


def _called_body(eqn) -> Any | None:
  """The one body a call eqn (a jit, closed_call, remat) runs on its inputs, giving its outputs;
  None for other eqns."""
  bodies = compat.sub_jaxpr_inputs(eqn)
  if bodies is None or len(bodies) != 1 or len(bodies[0][0].outvars) != len(eqn.outvars):
    return None
  return bodies[0][0]


def _is_inexact(atom) -> bool:
  dtype = getattr(atom.aval, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _promotes_integers(eqn) -> bool:
  """Whether ``eqn`` converts an integer array to a float dtype other than by the caller's
  request: jnp's promotion of an operand (``h / lengths``)."""
  return (
    eqn.primitive is prims.convert_element_type_p
    and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer)
    and not compat.is_requested_cast(eqn)
  )


def mask_outputs(jaxpr) -> tuple[bool, ...]:
  """Which outputs of ``jaxpr`` are boolean arrays converted to floats, or integer arrays jnp
  promoted to them (``Provenance.is_discrete``), through layout changes, casts and the calls
  it makes."""
  masks = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive in KEEPS_PROVENANCE:
      for source, out in passed_through(eqn):
        discrete = source.aval.dtype == np.bool_ or _promotes_integers(eqn)
        if not compat.is_literal(source) and (source in masks or discrete):
          masks.add(out)
      continue
    body = _called_body(eqn)
    if body is not None:
      found = body_mask_outputs(body)
      masks.update(out for out, mask in zip(eqn.outvars, found, strict=True) if mask)
  return tuple(not compat.is_literal(out) and out in masks for out in jaxpr.outvars)


def selected_reads(jaxpr) -> frozenset:
  """The vars of ``jaxpr`` that nothing reads but as a ``select_n`` case (a ``jnp.where``
  branch), through layout changes, casts and the calls it makes, and that it does not return:
  a mask's fill, however computed (Keras's ``where(padding, scores - 1e9, scores)``)."""
  selected: set = set()
  other = {v for v in jaxpr.outvars if not compat.is_literal(v)}
  for eqn in reversed(jaxpr.eqns):  # every read of an eqn's outputs is seen before the eqn
    only_selected = _selected_inputs(eqn, selected)
    for atom in eqn.invars:
      if compat.is_literal(atom) or atom in other:
        continue
      if atom in only_selected:
        selected.add(atom)
      else:
        selected.discard(atom)
        other.add(atom)
  return frozenset(selected)


def _selected_inputs(eqn, selected: set) -> set:
  """The inputs ``eqn`` reads only as ``select_n`` cases: a select's cases, the input of a
  layout change or cast whose outputs are ``selected``, or those a call's body reads so."""
  if eqn.primitive is prims.select_n_p:
    reads = [(atom, position > 0) for position, atom in enumerate(eqn.invars)]
  elif eqn.primitive in KEEPS_PROVENANCE:
    reads = [(source, out in selected) for source, out in passed_through(eqn)]
  else:
    body = _called_body(eqn)
    if body is None:
      return set()
    inner = body_selected(body)
    atoms = compat.sub_jaxpr_inputs(eqn)[0][1]
    reads = [(atom, var in inner) for atom, var in zip(atoms, body.invars, strict=True)]
  reads = [(atom, only) for atom, only in reads if not compat.is_literal(atom)]
  return {atom for atom, only in reads if only} - {atom for atom, only in reads if not only}


def gradient_exits(jaxpr) -> dict[int, tuple]:
  """The gradients a backward pass traced inside the jaxpr hands on, by the index of the eqn
  computing them: the floating results of a transposed eqn (``compat.is_transposed``) that an
  eqn outside the backward pass reads, or the jaxpr returns."""
  transposed = [compat.is_transposed(eqn) for eqn in jaxpr.eqns]
  if not any(transposed):
    return {}
  producer = {
    var: index for index, eqn in enumerate(jaxpr.eqns) if transposed[index] for var in eqn.outvars
  }
  read_outside = {
    atom
    for eqn, backward in zip(jaxpr.eqns, transposed, strict=True)
    if not backward
    for atom in eqn.invars
    if not compat.is_literal(atom)
  }
  read_outside.update(v for v in jaxpr.outvars if not compat.is_literal(v))
  exits: dict[int, tuple] = {}
  for var in read_outside:
    if var in producer and jnp.issubdtype(var.aval.dtype, jnp.inexact):
      exits[producer[var]] = (*exits.get(producer[var], ()), var)
  return exits


def _per_jaxpr(name: str, compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """``compute`` of a jaxpr, computed once per jaxpr object while it lives (a part of one,
  which cannot be referenced weakly, every time)."""
  memo = caches.weak_key_dict(name)

  def once(jaxpr) -> Any:
    try:
      found = memo.get(jaxpr)
    except TypeError:
      return compute(jaxpr)
    if found is None:
      found = memo[jaxpr] = compute(jaxpr)
    return found

  return once


# ``mask_outputs``, ``activation_reads``, ``input_reads``, ``selected_reads`` and
# ``gradient_exits`` of a jaxpr, once per jaxpr object.
body_mask_outputs = _per_jaxpr("dataflow.body_masks", mask_outputs)
body_activations = _per_jaxpr("dataflow.body_reads", activation_reads)
body_input_reads = _per_jaxpr("dataflow.input_reads", input_reads)
body_selected = _per_jaxpr("dataflow.body_selected", selected_reads)
body_gradient_exits = _per_jaxpr("dataflow.gradient_exits", gradient_exits)
