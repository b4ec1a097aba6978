"""A dtype the user wrote wins over the policy.

torch runs an op called with ``dtype=`` as written, also when it is on the float32 list; in JAX
the caller's ``dtype=`` is a cast at the op's entrance, told apart from the op's own
upcast-then-restore. ``preferred_element_type`` chosen by the caller is kept as well.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
DEVICES = ("cuda", "cpu", "xpu")
REDUCTIONS = {
  "sum": jnp.sum,
  "mean": jnp.mean,
  "cumsum": jnp.cumsum,
  "prod": jnp.prod,
  "cumprod": jnp.cumprod,
  "nansum": jnp.nansum,
}


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.slow_after_first
def test_a_reductions_explicit_dtype_is_kept(device_type, name, dtype):
  # (dtype=jnp.float32 on a value traced as float32 leaves no trace in the jaxpr: JAX drops the
  # cast to the dtype a value already has, so autocast cannot see it; README "Limits".)
  reduce = REDUCTIONS[name]
  fun = jaxamp.autocast(lambda x, w: reduce(x @ w, dtype=dtype), device_type=device_type)
  assert jax.jit(fun)(X, W).dtype == dtype


@pytest.mark.parametrize("device_type", DEVICES)
def test_an_explicit_dtype_changes_what_the_op_computes_in(device_type):
  fun = jaxamp.autocast(lambda x: jnp.sum(x, dtype=jnp.float16), device_type=device_type)
  x = jnp.full((4096,), 1.0 + 2.0**-9)  # float16 accumulation loses the low bits
  assert fun(x) == jnp.sum(x, dtype=jnp.float16)


@pytest.mark.parametrize("device_type", DEVICES)
def test_without_a_dtype_the_policy_decides(device_type):
  fun = jaxamp.autocast(lambda x, w: jnp.sum(x @ w), device_type=device_type)
  expected = jnp.bfloat16 if device_type == "cpu" else jnp.float32  # cpu: sum returns its input's
  assert fun(X, W).dtype == expected


@pytest.mark.parametrize("device_type", DEVICES)
def test_the_callers_preferred_element_type_is_kept(device_type):
  dot = lambda x, w: lax.dot(
    x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32
  )
  assert jaxamp.autocast(dot, device_type=device_type)(X, W).dtype == jnp.float32


GROUPS = jnp.array([1, 3], jnp.int32)
CALLER_CHOSE_FLOAT32 = {  # matmuls that record preferred_element_type only when given one
  "conv": lambda x, w, **kw: lax.conv_general_dilated(
    x[None, None], w[None, None], (1, 1), "SAME", **kw
  ),
  "ragged_dot": lambda x, w, **kw: lax.ragged_dot(x, jnp.stack([w, w]), GROUPS, **kw),
}


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", sorted(CALLER_CHOSE_FLOAT32))
def test_a_float32_preferred_element_type_on_float32_operands_is_kept(device_type, name):
  matmul = CALLER_CHOSE_FLOAT32[name]
  chosen = jaxamp.autocast(
    lambda x, w: matmul(x, w, preferred_element_type=jnp.float32), device_type=device_type
  )
  default = jaxamp.autocast(matmul, device_type=device_type)
  assert chosen(X, W).dtype == jnp.float32
  assert default(X, W).dtype == jaxamp.get_autocast_dtype(device_type)


@pytest.mark.parametrize("device_type", DEVICES)
def test_a_16_bit_input_summed_without_dtype_returns_the_policys_dtype(device_type):
  # jnp.sum's own float16 upcast-then-restore is not an explicit dtype.
  fun = jaxamp.autocast(lambda x: jnp.sum(x), device_type=device_type)
  expected = jnp.float16 if device_type == "cpu" else jnp.float32
  assert fun(X.astype(jnp.float16)).dtype == expected


WIDENING = {**REDUCTIONS, "var": jnp.var, "std": jnp.std, "nanmean": jnp.nanmean}
LOW_INPUT = jnp.linspace(0.0, 1.0, 64).astype(jnp.bfloat16)


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", sorted(WIDENING))
@pytest.mark.slow_after_first
def test_a_16_bit_input_reduced_with_a_wider_dtype_returns_it_bit_for_bit(device_type, name):
  # torch: sum(bf16, dtype=torch.float32) is float32, accumulated in float32.
  reduce = lambda x: WIDENING[name](x, dtype=jnp.float32)
  got = jaxamp.autocast(reduce, device_type=device_type)(LOW_INPUT)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(reduce(LOW_INPUT)), strict=True)


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", ["sum", "cumsum", "mean"])
def test_a_16_bit_input_reduced_with_the_other_16_bit_dtype_returns_that_dtype(device_type, name):
  # torch: sum(bf16, dtype=torch.float16) is float16, also where sum is on the float32 list.
  fun = jaxamp.autocast(lambda x: REDUCTIONS[name](x, dtype=jnp.float16), device_type=device_type)
  assert fun(LOW_INPUT).dtype == jnp.float16


# --- precision=: an explicit request for full precision ------------------------------------

XS = jax.random.normal(jax.random.key(2), (4, 8))
WS = jax.random.normal(jax.random.key(3), (8, 3))
FULL = [lax.Precision.HIGHEST, "highest", lax.Precision.HIGH, (lax.Precision.HIGHEST,) * 2]


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("precision", FULL, ids=["HIGHEST", "highest", "HIGH", "pair"])
def test_a_dot_with_an_explicit_precision_runs_in_its_input_dtype(device_type, precision):
  fun = jaxamp.autocast(lambda x, w: jnp.dot(x, w, precision=precision), device_type=device_type)
  out = fun(XS, WS)
  assert out.dtype == jnp.float32
  assert bool(jnp.array_equal(out, jnp.dot(XS, WS, precision=precision)))


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_lax_dot_general_and_einsum_with_highest_precision_run_in_float32(device_type):
  dims = (((1,), (0,)), ((), ()))
  highest = lax.Precision.HIGHEST
  general = lambda x, w: lax.dot_general(x, w, dims, precision=highest)
  einsum = lambda x, w: jnp.einsum("ij,jk->ik", x, w, precision=highest)
  for fun in (general, einsum):
    assert jaxamp.autocast(fun, device_type=device_type)(XS, WS).dtype == jnp.float32


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_conv_with_highest_precision_runs_in_float32(device_type):
  image, kernel = jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
  conv = lambda x, k: lax.conv(x, k, (1, 1), "SAME", precision=lax.Precision.HIGHEST)
  assert jaxamp.autocast(conv, device_type=device_type)(image, kernel).dtype == jnp.float32


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_default_precision_spelled_out_is_autocast(device_type):
  fun = jaxamp.autocast(
    lambda x, w: jnp.dot(x, w, precision=lax.Precision.DEFAULT), device_type=device_type
  )
  assert fun(XS, WS).dtype == jaxamp.get_autocast_dtype(device_type)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("configured", ["float32", "highest", "tensorfloat32", "F32_F32_F32"])
def test_a_process_wide_default_matmul_precision_is_not_an_explicit_request(
  device_type, configured
):
  # dynamax sets jax_default_matmul_precision="float32" on import; torch's
  # set_float32_matmul_precision("highest") leaves autocast's matmuls low as well.
  fun = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), device_type=device_type)
  with jax.default_matmul_precision(configured):
    assert jax.jit(fun)(XS, WS).dtype == jaxamp.get_autocast_dtype(device_type)
    lowered = jax.jit(fun).lower(XS, WS).as_text()
  (dot,) = [line for line in lowered.splitlines() if "dot_general" in line]
  assert "f32" not in dot  # a configured dot algorithm would compute in float32


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_an_explicit_precision_beside_another_configured_one_runs_in_float32(device_type):
  fun = lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST)
  with jax.default_matmul_precision("tensorfloat32"):
    assert jaxamp.autocast(fun, device_type=device_type)(XS, WS).dtype == jnp.float32


def test_explain_names_the_explicit_precision():
  fun = lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST)
  report = str(jaxamp.explain(fun, device_type="cpu")(XS, WS))
  assert "explicit precision" in report


def test_explain_names_the_explicit_dtype_row_and_its_torch_ops():
  fun = lambda x: jnp.sum(x, dtype=jnp.float32)
  decisions = jaxamp.explain(fun, device_type="cpu")(LOW_INPUT).decisions
  assert {d.op for d in decisions} == {"sum[dtype]"}
  assert all("sum(dtype=...)" in d.torch_ops for d in decisions)


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", ["mean", "sum", "var", "std"])
def test_a_reduction_with_where_and_dtype_returns_the_dtype(device_type, name):
  # jnp.mean(where=) counts the selected elements apart from summing them: one call still
  mask = X > 0
  reduce = getattr(jnp, name)
  fun = jaxamp.autocast(
    lambda x, w, m: reduce(x @ w, where=m, dtype=jnp.float16), device_type=device_type
  )
  assert fun(X, W, mask).dtype == jnp.float16


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", ["sum", "cumsum", "prod"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_an_integer_input_reduced_with_a_float_dtype_returns_that_dtype(device_type, name, dtype):
  # torch.sum(int_tensor, dtype=torch.bfloat16) is bfloat16 under autocast: dtype= wins
  counts = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
  fun = jaxamp.autocast(lambda n: getattr(jnp, name)(n, dtype=dtype), device_type=device_type)
  out = fun(counts)
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, getattr(jnp, name)(counts, dtype=dtype))


# Norm layers whose ``dtype=`` is their computation's (flax linen and nnx): given one, the layer
# runs as written, as a reduction given ``dtype=`` does; without one the policy decides.
def linen_norms(dtype):
  import flax.linen as nn  # noqa: PLC0415

  return {
    "LayerNorm": nn.LayerNorm(dtype=dtype),
    "RMSNorm": nn.RMSNorm(dtype=dtype),
    "GroupNorm": nn.GroupNorm(num_groups=2, dtype=dtype),
    "BatchNorm": nn.BatchNorm(use_running_average=True, dtype=dtype),
    "InstanceNorm": nn.InstanceNorm(dtype=dtype),
  }


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", sorted(linen_norms(None)))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.slow_after_first
def test_a_linen_norm_layers_explicit_dtype_is_kept_bit_for_bit(device_type, name, dtype):
  layer = linen_norms(dtype)[name]
  x = jax.random.normal(jax.random.key(2), (2, 4, 4, 8))
  variables = layer.init(jax.random.key(3), x)
  out = jaxamp.autocast(layer.apply, device_type=device_type)(variables, x)
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, layer.apply(variables, x))


@pytest.mark.parametrize("device_type", DEVICES)
def test_a_training_batch_norms_explicit_dtype_is_kept_with_its_float32_statistics(device_type):
  import flax.linen as nn  # noqa: PLC0415

  layer = nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (2, 4, 4, 8))
  variables = layer.init(jax.random.key(3), x)
  apply = jaxamp.autocast(layer.apply, device_type=device_type)
  out, stats = apply(variables, x, mutable=["batch_stats"])
  expected, expected_stats = layer.apply(variables, x, mutable=["batch_stats"])
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, expected)
  jax.tree.map(np.testing.assert_array_equal, stats, expected_stats)


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_an_nnx_norm_layers_explicit_dtype_is_kept_bit_for_bit(device_type, name):
  from flax import nnx  # noqa: PLC0415

  layer = getattr(nnx, name)(8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  out = jaxamp.autocast(layer, device_type=device_type)(X)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, layer(X))


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_norm_layer_without_a_dtype_follows_the_policy(device_type):
  import flax.linen as nn  # noqa: PLC0415

  layer = nn.LayerNorm()
  variables = layer.init(jax.random.key(3), X)
  out = jaxamp.autocast(lambda v, x, w: layer.apply(v, x @ w), device_type=device_type)(
    variables, X, W
  )
  # cuda: layer_norm is on the float32 list; cpu: it returns its (bfloat16) input's dtype
  assert out.dtype == (jnp.float32 if device_type == "cuda" else jnp.bfloat16)


def test_explain_names_the_norms_explicit_dtype_row():
  import flax.linen as nn  # noqa: PLC0415

  layer = nn.LayerNorm(dtype=jnp.bfloat16)
  variables = layer.init(jax.random.key(3), X)
  decisions = jaxamp.explain(layer.apply, device_type="cuda")(variables, X).decisions
  assert {d.op for d in decisions} == {"layer_norm[dtype]"}
  assert all("layer_norm(dtype=...)" in d.torch_ops for d in decisions)
