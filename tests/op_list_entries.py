"""Building blocks of the ported torch autocast test lists
(tests/policies/test_torch_autocast_lists.py, tests/policies/test_tpu_autocast_lists.py): tensor
arguments described by torch dtype names, how their values are drawn, the JAX spellings of a few
torch ops, and how outputs are compared."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class In(NamedTuple):
  """A tensor argument of an entry.

  Attributes:
    dtype: torch's dtype name; "low" is the CPU mode's dtype.
    shape: its shape.
    kind: how its values are drawn: "normal"; "positive" (0.1 to 2, torch's ``clamp(0.1, ...)``);
      "unit" (-0.9 to 0.9); "tan" (-1.5 to 1.5); "rand" (0 to 1, ``torch.rand``); "ones";
      "zeros"; "randint2" (0 or 1); or "values" (``values``).
    values: the values of a "values" input.
  """

  dtype: str
  shape: tuple[int, ...]
  kind: str = "normal"
  values: Any = None


def f32(*shape: int, kind: str = "normal") -> In:
  return In("float32", shape, kind)


def f16(*shape: int, kind: str = "normal") -> In:
  return In("float16", shape, kind)


def bf16(*shape: int, kind: str = "normal") -> In:
  return In("bfloat16", shape, kind)


def low(*shape: int, kind: str = "normal") -> In:
  return In("low", shape, kind)


def i64(*shape: int, kind: str = "zeros") -> In:
  return In("int64", shape, kind)


def i32(*shape: int, kind: str = "ones") -> In:
  return In("int32", shape, kind)


def given(dtype: str, values: list) -> In:
  return In(dtype, np.shape(values), "values", values)


JAX_DTYPES = {
  "float32": jnp.float32,
  "float16": jnp.float16,
  "bfloat16": jnp.bfloat16,
  "int64": jnp.int32,
  "int32": jnp.int32,
  "bool": jnp.bool_,
}


FLOATS = ("float32", "float16", "bfloat16")


WIDTH = {"bfloat16": 0, "float16": 1, "float32": 2}


def random_values(spec: In, rng: np.random.Generator) -> np.ndarray:
  draw = {
    "normal": lambda: rng.standard_normal(spec.shape),
    "positive": lambda: rng.uniform(0.1, 2.0, spec.shape),
    "unit": lambda: rng.uniform(-0.9, 0.9, spec.shape),
    "tan": lambda: rng.uniform(-1.5, 1.5, spec.shape),
    "rand": lambda: rng.uniform(0.0, 1.0, spec.shape),
    "ones": lambda: np.ones(spec.shape),
    "zeros": lambda: np.zeros(spec.shape),
    "randint2": lambda: rng.integers(0, 2, spec.shape),
    "values": lambda: np.asarray(spec.values),
  }
  return draw[spec.kind]()


def conv(x, w, b=None):
  """torch's conv{1,2,3}d (N, C, *spatial) with an (O, I, *kernel) weight, stride 1, no padding."""
  spatial = "DHW"[3 - (x.ndim - 2) :]
  y = lax.conv_general_dilated(
    x,
    w,
    (1,) * (x.ndim - 2),
    "VALID",
    dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
  )
  return y if b is None else y + b.reshape((-1,) + (1,) * (x.ndim - 2))


def conv_transpose(x, w):
  """torch's conv_transpose{1,2,3}d (weight (I, O, *kernel)), stride 1, as a convolution."""
  n = x.ndim - 2
  spatial = "DHW"[3 - n :]
  kernel = jnp.swapaxes(jnp.flip(w, tuple(range(2, w.ndim))), 0, 1)
  pads = [(k - 1, k - 1) for k in w.shape[2:]]
  return lax.conv_general_dilated(
    x, kernel, (1,) * n, pads, dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial)
  )


def conv_tbc(x, w, b, pad=0):
  """torch.conv_tbc: (time, batch, channels) input, (kernel, in, out) weight."""
  return (
    lax.conv_general_dilated(x, w, (1,), [(pad, pad)], dimension_numbers=("HNC", "HIO", "HNC")) + b
  )


def unreduced(loss):
  """A loss with ``reduction="none"``: the lists call the ATen ops, whose default it is."""
  return functools.partial(loss, reduction="none")


N = 8


V = f32(N)  # pointwise*_fp32


M = f32(N, N)  # the lists' mat*_fp32


CONV = {1: (f32(N, N, N),) * 2, 2: (f32(N, N, N, N),) * 2, 3: (f32(N, N, N, N, N),) * 2}


Spelling = tuple[Callable[..., Any], tuple[In, ...]]


def flat(out: Any) -> tuple[np.ndarray, ...]:
  return tuple(np.asarray(o) for o in (out if isinstance(out, tuple) else (out,)))


def dtype_names(outputs: tuple[np.ndarray, ...]) -> list[str]:
  return [str(jnp.dtype(o.dtype)) for o in outputs]


PRECISION = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2, "bool": 0.0}


def assert_close(
  actual: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...], rtol: float
) -> None:
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected, strict=True):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape
    finite = e[np.isfinite(e)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)
