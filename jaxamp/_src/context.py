"""The state of one autocast evaluation: what an eqn inherits (``Context``), the rules handed
to the interpreter (``Rules``), one jaxpr's values and concerns (``Env``), and ``explain``'s
recorder.

The interpreter (``interpreter.py``), the rules (``rules.py``, ``higher_order.py``) and the
reports all import these types from here, so none of them imports another for its types.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from jaxamp._src import casting, compat, dataflow, op_calls, regions
from jaxamp._src.policy import Policy

# A higher-order rule: (eqn, input values, the outer jaxpr's Env, Context) -> outputs.
HigherOrderRule = Callable[[Any, list, "Env", "Context"], list[Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
  """The rules the interpreter dispatches to beyond ``rules.py``: those of higher-order
  primitives, which evaluate their bodies with the interpreter itself (``higher_order.RULES``).
  Compared by identity, so a ``Context`` holding it keys caches."""

  higher_order: Mapping[Any, HigherOrderRule]


class Context(NamedTuple):
  """What an eqn inherits from the eqns around it. Hashable: it keys the rewrite cache.

  Attributes:
    policy: the active policy.
    rules: the higher-order rules.
    op: the enclosing op region, whose inside runs natively.
  """

  policy: Policy
  rules: Rules
  op: regions.OpRegion | None = None


# ``explain`` installs a recorder: (path, eqn, ruling, values run on, outputs, converts, policy).
Recorder = Callable[..., None]
_recorder: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
  "jaxamp_explain_recorder", default=None
)


def current_recorder() -> Recorder | None:
  return _recorder.get()


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
  """Calls ``recorder`` for every eqn evaluated inside the block (in this context only)."""
  token = _recorder.set(recorder)
  try:
    yield
  finally:
    _recorder.reset(token)


class Env:
  """One jaxpr's evaluation: its values and their op call, and the state of each concern.

  Attributes:
    ctx: the context the jaxpr is evaluated in.
    path: where the jaxpr sits, for ``explain``.
    values: var -> its value now.
    region: var -> the op call instance that computed it (None outside op calls).
    casts: the cast cache.
    facts: the dataflow facts the rules read.
    exits: what FLOAT32_INSIDE op calls return their results in.
    op_numbers: numbers the op calls found in this jaxpr.
    recorder: ``explain``'s recorder, if one is installed and this pass is not a discovery pass.
    in_checkpointed_op: evaluating one ``RECOMPUTED_OPS`` call under ``jax.checkpoint``.
  """

  def __init__(
    self,
    ctx: Context,
    path: str = "",
    casts: casting.CastCache | None = None,
    facts: dataflow.Provenance | None = None,
    record: bool = True,
    in_checkpointed_op: bool = False,
  ):
    self.ctx = ctx
    self.path = path
    self.values: dict[Any, Any] = {}
    self.region: dict[Any, str | None] = {}
    self.casts = casts if casts is not None else casting.CastCache()
    self.facts = facts if facts is not None else dataflow.Provenance()
    self.exits = op_calls.OpExits()
    self.op_numbers = itertools.count(1)
    self.recorder = current_recorder() if record else None
    self.in_checkpointed_op = in_checkpointed_op

  def read(self, atom) -> Any:
    return atom.val if compat.is_literal(atom) else self.values[atom]

  def dtype(self, atom) -> np.dtype:
    if compat.is_literal(atom):
      return atom.aval.dtype
    return compat.typeof(self.values[atom]).dtype

  def cast(self, atom, dtype: np.dtype, saturate: bool = False) -> Any:
    """The value of ``atom`` in ``dtype``, converted at most once per (variable, dtype).

    Python scalars, fills and (``saturate``) other constants keep finite values finite; a
    computed value overflows, as in torch."""
    value = self.read(atom)
    if self.dtype(atom) == dtype:
      return value
    if compat.is_literal(atom):
      return casting.saturating_constant(atom.val, dtype)
    key = (atom, dtype)
    cached = self.casts.ask(key)
    if cached is not None:
      return cached
    fill = self.facts.fills.get(atom)
    if fill is not None:  # a fill in the target dtype: no convert, no float32 copy kept
      converted = compat.bind(fill, [casting.saturating_constant(fill.invars[0].val, dtype)])[0]
    else:
      saturate = saturate or self.facts.saturates(atom, value)
      converted = self.casts.convert(value, dtype, saturate=saturate)
    if self.ctx.policy.cache_enabled:
      self.casts.made[key] = converted
    return converted
