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

An all-zero (or empty) tensor gets scale 1; an infinity or NaN anywhere in a tensor makes its
scale, and so the product, non-finite, so the loss scaler still sees an overflow. float16 work is
dequantized in float32: float16 cannot hold the scales of small tensors (its smallest normal is
6e-5), so a small gradient would flush to zero.

The residuals are saved as their bytes (``uint8``): ``jax.checkpoint`` rounds the residuals it
saves to their own dtype with ``reduce_precision``, which takes ``float8_e4m3fn`` for an IEEE
format (largest finite 240, not 448) and turns the amax element into NaN. A float8 matmul is
differentiable once, in reverse mode: a second derivative through it raises
(``SECOND_DERIVATIVE``); JAX's forward mode cannot enter a ``custom_vjp``.
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
SECOND_DERIVATIVE = (
  "A float8 matmul (autocast with dtype=float8_e4m3fn) is differentiable once, in reverse mode "
  "(jax.grad, jax.vjp); a second derivative through it (grad of grad, jax.hessian, a gradient "
  "penalty) would differentiate its quantization. Run that part in bfloat16: autocast it with "
  "dtype=jnp.bfloat16, or override its place, e.g. overrides={'penalty': jnp.bfloat16}."
)


@jax.custom_jvp
def _differentiated_once(x):
  """``x``; differentiating it raises: the float8 matmul's own rules are its only derivative."""
  return x


@_differentiated_once.defjvp
def _differentiated_once_jvp(primals, tangents):
  raise TypeError(SECOND_DERIVATIVE)


def amax(x) -> jax.Array:
  """The largest absolute value of ``x``, in float32 (0 if empty, NaN if ``x`` holds one)."""
  return jnp.max(jnp.abs(x.astype(FLOAT32)), initial=0.0)


def dequantized_dtype(dtype: np.dtype) -> np.dtype:
  """The dtype float8 values are dequantized into for work in ``dtype``: itself, but float32
  for float16, whose range cannot hold a small tensor's scale."""
  return FLOAT32 if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def scale_of(x, fp8: np.dtype, dequantized: np.dtype) -> jax.Array:
  """The float32 scale that maps ``x``'s amax to ``fp8``'s largest finite value.

  Rounded to ``dequantized`` (the dtype the product is computed in), so that quantizing and
  dequantizing divide and multiply by the same number; at least float32's smallest normal, so
  a tiny tensor keeps its values. An all-zero tensor gets 1; infinity and NaN propagate.
  """
  largest = amax(x)
  scale = jnp.maximum(largest / float(jnp.finfo(fp8).max), jnp.finfo(FLOAT32).tiny)
  scale = scale.astype(dequantized).astype(FLOAT32)
  return jnp.where(largest == 0, jnp.ones_like(scale), scale)


def quantize(x, fp8: np.dtype, dequantized: np.dtype) -> tuple[jax.Array, jax.Array]:
  """``x`` in ``fp8`` (saturated to its range) and its float32 scale: ``x ~ q * scale``."""
  scale = scale_of(x, fp8, dequantized)
  limit = float(jnp.finfo(fp8).max)
  q = jnp.clip(x.astype(FLOAT32) / scale, -limit, limit).astype(fp8)
  return q, scale


def dequantize(q, scale, dtype: np.dtype) -> jax.Array:
  """``q * scale`` in ``dtype``: the convert-then-multiply XLA matches as a float8 operand."""
  return q.astype(dtype) * scale.astype(dtype)


def _as_bytes(q) -> jax.Array:
  return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _from_bytes(data, fp8: np.dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(data, fp8)


def bind(
  eqn, values: Sequence[Any], out_dtype: np.dtype, gradient_dtype: np.dtype = E5M2
) -> list[Any]:
  """``eqn`` (a matmul) on ``values`` (float32, float16 or bfloat16) with float8 operands and an
  ``out_dtype`` result, its incoming gradient quantized to ``gradient_dtype``, through a
  ``jax.custom_vjp`` cached per signature."""
  # A scalar operand read from the jaxpr (``jnp.dot(x, 2.0)``) is a typed Python scalar.
  values = [
    v if isinstance(v, jax.Array) else jnp.asarray(v, compat.typeof(v).dtype) for v in values
  ]
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
  dequantized = dequantized_dtype(compute)

  def forward(a, b):
    a, b = _differentiated_once(a), _differentiated_once(b)
    qa, sa = quantize(a, E4M3, dequantized)
    qb, sb = quantize(b, E4M3, dequantized)
    out = primitive.bind(dequantize(qa, sa, dequantized), dequantize(qb, sb, dequantized), **params)
    return out, ((_as_bytes(qa), sa), (_as_bytes(qb), sb))

  @jax.custom_vjp
  def fp8_matmul(a, b):
    return forward(a, b)[0]

  def backward(residuals, g):
    g = _differentiated_once(g)
    residuals = [(_from_bytes(data, E4M3), scale) for data, scale in residuals]
    qg, sg = quantize(g, gradient_dtype, dequantized_dtype(g.dtype))
    cotangents = []
    for position, dtype in enumerate(dtypes):
      # A float32 operand's gradient is dequantized and summed in float32.
      work = dequantized_dtype(dtype)
      q_other, s_other = residuals[1 - position]
      operands = [None, None]
      operands[position] = _Typed(
        compat.aval_with_dtype(compat.typeof(residuals[position][0]), work)
      )
      operands[1 - position] = dequantize(q_other, s_other, work)
      ct_params = dict(params, preferred_element_type=work)
      ct = compat.bilinear_transpose(
        primitive, dequantize(qg, sg, work), operands, position, ct_params
      )
      cotangents.append(ct.astype(dtype))
    return tuple(cotangents)

  fp8_matmul.defvjp(forward, backward)
  return fp8_matmul
