"""Autocast policies: a device type's table and the low-precision dtype, chosen and validated.

Each device type has one table (``jaxamp/_src/policies/<device>.py``, rows as in ``table.py``);
this module maps device types to their tables and answers ``is_autocast_available`` and
``get_autocast_dtype``. The interpreter looks categories up in a ``Policy`` and never branches
on device types itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.policies import cpu, cuda, tpu, xpu
from jaxamp._src.policies.table import ELIGIBLE_DTYPES, LOW_DTYPES, Category, Table, Variant


@dataclasses.dataclass(frozen=True)
class Policy:
  """An active autocast setting: a device table and the low-precision dtype it casts to.

  Frozen and hashable, so it keys the caches of traced and rewritten jaxprs.
  """

  table: Table
  dtype: np.dtype
  cache_enabled: bool = True

  @property
  def device_type(self) -> str:
    return self.table.device_type

  def primitive_category(self, primitive, variant: str | None = None) -> Category:
    """The category of ``primitive`` (used as ``variant``, if its table row lists that)."""
    categories = self.table.primitive_categories
    if variant is not None:
      keyed = categories.get(Variant(primitive, variant))
      if keyed is not None:
        return keyed
    return categories.get(primitive, Category.NATIVE)

  def op_category(self, name: str, default: Category | None) -> Category | None:
    """The category of a named op region; ``default`` for ops the table does not list.

    None means the op is a plain composition here (torch decomposes it into listed ops, like
    ``tensordot`` into ``mm`` on CPU): its primitives follow their own rules.
    """
    category = self.table.op_categories.get(name)
    return category if category is not None else default


# Device type -> its table: every table jaxamp has, one per module of ``tables/``.
_TABLES: dict[str, Table] = {
  table.device_type: table for table in (cpu.TABLE, cuda.TABLE, tpu.TABLE, xpu.TABLE)
}


# JAX platform names (``jax.default_backend()``, ``Device.platform``) that name another device
# type's policy; every table's own name maps to itself.
_ALIASES: dict[str, str] = {"gpu": "cuda", "rocm": "cuda"}


def device_types() -> tuple[str, ...]:
  """The device types jaxamp has policy tables for."""
  return tuple(sorted(_TABLES))


def _resolve(device_type: str) -> str | None:
  """The device type whose table serves ``device_type`` (a JAX platform name too), or None."""
  name = _ALIASES.get(device_type, device_type)
  return name if name in _TABLES else None


def _platforms() -> str:
  """Which names map to which policy, e.g. 'gpu, cuda, rocm -> "cuda"; cpu -> "cpu"'."""
  names = {t: [t] + sorted(a for a, target in _ALIASES.items() if target == t) for t in _TABLES}
  return "; ".join(f'{", ".join(n)} -> "{t}"' for t, n in sorted(names.items()))


def _check_string(device_type) -> None:
  if not isinstance(device_type, str):
    raise TypeError(
      f"`device_type` must be a string, one of {device_types()}; got {device_type!r}."
    )


def get_table(device_type: str) -> Table:
  """The table of ``device_type``: a device type or a JAX platform name ("gpu" is "cuda")."""
  _check_string(device_type)
  name = _resolve(device_type)
  if name is None:
    raise ValueError(
      f"`device_type` must be one of {device_types()} or a JAX platform name that maps to "
      f"one ({_platforms()}); got {device_type!r}."
    )
  return _TABLES[name]


def default_device_type() -> str:
  """The device type of JAX's default backend ("gpu" -> "cuda", ...); "cpu" if it has none."""
  return _resolve(jax.default_backend()) or "cpu"


def _canonical(dtype, allowed: tuple[np.dtype, ...], argument: str) -> np.dtype:
  try:
    canonical = jnp.dtype(dtype)
  except TypeError:
    canonical = None
  if canonical not in allowed:
    names = [f"jnp.{d.name}" for d in allowed]
    names = ", ".join(names[:-1]) + " or " + names[-1]
    raise ValueError(f"`{argument}` must be one of {names}; got {dtype!r}.")
  return canonical


def canonical_dtype(dtype) -> np.dtype:
  """Validates a user's autocast ``dtype``: float16 or bfloat16 (the lower-precision dtypes)."""
  return _canonical(dtype, LOW_DTYPES, "dtype")


def canonical_cast_dtype(dtype) -> np.dtype:
  """Validates an explicit cast target: float32, float16 or bfloat16."""
  return _canonical(dtype, ELIGIBLE_DTYPES, "cast_inputs")


def make_policy(device_type: str | None, dtype, cache_enabled: bool = True) -> Policy:
  """The policy for ``device_type`` (None: the default backend's) and ``dtype``."""
  table = get_table(default_device_type() if device_type is None else device_type)
  low = table.default_dtype if dtype is None else canonical_dtype(dtype)
  if not isinstance(cache_enabled, bool):
    raise TypeError(f"`cache_enabled` must be a bool; got {cache_enabled!r}.")
  return Policy(table, low, cache_enabled)


def is_autocast_available(device_type: str) -> bool:
  """True if jaxamp has an autocast policy for ``device_type`` (like torch's; "gpu" too)."""
  _check_string(device_type)
  return _resolve(device_type) is not None


def get_autocast_dtype(device_type: str) -> np.dtype:
  """The default lower-precision dtype of ``device_type``'s policy."""
  return get_table(device_type).default_dtype
