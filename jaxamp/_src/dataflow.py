"""Where each value of a jaxpr comes from, as far as the cast rules care.

A bias is a parameter added to a dot's output; a Python scalar or a fill follows the dtype of
what it meets; an activation is computed, or read by something other than an add. These facts
are gathered eqn by eqn (``Provenance.note``) and, for values passed into a sub-jaxpr, from what
its body does with them (``activation_reads``).
"""

from __future__ import annotations

import weakref
from typing import Any

from jaxamp._src import compat

p = compat.primitives

# Primitives that move or copy a value without computing: what comes out has the provenance of
# what went in (a parameter stays a parameter, a dot's output stays a dot's output).
LAYOUT = frozenset({p.broadcast_in_dim_p, p.reshape_p, p.squeeze_p, p.transpose_p, p.copy_p})
# ... and casts, which keep where a value comes from too (a cast parameter is a parameter).
KEEPS_PROVENANCE = LAYOUT | {p.convert_element_type_p}


class Provenance:
  """The facts about one jaxpr's values that the cast rules read.

  Attributes:
    source: var -> the var it is a layout change or cast of (its root).
    computed: vars computed from others (not parameters or constants).
    activations: uncomputed vars read by computations other than adds.
    lowered: outputs of low-precision dots and convs, and their layout changes.
    weak: vars holding a converted Python scalar or a fill: they follow the other operand.
    fills: var -> the ``broadcast_in_dim`` of a literal that made it (remade in any dtype).
  """

  def __init__(self):
    self.source: dict[Any, Any] = {}
    self.computed: set[Any] = set()
    self.activations: set[Any] = set()
    self.lowered: set[Any] = set()
    self.weak: set[Any] = set()
    self.fills: dict[Any, Any] = {}

  def root(self, atom) -> Any:
    return self.source.get(atom, atom)

  def note(self, eqn) -> None:
    """Layout changes and casts keep their input's provenance; everything else is computed."""
    if eqn.primitive in KEEPS_PROVENANCE:
      source = eqn.invars[0]
      if not compat.is_literal(source):
        self.source[eqn.outvars[0]] = self.root(source)
        if eqn.primitive in LAYOUT and source in self.lowered:
          self.lowered.add(eqn.outvars[0])
      return
    self.computed.update(eqn.outvars)

  def note_weak_flow(self, eqn) -> None:
    """A broadcast literal is a fill, and a layout change of a weak value is weak."""
    source = eqn.invars[0] if eqn.invars else None
    if eqn.primitive is p.broadcast_in_dim_p and compat.is_literal(source):
      self.fills[eqn.outvars[0]] = eqn  # zeros_like & co: a fill follows the other operand
      self.weak.update(eqn.outvars)
    if eqn.primitive in LAYOUT and not compat.is_literal(source) and source in self.weak:
      self.weak.update(eqn.outvars)

  def is_parameter(self, atom) -> bool:
    """Whether ``atom`` is (a layout change of) a parameter or constant: read, not computed,
    and read by nothing but adds here, as a bias is."""
    root = self.root(atom)
    return root not in self.computed and root not in self.activations

  def is_computed(self, atom) -> bool:
    """Whether ``atom`` was computed from other values (an activation), not passed in."""
    return not compat.is_literal(atom) and self.root(atom) in self.computed

  def is_weak(self, atom, value=None) -> bool:
    """A scalar that follows the other operand's dtype instead of promoting it.

    Python scalars (literals, weakly typed values, also once passed into a jit or converted
    there, as in ``jnp.clip(x, 0)``) and, as torch's 0-dim tensors, rank-0 values and
    broadcasts of them (``jnp.where(m, x, jnp.finfo(jnp.float32).min)``, relu's zeros).
    """
    if is_weak_atom(atom, value):
      return True
    source = self.source.get(atom)
    return atom in self.weak or source is not None and not source.aval.shape

  def carried(self, atoms) -> Provenance:
    """The facts about ``atoms`` alone, for a part of the jaxpr evaluated on its own."""
    facts = Provenance()
    for atom in atoms:
      root = self.root(atom)
      if root is not atom:
        facts.source[atom] = root
      for mine, theirs in (
        (self.computed, facts.computed),
        (self.activations, facts.activations),
        (self.lowered, facts.lowered),
        (self.weak, facts.weak),
      ):
        theirs.update(x for x in (atom, root) if x in mine)
      if atom in self.fills:
        facts.fills[atom] = self.fills[atom]
    return facts


def is_weak_atom(atom, value=None) -> bool:
  """``Provenance.is_weak`` from the atom and its value alone: a literal, a weakly typed or a
  rank-0 value."""
  if compat.is_literal(atom) or getattr(atom.aval, "weak_type", False) or not atom.aval.shape:
    return True
  return value is not None and getattr(compat.typeof(value), "weak_type", False)


def activation_reads(jaxpr) -> set[Any]:
  """The values (through layout changes) that eqns other than adds read: activations, which
  a bias never is (``x + W @ x`` is a residual, ``W @ x + b`` a bias add). A value passed into
  a sub-jaxpr (a layer's jit or remat, a scan over layers) counts as its body reads it."""
  roots: dict[Any, Any] = {}
  read = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive in KEEPS_PROVENANCE:
      if not compat.is_literal(eqn.invars[0]):
        roots[eqn.outvars[0]] = roots.get(eqn.invars[0], eqn.invars[0])
      continue
    if eqn.primitive is p.add_p:
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
    read = body_activations(body)
    inputs.extend(atom for atom, var in zip(atoms, body.invars, strict=True) if var in read)
  return inputs


_body_reads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def body_activations(jaxpr) -> set[Any]:
  """``activation_reads`` of a jaxpr, computed once per jaxpr object (a part of one, which
  cannot be referenced weakly, every time)."""
  try:
    read = _body_reads.get(jaxpr)
  except TypeError:
    return activation_reads(jaxpr)
  if read is None:
    read = _body_reads[jaxpr] = activation_reads(jaxpr)
  return read
