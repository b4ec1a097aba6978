"""Walks a jaxpr and every jaxpr nested in it, to check the dtypes autocast chose.

Sub-jaxprs hide in eqn params under many names (jit/pjit ``jaxpr``, scan ``jaxpr``, while
``cond_jaxpr``/``body_jaxpr``, cond ``branches``, remat ``jaxpr``, custom_jvp_call/custom_vjp_call
``call_jaxpr``, shard_map ``jaxpr``, closed_call ``call_jaxpr``), so the walk is generic: any
param value that is a ``Jaxpr`` or ``ClosedJaxpr``, or a tuple/list of them, is descended into.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

Path = tuple[str, ...]


def _as_jaxpr(value) -> jex_core.Jaxpr | None:
  if isinstance(value, jex_core.ClosedJaxpr):
    return value.jaxpr
  if isinstance(value, jex_core.Jaxpr):
    return value
  return None


def sub_jaxprs(eqn) -> Iterator[tuple[str, jex_core.Jaxpr]]:
  """(label, jaxpr) of each jaxpr in ``eqn``'s params; tuple members are labelled ``name[i]``."""
  for name, value in eqn.params.items():
    inner = _as_jaxpr(value)
    if inner is not None:
      yield name, inner
    elif isinstance(value, tuple | list):
      for i, item in enumerate(value):
        inner = _as_jaxpr(item)
        if inner is not None:
          yield f"{name}[{i}]", inner


def walk(jaxpr, path: Path = ()) -> Iterator[tuple[Path, object]]:
  """Yields (path, eqn) for every eqn of ``jaxpr`` and, recursively, of its sub-jaxprs.

  ``path`` names the enclosing eqns outermost first, e.g. ``("jit:jaxpr", "scan:jaxpr")``.
  """
  inner = _as_jaxpr(jaxpr)
  jaxpr = inner if inner is not None else jaxpr
  for eqn in jaxpr.eqns:
    yield path, eqn
    for label, sub in sub_jaxprs(eqn):
      yield from walk(sub, path + (f"{eqn.primitive.name}:{label}",))


def _dtype(atom):
  return atom.aval.dtype  # a numpy dtype, or an extended one (PRNG keys)


def dtypes_of(jaxpr, primitive_name: str) -> list[tuple[tuple, tuple]]:
  """(input dtypes, output dtypes) of every ``primitive_name`` eqn anywhere in ``jaxpr``."""
  return [
    (tuple(_dtype(a) for a in eqn.invars), tuple(_dtype(v) for v in eqn.outvars))
    for _, eqn in walk(jaxpr)
    if eqn.primitive.name == primitive_name
  ]


def primitive_names(jaxpr) -> set[str]:
  """The names of all primitives anywhere in ``jaxpr``."""
  return {eqn.primitive.name for _, eqn in walk(jaxpr)}


def traced(fun, *args, **kwargs) -> jex_core.Jaxpr:
  """``fun``'s jaxpr for ``args``, after ``check_jaxpr`` confirmed it is well typed."""
  jaxpr = jax.make_jaxpr(fun)(*args, **kwargs).jaxpr
  jex_core.check_jaxpr(jaxpr)
  return jaxpr


def float_dtypes_of(jaxpr, primitive_name: str) -> set:
  """The floating dtypes entering and leaving every ``primitive_name`` eqn in ``jaxpr``."""
  found = set()
  for ins, outs in dtypes_of(jaxpr, primitive_name):
    found.update(d for d in ins + outs if jnp.issubdtype(d, jnp.floating))
  return found


def matmuls_off_dtype(jaxpr, low) -> list:
  """The dot_general / conv_general_dilated eqns of ``jaxpr`` that do not run in ``low``.

  A matmul runs in ``low`` on ``low`` operands. A float32 result of them (its
  ``preferred_element_type``) is the gradient of a float32 value autocast cast down
  (``weight_grads``, whose bfloat16 ones are ``jaxamp_cpu_result_dot`` eqns).
  """
  low, f32, off = jnp.dtype(low), jnp.dtype(jnp.float32), []
  for _, eqn in walk(jaxpr):
    if eqn.primitive.name not in ("dot_general", "conv_general_dilated", "jaxamp_cpu_result_dot"):
      continue
    ins = {_dtype(a) for a in eqn.invars}
    (out,) = (_dtype(v) for v in eqn.outvars)
    if out == low and ins == {low}:
      continue
    if out == f32 == eqn.params.get("preferred_element_type") and ins == {low}:
      continue
    off.append(eqn)
  return off


# Ops that only move or copy elements: a float8 operand may pass through them to a matmul (JAX's
# vmap and transpose rules put them there; a conv's input gradient reverses the kernel).
_LAYOUT = {"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy", "rev"}


def matmuls_without_float8_operands(jaxpr) -> list:
  """The dot_general / conv_general_dilated eqns anywhere in ``jaxpr`` (vector dots and their
  scalar-by-vector transposes aside, which promote) with
  an operand that is not a dequantized float8 value: ``mul(convert(q: float8), scale)``, maybe
  moved by layout ops."""
  inner = _as_jaxpr(jaxpr)
  jaxpr = inner if inner is not None else jaxpr
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

  def from_float8(atom) -> bool:
    eqn = producers.get(atom)
    while eqn is not None and eqn.primitive.name in _LAYOUT:
      eqn = producers.get(eqn.invars[0])
    if eqn is None or eqn.primitive.name != "mul":
      return False
    converts = [producers.get(a) for a in eqn.invars]
    return any(
      c is not None
      and c.primitive.name == "convert_element_type"
      and "float8" in str(_dtype(c.invars[0]))
      for c in converts
    )

  off = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      vector = all(len(a.aval.shape) <= 1 for a in eqn.invars)  # a vector dot, its transposes
      if not vector and not all(from_float8(a) for a in eqn.invars):
        off.append(eqn)
    for _, sub in sub_jaxprs(eqn):
      off.extend(matmuls_without_float8_operands(sub))
  return off
