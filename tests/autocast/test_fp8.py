"""``autocast(f, device_type="cuda", dtype=jnp.float8_e4m3fn)``: float8 matmuls, dynamic scales.

Every matmul of the CUDA lower-precision list runs on float8_e4m3fn operands dequantized by a
float32 per-tensor scale (the pattern XLA's GPU compiler turns into cuBLASLt float8 gemms), its
gradient on a float8_e5m2 cotangent; every other op follows the CUDA lists in bfloat16. On this
machine (no GPU) XLA emulates float8, which is what these tests run.
"""

from __future__ import annotations

import types

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jaxpr_utils import (
  dtypes_of,
  float_dtypes_of,
  matmuls_without_float8_operands,
  traced,
  walk,
)

import jaxamp
from jaxamp._src.autocast import fp8
from jaxamp._src.policies import policy

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FP8 = dict(device_type="cuda", dtype=jnp.float8_e4m3fn)
# e4m3 keeps 3 mantissa bits: a product of two quantized operands is within a few 2**-4 of
# float32's, relative to its largest value.
FORWARD_RTOL = 0.08


def fp8_autocast(fun):
  return jaxamp.autocast(fun, **FP8)


def normal(key: int, shape, scale: float = 1.0) -> jax.Array:
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def relative_error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jax.nn.softmax(h @ params["w2"])


def mlp_loss(params, x):
  return jnp.sum(mlp(params, x) ** 2)


PARAMS = {"w1": normal(0, (32, 64), 0.2), "b1": normal(1, (64,), 0.1), "w2": normal(2, (64, 16))}
X = normal(3, (8, 32))


def converts_to(jaxpr, dtype) -> int:
  return sum(
    ins[0] != dtype and outs == (dtype,) for ins, outs in dtypes_of(jaxpr, "convert_element_type")
  )


# --- the policy -------------------------------------------------------------------------------


def test_matmul_operands_are_dequantized_float8_values():
  jaxpr = traced(fp8_autocast(mlp), PARAMS, X)
  assert len(dtypes_of(jaxpr, "dot_general")) == 2
  assert not matmuls_without_float8_operands(jaxpr)
  assert converts_to(jaxpr, E4M3) == 4  # both operands of both matmuls


def test_matmul_results_are_bfloat16():
  jaxpr = traced(fp8_autocast(mlp), PARAMS, X)
  assert {outs for _, outs in dtypes_of(jaxpr, "dot_general")} == {(BF16,)}


def test_other_ops_follow_the_bfloat16_cuda_lists():
  jaxpr = traced(fp8_autocast(mlp), PARAMS, X)
  assert float_dtypes_of(jaxpr, "tanh") == {BF16}  # unlisted: its input's dtype
  assert float_dtypes_of(jaxpr, "exp") == {F32}  # softmax: the float32 list
  assert dtypes_of(jaxpr, "add") == [((BF16, BF16), (BF16,))]  # the bias add of the matmul


def test_scales_are_float32():
  jaxpr = traced(fp8_autocast(mlp), PARAMS, X)
  assert {outs for _, outs in dtypes_of(jaxpr, "reduce_max")} == {(F32,)}


@pytest.mark.slow
def test_forward_is_close_to_float32():
  out = fp8_autocast(mlp)(PARAMS, X)
  assert out.dtype == F32  # softmax's float32
  assert relative_error(out, mlp(PARAMS, X)) < FORWARD_RTOL


@pytest.mark.slow
def test_a_float32_parameter_is_quantized_from_float32_not_from_bfloat16():
  jaxpr = traced(fp8_autocast(lambda w, x: x @ w), PARAMS["w2"], normal(4, (8, 64)))
  array_casts = [
    eqn
    for _, eqn in walk(jaxpr)
    if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.ndim
  ]
  assert {(e.invars[0].aval.dtype, e.outvars[0].aval.dtype) for e in array_casts} == {
    (F32, E4M3),  # quantized from float32
    (E4M3, BF16),  # dequantized; float32 -> bfloat16 only for the scalar scales
  }


def test_vector_dots_are_not_quantized():
  jaxpr = traced(fp8_autocast(jnp.dot), normal(0, (16,)), normal(1, (16,)))
  assert converts_to(jaxpr, E4M3) == 0
  assert dtypes_of(jaxpr, "dot_general") == [((F32, F32), (F32,))]  # promote, as torch's dot


def test_explicit_precision_is_not_quantized():
  f = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  jaxpr = traced(fp8_autocast(f), normal(0, (8, 8)), normal(1, (8, 8)))
  assert converts_to(jaxpr, E4M3) == 0


@pytest.mark.slow
def test_convolutions_are_quantized():
  f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
  x, w = normal(0, (2, 3, 8, 8)), normal(1, (4, 3, 3, 3), 0.3)
  jaxpr = traced(fp8_autocast(f), x, w)
  assert not matmuls_without_float8_operands(jaxpr)
  assert relative_error(fp8_autocast(f)(x, w), f(x, w)) < FORWARD_RTOL


# --- gradients --------------------------------------------------------------------------------


def test_gradients_quantize_the_cotangent_to_e5m2():
  jaxpr = traced(jax.grad(fp8_autocast(mlp_loss)), PARAMS, X)
  assert converts_to(jaxpr, E5M2) == 2  # the cotangent of each matmul
  assert not matmuls_without_float8_operands(jaxpr)


def test_a_policy_with_e4m3_gradients_quantizes_the_cotangent_to_e4m3():
  policy = jaxamp.policy("cuda", dtype=E4M3, gradient_dtype=jnp.float8_e4m3fn)
  jaxpr = traced(jax.grad(jaxamp.autocast(mlp_loss, policy=policy)), PARAMS, X)
  assert converts_to(jaxpr, E5M2) == 0
  assert converts_to(jaxpr, E4M3) == 4 + 2  # both operands of both matmuls, each cotangent
  assert not matmuls_without_float8_operands(jaxpr)


@pytest.mark.slow
def test_float32_parameters_get_float32_gradients_from_a_float32_dot():
  jaxpr = traced(jax.grad(fp8_autocast(mlp_loss)), PARAMS, X)
  weight_grads = [d for d in dtypes_of(jaxpr, "dot_general") if d[1] == (F32,)]
  assert len(weight_grads) == 3  # dW1, dW2, and dX (x is a float32 input too)
  grads = jax.grad(fp8_autocast(mlp_loss))(PARAMS, X)
  assert {k: v.dtype for k, v in grads.items()} == {k: F32 for k in PARAMS}


@pytest.mark.slow
def test_gradients_are_close_to_float32s():
  grads = jax.grad(fp8_autocast(mlp_loss))(PARAMS, X)
  reference = jax.grad(mlp_loss)(PARAMS, X)
  for name in PARAMS:
    assert relative_error(grads[name], reference[name]) < 0.15, name


# --- scales: zeros, infinities, NaN -----------------------------------------------------------


@pytest.mark.slow
def test_an_all_zero_tensor_has_scale_one():
  assert float(fp8.scale_of(jnp.zeros((4, 4)), E4M3, BF16)) == 1.0
  assert float(fp8.scale_of(jnp.full((4,), 1e-44), E4M3, BF16)) == 1.0  # underflows float32


@pytest.mark.slow
def test_an_all_zero_operand_gives_zeros_and_finite_gradients():
  w = jnp.zeros((32, 64))
  out = fp8_autocast(lambda w, x: x @ w)(w, X)
  assert not np.asarray(out).any()
  gw, gx = jax.grad(lambda w, x: fp8_autocast(lambda w, x: x @ w)(w, x).sum(), (0, 1))(w, X)
  assert np.isfinite(gw).all() and np.isfinite(gx).all()
  assert not np.asarray(gx).any()


def test_the_scale_maps_the_amax_to_e4m3s_largest_value():
  x = jnp.array([[-3.0, 1.0], [0.5, 2.0]])
  q, scale = fp8.quantize(x, E4M3, BF16)
  assert float(scale) == pytest.approx(3.0 / 448, rel=2**-8)
  assert float(jnp.abs(q.astype(F32)).max()) == 448.0


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.slow
def test_a_non_finite_input_makes_the_matmul_non_finite(bad):
  x = X.at[2, 3].set(bad)
  out = fp8_autocast(lambda w, x: x @ w)(PARAMS["w1"], x)
  assert not np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.slow
def test_a_non_finite_cotangent_makes_the_gradients_non_finite():
  def loss(w, x, scale):
    return jnp.sum(fp8_autocast(lambda w, x: x @ w)(w, x).astype(F32) * scale)

  scale = jnp.ones((8, 64)).at[0, 0].set(jnp.inf)
  gw = jax.grad(loss)(PARAMS["w1"], X, scale)
  assert not np.isfinite(gw).all()


@pytest.mark.slow
def test_the_loss_scaler_skips_a_step_whose_fp8_gradients_overflow():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
  opt_state = tx.init(PARAMS)

  def step(params, opt_state, x):
    loss = lambda p: jaxamp.scale_loss(fp8_autocast(mlp_loss)(p, x), opt_state)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state

  params, new_state = step(PARAMS, opt_state, X.at[0, 0].set(jnp.inf))
  assert jaxamp.scaler.get_scale(new_state) < jaxamp.scaler.get_scale(opt_state)
  assert all(np.array_equal(params[k], PARAMS[k]) for k in PARAMS)


def test_an_empty_operand_gives_an_empty_product_and_gradient():
  f = fp8_autocast(lambda x, w: x @ w)
  x, w = jnp.zeros((0, 32)), PARAMS["w1"]
  assert f(x, w).shape == (0, 64)
  gw = jax.grad(lambda w: f(x, w).astype(F32).sum())(w)
  assert gw.shape == w.shape and not np.asarray(gw).any()


@pytest.mark.parametrize(
  "product",
  [lambda x: jnp.dot(x, 2.0), lambda x: jnp.dot(2.0, x)],
  ids=["dot(x, 2.0)", "dot(2.0, x)"],
)
def test_a_product_with_a_scalar_literal_runs(product):
  """The scalar is a typed Python scalar in the jaxpr, not an array."""
  out = fp8_autocast(product)(X)
  np.testing.assert_allclose(np.asarray(out, np.float32), product(X), rtol=FORWARD_RTOL)


def test_a_bfloat16_override_runs_its_place_without_float8():
  """The override's dtype is its matmuls' too, so a second derivative through them works."""

  def loss(w):
    with jax.named_scope("penalty"):
      return jnp.sum((X @ w).astype(F32) ** 2)

  f = jaxamp.autocast(loss, **FP8, overrides={"penalty": jnp.bfloat16})
  converted = float_dtypes_of(jax.make_jaxpr(f)(PARAMS["w1"]), "convert_element_type")
  assert jnp.dtype(jnp.float8_e4m3fn) not in converted
  assert bool(jnp.all(jnp.isfinite(jax.hessian(f)(PARAMS["w1"][:, :2]))))


@pytest.mark.parametrize("tiny", [1e-35, 1e-36])
@pytest.mark.slow
def test_a_tiny_gradient_keeps_its_values(tiny):
  # amax / 57344 below float32's smallest normal: the scale stops there instead of becoming 1.
  f = lambda w, x: x @ w
  w = jnp.ones((32, 4)) / 32
  got = jax.grad(lambda w: tiny * fp8_autocast(f)(w, X).astype(F32).sum())(w)
  want = jax.grad(lambda w: tiny * f(w, X).sum())(w)
  assert relative_error(got, want) < FORWARD_RTOL


# --- float16 operands -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_float16_layer_gets_the_gradients_of_a_small_loss():
  # float16 cannot hold the scale of a small gradient (amax / 57344 below 6e-5): dequantizing
  # in float16 flushed them to zero.
  layer = nn.Dense(4, dtype=jnp.float16)
  variables = layer.init(jax.random.key(1), X)

  def kernel_grad(apply):
    loss = lambda p: 1e-3 * apply({"params": p}, X).astype(F32).sum()
    return jax.grad(loss)(variables["params"])["kernel"]

  want = kernel_grad(layer.apply)
  assert relative_error(kernel_grad(fp8_autocast(layer.apply)), want) < FORWARD_RTOL


@pytest.mark.slow
def test_a_float16_activation_gets_its_small_gradient():
  w = normal(4, (32, 4), 0.1)
  x16 = X.astype(jnp.float16)
  got = jax.grad(lambda x: 1e-4 * fp8_autocast(lambda x: x @ w)(x).astype(F32).sum())(x16)
  want = jax.grad(lambda x: 1e-4 * (x.astype(F32) @ w).sum())(x16)
  assert got.dtype == F16 and relative_error(got, want) < FORWARD_RTOL


def test_a_float16_product_of_small_values_is_not_flushed():
  w = normal(4, (32, 4), 0.1)
  dot = lambda w, x: lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=F16)
  got = fp8_autocast(dot)(w, X * 1e-6)
  assert got.dtype == F16
  assert relative_error(got, dot(w, X * 1e-6)) < FORWARD_RTOL


# --- transformations --------------------------------------------------------------------------


def grid(key: int, shape) -> jax.Array:
  """Multiples of 1/2 with amax 3.5: their scales are powers of two (3.5 = 448 / 2**7 =
  57344 / 2**14) and every value is exact in e4m3 and e5m2, so a matmul of them rounds only its
  bfloat16 result, however XLA compiles it."""
  values = jax.random.randint(jax.random.key(key), shape, -7, 8).astype(F32) / 2
  return values.at[(0,) * len(shape)].set(3.5)


def weighted_sum(fun):
  """``sum(fun(w, x) * c)``: the cotangent entering ``fun`` is ``c``."""
  return lambda w, x, c: jnp.sum(fun(w, x).astype(F32) * c)


@pytest.mark.slow
def test_jit_gives_the_eager_result():
  matmul = fp8_autocast(lambda w, x: x @ w)
  w, x, c = grid(0, (32, 16)), grid(1, (8, 32)), grid(2, (8, 16))
  grad = jax.grad(weighted_sum(matmul), argnums=(0, 1))
  np.testing.assert_array_equal(jax.jit(matmul)(w, x), matmul(w, x))
  for jitted, eager in zip(jax.jit(grad)(w, x, c), grad(w, x, c), strict=True):
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)


@pytest.mark.slow
def test_vmap_scales_each_example_by_its_own_amax():
  f = fp8_autocast(lambda w, x: x @ w)
  xs = normal(5, (3, 32)) * jnp.array([[1.0], [100.0], [0.01]])
  batched = jax.vmap(f, in_axes=(None, 0))(PARAMS["w1"], xs)
  looped = jnp.stack([f(PARAMS["w1"], x) for x in xs])
  np.testing.assert_array_equal(np.asarray(batched, np.float32), np.asarray(looped, np.float32))


@pytest.mark.slow
def test_grad_of_vmap_scales_each_example_as_the_loop_does():
  f = lambda w, x: fp8_autocast(lambda w, x: jnp.tanh(x @ w))(w, x).astype(F32).sum()
  xs = normal(5, (3, 32))
  batched = jax.grad(lambda w: jax.vmap(f, in_axes=(None, 0))(w, xs).sum())(PARAMS["w1"])
  looped = sum(jax.grad(f)(PARAMS["w1"], x) for x in xs)
  # Each column of dW sums one cotangent element per example. XLA may compute a batched
  # cotangent an ulp away from the unbatched one, which can round it to the neighbouring e5m2
  # value (jax 0.10.0 does for a few): those columns differ, every other is equal. Scales taken
  # over the whole batch instead of per example would move most columns.
  differing = ~np.isclose(batched, looped, rtol=1e-5, atol=1e-5).all(axis=0)
  assert differing.sum() <= len(xs) * 2, np.flatnonzero(differing)


@pytest.mark.slow
def test_scan_bodies_run_float8_matmuls():
  def scanned(w, xs):
    return jax.lax.scan(lambda carry, x: (carry, x @ w), None, xs)[1]

  w, xs = grid(0, (16, 16)), grid(1, (3, 4, 16))
  jaxpr = traced(fp8_autocast(scanned), w, xs)
  assert not matmuls_without_float8_operands(jaxpr)
  looped = jnp.stack([fp8_autocast(lambda w, x: x @ w)(w, x) for x in xs])
  np.testing.assert_array_equal(fp8_autocast(scanned)(w, xs), looped)


@pytest.mark.slow
def test_remat_gives_the_same_gradients():
  grad = jax.grad(fp8_autocast(mlp_loss))
  rematted = jax.grad(fp8_autocast(jax.checkpoint(mlp_loss)))(PARAMS, X)
  plain = grad(PARAMS, X)
  for name in PARAMS:
    np.testing.assert_allclose(rematted[name], plain[name], rtol=1e-6, atol=1e-7)


def test_forward_mode_differentiation_raises():
  """The float8 backward is a custom VJP (reverse mode, as torchao's float8 training)."""
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(fp8_autocast(mlp_loss), (PARAMS, X), (PARAMS, X))


def test_a_second_derivative_raises_naming_the_fix():
  grad = jax.grad(fp8_autocast(mlp_loss))
  penalty = lambda p: sum(jnp.sum(g**2) for g in jax.tree.leaves(grad(p, X)))
  with pytest.raises(TypeError, match="differentiable once.*bfloat16"):
    jax.grad(penalty)(PARAMS)
  with pytest.raises(TypeError, match="differentiable once"):
    jax.hessian(lambda w: jnp.sum(fp8_autocast(lambda w: X @ w)(w).astype(F32) ** 2))(
      PARAMS["w1"][:, :2]
    )


@pytest.mark.parametrize(
  "policy",
  [
    None,
    jax.checkpoint_policies.everything_saveable,
    jax.checkpoint_policies.save_anything_except_these_names("none"),
    jax.checkpoint_policies.dots_saveable,
  ],
  ids=["default", "everything_saveable", "save_anything_except", "dots_saveable"],
)
def test_remat_saving_the_float8_residuals_gives_the_same_gradients(policy):
  # jax.checkpoint rounds the residuals it saves with reduce_precision, which overflows
  # float8_e4m3fn's amax element to NaN: the residuals are saved as bytes.
  loss = fp8_autocast(mlp_loss)
  plain = jax.grad(loss)(PARAMS, X)
  rematted = jax.grad(jax.checkpoint(loss, policy=policy))(PARAMS, X)
  for name in PARAMS:
    np.testing.assert_allclose(rematted[name], plain[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_linen_remat_saving_everything_trains():
  block = nn.remat(nn.Dense, policy=jax.checkpoint_policies.everything_saveable)(16)
  variables = block.init(jax.random.key(0), X)
  loss = lambda v: jnp.sum(fp8_autocast(block.apply)(v, X).astype(F32) ** 2)
  grads = jax.grad(loss)(variables)
  want = jax.grad(lambda v: jnp.sum(block.apply(v, X) ** 2))(variables)
  for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    assert np.isfinite(got).all() and relative_error(got, expected) < 0.2


def test_a_custom_jvp_whose_rule_has_matmuls_differentiates():
  # JAX transposes the rule's tangent matmuls, which a float8 matmul (a custom_vjp) cannot be:
  # the rule's matmuls run in bfloat16.
  @jax.custom_jvp
  def layer(w, x):
    return jnp.tanh(x @ w)

  @layer.defjvp
  def layer_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    y = jnp.tanh(x @ w)
    return y, (1 - y**2) * (dx @ w + x @ dw)

  w = PARAMS["w1"]
  got = jax.grad(lambda w: fp8_autocast(layer)(w, X).astype(F32).sum())(w)
  want = jax.grad(lambda w: layer(w, X).sum())(w)
  assert got.dtype == F32 and relative_error(got, want) < FORWARD_RTOL
  forward = traced(fp8_autocast(layer), w, X)  # undifferentiated, the primal: float8 still
  assert dtypes_of(forward, "dot_general") and not matmuls_without_float8_operands(forward)


# --- libraries --------------------------------------------------------------------------------


def assert_float8_and_close(fun, *args):
  jaxpr = traced(jax.grad(lambda *a: jnp.sum(fun(*a).astype(F32) ** 2)), *args)
  assert dtypes_of(jaxpr, "dot_general") or dtypes_of(jaxpr, "conv_general_dilated")
  assert not matmuls_without_float8_operands(jaxpr)
  assert relative_error(fp8_autocast(fun)(*args), fun(*args)) < FORWARD_RTOL


@pytest.mark.slow
def test_flax_linen_dense_and_conv():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(8, (3, 3))(x))
      return nn.Dense(10)(x.reshape(x.shape[0], -1))

  x = normal(0, (2, 8, 8, 3))
  variables = Net().init(jax.random.key(0), x)
  assert_float8_and_close(fp8_autocast(Net().apply), variables, x)


@pytest.mark.slow
def test_flax_nnx_linear():
  model = nnx.Sequential(
    nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.gelu, nnx.Linear(64, 8, rngs=nnx.Rngs(1))
  )
  graphdef, state = nnx.split(model)
  apply = lambda state, x: nnx.merge(graphdef, state)(x)
  assert_float8_and_close(fp8_autocast(apply), state, X)


@pytest.mark.slow
def test_equinox_vmapped_mlp():
  model = eqx.nn.MLP(32, 8, 64, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  apply = lambda params, x: jax.vmap(eqx.combine(params, static))(x)
  assert_float8_and_close(fp8_autocast(apply), params, X)


@pytest.mark.slow
def test_haiku_mlp():
  net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([64, 8])(x)))
  params = net.init(jax.random.key(0), X)
  assert_float8_and_close(fp8_autocast(net.apply), params, X)


# --- reports ----------------------------------------------------------------------------------


def test_explain_names_the_float8_rule():
  rows = jaxamp.explain(mlp, **FP8)(PARAMS, X).to_dicts()
  dots = [row for row in rows if row["primitive"] == "dot_general"]
  assert len(dots) == 2 and all(row["rule"] == fp8_rule() for row in dots)


def fp8_rule() -> str:
  from jaxamp._src.autocast import rules

  return rules.Decider.FP8.value


@pytest.mark.slow
def test_precision_report_compares_float8_matmuls_with_float32():
  report = jaxamp.precision_report(mlp, **FP8)(PARAMS, X)
  assert report.dtype == "float8_e4m3fn"
  dots = [e for e in report.entries if e.primitive == "dot_general"]
  assert len(dots) == 2 and {e.compute_dtype for e in dots} == {"float8_e4m3fn"}
  assert all(2**-10 < e.local_error < FORWARD_RTOL for e in dots)  # float8's error, not zero


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "tpu", "xpu"])
def test_float8_on_another_device_type_raises(device_type):
  with pytest.raises(ValueError, match='"cuda" policy'):
    jaxamp.autocast(mlp, device_type=device_type, dtype=jnp.float8_e4m3fn)


def test_the_default_float8_policy_has_e5m2_gradients():
  policy = jaxamp.policy("cuda", dtype=E4M3)
  assert policy.gradient_dtype == E5M2
  assert policy == jaxamp.policy("cuda", dtype=E4M3, gradient_dtype=jnp.float8_e5m2)
  assert repr(policy) == "jaxamp.policy('cuda', dtype=jnp.float8_e4m3fn)"


def test_a_policy_with_e4m3_gradients_says_so():
  policy = jaxamp.policy("cuda", dtype=E4M3, gradient_dtype=jnp.float8_e4m3fn)
  assert "gradient_dtype=jnp.float8_e4m3fn" in repr(policy)
  assert policy != jaxamp.policy("cuda", dtype=E4M3)


@pytest.mark.parametrize("gradient_dtype", [jnp.bfloat16, jnp.float16, "e5m2", jnp.float32])
def test_a_gradient_dtype_that_is_not_float8_raises(gradient_dtype):
  with pytest.raises(ValueError, match="jnp.float8_e5m2 or jnp.float8_e4m3fn"):
    jaxamp.policy("cuda", dtype=E4M3, gradient_dtype=gradient_dtype)


def test_a_gradient_dtype_without_a_float8_dtype_raises():
  with pytest.raises(ValueError, match="needs dtype=jnp.float8_e4m3fn"):
    jaxamp.policy("cuda", dtype=jnp.bfloat16, gradient_dtype=jnp.float8_e4m3fn)


def test_float8_e5m2_is_not_a_compute_dtype():
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    jaxamp.autocast(mlp, device_type="cuda", dtype=jnp.float8_e5m2)


def fake_gpu(monkeypatch, capability):
  device = types.SimpleNamespace(
    platform="gpu", device_kind="Fake GPU", compute_capability=capability
  )
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "local_devices", lambda: [device])


@pytest.mark.parametrize("capability", ["8.0", "8.6", "7.5", "gfx942"])
def test_float8_on_a_gpu_without_float8_tensor_cores_raises(monkeypatch, capability):
  fake_gpu(monkeypatch, capability)
  with pytest.raises(ValueError, match="compute capability 8.9"):
    jaxamp.autocast(mlp, device_type="cuda", dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize("capability", ["8.9", "9.0", "10.0", "12.0"])
def test_float8_on_ada_hopper_and_blackwell_is_accepted(monkeypatch, capability):
  fake_gpu(monkeypatch, capability)
  amp_policy = policy.make_policy("cuda", jnp.float8_e4m3fn)
  assert (amp_policy.dtype, amp_policy.matmul_dtype) == (BF16, E4M3)


@pytest.mark.slow
def test_float8_gradients_are_exact_where_float8_is():
  """On values exact in e4m3 (operands) and e5m2 (cotangent) the float8 matmul's gradients are
  float32's: the backward pass is the transpose of the forward, nothing else."""
  conv = lambda w, x: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
  cases = [
    (lambda w, x: x @ w, [(32, 16), (8, 32), (8, 16)]),
    (conv, [(4, 3, 3, 3), (2, 3, 8, 8), (2, 4, 8, 8)]),
  ]
  for fun, shapes in cases:
    w, x, c = (grid(i, shape) for i, shape in enumerate(shapes))
    got = jax.grad(weighted_sum(fp8_autocast(fun)), argnums=(0, 1))(w, x, c)
    want = jax.grad(weighted_sum(fun), argnums=(0, 1))(w, x, c)
    for g, r in zip(got, want, strict=True):
      np.testing.assert_array_equal(g, r)


# --- training (XLA:CPU emulates float8) ---------------------------------------------------------

SEEDS, STEPS = 3, 40


@pytest.mark.slow  # 6 short training runs of the benchmark LM
def test_the_benchmark_lm_trains_within_the_bfloat16_runs_seed_to_seed_spread():
  from benchmarks import fp8 as bench

  fp8_losses = bench.final_losses("lm", "float8", SEEDS, STEPS)
  bf16_losses = bench.final_losses("lm", "bfloat16", SEEDS, STEPS)
  assert bench.within_spread(fp8_losses, bf16_losses), (fp8_losses, bf16_losses)


@pytest.mark.slow  # 6 short training runs of the benchmark conv net
def test_the_benchmark_conv_net_trains_within_the_bfloat16_spread_with_e4m3_gradients():
  from benchmarks import fp8 as bench

  fp8_losses = bench.final_losses("conv", "float8 e4m3 grads", SEEDS, STEPS)
  bf16_losses = bench.final_losses("conv", "bfloat16", SEEDS, STEPS)
  assert bench.within_spread(fp8_losses, bf16_losses), (fp8_losses, bf16_losses)


@pytest.mark.slow  # 3 short training runs of the benchmark conv net
def test_the_benchmark_conv_net_trains_under_float8():
  from benchmarks import fp8 as bench

  task = bench.TASKS["conv"](None, seed=0)
  initial = float(task.loss(task.params, task.state, task.batch)[0])
  losses = bench.final_losses("conv", "float8", 1, STEPS)
  assert np.isfinite(losses).all() and losses[0] < initial - 0.2, (initial, losses)
