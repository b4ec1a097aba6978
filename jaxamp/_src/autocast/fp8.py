"""Float8 matmuls with dynamic per-tensor scaling (``autocast(..., dtype=jnp.float8_e4m3fn)``).

Each operand of a matmul (``dot_general``, ``conv_general_dilated``) is quantized to
``float8_e4m3fn`` with a float32 scale from its current absolute maximum (``scale = amax / 448``,
torchao's "tensorwise" recipe), dequantized and multiplied: ``dot(convert(q_a) * s_a,
convert(q_b) * s_b)``, the pattern XLA's GPU gemm rewriter turns into a cuBLASLt float8 gemm
(a convert from float8 times a broadcast scalar scale, then the dot), so no kernel of our own is
needed; elsewhere (XLA:CPU) XLA evaluates it as written. The product comes out in the policy's
16-bit dtype (bfloat16).

The backward pass (a ``jax.custom_vjp``) quantizes the incoming gradient to ``float8_e5m2``
(or the policy's ``gradient_dtype``) with its own dynamic scale and multiplies it by the
forward's float8 operands, which are the saved residuals (a quarter of float32's memory). A
float32 operand (a parameter) gets a float32 gradient, dequantized and accumulated in float32,
as ``weight_grads`` gives the 16-bit policies.

An all-zero tensor gets scale 1; an infinity or NaN anywhere in a tensor makes its scale, and so
the product, non-finite, so the loss scaler still sees an overflow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import caches, compat

prims = compat.primitives
FLOAT32 = jnp.dtype(jnp.float32)
E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients: 2 mantissa bits, max 57344
# The matmuls quantized (``ragged_dot_general``, a grouped matmul, is not: XLA has no float8
# grouped gemm).
MATMULS = frozenset({prims.dot_general_p, prims.conv_general_dilated_p})


def amax(x) -> jax.Array:
  """The largest absolute value of ``x``, in float32 (NaN if ``x`` holds one)."""
  return jnp.max(jnp.abs(x.astype(FLOAT32)))


def scale_of(x, fp8: np.dtype, dequantized: np.dtype) -> jax.Array:
  """The float32 scale that maps ``x``'s amax to ``fp8``'s largest finite value.

  Rounded to ``dequantized`` (the dtype the product is computed in), so that quantizing and
  dequantizing divide and multiply by the same number. An all-zero (or float32-underflowing)
  tensor gets 1; infinity and NaN propagate.
  """
  scale = amax(x) / float(jnp.finfo(fp8).max)
  scale = scale.astype(dequantized).astype(FLOAT32)
  return jnp.where(scale < jnp.finfo(FLOAT32).tiny, jnp.ones_like(scale), scale)


def quantize(x, fp8: np.dtype, dequantized: np.dtype) -> tuple[jax.Array, jax.Array]:
  """``x`` in ``fp8`` (saturated to its range) and its float32 scale: ``x ~ q * scale``."""
  scale = scale_of(x, fp8, dequantized)
  limit = float(jnp.finfo(fp8).max)
  q = jnp.clip(x.astype(FLOAT32) / scale, -limit, limit).astype(fp8)
  return q, scale


def dequantize(q, scale, dtype: np.dtype) -> jax.Array:
  """``q * scale`` in ``dtype``: the convert-then-multiply XLA matches as a float8 operand."""
  return q.astype(dtype) * scale.astype(dtype)


def bind(
  eqn, values: Sequence[Any], out_dtype: np.dtype, gradient_dtype: np.dtype = E5M2
) -> list[Any]:
  """``eqn`` (a matmul) on ``values`` (float32, float16 or bfloat16) with float8 operands and an
  ``out_dtype`` result, its incoming gradient quantized to ``gradient_dtype``, through a
  ``jax.custom_vjp`` cached per signature."""
  params = dict(eqn.params, preferred_element_type=jnp.dtype(out_dtype))
  dtypes = tuple(jnp.dtype(compat.typeof(v).dtype) for v in values)
  gradient_dtype = jnp.dtype(gradient_dtype)
  key = caches.primitive_key(eqn.primitive, params, (dtypes, gradient_dtype))
  if key is None:
    fun = _matmul(eqn.primitive, params, dtypes, gradient_dtype)
  else:
    fun = _cached_matmul(key)
  if key is not None and compat.linearizing(values):  # linearized once per signature
    fun = compat.staged(("fp8", key), lambda: fun)
  return [compat.bind_like(eqn, fun, values)]


@caches.lru_cache("fp8.matmuls", maxsize=1024)
def _cached_matmul(key: tuple) -> Callable[..., Any]:
  primitive, params, (dtypes, gradient_dtype) = key
  return _matmul(primitive, dict(params), dtypes, gradient_dtype)


class _Typed(NamedTuple):
  """A stand-in for an operand whose cotangent is wanted: only its type is read."""

  aval: Any


def _matmul(
  primitive, params: dict, dtypes: tuple[np.dtype, ...], gradient_dtype: np.dtype
) -> Callable[..., Any]:
  """The float8 matmul ``primitive(a, b, **params)`` of operands of ``dtypes``, and its float8
  backward pass, the incoming gradient quantized to ``gradient_dtype``."""
  compute = params["preferred_element_type"]

  def forward(a, b):
    qa, sa = quantize(a, E4M3, compute)
    qb, sb = quantize(b, E4M3, compute)
    out = primitive.bind(dequantize(qa, sa, compute), dequantize(qb, sb, compute), **params)
    return out, ((qa, sa), (qb, sb))

  @jax.custom_vjp
  def fp8_matmul(a, b):
    return forward(a, b)[0]

  def backward(residuals, g):
    qg, sg = quantize(g, gradient_dtype, g.dtype)
    cotangents = []
    for position, dtype in enumerate(dtypes):
      # A float32 operand's gradient is dequantized and summed in float32.
      q_other, s_other = residuals[1 - position]
      operands = [None, None]
      operands[position] = _Typed(
        compat.aval_with_dtype(compat.typeof(residuals[position][0]), dtype)
      )
      operands[1 - position] = dequantize(q_other, s_other, dtype)
      ct_params = dict(params, preferred_element_type=dtype)
      ct = compat.bilinear_transpose(
        primitive, dequantize(qg, sg, dtype), operands, position, ct_params
      )
      cotangents.append(ct.astype(dtype))
    return tuple(cotangents)

  fp8_matmul.defvjp(forward, backward)
  return fp8_matmul
