"""autocast's semantics: categories, eligibility, explicit dtypes, nesting, caching."""

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp
from jaxamp._src import compat

POLICIES = [("cuda", jnp.float16), ("cpu", jnp.bfloat16)]
KEY = jax.random.key(0)
X = jax.random.normal(KEY, (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
B = jax.random.normal(jax.random.key(2), (8,))


def eqns(fun, *args):
  return jax.make_jaxpr(fun)(*args).jaxpr.eqns


def converts(fun, *args):
  return [e for e in eqns(fun, *args) if e.primitive.name == "convert_element_type"]


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_matmul_runs_in_the_low_dtype(device_type, low):
  out = jax.jit(jaxamp.autocast(lambda x, w: x @ w, device_type=device_type))(X, W)
  assert out.dtype == low
  np.testing.assert_allclose(out.astype(np.float32), X @ W, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_conv_runs_in_the_low_dtype(device_type, low):
  x = jnp.ones((1, 3, 8, 8))
  k = jnp.ones((4, 3, 3, 3))
  conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME")
  assert jaxamp.autocast(conv, device_type=device_type)(x, k).dtype == low


def test_default_dtypes_follow_torch():
  assert jaxamp.get_autocast_dtype("cuda") == jnp.float16
  assert jaxamp.get_autocast_dtype("xpu") == jnp.float16
  assert jaxamp.get_autocast_dtype("cpu") == jnp.bfloat16
  assert jaxamp.autocast(lambda x, w: x @ w, device_type="cuda")(X, W).dtype == jnp.float16


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_both_low_dtypes_are_allowed_on_both_device_types(device_type, dtype):
  out = jaxamp.autocast(lambda x, w: x @ w, device_type=device_type, dtype=dtype)(X, W)
  assert out.dtype == dtype


def test_device_type_none_picks_the_default_backend():
  assert jaxamp.autocast(lambda x, w: x @ w)(X, W).dtype == jnp.bfloat16  # CPU backend here


def test_is_autocast_available_names_the_policies():
  assert jaxamp.is_autocast_available("cuda")
  assert jaxamp.is_autocast_available("cpu")
  assert jaxamp.is_autocast_available("xpu")
  assert jaxamp.is_autocast_available("tpu")
  assert not jaxamp.is_autocast_available("mps")


@pytest.mark.parametrize(
  "op",
  [
    jnp.exp,
    jnp.log1p,
    jnp.sum,
    jnp.cumsum,
    lambda x: x**2,
    lambda x: 1.0 / x,
    lax.rsqrt,
    jax.nn.softmax,
    jax.nn.log_softmax,
  ],
)
@pytest.mark.slow_after_first
def test_cuda_float32_list_runs_in_float32(op):
  fun = jaxamp.autocast(lambda x, w: op(jnp.abs(x @ w) + 1.0), device_type="cuda")
  assert fun(X, W).dtype == jnp.float32


@pytest.mark.parametrize(
  "op", [jnp.exp, jnp.sum, jax.nn.softmax, jax.nn.log_softmax, lambda x: x**2]
)
def test_cpu_unlisted_ops_stay_in_bfloat16(op):
  fun = jaxamp.autocast(lambda x, w: op(x @ w), device_type="cpu")
  assert fun(X, W).dtype == jnp.bfloat16


@pytest.mark.parametrize("op", [jnp.expm1, jnp.prod, jnp.cosh, jnp.tan])
def test_xpu_runs_ops_missing_from_its_float32_list_in_the_input_dtype(op):
  fun = jaxamp.autocast(lambda x, w: op(x @ w), device_type="xpu")
  assert fun(X, W).dtype == jnp.float16
  assert jaxamp.autocast(lambda x, w: op(x @ w), device_type="cuda")(X, W).dtype == jnp.float32


@pytest.mark.slow
def test_cpu_float32_list_runs_in_float32():
  fun = jaxamp.autocast(lambda x, w: jnp.prod(x @ w, axis=0), device_type="cpu")
  assert fun(X, W).dtype == jnp.float32
  spd = jnp.eye(8) * 3.0
  chol = jaxamp.autocast(lambda a: jnp.linalg.cholesky(a.astype(jnp.bfloat16)), device_type="cpu")
  assert chol(spd).dtype == jnp.float32


def test_gelu_is_an_unlisted_op_not_a_pow():
  fun = jaxamp.autocast(lambda x, w: jax.nn.gelu(x @ w), device_type="cuda")
  assert fun(X, W).dtype == jnp.float16


def test_float64_integers_and_bools_pass_through():
  with jax.enable_x64(True):
    x64 = jnp.ones((4, 8), jnp.float64)
    out = jaxamp.autocast(lambda a, b: a @ b, device_type="cuda")(x64, x64.T)
    assert out.dtype == jnp.float64
  ints = jnp.ones((4, 8), jnp.int32)
  out = jaxamp.autocast(lambda a: (a @ a.T, a > 0), device_type="cuda")(ints)
  assert out[0].dtype == jnp.int32 and out[1].dtype == jnp.bool_


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_matmul_with_a_complex_operand_runs_as_written(dtype):
  # like float64: not eligible, and its float32 partner is not rounded for a complex64 product
  spectrum = jnp.fft.rfft(X, axis=0)
  fun = jaxamp.autocast(lambda s, w: s @ w, device_type="cuda", dtype=dtype)
  out = fun(spectrum, W)
  assert out.dtype == jnp.complex64
  np.testing.assert_array_equal(out, spectrum @ W)


@pytest.mark.slow
def test_prng_keys_pass_through():
  def fun(key, x, w):
    return jax.random.normal(key, (4, 8)) + x @ w, jax.random.split(key)

  out, keys = jaxamp.autocast(fun, device_type="cuda")(KEY, X, W)
  assert out.dtype == jnp.float32  # normal() is float32: f16 + f32 promotes, as in torch
  assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)


def test_python_scalars_follow_the_other_operand():
  fun = jaxamp.autocast(lambda x, w: (x @ w) * 0.5 + 2.0, device_type="cpu")
  assert fun(X, W).dtype == jnp.bfloat16


def test_mixed_dtypes_promote_natively_to_the_widest():
  fun = jaxamp.autocast(lambda x, w, y: (x @ w) * y, device_type="cpu")
  assert fun(X, W, X).dtype == jnp.float32


def test_bias_add_after_a_dot_stays_in_the_low_dtype():
  fun = jaxamp.autocast(lambda x, w, b: x @ w + b, device_type="cuda")
  assert fun(X, W, B).dtype == jnp.float16


def test_bias_add_of_a_batch_of_one_stays_in_the_low_dtype():
  dense = lambda x, w, b: x @ w + jnp.reshape(b, (1, -1))  # flax Dense: no broadcast at batch 1
  assert jaxamp.autocast(dense, device_type="cuda")(X[:1], W, B).dtype == jnp.float16


def test_residual_add_of_a_computed_value_after_a_dot_promotes():
  fun = jaxamp.autocast(lambda x, w, h: jnp.tanh(h) + x @ w, device_type="cuda")  # h + linear(x)
  assert fun(X, W, X).dtype == jnp.float32


def test_residual_add_of_the_dots_own_input_promotes():
  fun = jaxamp.autocast(lambda x, w: x + x @ w, device_type="cuda")
  assert fun(X, W).dtype == jnp.float32


def test_full_shape_parameter_added_to_a_dot_promotes():
  # A bias varies along the output features only; an addend with batch extent (an attention
  # mask, torch's `c + mm(x, w)`) is not one and promotes.
  fun = jaxamp.autocast(lambda x, w, c: c + x @ w, device_type="cuda")
  assert fun(X, W, X).dtype == jnp.float32


def test_feature_vector_added_to_a_dot_stays_in_the_low_dtype():
  fun = jaxamp.autocast(lambda x, w, c: c + x @ w, device_type="cuda")  # torch.addmm(c, x, w)
  assert fun(X, W, X[0]).dtype == jnp.float16


def test_cpu_cat_promotes_to_the_widest():
  fun = jaxamp.autocast(lambda x, w: jnp.concatenate([x @ w, x]), device_type="cpu")
  assert fun(X, W).dtype == jnp.float32
  fun = jaxamp.autocast(lambda x, w: jnp.concatenate([x @ w, x @ w]), device_type="cpu")
  assert fun(X, W).dtype == jnp.bfloat16


def test_cuda_promote_widens_to_a_0dim_float32_tensor_but_not_to_a_python_scalar():
  # torch's prioritize reads every floating tensor argument, 0-dim ones too.
  fun = jaxamp.autocast(lambda x, w, s: jnp.arctan2(x @ w, s), device_type="cuda")
  assert fun(X, W, jnp.float32(0.5)).dtype == jnp.float32
  fun = jaxamp.autocast(lambda x, w: jnp.arctan2(x @ w, 0.5), device_type="cuda")
  assert fun(X, W).dtype == jnp.float16


def test_cuda_index_put_of_a_computed_0dim_value_promotes():
  fun = jaxamp.autocast(lambda x, w: (x @ w).at[0, 1].set(jnp.sum(x)), device_type="cuda")
  assert fun(X, W).dtype == jnp.float32  # torch.index_put: promote, the 0-dim sum is float32


def test_explicit_astype_is_respected():
  def fun(x, w):
    return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)

  assert jaxamp.autocast(fun, device_type="cpu")(X, W).dtype == jnp.float32
  exp_bf16 = jaxamp.autocast(lambda x: jnp.exp(x.astype(jnp.bfloat16)), device_type="cpu")
  assert exp_bf16(X).dtype == jnp.bfloat16


def test_explicit_preferred_element_type_is_respected():
  def fun(x, w):
    return lax.dot(
      x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
    )

  assert jaxamp.autocast(fun, device_type="cpu")(X, W).dtype == jnp.float32


def test_outputs_leave_in_the_dtype_the_region_produced():
  out = jaxamp.autocast(lambda x, w: {"h": x @ w, "x": x}, device_type="cuda")(X, W)
  assert out["h"].dtype == jnp.float16 and out["x"].dtype == jnp.float32


@pytest.mark.slow
def test_gradients_of_float32_params_are_float32_and_close():
  def loss(w, x):
    return jnp.mean(jax.nn.log_softmax(jnp.tanh(x @ w) @ w) ** 2)

  for device_type, _ in POLICIES:
    g = jax.jit(jax.grad(jaxamp.autocast(loss, device_type=device_type)))(W, X)
    ref = jax.grad(loss)(W, X)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, ref, rtol=0.1, atol=2e-2)


def test_autocast_disabled_block_runs_as_written():
  def fun(x, w):
    with jaxamp.autocast_disabled():
      inner = x @ w
    return inner, x @ w

  inner, outer = jaxamp.autocast(fun, device_type="cuda")(X, W)
  assert inner.dtype == jnp.float32 and outer.dtype == jnp.float16


def test_autocast_disabled_block_gets_traced_dtypes_back():
  def fun(x, w):
    h = x @ w
    with jaxamp.autocast_disabled():
      return h @ w  # h was float32 when traced: the block sees float32

  out = jaxamp.autocast(fun, device_type="cuda")(X, W)
  assert out.dtype == jnp.float32


def test_enabled_false_inside_autocast_runs_as_written():
  inner = jaxamp.autocast(lambda x, w: x @ w, enabled=False)
  out = jaxamp.autocast(lambda x, w: (inner(x, w), x @ w), device_type="cuda")(X, W)
  assert out[0].dtype == jnp.float32 and out[1].dtype == jnp.float16


def test_inner_autocast_uses_its_own_dtype_and_outer_resumes():
  inner = jaxamp.autocast(lambda x, w: x @ w, device_type="cpu", dtype=jnp.bfloat16)
  fun = jaxamp.autocast(lambda x, w: (x @ w, inner(x, w), x @ w), device_type="cuda")
  assert [o.dtype for o in fun(X, W)] == [jnp.float16, jnp.bfloat16, jnp.float16]


def test_each_value_is_cast_once_per_trace():
  fun = jaxamp.autocast(lambda x, w: (x @ w) @ w + x @ (w @ w), device_type="cuda")
  sources = [e.invars[0] for e in converts(fun, X, W) if e.params["new_dtype"] == jnp.float16]
  assert len(sources) == len(set(map(id, sources)))


def cancelling_converts(fun, *args) -> list:
  """``convert(convert(v: A -> B) -> A)`` pairs in ``fun``'s jaxpr."""
  made_by, pairs = {}, []
  for eqn in converts(fun, *args):
    made_by[eqn.outvars[0]] = eqn
    source = made_by.get(eqn.invars[0])
    if source is not None and source.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
      pairs.append((source, eqn))
  return pairs


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_no_convert_chain_cancels_when_a_value_is_used_in_two_dtypes(device_type, low):
  # x, w and h are each needed low (dots) and float32 (exp, log, the float32 sum): every float32
  # use reads the original, never a float32 convert of the low copy. (A float32-inside op's
  # result rounded to the input dtype and upcast again by a float32 op is not such a chain:
  # torch rounds there too.)
  def fun(x, w):
    h = x @ w
    return jnp.exp(x) + jnp.log(jnp.abs(w[:4, :4])).sum() + jnp.exp(h) + (h @ w) + (x @ w) @ w

  assert cancelling_converts(jaxamp.autocast(fun, device_type=device_type), X, W) == []


def attention_probs(x, w):
  return jax.nn.softmax(x @ w)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_inserted_casts_point_at_the_source_line_of_the_op_that_needed_them(device_type, low):
  # Profiles and residual listings name the user's line, not the interpreter's.
  jaxpr = jax.make_jaxpr(jaxamp.autocast(attention_probs, device_type=device_type))(X, W).jaxpr
  casts = [
    eqn for _, eqn in jaxpr_utils.walk(jaxpr) if eqn.primitive.name == "convert_element_type"
  ]
  assert casts
  for eqn in casts:
    files = {file for file, _, _ in compat.traceback_frames(eqn)}
    assert __file__ in files and not any(f.endswith("interpreter.py") for f in files)


def test_op_names_in_the_compiled_program_say_autocast():
  # What a profiler shows: jit(loss)/jaxamp.autocast/dot_general.
  lowered = jax.jit(jaxamp.autocast(attention_probs, device_type="cpu")).lower(X, W)
  text = lowered.as_text(debug_info=True)
  assert "jaxamp.autocast/" in text and "jaxamp.kept" not in text


def test_cache_disabled_casts_at_every_use():
  fun = jaxamp.autocast(lambda x, w: (x @ w, x @ w), device_type="cuda", cache_enabled=False)
  assert len(converts(fun, X, W)) == 4


def test_loop_invariant_casts_are_hoisted_out_of_scan():
  def fun(x, w):
    return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0]

  jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, device_type="cuda"))(X, W).jaxpr
  scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
  body_converts = [
    e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name == "convert_element_type"
  ]
  body_sources = {e.invars[0] for e in body_converts}
  consts = scan.params["jaxpr"].jaxpr.invars[: scan.params["num_consts"]]
  assert not body_sources & set(consts)  # w is cast before the loop, not in every iteration


def test_traced_jaxprs_are_cached_per_signature():
  calls = []

  def fun(x, w):
    calls.append(1)
    return x @ w

  auto = jaxamp.autocast(fun, device_type="cuda")
  auto(X, W)
  auto(X + 1, W)
  assert len(calls) == 1
  auto(X[:2], W)
  assert len(calls) == 2


def test_static_python_arguments_key_the_cache():
  def fun(x, w, train):
    return x @ w if train else x

  auto = jaxamp.autocast(fun, device_type="cuda")
  assert auto(X, W, True).dtype == jnp.float16
  assert auto(X, W, False).dtype == jnp.float32


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_composes_with_vmap_jvp_and_checkpoint(device_type, low):
  auto = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), device_type=device_type)
  assert jax.vmap(auto, (0, None))(jnp.stack([X, X]), W).dtype == low
  primal, tangent = jax.jvp(auto, (X, W), (X, W))
  assert primal.dtype == low and tangent.dtype == low
  g = jax.grad(lambda w: jax.checkpoint(auto)(X, w).astype(jnp.float32).sum())(W)
  assert g.dtype == jnp.float32


def test_autocast_inside_jit_and_jit_inside_autocast_agree():
  f = lambda x, w: jnp.tanh(jax.jit(lambda a: a @ w)(x))
  a = jax.jit(jaxamp.autocast(f, device_type="cuda"))(X, W)
  b = jaxamp.autocast(jax.jit(f), device_type="cuda")(X, W)
  assert a.dtype == b.dtype == jnp.float16
  np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_custom_jvp_rule_survives():
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda primals, t: (f(primals[0]), 7.0 * t[0]))
  auto = jaxamp.autocast(lambda x, w: f(x @ w).astype(jnp.float32).sum(), device_type="cuda")
  g = jax.grad(auto, argnums=1)(X, W)
  np.testing.assert_allclose(g, X.T @ jnp.full((4, 8), 7.0), rtol=1e-2)


def test_custom_vjp_rule_survives_and_cotangents_keep_primal_dtypes():
  @jax.custom_vjp
  def f(x, w):
    return jnp.tanh(x @ w)

  f.defvjp(
    lambda x, w: (f(x, w), (x, w)),
    lambda res, g: (jnp.full_like(res[0], 3.0), jnp.full_like(res[1], 5.0)),
  )
  auto = jaxamp.autocast(lambda x, w: f(x, w).astype(jnp.float32).sum(), device_type="cuda")
  gx, gw = jax.jit(jax.grad(auto, argnums=(0, 1)))(X, W)
  assert gx.dtype == gw.dtype == jnp.float32
  np.testing.assert_array_equal(gw, jnp.full_like(W, 5.0))


def test_custom_fwd_casts_inputs_and_disables_autocast_inside():
  @jaxamp.custom_fwd(cast_inputs=jnp.float32)
  def exact(x, w):
    return x @ w

  fun = jaxamp.autocast(lambda x, w: exact((x @ w), w), device_type="cuda")
  assert fun(X, W).dtype == jnp.float32
  assert exact(X.astype(jnp.float16), W.astype(jnp.float16)).dtype == jnp.float16  # no autocast


@pytest.mark.parametrize("decorate,low_dots", [(jaxamp.custom_bwd, 3), (lambda f: f, 1)])
def test_custom_bwd_runs_the_backward_under_the_forward_policy(decorate, low_dots):
  @jax.custom_vjp
  def f(x, w):
    return x @ w

  @decorate
  def bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g

  f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
  auto = jaxamp.autocast(lambda x, w: f(x, w).astype(jnp.float32).sum(), device_type="cuda")
  jaxpr = jax.make_jaxpr(jax.grad(auto, argnums=1))(X, W)
  dots = jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert sum(ins[0] == jnp.float16 for ins, _ in dots) == low_dots


def test_registered_op_uses_its_category():
  @jaxamp.register_op("my_loss", category="float32")
  def my_loss(prediction, target):
    return jnp.mean((prediction - target) ** 2)

  fun = jaxamp.autocast(lambda x, w: my_loss(x @ w, x), device_type="cpu")
  assert fun(X, W).dtype == jnp.float32


def test_a_registered_float32_op_returning_its_input_returns_it_in_float32():
  passed_on = jaxamp.register_op("test_semantics.passed_on", category="float32")(lambda a: a)
  fun = jaxamp.autocast(lambda x, w: passed_on(x @ w), device_type="cuda")
  assert fun(X, W).dtype == jnp.float32


def test_a_registered_lower_op_returning_its_input_returns_it_in_16_bits():
  passed_on = jaxamp.register_op("test_semantics.passed_on_low", category="lower")(lambda a: a)
  assert jaxamp.autocast(passed_on, device_type="cuda")(X).dtype == jnp.float16


def test_an_input_a_registered_op_returns_beside_a_result_takes_the_ops_dtype_too():
  both = jaxamp.register_op("test_semantics.both", category="float32")(lambda a, b: (a, a * b))
  fun = jaxamp.autocast(lambda x, w: both(x @ w, x @ w), device_type="cuda")
  assert [out.dtype for out in fun(X, W)] == [jnp.float32, jnp.float32]


def test_a_forbidden_registered_op_returning_its_input_raises():
  passed_on = jaxamp.register_op("test_semantics.passed_on_fb", category="forbidden")(lambda a: a)
  with pytest.raises(RuntimeError, match="FORBIDDEN"):
    jaxamp.autocast(lambda x, w: passed_on(x @ w), device_type="cuda")(X, W)


def test_a_registered_op_returning_its_input_is_the_identity_outside_autocast():
  passed_on = jaxamp.register_op("test_semantics.identity", category="float32")(lambda a: a)
  fun = jax.jit(jax.vmap(jax.grad(lambda x: (passed_on(x) ** 2).sum())))
  np.testing.assert_array_equal(fun(X[None]), 2 * X[None])
  assert "jaxamp" not in jax.jit(passed_on).lower(X).as_text()


@pytest.mark.slow
def test_optax_losses_are_recognised_as_float32_ops_on_cpu():
  labels = jnp.array([0, 1, 2, 3])
  loss = lambda x, w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
  assert jaxamp.autocast(loss, device_type="cpu")(X, W).dtype == jnp.float32


def test_binary_cross_entropy_raises_under_cuda():
  bce = lambda x, w: jaxamp.functional.binary_cross_entropy(jax.nn.sigmoid(x @ w), jnp.ones((4, 8)))
  with pytest.raises(RuntimeError, match="with_logits"):
    jaxamp.autocast(bce, device_type="cuda")(X, W)
  assert jaxamp.autocast(bce, device_type="cpu")(X, W).dtype == jnp.float32


def test_rewritten_programs_typecheck():
  def fun(x, w):
    c = lax.scan(lambda c, _: (jnp.tanh(c @ w), jnp.exp(c).sum()), x, None, length=2)
    y = lax.cond(c[0].sum() > 0, jnp.exp, jnp.sin, c[0])
    return jax.checkpoint(lambda a: jax.nn.softmax(a @ w))(y)

  for device_type, _ in POLICIES:
    jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, device_type=device_type))(X, W)
    jax.extend.core.check_jaxpr(jaxpr.jaxpr)


def test_fills_like_zeros_like_follow_the_other_operand():
  fun = lambda x, w: jnp.where(x @ w > 0, x @ w, jnp.zeros_like(x @ w))
  assert jaxamp.autocast(fun, device_type="cuda")(X, W).dtype == jnp.float16


@pytest.mark.parametrize("device_type,low", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_a_fill_made_like_a_16_bit_value_is_16_bit_as_torchs_zeros_like(device_type, low):
  """``torch.zeros_like(h)`` has ``h``'s run-time dtype; JAX's has the one ``h`` was traced in."""
  shifted = lambda x, w: jnp.concatenate([jnp.zeros_like((x @ w)[:1]), (x @ w)[:-1]])
  plus_one = lambda x, w: x @ w + jnp.ones_like(x @ w)
  scaled = lambda x, w: (x @ w) * jnp.full_like(x @ w, 2.0).T.T
  for fun in (shifted, plus_one, scaled):
    out = jax.jit(jaxamp.autocast(fun, device_type=device_type))(X, W)
    assert out.dtype == low
    np.testing.assert_allclose(out.astype(jnp.float32), fun(X, W), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_an_accumulator_made_with_zeros_sums_in_float32_as_a_loop_carry_does(device_type):
  # torch.zeros(shape) + a 16-bit product is float32; a fori_loop's carry keeps its dtype too.
  ws = jnp.full((30, 8, 8), 0.12625)

  def unrolled(x, ws):
    total = jnp.zeros((4, 8))
    for i in range(30):
      total = total + x @ ws[i]
    return total

  def looped(x, ws):
    return lax.fori_loop(0, 30, lambda i, total: total + x @ ws[i], jnp.zeros((4, 8)))

  got = jaxamp.autocast(unrolled, device_type=device_type)(X, ws)
  assert got.dtype == jnp.float32
  # XLA may round the 16-bit products differently inside a loop: equal up to those roundings.
  looped = jaxamp.autocast(looped, device_type=device_type)(X, ws)
  np.testing.assert_allclose(got, looped, rtol=2**-7)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_segment_sum_of_16_bit_messages_accumulates_in_float32(device_type):
  # jax.ops.segment_sum scatter-adds into zeros of the traced dtype (torch's scatter_add into
  # a float32 tensor promotes): bfloat16 accumulation stalled at 8192.
  ids = jnp.arange(2400) % 3
  x, w = jnp.ones((2400, 8)), jnp.eye(8) * 30.0
  agg = lambda x, w: jax.ops.segment_sum(x @ w, ids, num_segments=3)
  got = jaxamp.autocast(agg, device_type=device_type)(x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, agg(x, w))


def test_a_fill_passed_into_a_jit_keeps_its_role_inside():
  accumulate = jax.jit(lambda total, h: total + h)
  masked = jax.jit(lambda h, fill: jnp.where(h > 0, h, fill))
  summed = lambda x, w: accumulate(jnp.zeros((4, 8)), x @ w)
  kept = lambda x, w: masked(x @ w, jnp.zeros((4, 8)))
  assert jaxamp.autocast(summed, device_type="cuda")(X, W).dtype == jnp.float32
  assert jaxamp.autocast(kept, device_type="cuda")(X, W).dtype == jnp.float16


def test_a_buffer_made_inside_keeps_its_dtype_when_a_16_bit_value_is_written_into_it():
  cache = lambda x, w: lax.dynamic_update_slice(jnp.zeros((6, 8)), x @ w, (1, 0))
  assert jaxamp.autocast(cache, device_type="cpu")(X, W).dtype == jnp.float32


def test_a_constant_written_into_a_16_bit_value_keeps_it_16_bit():
  cleared = lambda x, w: lax.dynamic_update_slice(x @ w, jnp.zeros((1, 8)), (0, 0))
  assert jaxamp.autocast(cleared, device_type="cuda")(X, W).dtype == jnp.float16
  zeroed = lambda x, w: (x @ w).at[0].set(jnp.zeros(8))
  assert jaxamp.autocast(zeroed, device_type="cuda")(X, W).dtype == jnp.float16


def test_rank_zero_values_do_not_promote_tensors_like_torchs_zero_dim_tensors():
  fun = lambda x, w: jnp.where(x @ w > 0, x @ w, jnp.finfo(jnp.float32).min)
  assert jaxamp.autocast(fun, device_type="cpu")(X, W).dtype == jnp.bfloat16


def test_a_weakly_typed_array_promotes_like_torchs_default_dtype_tensor():
  # torch.arange(8) * 0.5 is a float32 tensor: added to a float16 one, the sum is float32.
  fun = lambda x, w: x @ w + jnp.arange(8) * 0.5
  assert (jnp.arange(8) * 0.5).weak_type
  assert jaxamp.autocast(fun, device_type="cuda")(X, W).dtype == jnp.float32


def test_relu_backward_keeps_no_float32_copy_of_the_activation():
  fun = jaxamp.autocast(
    lambda x, w: jnp.sum(jax.nn.relu(x @ w)).astype(jnp.float32), device_type="cuda"
  )
  jaxpr = jax.make_jaxpr(jax.grad(fun, argnums=1))(X, W)
  selects = jaxpr_utils.dtypes_of(jaxpr, "select_n")
  assert selects and all(jnp.float32 not in ins for ins, _ in selects), selects


# --- jnp's promotion of 16-bit values, redone on autocast's dtypes -------------------------------

X16 = X.astype(jnp.bfloat16)
MEETS_A_PRODUCT = {
  "add": lambda x, w: x @ w + x,
  "where": lambda x, w: jnp.where(x > 0, x @ w, x),
  "concatenate": lambda x, w: jnp.concatenate([x @ w, x]),
  "maximum": lambda x, w: jnp.maximum(x @ w, x),
  "rank_0_float32": lambda x, w: jnp.float32(2.0) * (x @ w),
}


@pytest.mark.parametrize("spelling", list(MEETS_A_PRODUCT))
def test_a_16_bit_input_meeting_a_low_precision_product_stays_16_bit(spelling):
  """Traced, ``x_bf16 @ w`` is float32 and jnp promotes ``x`` to float32 to meet it; under
  autocast both are bfloat16, and torch's ``bf16 + bf16`` is bfloat16."""
  fun = MEETS_A_PRODUCT[spelling]
  out = jax.jit(jaxamp.autocast(fun, device_type="cpu"))(X16, W)
  assert out.dtype == jnp.bfloat16
  expected = fun(X16, W.astype(jnp.bfloat16))  # everything in bfloat16, as torch computes it
  np.testing.assert_array_equal(out.astype(jnp.float32), expected.astype(jnp.float32))


def test_a_float16_product_meeting_a_bfloat16_input_promotes_to_float32_as_in_torch():
  out = jaxamp.autocast(lambda x, w: x @ w + x, device_type="cuda")(X16, W)
  assert out.dtype == jnp.float32


def test_a_16_bit_input_cast_to_float32_by_the_caller_stays_float32():
  fun = lambda x, w: x @ w + x.astype(jnp.float32)
  assert jaxamp.autocast(fun, device_type="cpu")(X16, W).dtype == jnp.float32


def test_a_16_bit_input_meeting_a_float32_parameter_promotes():
  fun = lambda x, w: x + w[0]
  assert jaxamp.autocast(fun, device_type="cpu")(X16, W).dtype == jnp.float32
