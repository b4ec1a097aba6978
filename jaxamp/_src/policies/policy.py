"""Autocast policies: a device type's table and the low-precision dtype, chosen and validated.

Each device type has one table (``jaxamp/_src/policies/<device>.py``, rows as in ``table.py``);
this module maps device types to their tables and answers ``is_autocast_available`` and
``get_autocast_dtype``. The interpreter looks categories up in a ``Policy`` and never branches
on device types itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.policies import cpu, cuda, edit, tpu, xpu
from jaxamp._src.policies.table import (
  ELIGIBLE_DTYPES,
  FP8_DTYPES,
  FP8_GRADIENT_DTYPES,
  LOW_DTYPES,
  Category,
  Table,
  Variant,
)


@dataclasses.dataclass(frozen=True)
class Policy:
  """An autocast policy: a device type's table and the lower-precision dtype it casts to.

  ``jaxamp.policy("cuda")`` is the built-in one; ``with_rules`` derives another. Immutable,
  hashable and equal to any policy that casts alike, so it keys the caches of traced and
  rewritten jaxprs. ``print(policy)`` shows its rows, ``policy.diff()`` what it changes of the
  built-in policy.
  """

  table: Table
  dtype: np.dtype
  cache_enabled: bool = True
  # float8_e4m3fn: the matmuls the table lists as lower precision run with float8 operands
  # (``autocast/fp8.py``), everything else as the table says with ``dtype`` (bfloat16).
  matmul_dtype: np.dtype | None = None
  # With a float8 ``matmul_dtype``: the float8 dtype the matmuls' incoming gradients are
  # quantized to (float8_e5m2 unless chosen).
  gradient_dtype: np.dtype | None = None

  @property
  def device_type(self) -> str:
    """The device type whose table this is ("cuda", "cpu", "xpu", "tpu")."""
    return self.table.device_type

  @property
  def requested_dtype(self) -> np.dtype:
    """The ``dtype=`` this policy was made for: ``matmul_dtype`` if set, else ``dtype``."""
    return self.dtype if self.matmul_dtype is None else self.matmul_dtype

  def primitive_category(self, primitive, variant: str | None = None) -> Category:
    """The category of ``primitive`` (used as ``variant``, if its table row lists that)."""
    categories = self.table.primitive_categories
    if variant is not None:
      keyed = categories.get(Variant(primitive, variant))
      if keyed is not None:
        return keyed
    return categories.get(primitive, Category.NATIVE)

  def without_float8(self) -> Policy:
    """This policy with its matmuls in ``dtype`` (bfloat16) instead of float8; itself if none
    are float8."""
    if self.matmul_dtype is None:
      return self
    return dataclasses.replace(self, matmul_dtype=None, gradient_dtype=None)

  def with_rules(self, rules: Mapping) -> Policy:
    """A new policy with the rows ``rules`` names changed; this one is left as it is.

    Keys: torch op names as the tables write them (``"softmax"``, ``"layer_norm"``; a row
    realising several torch ops changes as a whole: ``"log"`` is also ``log10`` and ``log2``),
    op regions (``"log_sigmoid"``), JAX primitives (``jax.lax.exp_p``: only that primitive) or
    library functions autocast recognises (``jax.nn.gelu``, ``flax.linen.LayerNorm``). Values:
    a ``jaxamp.Category``, or a dtype: ``jnp.float32`` is ``FLOAT32`` (inputs cast to float32)
    and this policy's lower-precision dtype is ``LOWER``.

    Example::

      policy = jaxamp.policy("cuda").with_rules(
        {"softmax": jaxamp.Category.LOWER, jax.lax.exp_p: jnp.float16}
      )
      jaxamp.autocast(f, policy=policy)
    """
    return dataclasses.replace(
      self, table=edit.with_rules(self.table, rules, self.dtype, _TABLES.values())
    )

  def diff(self, other: Policy | None = None) -> edit.Diff:
    """What this policy changes of ``other`` (None: the built-in policy of its device type):
    one ``Change`` per primitive or op region whose category differs."""
    if other is not None and not isinstance(other, Policy):
      raise TypeError(f"`diff` compares with another jaxamp.Policy; got {other!r}.")
    return edit.diff(self.table, _TABLES[self.device_type] if other is None else other.table)

  def __str__(self) -> str:
    return edit.text(self.table, self.dtype, f"{self!r}: {len(self.table.rows)} rows")

  def __repr__(self) -> str:
    changed = len(self.diff()) if self.table is not _TABLES.get(self.device_type) else 0
    rules = f".with_rules(<{changed} changes>)" if changed else ""
    gradients = ""
    if self.gradient_dtype is not None and self.gradient_dtype != FP8_GRADIENT_DTYPES[0]:
      gradients = f", gradient_dtype=jnp.{self.gradient_dtype.name}"
    return (
      f"jaxamp.policy({self.device_type!r}, dtype=jnp.{self.requested_dtype.name}{gradients})"
      f"{rules}"
    )

  def op_category(
    self, name: str, default: Category | None, variant: str | None = None
  ) -> Category | None:
    """The category of a named op region (used as ``variant``, if a row lists ``name[variant]``);
    ``default`` for ops the table does not list.

    None means the op is a plain composition here (torch decomposes it into listed ops, like
    ``tensordot`` into ``mm`` on CPU): its primitives follow their own rules.
    """
    category = self.table.op_categories.get(self.op_row(name, variant))
    return category if category is not None else default

  def op_row(self, name: str, variant: str | None = None) -> str:
    """The table key deciding op ``name`` called as ``variant``: ``name[variant]`` where a row
    lists it, else ``name``."""
    if variant is not None and f"{name}[{variant}]" in self.table.op_categories:
      return f"{name}[{variant}]"
    return name


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
  """The device type whose table serves ``device_type`` (a JAX platform name too, and torch's
  indexed spelling ``"cuda:0"``: a policy is per device type), or None."""
  base, colon, index = device_type.partition(":")
  if colon and index.isdigit() and index.isascii():
    device_type = base
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
  """Validates a user's autocast ``dtype``: float16 or bfloat16 (the lower-precision dtypes),
  or float8_e4m3fn (float8 matmuls, on "cuda")."""
  return _canonical(dtype, LOW_DTYPES + FP8_DTYPES, "dtype")


def canonical_cast_dtype(dtype) -> np.dtype:
  """Validates an explicit cast target: float32, float16 or bfloat16."""
  return _canonical(dtype, ELIGIBLE_DTYPES, "cast_inputs")


def make_policy(
  device_type: str | None, dtype, cache_enabled: bool = True, gradient_dtype=None
) -> Policy:
  """The policy for ``device_type`` (None: the default backend's) and ``dtype``; with a
  float8 ``dtype``, ``gradient_dtype`` (None: float8_e5m2) for the matmuls' gradients."""
  table = get_table(default_device_type() if device_type is None else device_type)
  low = table.default_dtype if dtype is None else canonical_dtype(dtype)
  if not isinstance(cache_enabled, bool):
    raise TypeError(f"`cache_enabled` must be a bool; got {cache_enabled!r}.")
  if low in FP8_DTYPES:
    _check_fp8(table)
    gradients = FP8_GRADIENT_DTYPES[0] if gradient_dtype is None else gradient_dtype
    gradients = _canonical(gradients, FP8_GRADIENT_DTYPES, "gradient_dtype")
    return Policy(
      table, jnp.dtype(jnp.bfloat16), cache_enabled, matmul_dtype=low, gradient_dtype=gradients
    )
  if gradient_dtype is not None:
    raise ValueError(
      "`gradient_dtype` chooses the float8 dtype of the gradients of float8 matmuls: it needs "
      f"dtype=jnp.float8_e4m3fn; got dtype=jnp.{low.name}, whose gradients are jnp.{low.name}."
    )
  return Policy(table, low, cache_enabled)


def builtin_policy(device_type: str | None = None, dtype=None, *, gradient_dtype=None) -> Policy:
  """The built-in autocast policy of ``device_type`` (None: the default backend's) and ``dtype``
  (None: the device type's default), as a value to print, compare or derive others from with
  ``Policy.with_rules``.

  With ``dtype=jnp.float8_e4m3fn``, ``gradient_dtype`` is the float8 dtype the matmuls'
  incoming gradients are quantized to: ``jnp.float8_e5m2`` (the default, torchao's
  "tensorwise" recipe: e5m2's range suits gradients) or ``jnp.float8_e4m3fn`` (one more
  mantissa bit, for gradients that are small differences of large terms, such as a conv's
  before a BatchNorm; see docs/fp8.md).

  Example::

    print(jaxamp.policy("cuda"))  # its rows, as in docs/coverage.md
    fp8 = jaxamp.policy("cuda", dtype=jnp.float8_e4m3fn, gradient_dtype=jnp.float8_e4m3fn)
  """
  return make_policy(device_type, dtype, gradient_dtype=gradient_dtype)


# The first CUDA compute capability with float8 tensor cores (Ada; Hopper is 9.0).
FP8_COMPUTE_CAPABILITY = (8, 9)


def _check_fp8(table: Table) -> None:
  """Float8 autocast is a CUDA policy; on a CUDA GPU, one with float8 tensor cores.

  Without a GPU (XLA:CPU emulates float8) it runs, as exporting for a GPU or testing needs.
  """
  if table.device_type != "cuda":
    raise ValueError(
      f'dtype=jnp.float8_e4m3fn is a "cuda" policy (float8 gemms need Ada or Hopper tensor '
      f'cores); got device_type={table.device_type!r}. Pass device_type="cuda" (XLA emulates '
      f"float8 on a machine without a GPU), or dtype=jnp.bfloat16 for {table.device_type!r}."
    )
  if jax.default_backend() != "gpu":
    return
  for device in jax.local_devices():
    capability = getattr(device, "compute_capability", None)
    if _compute_capability(capability) < FP8_COMPUTE_CAPABILITY:
      raise ValueError(
        f"dtype=jnp.float8_e4m3fn needs a CUDA GPU with float8 tensor cores (compute "
        f"capability 8.9 or higher: Ada, Hopper, Blackwell); {device.device_kind} "
        f"({device.platform}, compute capability {capability}) has none. Use "
        "dtype=jnp.bfloat16."
      )


def _compute_capability(capability) -> tuple[int, ...]:
  """A CUDA compute capability, "9.0" -> (9, 0); () for anything else (a ROCm "gfx942")."""
  try:
    return tuple(int(part) for part in str(capability).split("."))
  except ValueError:
    return ()


def is_autocast_available(device_type: str) -> bool:
  """True if jaxamp has an autocast policy for ``device_type`` (like torch's; "gpu" too)."""
  _check_string(device_type)
  return _resolve(device_type) is not None


def get_autocast_dtype(device_type: str) -> np.dtype:
  """The default lower-precision dtype of ``device_type``'s policy.

  Inside an autocast function too (torch answers with the enclosing region's dtype): the
  function is traced before a policy applies, so no call inside it knows one.
  """
  return get_table(device_type).default_dtype
