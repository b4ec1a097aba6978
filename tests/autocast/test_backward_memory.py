"""What autocast keeps for the backward pass.

torch's CPU softmax kernels (float32 arithmetic, 16-bit result) save their 16-bit output for the
backward. jaxamp runs softmax, log_softmax and softmin on a 16-bit input under
``jax.checkpoint``, so the backward recomputes their float32 inside instead of keeping it.
Norms are not recomputed (``interpreter.RECOMPUTED_OPS`` says why).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest

import jaxamp
from jaxamp._src.autocast import weight_grads

X = jax.random.normal(jax.random.key(0), (4, 16, 32))
W = jax.random.normal(jax.random.key(1), (32, 32)) * 0.2
MASK = jnp.tril(jnp.ones((16, 32), bool))
COTANGENT = jax.random.normal(jax.random.key(2), (4, 16, 32))  # a linear loss keeps nothing


def saved_residuals(fun, *primals) -> list[jax.ShapeDtypeStruct]:
  """The distinct values ``jax.vjp(fun, *primals)`` keeps that are not the primals themselves."""

  def residuals(*primals):
    return jax.tree.leaves(jax.vjp(fun, *primals)[1])

  jaxpr = jax.make_jaxpr(residuals)(*primals).jaxpr
  kept = dict.fromkeys(
    v
    for v in jaxpr.outvars
    if hasattr(v, "aval")
    and hasattr(v.aval, "dtype")
    and v not in jaxpr.invars
    and type(v).__name__ != "Literal"
  )
  return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in kept]


def float32_activations(residuals, shape) -> list[jax.ShapeDtypeStruct]:
  return [r for r in residuals if r.dtype == jnp.float32 and r.shape == shape]


def attention_probs(x, w):
  return jax.nn.softmax(jnp.where(MASK, (x @ w) @ w.T, -1e9))


OPS = {
  "softmax": attention_probs,
  "log_softmax": lambda x, w: jax.nn.log_softmax(x @ w),
}


def layer_norm(x, w):
  return nn.LayerNorm().apply({"params": {"scale": jnp.ones(32), "bias": jnp.zeros(32)}}, x @ w)


def loss_of(op, device_type="cpu"):
  fun = jaxamp.autocast(op, device_type=device_type)
  return lambda w: jnp.vdot(fun(X, w).astype(jnp.float32), COTANGENT)


@pytest.mark.parametrize("name", sorted(OPS))
def test_softmax_keeps_no_float32_activation_for_the_backward(name):
  residuals = saved_residuals(loss_of(OPS[name]), W)
  shape = (4, 16, 32)
  assert float32_activations(residuals, shape) == []
  assert any(r.dtype == jnp.bfloat16 and r.shape == shape for r in residuals)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_recomputed_softmax_gives_the_gradients_of_its_float32_inside(name):
  # The same program written out: the op on the 16-bit input computed in float32, cast back.
  def by_hand(w):
    h = X.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    if name == "softmax":
      logits = jnp.where(MASK, h @ w.T.astype(jnp.bfloat16), jnp.bfloat16(-1e9))
      out = jax.nn.softmax(logits.astype(jnp.float32)).astype(jnp.bfloat16)
    else:
      out = jax.nn.log_softmax(h.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.vdot(out.astype(jnp.float32), COTANGENT)

  # by_hand rounds W's gradient to bfloat16 before the float32 convert: compared with autocast's
  # float32 weight gradients (weight_grads) turned off.
  jaxamp.clear_caches()
  with weight_grads.disabled():
    ours = jax.grad(loss_of(OPS[name]))(W)
  jaxamp.clear_caches()
  np.testing.assert_array_equal(ours, jax.grad(by_hand)(W))


@pytest.mark.slow
def test_recomputed_softmax_supports_forward_mode_differentiation():
  loss = loss_of(attention_probs)
  _, tangent = jax.jvp(loss, (W,), (jnp.ones_like(W),))
  np.testing.assert_allclose(tangent, jnp.vdot(jax.grad(loss)(W), jnp.ones_like(W)), rtol=2e-2)


CHECKPOINT = {"checkpoint", "remat", "remat2"}


def checkpoints_in(fun, device_type) -> int:
  jaxpr = jaxpr_utils.traced(jaxamp.autocast(fun, device_type=device_type), X, W)
  return sum(eqn.primitive.name in CHECKPOINT for _, eqn in jaxpr_utils.walk(jaxpr))


def test_softmax_of_a_16_bit_input_runs_under_checkpoint():
  assert checkpoints_in(attention_probs, "cpu") == 1


def test_norms_are_not_recomputed():
  assert checkpoints_in(layer_norm, "cpu") == 0


def test_float32_softmax_is_not_recomputed():
  assert checkpoints_in(attention_probs, "cuda") == 0  # softmax is on CUDA's float32 list


def test_softmax_of_a_float32_input_is_not_recomputed():
  assert checkpoints_in(lambda x, w: jax.nn.softmax(x) @ w, "cpu") == 0


def test_sum_of_a_16_bit_tensor_keeps_nothing_for_the_backward():
  loss = jaxamp.autocast(lambda w: jnp.sum(X @ w), device_type="cpu")
  residuals = saved_residuals(lambda w: loss(w).astype(jnp.float32), W)
  assert all(r.dtype != jnp.float32 or r.size <= 1 for r in residuals)
