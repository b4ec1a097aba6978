"""``jax.nn.dot_product_attention`` computes as torch's SDPA kernels: float32 inside.

torch's ``scaled_dot_product_attention`` is on the lower-precision lists, and its kernels (flash,
CUDA and CPU) multiply the 16-bit inputs with float32 accumulation, take the softmax of the
float32 scores, round the probabilities to 16 bits for the product with ``v`` and round the
output once. Traced on float32, JAX's XLA attention records none of the 16-bit choices its own
16-bit path makes; run as a 16-bit composite, its float16 scores overflowed (NaN) and its softmax
lost precision. flax nnx's attention and Keras's ``MultiHeadAttention`` call it.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from jaxamp._src.autocast import rules

POLICIES = [("cuda", jnp.float16), ("cpu", jnp.bfloat16)]
policies = pytest.mark.parametrize(
  "device_type,dtype", POLICIES, ids=[f"{d}-{jnp.dtype(t).name}" for d, t in POLICIES]
)

B, T, N, H = 2, 64, 2, 16
Q, K, V = (jax.random.normal(key, (B, T, N, H)) for key in jax.random.split(jax.random.key(0), 3))
CAUSAL = jnp.tril(jnp.ones((T, T), bool))[None, None]
MASKS = {
  "none": {},
  "is_causal": {"is_causal": True},
  "bool_mask": {"mask": CAUSAL},
  "additive_bias": {"bias": jnp.where(CAUSAL, 0.0, jnp.finfo(jnp.float32).min)},
  "scale": {"scale": 0.5},
}
masks = pytest.mark.parametrize("spelling", list(MASKS))


def attention(spelling):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **MASKS[spelling])


def kernel_numerics(spelling, dtype):
  """torch's SDPA numerics, spelled out: 16-bit inputs, float32 scores and softmax, the
  probabilities and the output each rounded to ``dtype`` once."""
  kwargs = MASKS[spelling]
  rounded = lambda x: x.astype(dtype).astype(jnp.float32)

  def fun(q, k, v):
    scores = jnp.einsum("btnh,bsnh->bnts", rounded(q), rounded(k)) * kwargs.get("scale", H**-0.5)
    if "bias" in kwargs:
      scores = scores + kwargs["bias"]
    if "mask" in kwargs or "is_causal" in kwargs:
      scores = jnp.where(CAUSAL, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return rounded(jnp.einsum("bnts,bsnh->btnh", rounded(probs), rounded(v)))

  return fun


def mean_relative_error(actual, expected) -> float:
  actual, expected = (np.asarray(x, np.float64) for x in (actual, expected))
  return float(np.abs(actual - expected).mean() / np.abs(expected).mean())


@policies
@masks
def test_attention_output_is_torchs_kernel_numerics(device_type, dtype, spelling):
  out = jax.jit(jaxamp.autocast(attention(spelling), device_type=device_type))(Q, K, V)
  assert out.dtype == dtype
  expected = kernel_numerics(spelling, dtype)(Q, K, V).astype(dtype)
  # Equal but for the order of float32 additions: within one unit in the last place.
  one_ulp = np.spacing(np.abs(np.asarray(expected, np.float32)).astype(dtype)).astype(np.float64)
  error = np.abs(np.asarray(out, np.float64) - np.asarray(expected, np.float64))
  assert (error <= one_ulp).all()


@policies
@masks
def test_attention_gradients_are_nearly_those_of_torchs_kernel_numerics(
  device_type, dtype, spelling
):
  def loss(fun):
    return lambda q, k, v: jnp.sum(fun(q, k, v).astype(jnp.float32) ** 2)

  exact = jax.grad(loss(attention(spelling)), argnums=(0, 1, 2))(Q, K, V)
  reference = jax.grad(loss(kernel_numerics(spelling, dtype)), argnums=(0, 1, 2))(Q, K, V)
  autocast = jaxamp.autocast(attention(spelling), device_type=device_type)
  grads = jax.jit(jax.grad(loss(autocast), argnums=(0, 1, 2)))(Q, K, V)
  for grad, ref, ex in zip(grads, reference, exact, strict=True):
    assert grad.dtype == jnp.float32
    # The backward's products take 16-bit operands (flash's backward does) into float32 results,
    # dP among them: about the reference's float32 backward (a 16-bit dP gave up to 1.07x, a
    # 16-bit softmax 2x).
    assert mean_relative_error(grad, ex) <= 1.1 * mean_relative_error(ref, ex)


def test_attention_scores_past_float16s_range_stay_finite():
  q, k = 300 * Q, 300 * K  # scores of order 1e5: inf in float16, finite in float32 and torch
  fun = jaxamp.autocast(attention("is_causal"), device_type="cuda")
  out = jax.jit(fun)(q, k, V)
  grads = jax.jit(jax.grad(lambda q, k: jnp.sum(fun(q, k, V).astype(jnp.float32)), (0, 1)))(q, k)
  for value in (out, *grads):
    assert bool(jnp.isfinite(value.astype(jnp.float32)).all())


@policies
def test_attention_computes_its_scores_and_softmax_in_float32(device_type, dtype):
  explanation = jaxamp.explain(attention("is_causal"), device_type=device_type)(Q, K, V)
  inside = [d for d in explanation.decisions if d.op == "scaled_dot_product_attention"]
  assert {d.outputs for d in inside if d.primitive == "exp"} == {("float32",)}
  dots = [d for d in inside if d.primitive == "dot_general"]
  low = jnp.dtype(dtype).name
  assert [(d.inputs, d.outputs) for d in dots] == [((low, low), ("float32",))] * 2


BATCHED_DOT = (((2,), (2,)), ((0,), (0,)))


def accumulating_dot(lhs, rhs, operand_dtype, dimension_numbers=BATCHED_DOT):
  """``rules.accumulating_dot_p`` of ``lhs`` and ``rhs`` rounded to ``operand_dtype``."""
  return rules.accumulating_dot_p.bind(
    lhs,
    rhs,
    dimension_numbers=dimension_numbers,
    precision=None,
    preferred_element_type=jnp.dtype(jnp.float32),
    out_sharding=None,
    operand_dtype=jnp.dtype(operand_dtype),
  )


def rounded_dot(lhs, rhs, dtype):
  """The float32 dot of ``lhs`` and ``rhs`` rounded to ``dtype``, spelled out."""
  lhs, rhs = (x.astype(dtype).astype(jnp.float32) for x in (lhs, rhs))
  return jnp.einsum("bik,bjk->bij", lhs, rhs)


def test_the_accumulating_dot_runs_16_bit_operands_into_a_float32_result_on_every_platform():
  """XLA:CPU has no kernel for some bfloat16 x bfloat16 -> float32 dots (this batched one among
  them): lowered for CPU, the operands are widened to float32 first, which is exact."""
  lhs = jnp.ones((2, 2, 4, 8), jnp.bfloat16)
  rhs = jnp.ones((2, 2, 5, 8), jnp.bfloat16)
  dot = lambda lhs, rhs: accumulating_dot(lhs, rhs, jnp.bfloat16, (((3,), (3,)), ((0, 1), (0, 1))))
  out = jax.jit(dot)(lhs, rhs)
  np.testing.assert_array_equal(out, np.full((2, 2, 4, 5), 8.0, np.float32))
  for platform, operand in (("cpu", "f32"), ("cuda", "bf16")):
    text = jax.jit(dot).trace(lhs, rhs).lower(lowering_platforms=(platform,)).as_text()
    assert f"tensor<2x2x4x8x{operand}>, tensor<2x2x5x8x{operand}>) -> tensor<2x2x4x5xf32>" in text


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_the_accumulating_dot_rounds_a_float32_operand_on_every_platform(dtype):
  """The float32 probabilities go in unrounded: the dot rounds them, once, on CPU too (where
  XLA would otherwise drop a float32 -> 16-bit -> float32 round trip)."""
  lhs = jax.random.normal(jax.random.key(1), (3, 4, 8))
  rhs = jax.random.normal(jax.random.key(2), (3, 5, 8)).astype(dtype)
  dot = jax.jit(lambda lhs, rhs: accumulating_dot(lhs, rhs, dtype))
  np.testing.assert_array_equal(dot(lhs, rhs), rounded_dot(lhs, rhs, dtype))
  low = {"float16": "f16", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
  text = dot.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
  assert f"tensor<3x4x8x{low}>, tensor<3x5x8x{low}>) -> tensor<3x4x5xf32>" in text


def test_the_accumulating_dots_cotangent_of_a_float32_operand_is_not_rounded():
  """flash attention's backward keeps dP = dO V^T in float32; so does this dot's transpose for
  its float32 operand (the probabilities), while the residual it keeps is the 16-bit copy."""
  lhs = jax.random.normal(jax.random.key(1), (3, 4, 8))
  rhs = jax.random.normal(jax.random.key(2), (3, 5, 8)).astype(jnp.float16)
  cotangent = jax.random.normal(jax.random.key(3), (3, 4, 5))
  out, vjp = jax.vjp(lambda lhs: accumulating_dot(lhs, rhs, jnp.float16), lhs)
  (grad,) = vjp(cotangent)
  assert grad.dtype == jnp.float32
  rounded_cotangent = cotangent.astype(jnp.float16).astype(jnp.float32)
  expected = jnp.einsum("bij,bjk->bik", rounded_cotangent, rhs.astype(jnp.float32))
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
  assert not np.array_equal(grad, grad.astype(jnp.float16).astype(jnp.float32))
  _, linear = jax.linearize(lambda lhs, rhs: accumulating_dot(lhs, rhs, jnp.float16), lhs, rhs)
  kept = [leaf.dtype for leaf in jax.tree.leaves(linear) if leaf.shape == lhs.shape]
  assert kept == [jnp.float16]


def test_the_accumulating_dots_backward_takes_16_bit_operands_and_batches_as_a_dot():
  lhs = jax.random.normal(jax.random.key(1), (3, 4, 8)).astype(jnp.float16)
  rhs = jax.random.normal(jax.random.key(2), (3, 5, 8)).astype(jnp.float16)
  dot = lambda lhs, rhs: accumulating_dot(lhs, rhs, jnp.float16)
  plain = lambda lhs, rhs: jnp.einsum("bik,bjk->bij", lhs, rhs, preferred_element_type=jnp.float32)
  stacked = [jnp.stack([x, -x]) for x in (lhs, rhs)]
  np.testing.assert_array_equal(jax.vmap(dot)(*stacked), jax.vmap(plain)(*stacked))
  loss = lambda fun: lambda a, b: jnp.sum(fun(a, b) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss(dot), (0, 1)))(lhs, rhs)
  backward = [e for e in jaxpr.eqns if e.primitive is rules.accumulating_dot_p][1:]
  assert len(backward) == 2
  for eqn in backward:
    assert eqn.params["operand_dtype"] == jnp.float16  # the float32 cotangent rounded inside
  grads = jax.grad(loss(dot), (0, 1))(lhs, rhs)
  expected = jax.grad(loss(plain), (0, 1))(lhs, rhs)
  for grad, ref in zip(grads, expected, strict=True):
    assert mean_relative_error(grad, ref) < 2e-3  # the float32 cotangent rounded to float16


def test_attention_keeps_16_bit_probabilities_for_its_backward():
  """The product with ``v`` takes the float32 probabilities and rounds them itself; what the
  backward keeps of them for ``dv`` is the 16-bit copy, as before that change."""
  fun = jaxamp.autocast(attention("is_causal"), device_type="cuda")
  _, vjp = jax.vjp(fun, Q, K, V)
  scores_sized = [leaf.dtype for leaf in jax.tree.leaves(vjp) if leaf.size == B * N * T * T]
  assert scores_sized.count(jnp.float16) == 1


@policies
def test_nnx_attention_scores_and_softmax_are_float32(device_type, dtype):
  """flax nnx's attention calls ``jax.nn.dot_product_attention`` when it has no dropout."""
  layer = nnx.MultiHeadAttention(
    num_heads=N, in_features=N * H, decode=False, rngs=nnx.Rngs(0), deterministic=True
  )
  x = 30 * jax.random.normal(jax.random.key(3), (B, T, N * H))

  @jaxamp.autocast(device_type=device_type)
  def forward(x):
    return layer(x)

  explanation = jaxamp.explain(lambda x: layer(x), device_type=device_type)(x)
  inside = [d for d in explanation.decisions if d.op == "scaled_dot_product_attention"]
  assert {d.outputs for d in inside if d.primitive == "exp"} == {("float32",)}
  out = forward(x)
  assert out.dtype == dtype
  assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
  reference = layer(x)
  assert mean_relative_error(out, reference) < (1e-2 if dtype == jnp.bfloat16 else 2e-3)


def test_keras_multi_head_attention_scores_and_softmax_are_float32():
  """Keras 3's ``MultiHeadAttention`` on JAX calls ``jax.nn.dot_product_attention``."""
  keras = pytest.importorskip("keras")  # the ``thirdparty`` extra
  layer = keras.layers.MultiHeadAttention(num_heads=N, key_dim=H)
  x = jax.random.normal(jax.random.key(4), (B, T, N * H))
  layer(np.asarray(x), np.asarray(x))
  trainable = [v.value for v in layer.trainable_variables]
  fun = lambda t, x: layer.stateless_call(t, [], x, x)[0]
  explanation = jaxamp.explain(fun, device_type="cuda")(trainable, x)
  inside = [d for d in explanation.decisions if d.op == "scaled_dot_product_attention"]
  assert inside
  assert {d.outputs for d in inside if d.primitive == "exp"} == {("float32",)}
  assert math.isfinite(float(jnp.sum(jaxamp.autocast(fun, device_type="cuda")(trainable, x))))
