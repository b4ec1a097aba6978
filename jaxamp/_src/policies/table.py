"""The shape of a policy table: categories, rows and the table indexed by primitive and op.

A table is data (``jaxamp/_src/policies/<device>.py``): rows mapping JAX primitives (the objects,
``compat.primitives.dot_general_p``) and named op regions to a category, each row naming the
torch ops it realises. The interpreter looks categories up here and never branches on device
types itself.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxamp._src import compat

prims = compat.primitives


class Category(enum.Enum):
  """How autocast treats the floating-point inputs of an op (torch.amp's op lists)."""

  LOWER = "lower"  # cast to the autocast dtype (float16 / bfloat16)
  FLOAT32 = "float32"  # cast to float32
  FLOAT32_INSIDE = "float32_inside"  # compute in float32, return the main input's dtype
  PROMOTE = "promote"  # cast to the widest floating input dtype
  NATIVE = "native"  # unlisted op: run in the dtypes its inputs already have
  FORBIDDEN = "forbidden"  # raises inside an autocast region (binary_cross_entropy on cuda)


class Variant(NamedTuple):
  """A primitive used as a particular torch op: ``div`` of a Python scalar is ``__rdiv__``.

  ``interpreter`` names the variant of an eqn; a table row may list it apart from the primitive.
  """

  primitive: Any
  name: str

  def __str__(self) -> str:
    return f"{self.primitive.name}[{self.name}]"


class LazyPrimitive(NamedTuple):
  """A primitive of a module jaxamp does not import (``jax.experimental.sparse`` costs half a
  second), named by module and attribute: its row applies once the module is imported, which
  any jaxpr holding the primitive implies.
  """

  module: str
  attribute: str

  def resolve(self) -> Any:
    """The primitive, or None while its module is not imported."""
    module = sys.modules.get(self.module)
    return None if module is None else getattr(module, self.attribute)

  def __str__(self) -> str:
    return self.attribute.removesuffix("_p")


class Row(NamedTuple):
  """One row of a policy table.

  Attributes:
    torch_ops: the torch ops this row realises (names as in torch's autocast op reference).
    category: how the row's inputs are cast.
    primitives: the JAX primitives (or ``Variant``s of one, or ``LazyPrimitive``s) the row covers.
    ops: names of registered op regions (composites) the row covers.
  """

  torch_ops: tuple[str, ...]
  category: Category
  primitives: tuple[Any, ...] = ()
  ops: tuple[str, ...] = ()


def named_op_rows(category: Category, *names: str) -> tuple[Row, ...]:
  """One row per op region named like the torch op it realises (most composite rows)."""
  return tuple(Row((name,), category, ops=(name,)) for name in names)


ELIGIBLE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
LOW_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Float8 autocast (``autocast/fp8.py``): matmuls with float8 operands, everything else bfloat16.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)
# The float8 dtypes of float8 matmuls' incoming gradients; the first is the default.
FP8_GRADIENT_DTYPES = (jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3fn))

# Every jax.lax.linalg primitive with floating operands, and fft: JAX has no float16 or bfloat16
# kernels for most (LAPACK, cuSOLVER and ducc take float32 and float64; lax.fft rejects 16-bit
# inputs), so all run in float32 rather than fail. torch raises on low-precision linear algebra
# on CUDA and XPU; on CPU its float32 list names most of them.
NO_16_BIT_KERNELS = (
  prims.cholesky_p,
  prims.cholesky_update_p,
  prims.eig_p,
  prims.eigh_p,
  prims.geqp3_p,
  prims.geqrf_p,
  prims.hessenberg_p,
  prims.householder_product_p,
  prims.lu_p,
  prims.ormqr_p,
  prims.qr_p,
  prims.schur_p,
  prims.svd_p,
  prims.symmetric_product_p,
  prims.triangular_solve_p,
  prims.tridiagonal_p,
  prims.tridiagonal_solve_p,
  prims.fft_p,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
  """A device type's policy table: its default dtype and its rows.

  Equal to another table that gives every primitive and op the same category (row order and
  the torch op names rows carry aside), so caches keyed by a table hit for equal ones.
  """

  device_type: str
  default_dtype: np.dtype
  rows: tuple[Row, ...]

  @functools.cached_property
  def _content(self) -> tuple:
    return (
      self.device_type,
      self.default_dtype,
      frozenset(self.row_primitive_categories.items()),
      frozenset(self.op_categories.items()),
    )

  def __eq__(self, other: object) -> bool:
    return self is other or isinstance(other, Table) and self._content == other._content

  def __hash__(self) -> int:
    return hash(self._content)

  @functools.cached_property
  def row_primitive_categories(self) -> Mapping[Any, Category]:
    """Primitive, ``Variant`` or ``LazyPrimitive``, as the rows name it -> its category."""
    return _index(self.rows, "primitives")

  @property
  def primitive_categories(self) -> Mapping[Any, Category]:
    """Primitive (or ``Variant``) -> its category; a ``LazyPrimitive``'s once it is imported."""
    return self._loaded("row_primitive_categories")

  @functools.cached_property
  def _lazy_modules(self) -> tuple[str, ...]:
    """The modules the rows' ``LazyPrimitive``s come from."""
    keys = (k for row in self.rows for k in row.primitives if isinstance(k, LazyPrimitive))
    return tuple(sorted({key.module for key in keys}))

  @functools.cached_property
  def _resolved(self) -> dict[tuple[str, frozenset[str]], Mapping]:
    return {}

  def _loaded(self, attribute: str) -> Mapping[Any, Any]:
    """The mapping ``attribute`` names with each ``LazyPrimitive`` key resolved, or left out
    while its module is not imported (asked once per eqn: one lookup per lazy module)."""
    mapping = getattr(self, attribute)
    if not self._lazy_modules:
      return mapping
    loaded = frozenset(m for m in self._lazy_modules if m in sys.modules)
    resolved = self._resolved.get((attribute, loaded))
    if resolved is None:
      resolved = {
        (key.resolve() if isinstance(key, LazyPrimitive) else key): value
        for key, value in mapping.items()
        if not isinstance(key, LazyPrimitive) or key.module in loaded
      }
      self._resolved[attribute, loaded] = resolved
    return resolved

  @functools.cached_property
  def op_categories(self) -> Mapping[str, Category]:
    return _index(self.rows, "ops")

  @functools.cached_property
  def ops_with_variants(self) -> frozenset[str]:
    """Op region names some row lists with a variant (``avg_pool`` for ``avg_pool[3d]``)."""
    return frozenset(name.split("[")[0] for name in self.op_categories if "[" in name)

  @functools.cached_property
  def _primitive_rows(self) -> Mapping[Any, tuple[str, ...]]:
    return {key: row.torch_ops for row in self.rows for key in row.primitives}

  @property
  def primitive_rows(self) -> Mapping[Any, tuple[str, ...]]:
    """Primitive (or ``Variant``) -> the torch ops of its row."""
    return self._loaded("_primitive_rows")

  @functools.cached_property
  def op_rows(self) -> Mapping[str, tuple[str, ...]]:
    """Op region name -> the torch ops of its row."""
    return {name: row.torch_ops for row in self.rows for name in row.ops}


def _index(rows: tuple[Row, ...], field: str) -> dict[Any, Category]:
  index: dict[Any, Category] = {}
  for row in rows:
    for key in getattr(row, field):
      if key in index and index[key] != row.category:
        raise ValueError(f"{str(key)!r} has two categories in one table")
      index[key] = row.category
  return index
