"""Autocast policies: which dtype each JAX primitive or registered op runs in.

A policy is data. Each device type has one table (``jaxamp/_src/tables/<device>.py``) whose rows
map JAX primitives and named op regions to a category, and name the torch ops they realise. The
interpreter looks categories up here and never branches on device types itself.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Category(enum.Enum):
  """How autocast treats the floating-point inputs of an op (torch.amp's op lists)."""

  LOWER = "lower"  # cast to the autocast dtype (float16 / bfloat16)
  FLOAT32 = "float32"  # cast to float32
  FLOAT32_INSIDE = "float32_inside"  # compute in float32, return the main input's dtype
  PROMOTE = "promote"  # cast to the widest floating input dtype
  NATIVE = "native"  # unlisted op: run in the dtypes its inputs already have
  FORBIDDEN = "forbidden"  # raises inside an autocast region (binary_cross_entropy on cuda)


class Row(NamedTuple):
  """One row of a policy table.

  Attributes:
    torch_ops: the torch ops this row realises (names as in torch's autocast op reference).
    category: how the row's inputs are cast.
    primitives: names of the JAX primitives the row covers.
    ops: names of registered op regions (composites) the row covers.
  """

  torch_ops: tuple[str, ...]
  category: Category
  primitives: tuple[str, ...] = ()
  ops: tuple[str, ...] = ()


def op_rows(category: Category, *names: str) -> tuple[Row, ...]:
  """One row per op region named like the torch op it realises (most composite rows)."""
  return tuple(Row((name,), category, ops=(name,)) for name in names)


ELIGIBLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
LOW_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

# Every jax.lax.linalg primitive with floating operands, and fft: JAX has no float16 or bfloat16
# kernels for most (LAPACK, cuSOLVER and ducc take float32 and float64; lax.fft rejects 16-bit
# inputs), so all run in float32 rather than fail. torch raises on low-precision linear algebra
# on CUDA and XPU; on CPU its float32 list names most of them.
NO_16_BIT_KERNELS = ("cholesky", "cholesky_update", "eig", "eigh", "geqp3", "geqrf", "hessenberg",
                     "householder_product", "lu", "ormqr", "qr", "schur", "svd",
                     "symmetric_product", "triangular_solve", "tridiagonal", "tridiagonal_solve",
                     "fft")


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """A device type's policy table: its default dtype and its rows."""

  device_type: str
  default_dtype: np.dtype
  rows: tuple[Row, ...]

  @functools.cached_property
  def primitive_categories(self) -> Mapping[str, Category]:
    return _index(self.rows, "primitives")

  @functools.cached_property
  def op_categories(self) -> Mapping[str, Category]:
    return _index(self.rows, "ops")

  @functools.cached_property
  def primitive_rows(self) -> Mapping[str, tuple[str, ...]]:
    """Primitive name (with its variant, e.g. ``div[rdiv]``) -> the torch ops of its row."""
    return {name: row.torch_ops for row in self.rows for name in row.primitives}

  @functools.cached_property
  def op_rows(self) -> Mapping[str, tuple[str, ...]]:
    """Op region name -> the torch ops of its row."""
    return {name: row.torch_ops for row in self.rows for name in row.ops}


def _index(rows: tuple[Row, ...], field: str) -> dict[str, Category]:
  index: dict[str, Category] = {}
  for row in rows:
    for name in getattr(row, field):
      if name in index and index[name] != row.category:
        raise ValueError(f"{name!r} has two categories in one table")
      index[name] = row.category
  return index


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

  def primitive_category(self, name: str) -> Category:
    return self.table.primitive_categories.get(name, Category.NATIVE)

  def op_category(self, name: str, default: Category | None) -> Category | None:
    """The category of a named op region; ``default`` for ops the table does not list.

    None means the op is a plain composition here (torch decomposes it into listed ops, like
    ``tensordot`` into ``mm`` on CPU): its primitives follow their own rules.
    """
    category = self.table.op_categories.get(name)
    return category if category is not None else default

  @property
  def tag(self) -> str:
    return f"{self.device_type},{self.dtype.name}"


_TABLES: dict[str, Table] = {}


def register_table(table: Table) -> Table:
  """Makes ``table`` the policy of its device type."""
  _TABLES[table.device_type] = table
  return table


def device_types() -> tuple[str, ...]:
  """The device types jaxamp has policy tables for."""
  _load_tables()
  return tuple(sorted(_TABLES))


def get_table(device_type: str) -> Table:
  _load_tables()
  if not isinstance(device_type, str):
    raise TypeError(
        f"`device_type` must be a string, one of {device_types()}; got {device_type!r}."
    )
  try:
    return _TABLES[device_type]
  except KeyError:
    raise ValueError(
        f"`device_type` must be one of {device_types()}; got {device_type!r}."
    ) from None


def _load_tables() -> None:
  from jaxamp._src.tables import cpu, cuda, xpu  # noqa: F401  (registers the tables)


def default_device_type() -> str:
  """The device type of JAX's default backend: "cuda" on GPUs, "cpu" otherwise."""
  return "cuda" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


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
  """True if jaxamp has an autocast policy for ``device_type`` (like torch's)."""
  _load_tables()
  if not isinstance(device_type, str):
    raise TypeError(
        f"`device_type` must be a string, one of {device_types()}; got {device_type!r}."
    )
  return device_type in _TABLES


def get_autocast_dtype(device_type: str) -> np.dtype:
  """The default lower-precision dtype of ``device_type``'s policy."""
  return get_table(device_type).default_dtype
