"""Masked attention stays finite: constants moved into a 16-bit dtype saturate.

flax, ``jax.nn.dot_product_attention`` and most hand-written attention mask logits with
``finfo(float32).min`` (or a large fraction of it), taken when traced. Moved into float16 or
bfloat16 as it is, that constant is ``-inf``, and a fully masked row (a padding query) goes through
softmax as all ``-inf``: NaN in the outputs and the gradients, and the scaler skips every step.
torch takes ``finfo`` of the run-time dtype, so its masks stay finite; jaxamp saturates such
constants to the 16-bit range instead. A genuine ``-inf`` stays ``-inf``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxamp

POLICIES = [
  ("cuda", jnp.float16),
  ("cuda", jnp.bfloat16),
  ("cpu", jnp.bfloat16),
  ("cpu", jnp.float16),
  ("xpu", jnp.float16),
]
ids = [f"{device}-{jnp.dtype(dtype).name}" for device, dtype in POLICIES]
policies = pytest.mark.parametrize("device_type,dtype", POLICIES, ids=ids)

X = jax.random.normal(jax.random.key(0), (2, 4, 16))
VALID = jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]])  # padding queries: fully masked rows
MASK = nn.make_attention_mask(VALID, VALID)  # (batch, 1, q, k)


def assert_finite(tree):
  for leaf in jax.tree.leaves(tree):
    assert bool(jnp.isfinite(leaf.astype(jnp.float32)).all()), leaf


def value_and_grad_finite(loss, *args):
  value, grads = jax.jit(jax.value_and_grad(loss))(*args)
  assert_finite(value)
  assert_finite(grads)


@pytest.mark.slow  # flax attention under every policy
@policies
def test_linen_attention_with_a_padding_mask_is_finite(device_type, dtype):
  module = nn.MultiHeadDotProductAttention(num_heads=2)
  variables = module.init(jax.random.key(1), X, mask=MASK)
  fun = jaxamp.autocast(module.apply, device_type=device_type, dtype=dtype)
  out = fun(variables, X, mask=MASK)
  assert out.dtype == dtype
  assert_finite(out)
  value_and_grad_finite(lambda v: jnp.sum(fun(v, X, mask=MASK).astype(jnp.float32)), variables)


@pytest.mark.slow
@policies
def test_linen_attention_with_a_padding_mask_matches_float32(device_type, dtype):
  module = nn.MultiHeadDotProductAttention(num_heads=2)
  variables = module.init(jax.random.key(1), X, mask=MASK)
  out = jaxamp.autocast(module.apply, device_type=device_type, dtype=dtype)(variables, X, mask=MASK)
  reference = module.apply(variables, X, mask=MASK)
  np.testing.assert_allclose(out.astype(jnp.float32), reference, rtol=0.1, atol=0.1)


@pytest.mark.slow  # flax attention under every policy
@policies
def test_nnx_attention_with_a_padding_mask_is_finite(device_type, dtype):
  module = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0))
  fun = jaxamp.autocast(lambda m, x: m(x, mask=MASK), device_type=device_type, dtype=dtype)
  out = fun(module, X)
  assert out.dtype == dtype
  assert_finite(out)

  def loss(state):
    return jnp.sum(fun(nnx.merge(graphdef, state), X).astype(jnp.float32))

  graphdef, state = nnx.split(module)
  value_and_grad_finite(loss, state)


@pytest.mark.slow
@policies
def test_jax_nn_dot_product_attention_with_a_mask_is_finite(device_type, dtype):
  q = X.reshape(2, 4, 2, 8)
  mask = MASK.astype(bool)
  attend = lambda q: jax.nn.dot_product_attention(q, q, q, mask=mask)
  fun = jaxamp.autocast(attend, device_type=device_type, dtype=dtype)
  assert_finite(fun(q))
  value_and_grad_finite(lambda q: jnp.sum(fun(q).astype(jnp.float32)), q)


def hand_written_attention(x, w, mask, fill):
  scores = (x @ w) @ jnp.swapaxes(x @ w, -1, -2)
  scores = jnp.where(mask[:, 0], scores, fill)
  return jax.nn.softmax(scores, axis=-1) @ x


@pytest.mark.slow
@policies
@pytest.mark.parametrize("fill", [jnp.finfo(jnp.float32).min, -1e9, -0.7 * 3.4e38])
def test_hand_written_mask_fill_saturates_to_a_finite_value(device_type, dtype, fill):
  w = jax.random.normal(jax.random.key(2), (16, 16)) * 0.3
  fun = jaxamp.autocast(
    lambda x, w: hand_written_attention(x, w, MASK, fill), device_type=device_type, dtype=dtype
  )
  assert_finite(fun(X, w))
  value_and_grad_finite(lambda w: jnp.sum(fun(X, w).astype(jnp.float32)), w)


@policies
@pytest.mark.slow_after_first
def test_masked_logits_saturate_to_the_low_dtypes_range(device_type, dtype):
  fun = jaxamp.autocast(
    lambda x, w: jnp.where(MASK[:, 0], x @ w, jnp.finfo(jnp.float32).min),
    device_type=device_type,
    dtype=dtype,
  )
  x = jnp.ones((2, 4, 4))
  out = jax.jit(fun)(x, jnp.eye(4))
  assert out.dtype == dtype
  assert float(out.min()) == float(jnp.finfo(dtype).min)


@policies
@pytest.mark.slow_after_first
def test_a_genuine_infinity_stays_infinite(device_type, dtype):
  fun = jaxamp.autocast(
    lambda x, w: jnp.where(MASK[:, 0], x @ w, -jnp.inf), device_type=device_type, dtype=dtype
  )
  out = jax.jit(fun)(jnp.ones((2, 4, 4)), jnp.eye(4))
  assert out.dtype == dtype
  assert bool(jnp.isneginf(out).any())


def test_a_large_literal_in_arithmetic_gives_torchs_answer_not_a_saturated_one():
  # torch computes maximum(x16, -1e30) in float32 and rounds: -1e30 is -inf in float16.
  fun = jaxamp.autocast(lambda x, w: jnp.maximum(x @ w, -1e30), device_type="cuda")
  out = jax.jit(fun)(-jnp.ones((2, 4)) * 1e4, jnp.eye(4) * 10)
  assert out.dtype == jnp.float16
  assert bool(jnp.isneginf(out).all())


def test_a_computed_overflow_is_not_hidden():
  # Saturation is for constants: a computed value too large for float16 overflows, as in torch,
  # and the loss scaler sees the inf.
  fun = jaxamp.autocast(lambda x, w: x @ w, device_type="cuda")
  out = fun(jnp.full((1, 4), 1e3), jnp.full((4, 4), 1e3))
  assert bool(jnp.isinf(out).all())


@policies
def test_scores_shifted_by_a_large_constant_as_a_where_branch_stay_finite(device_type, dtype):
  # Keras's Attention picks its shift by the scores' run-time dtype (65504 for float16, else
  # 1e9); traced in float32 it is 1e9, whose float32 result becomes the 16-bit minimum, as a
  # fill does, not -inf: a fully masked row's softmax stays finite, as Keras's own float16 run.
  padding = ~MASK[:, 0].astype(bool)  # padding queries' rows are fully masked

  def attend(x):
    scores = jnp.einsum("bqd,bkd->bqk", x, x)
    return jax.nn.softmax(jnp.where(padding, scores - 1e9, scores))

  fun = jaxamp.autocast(attend, device_type=device_type, dtype=dtype)
  value_and_grad_finite(lambda x: fun(x).astype(jnp.float32).sum(), X)


@pytest.mark.parametrize(
  "fun",
  [
    lambda x: jnp.where(x.sum() > 0, jnp.inf, 1.0),
    lambda x: jnp.where(x > 0, 1.0, 0.0) * x,
    lambda x: jnp.clip(x.sum(), 0.0, 1.0),
  ],
  ids=["scalar-branches", "scalar-fills", "clip"],
)
def test_where_branches_that_are_python_scalars_run_as_in_jax(fun):
  x = jnp.array([1.0, -2.0, 3.0])
  np.testing.assert_array_equal(jaxamp.autocast(fun, device_type="cpu")(x), fun(x))


def test_scores_shifted_by_a_large_constant_and_returned_overflow_as_in_torch():
  # Only a where branch stands for a fill: torch's float16 scores - 1e9 is -inf.
  fun = jaxamp.autocast(lambda x, w: x @ w - 1e9, device_type="cuda")
  assert bool(jnp.isneginf(fun(X[0], X[0].T)).all())


def test_a_where_branch_scaled_by_a_large_constant_overflows_as_in_torch():
  # A product is an activation, not a fill: torch's float16 scores * 1e5 overflows.
  fun = jaxamp.autocast(lambda x, w: jnp.where(x @ w > 0, x @ w, (x @ w) * 1e5), device_type="cuda")
  assert bool(jnp.isinf(fun(X[0], X[0].T)).any())


# --- additive masks: a mask added to the scores is not a bias -------------------------------

PAIR = jnp.array([[1, 1, 0, 0]] * 2 + [[0, 0, 0, 0]] * 2, bool)  # rows 2, 3: fully masked
Q = jax.random.normal(jax.random.key(3), (4, 8))
K = jax.random.normal(jax.random.key(4), (4, 8))
ADDITIVE_MASKS = {
  "finfo-min": jnp.where(PAIR, 0.0, jnp.finfo(jnp.float32).min),
  "minus-1e9": (1.0 - PAIR.astype(jnp.float32)) * -1e9,
}
masks = pytest.mark.parametrize("mask", list(ADDITIVE_MASKS.values()), ids=list(ADDITIVE_MASKS))


def scores_softmax(q, k, mask):
  return jax.nn.softmax(q @ k.T + mask)


@policies
@masks
@pytest.mark.slow
def test_an_additive_mask_passed_as_an_argument_stays_finite(device_type, dtype, mask):
  fun = jaxamp.autocast(scores_softmax, device_type=device_type, dtype=dtype)
  assert_finite(fun(Q, K, mask))
  value_and_grad_finite(lambda q: jnp.sum(fun(q, K, mask)), Q)


@policies
@masks
@pytest.mark.slow
def test_an_additive_mask_closed_over_stays_finite(device_type, dtype, mask):
  fun = jaxamp.autocast(
    lambda q, k: scores_softmax(q, k, mask), device_type=device_type, dtype=dtype
  )
  assert_finite(fun(Q, K))


@policies
def test_an_additive_mask_promotes_the_scores_as_torch_does(device_type, dtype):
  # torch: a 16-bit matmul plus a float32 mask is float32; the mask keeps its value.
  fun = jaxamp.autocast(lambda q, k, m: q @ k.T + m, device_type=device_type, dtype=dtype)
  out = fun(Q, K, ADDITIVE_MASKS["finfo-min"])
  assert out.dtype == jnp.float32
  assert float(out.min()) < -1e38


@policies
@masks
@pytest.mark.slow
def test_jax_nn_attention_with_an_additive_bias_mask_is_finite(device_type, dtype, mask):
  def attention(q, k, mask):
    q, k = q[None, :, None], k[None, :, None]  # (batch, seq, heads, head_dim)
    return jax.nn.dot_product_attention(q, k, k, bias=mask[None, None])

  fun = jaxamp.autocast(attention, device_type=device_type, dtype=dtype)
  assert_finite(fun(Q, K, mask))
  value_and_grad_finite(lambda q: jnp.sum(fun(q, K, mask).astype(jnp.float32)), Q)


@policies
@masks
@pytest.mark.slow
def test_linen_attention_with_an_additive_bias_mask_is_finite(device_type, dtype, mask):
  def attention(q, k, mask):
    q, k = q[None, :, None], k[None, :, None]
    return nn.dot_product_attention(q, k, k, bias=mask[None, None])

  fun = jaxamp.autocast(attention, device_type=device_type, dtype=dtype)
  assert_finite(fun(Q, K, mask))
  value_and_grad_finite(lambda q: jnp.sum(fun(q, K, mask).astype(jnp.float32)), Q)


# --- weakly typed masks: JAX's weak type is for scalars; an array with dims is a tensor -------

WEAK_MASKS = {
  "where-of-two-scalars": jnp.where(PAIR, 0.0, -1e4),
  "scaled-bool-array": -1e9 * (~PAIR),
}
weak_masks = pytest.mark.parametrize("mask", list(WEAK_MASKS.values()), ids=list(WEAK_MASKS))


@policies
@weak_masks
def test_a_weakly_typed_additive_mask_promotes_the_scores_as_torch_does(device_type, dtype, mask):
  # torch: torch.where(pair, 0.0, -1e4) and -1e9 * ~pair are float32 tensors, not scalars.
  assert mask.weak_type
  fun = jaxamp.autocast(lambda q, k, m: q @ k.T + m, device_type=device_type, dtype=dtype)
  assert fun(Q, K, mask).dtype == jnp.float32


@policies
@weak_masks
def test_fully_masked_rows_under_a_weakly_typed_mask_match_float32(device_type, dtype, mask):
  # float32: a row masked everywhere is softmax(scores + c) = softmax(scores). In 16 bits, the
  # scores added to -1e4 lose their differences; added to -1e9, they are -inf and NaN.
  out = jaxamp.autocast(scores_softmax, device_type=device_type, dtype=dtype)(Q, K, mask)
  np.testing.assert_allclose(out.astype(jnp.float32), scores_softmax(Q, K, mask), atol=5e-2)


@policies
@pytest.mark.slow
def test_a_mask_scaled_from_a_bool_array_in_the_function_keeps_padding_rows_finite(
  device_type, dtype
):
  def attention(q, k):
    return jax.nn.softmax(q @ k.T - 1e9 * (~PAIR))

  fun = jaxamp.autocast(attention, device_type=device_type, dtype=dtype)
  np.testing.assert_allclose(fun(Q, K).astype(jnp.float32), attention(Q, K), atol=5e-2)
  value_and_grad_finite(lambda q: jnp.sum(fun(q, K).astype(jnp.float32) ** 2), Q)


def masked_by_selected_fills(q, k, pair):
  """Hugging Face's Flax spelling: the mask selects between two fills made in the function."""
  zeros = jnp.full(pair.shape, 0.0).astype(jnp.float32)
  lowest = jnp.full(pair.shape, jnp.finfo(jnp.float32).min).astype(jnp.float32)
  return scores_softmax(q, k, lax.select(pair, zeros, lowest))


@policies
@pytest.mark.slow_after_first
def test_a_mask_selected_between_fills_stays_finite_run_eagerly_and_jitted(device_type, dtype):
  fun = jaxamp.autocast(masked_by_selected_fills, device_type=device_type, dtype=dtype)
  assert_finite(fun(Q, K, PAIR))  # eager: each primitive bound on concrete values
  assert_finite(jax.jit(fun)(Q, K, PAIR))


@policies
@pytest.mark.slow
def test_a_key_padding_mask_of_one_sequence_stays_finite(device_type, dtype):
  # A (1, k) mask varies along the keys only, as a bias would: cast, it saturates.
  mask = jnp.where(PAIR[:1], 0.0, jnp.finfo(jnp.float32).min)
  fun = jaxamp.autocast(scores_softmax, device_type=device_type, dtype=dtype)
  assert_finite(fun(Q, K, jnp.broadcast_to(mask, (4, 4))))
  assert_finite(fun(Q[:1], K, mask))


@policies
def test_a_bias_too_large_for_16_bits_saturates_instead_of_overflowing(device_type, dtype):
  fun = jaxamp.autocast(lambda x, w, b: x @ w + b, device_type=device_type, dtype=dtype)
  out = fun(Q, jnp.eye(8), jnp.full((8,), -3.4e38))
  assert out.dtype == dtype
  assert_finite(out)
