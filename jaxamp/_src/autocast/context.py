"""The state of one autocast evaluation: what an eqn inherits (``Context``), the rules handed
to the interpreter (``RuleSet``), one jaxpr's values and concerns (``Env``), and ``explain``'s
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

from jaxamp._src import compat
from jaxamp._src.autocast import casting, dataflow, op_calls, regions
from jaxamp._src.autocast.overrides import OUTSIDE, Overrides, Scope
from jaxamp._src.policies.policy import Policy
from jaxamp._src.policies.table import Category

# Every rule: (eqn, the Env of its jaxpr, Context) -> ``rules.Applied`` (outputs, ruling, the
# values bound on). Inside an op call, ``env.call`` is the call.
Rule = Callable[[Any, "Env", "Context"], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class RuleSet:
  """Every rule the interpreter dispatches to, each of the one shape ``Rule``, and the one
  ``dispatch`` that picks an eqn's. Built by ``rules.rule_set``; compared by identity, so a
  ``Context`` holding it keys caches.

  Attributes:
    kept: for eqns of kept regions (an inner autocast, ``autocast_disabled()``).
    higher_order: by primitive, the rules that rewrite bodies (jit, scan, cond, ...).
    keeps_dtypes: whether a primitive runs in its traced dtypes (dtype-sensitive, unknown).
    traced_dtypes: the rule for those.
    outside: by primitive, special cases outside op calls; ``by_category`` for the rest.
    inside: by primitive, special cases inside op calls; ``op_entry`` for the rest.
  """

  kept: Rule
  higher_order: Mapping[Any, Rule]
  keeps_dtypes: Callable[[Any], bool]
  traced_dtypes: Rule
  outside: Mapping[Any, Rule]
  by_category: Rule
  inside: Mapping[Any, Rule]
  op_entry: Rule

  def dispatch(self, eqn, kept: bool, in_op: bool) -> Rule:
    """The rule for ``eqn``: in a kept region, or inside an op call, or outside."""
    if kept:
      return self.kept
    rule = self.higher_order.get(eqn.primitive)
    if rule is not None:
      return rule
    if self.keeps_dtypes(eqn):
      return self.traced_dtypes
    if in_op:
      return self.inside.get(eqn.primitive, self.op_entry)
    return self.outside.get(eqn.primitive, self.by_category)


class Context(NamedTuple):
  """What an eqn inherits from the eqns around it. Hashable: it keys the rewrite cache.

  Attributes:
    policy: the active policy.
    rules: the rules.
    op: the enclosing op region, whose inside runs natively.
    op_category: the category of the enclosing op call (its variant's: a ``[logits]`` loss),
      or None to look it up by the region's name.
    overrides: ``autocast``'s overrides by place (``overrides.Overrides``), if any.
    scope: where the evaluated jaxpr sits, as far as the overrides can tell.
    recomputed: in a custom_vjp's backward, the source sites (``regions.site_of``) of its
      forward: eqns traced from them recompute the forward and are autocast, every other
      computing eqn runs as written. None elsewhere.
  """

  policy: Policy
  rules: RuleSet
  op: regions.OpRegion | None = None
  op_category: Category | None = None
  overrides: Overrides | None = None
  scope: Scope = OUTSIDE
  recomputed: frozenset | None = None

  def within(self, eqn) -> Context:
    """The context of ``eqn``'s bodies: their scope, where there are overrides."""
    if self.overrides is None:
      return self
    return self._replace(scope=self.overrides.enter(self.scope, eqn))


# ``explain`` installs a recorder: (path, eqn, ruling, values run on, outputs, converts, policy,
# the name of the override that decided the eqn or None).
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
    checkpoint_ops: whether ``RECOMPUTED_OPS`` calls run under ``jax.checkpoint`` (not when
      already inside one, nor when evaluated eagerly).
    call: the op call of the eqn being evaluated (None outside op calls).
  """

  def __init__(
    self,
    ctx: Context,
    path: str = "",
    casts: casting.CastCache | None = None,
    facts: dataflow.Provenance | None = None,
    record: bool = True,
    checkpoint_ops: bool = True,
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
    self.checkpoint_ops = checkpoint_ops
    self.call: op_calls.OpCall | None = None

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
      saturate = saturate or self.facts.saturates(atom)
      converted = self.casts.convert(value, dtype, saturate=saturate)
    if self.ctx.policy.cache_enabled:
      self.casts.made[key] = converted
    return converted
