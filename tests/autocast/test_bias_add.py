"""A parameter added to a dot or conv runs in the low dtype, as torch's linear/addmm/conv with a
bias; a computed addend is a residual and promotes.

Whether an addend is a bias is decided by where it comes from (a parameter or constant that the
dot's output is not computed with, whatever else reads it), not by its rank: per-example layers
written unbatched (Equinox's ``Linear`` and ``Conv2d``), ``vmap`` (a transpose between the dot
and the add) and ``addmv`` all keep their output in the low dtype.
"""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import jaxpr_utils
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxamp

POLICIES = [("cuda", jnp.float16), ("cpu", jnp.bfloat16), ("xpu", jnp.float16)]
policies = pytest.mark.parametrize(
  "device_type,low", POLICIES, ids=[device_type for device_type, _ in POLICIES]
)

W = jax.random.normal(jax.random.key(0), (6, 8)) * 0.3
B = jax.random.normal(jax.random.key(1), (6,))
V = jax.random.normal(jax.random.key(2), (8,))
XS = jax.random.normal(jax.random.key(3), (5, 8))


@policies
def test_unbatched_linear_keeps_its_bias_add_low(device_type, low):
  fun = jaxamp.autocast(lambda w, v, b: w @ v + b, device_type=device_type)
  assert fun(W, V, B).dtype == low


@policies
def test_vmapped_unbatched_linear_keeps_its_bias_add_low(device_type, low):
  layer = jax.vmap(lambda w, v, b: w @ v + b, in_axes=(None, 0, None))
  assert jaxamp.autocast(layer, device_type=device_type)(W, XS, B).dtype == low


@policies
def test_addmv_stays_low(device_type, low):
  fun = jaxamp.autocast(lambda c, a, v: c + a @ v, device_type=device_type)  # torch.addmv
  assert fun(B, W, V).dtype == low


@policies
@pytest.mark.slow
def test_equinox_linear_output_is_low(device_type, low):
  layer = eqx.nn.Linear(8, 6, key=jax.random.key(4))
  assert jaxamp.autocast(layer, device_type=device_type)(V).dtype == low
  batched = jaxamp.autocast(jax.vmap(layer), device_type=device_type)(XS)
  assert batched.dtype == low


@policies
@pytest.mark.slow
def test_equinox_conv2d_output_is_low(device_type, low):
  conv = eqx.nn.Conv2d(3, 4, kernel_size=3, padding=1, key=jax.random.key(5))  # bias (4, 1, 1)
  image = jnp.ones((3, 8, 8))
  assert jaxamp.autocast(conv, device_type=device_type)(image).dtype == low


@policies
@pytest.mark.slow
def test_equinox_mlp_keeps_low_activations_between_layers(device_type, low):
  mlp = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=jax.random.key(6))
  jaxpr = jax.make_jaxpr(jaxamp.autocast(mlp, device_type=device_type))(V)
  adds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "add"]
  assert adds and all(e.outvars[0].aval.dtype == low for e in adds)


@policies
@pytest.mark.slow_after_first
def test_bias_add_inside_a_scan_over_layers_stays_low(device_type, low):
  def layer(carry, params):  # the weights and biases are scanned over (flax's nn.scan layout)
    w, b = params
    out = carry @ w + b
    return jnp.tanh(out), out

  stacked = (jnp.stack([jnp.eye(8)] * 3), jnp.zeros((3, 8)))
  fun = jaxamp.autocast(lambda x, params: lax.scan(layer, x, params)[1], device_type=device_type)
  assert fun(XS, stacked).dtype == low


@policies
@pytest.mark.parametrize(
  "layer",
  [
    lambda x, w, a: x @ w + a,
    lambda x, w, a: a + x @ w,
    lambda x, w, a: jnp.einsum("bi,io->bo", x, w) + a,
    jax.vmap(lambda x, w, a: x @ w + a, in_axes=(0, None, None)),
  ],
  ids=["dot_plus_scalar", "scalar_plus_dot", "einsum_plus_scalar", "vmapped"],
)
def test_a_rank_0_parameter_added_to_a_dot_is_its_bias(device_type, low, layer):
  # lax broadcasts a rank-0 addend itself; torch's 0-dim tensor added to mm does not promote.
  fun = jaxamp.autocast(layer, device_type=device_type)
  assert fun(XS, W.T, jnp.float32(0.5)).dtype == low
  loss = lambda a: fun(XS, W.T, a).astype(jnp.float32).sum()
  grad = jax.jit(jax.grad(loss))(jnp.float32(0.5))
  assert grad.dtype == jnp.float32 and grad == XS.shape[0] * W.shape[0]


@policies
def test_residual_add_of_a_computed_float32_value_promotes(device_type, low):
  fun = jaxamp.autocast(lambda h, w, v: jnp.sin(h) + w @ v, device_type=device_type)
  assert fun(B, W, V).dtype == jnp.float32  # torch: h + F.linear(x, W)


@policies
def test_residual_add_of_an_input_the_block_also_reads_promotes(device_type, low):
  def block(x, w):
    return x + jnp.tanh(x) @ w  # x is an activation: read by tanh, not only added

  assert jaxamp.autocast(block, device_type=device_type)(XS, jnp.eye(8)).dtype == jnp.float32


@policies
def test_a_bias_the_loss_also_penalizes_stays_low(device_type, low):
  # Weight decay written into the loss (Haiku's examples): the bias is read beside its add.
  def loss(w, v, b):
    out = w @ v + b
    return out, 1e-4 * (jnp.sum(w**2) + jnp.sum(b**2))

  out, penalty = jaxamp.autocast(loss, device_type=device_type)(W, V, B)
  assert out.dtype == low and penalty.dtype == jnp.float32


@policies
def test_a_linen_mlps_outputs_stay_low_under_an_l2_penalty_on_every_parameter(device_type, low):
  model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(4)])
  params = model.init(jax.random.key(7), XS)

  def loss(params, x):
    l2 = sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
    return model.apply(params, x), l2

  logits, _ = jaxamp.autocast(loss, device_type=device_type)(params, XS)
  assert logits.dtype == low


@policies
def test_a_bias_shared_by_unrolled_steps_stays_low(device_type, low):
  # One cell's weights and bias applied at every step of a Python loop (and also penalized).
  def unrolled(w, b, xs):
    h = jnp.zeros(8)
    for x in xs:
      h = jnp.tanh(w @ (h + x) + b)
    return h, jnp.sum(b**2)

  h, _ = jaxamp.autocast(unrolled, device_type=device_type)(jnp.eye(8), jnp.ones(8), XS)
  assert h.dtype == low


@policies
def test_a_second_parameter_added_after_a_dense_layer_promotes(device_type, low):
  # torch: F.linear(x, W, b) + position promotes; only the dot's own bias add joins it.
  fun = jaxamp.autocast(lambda x, w, b, position: x @ w.T + b + position, device_type=device_type)
  assert fun(XS, W, B, B).dtype == jnp.float32


@policies
def test_a_bias_of_a_computed_weight_stays_low(device_type, low):
  # Weight norm, spectral norm, a merged LoRA weight: the weight is computed, still a weight.
  fun = jaxamp.autocast(
    lambda w, v, b: (w / jnp.linalg.norm(w, axis=1, keepdims=True)) @ v + b,
    device_type=device_type,
  )
  assert fun(W, V, B).dtype == low


@policies
def test_an_addend_along_both_operands_free_dims_promotes(device_type, low):
  # q @ k.T + mask: the mask varies over queries and keys; no bias does.
  fun = jaxamp.autocast(lambda q, k, m: q @ k.T + m, device_type=device_type)
  assert fun(XS, XS, jnp.zeros((5, 5))).dtype == jnp.float32


@policies
def test_an_addend_along_a_batch_dim_promotes(device_type, low):
  scores = lambda q, k, m: jnp.einsum("bqd,bkd->bqk", q, k) + m
  q = jnp.stack([XS, XS])
  fun = jaxamp.autocast(scores, device_type=device_type)
  assert fun(q, q, jnp.zeros((2, 1, 1))).dtype == jnp.float32


@policies
def test_a_conv_bias_along_the_output_channels_stays_low_but_a_spatial_one_promotes(
  device_type, low
):
  conv = lambda x, k, b: lax.conv(x, k, (1, 1), "SAME") + b
  x, k = jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3)) * 0.1
  fun = jaxamp.autocast(conv, device_type=device_type)
  assert fun(x, k, jnp.zeros((1, 4, 1, 1))).dtype == low
  assert fun(x, k, jnp.zeros((1, 1, 8, 8))).dtype == jnp.float32


ENSEMBLE = 3
STACKED_W = jnp.stack([W.T * (i + 1) for i in range(ENSEMBLE)])  # (3, 8, 6)
STACKED_B = jnp.stack([B * (i + 1) for i in range(ENSEMBLE)])  # (3, 6)
PER_MEMBER_X = jnp.stack([XS + i for i in range(ENSEMBLE)])  # (3, 5, 8)


@policies
def test_a_vmapped_ensemble_of_linear_layers_keeps_its_bias_add_low(device_type, low):
  # torch.baddbmm(b, x, W) / vmap(F.linear): each member's own input, weight and bias.
  ensemble = jax.vmap(lambda w, b, x: x @ w + b)
  fun = jaxamp.autocast(ensemble, device_type=device_type)
  out = fun(STACKED_W, STACKED_B, PER_MEMBER_X)
  assert out.dtype == low
  expected = ensemble(STACKED_W, STACKED_B, PER_MEMBER_X)
  assert jnp.allclose(out.astype(jnp.float32), expected, rtol=2e-2, atol=5e-2)


@policies
@pytest.mark.slow_after_first
def test_an_ensembles_bias_gradients_are_float32_per_member(device_type, low):
  ensemble = jax.vmap(lambda w, b, x: x @ w + b)
  loss = lambda b: (
    jaxamp.autocast(ensemble, device_type=device_type)(STACKED_W, b, PER_MEMBER_X)
    .astype(jnp.float32)
    .sum()
  )
  grad = jax.jit(jax.grad(loss))(STACKED_B)
  assert grad.dtype == jnp.float32
  assert (grad == PER_MEMBER_X.shape[1]).all()  # each bias is added to each of 5 rows


@policies
@pytest.mark.slow
def test_an_equinox_ensemble_keeps_its_bias_adds_low(device_type, low):
  keys = jax.random.split(jax.random.key(7), ENSEMBLE)
  mlps = eqx.filter_vmap(lambda k: eqx.nn.MLP(8, 4, width_size=16, depth=2, key=k))(keys)
  forward = eqx.filter_vmap(lambda mlp, x: jax.vmap(mlp)(x))
  amp = jaxamp.autocast(forward, device_type=device_type)
  jaxpr = jax.make_jaxpr(lambda x: amp(mlps, x))(PER_MEMBER_X)
  adds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "add"]
  assert adds and all(e.outvars[0].aval.dtype == low for e in adds)


@policies
@pytest.mark.slow
def test_a_linen_vmapped_dense_ensemble_output_is_low(device_type, low):
  ensemble = nn.vmap(
    nn.Dense,
    variable_axes={"params": 0},
    split_rngs={"params": True},
    in_axes=0,
    out_axes=0,
  )(6)
  variables = ensemble.init(jax.random.key(8), PER_MEMBER_X)
  out = jaxamp.autocast(ensemble.apply, device_type=device_type)(variables, PER_MEMBER_X)
  assert out.dtype == low


class _ValueHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))


@policies
def test_an_ensembles_one_feature_head_keeps_its_bias_add_low_in_both_vmap_orders(device_type, low):
  # A critic ensemble (torch.func.vmap over F.linear): Dense(1)'s bias is one value per member.
  head = _ValueHead()
  stacked = jax.vmap(lambda k: head.init(k, XS))(jax.random.split(jax.random.key(9), ENSEMBLE))
  apply = lambda p: head.apply(p, XS)
  outside = jaxamp.autocast(jax.vmap(apply), device_type=device_type)(stacked)
  inside = jax.vmap(jaxamp.autocast(apply, device_type=device_type))(stacked)
  assert outside.dtype == inside.dtype == low
  assert jnp.array_equal(outside, inside)


@policies
@pytest.mark.slow
def test_a_haiku_critic_ensemble_keeps_its_value_heads_low(device_type, low):
  critic = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 1])(x)))
  stacked = jax.vmap(lambda k: critic.init(k, XS))(jax.random.split(jax.random.key(10), ENSEMBLE))
  ensemble = jax.vmap(lambda p: critic.apply(p, XS))
  out = jaxamp.autocast(ensemble, device_type=device_type)(stacked)
  assert out.dtype == low
  assert jnp.allclose(out.astype(jnp.float32), ensemble(stacked), rtol=2e-2, atol=5e-2)


@policies
def test_a_per_example_addend_of_a_batched_product_promotes(device_type, low):
  # torch.bmm(x, W) + s with s of shape (E, 1, 1): a scalar per member is no linear bias.
  fun = jaxamp.autocast(
    lambda w, x, s: jnp.einsum("eni,eio->eno", x, w) + s, device_type=device_type
  )
  assert fun(STACKED_W, PER_MEMBER_X, jnp.ones((ENSEMBLE, 1, 1))).dtype == jnp.float32


@policies
def test_a_padding_mask_over_computed_keys_of_batched_attention_promotes(device_type, low):
  def scores(x, wq, wk, mask):  # keys are computed: the mask is no bias of a stacked weight
    q, k = x @ wq, x @ wk
    return jnp.einsum("bqd,bkd->bqk", q, k) + mask

  x = jnp.stack([XS, XS])
  fun = jaxamp.autocast(scores, device_type=device_type)
  assert fun(x, jnp.eye(8), jnp.eye(8), jnp.zeros((2, 1, 5))).dtype == jnp.float32


@policies
def test_a_bias_read_from_a_ref_stays_low(device_type, low):
  """``ref[...]`` of a ``jax.new_ref`` argument is the parameter it holds, not a computed value."""
  weight, bias = jax.new_ref(W), jax.new_ref(B)
  fun = jaxamp.autocast(lambda w, b, v: w[...] @ v + b[...], device_type=device_type)
  assert fun(weight, bias, V).dtype == low


@pytest.mark.parametrize("storage", ["ref", "hijax"])
@policies
def test_an_nnx_linear_with_variables_kept_as_refs_or_hijax_types_stays_low(
  storage, device_type, low
):
  nnx = pytest.importorskip("flax.nnx")
  if not hasattr(nnx, "var_defaults"):
    pytest.skip("nnx.var_defaults is newer than this flax")
  with nnx.var_defaults(**{storage: True}):
    model = nnx.Linear(8, 6, rngs=nnx.Rngs(0))
  out = jaxamp.autocast(lambda m, x: m(x), device_type=device_type)(model, XS)
  assert out.dtype == low
  assert jnp.allclose(out.astype(jnp.float32), model(XS), atol=0.05)


# --- inside shard_map: check_vma casts a replicated bias or fill to varying (pvary) -------------


def _data_parallel(fun, in_specs):
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.shard_map(fun, mesh=mesh, in_specs=in_specs, out_specs=P("data"))


@pytest.mark.parametrize("nesting", ["autocast(shard_map)", "shard_map(autocast)"])
def test_a_replicated_bias_added_inside_shard_map_stays_16_bit(nesting):
  linear = lambda w, b, x: x @ w + b
  specs = (P(), P(), P("data"))
  if nesting == "autocast(shard_map)":
    fun = jaxamp.autocast(_data_parallel(linear, specs), device_type="cpu")
  else:
    fun = _data_parallel(jaxamp.autocast(linear, device_type="cpu"), specs)
  assert fun(jnp.ones((8, 3)), jnp.ones(3), jnp.ones((4, 8))).dtype == jnp.bfloat16


def test_a_replicated_masks_fill_inside_shard_map_is_the_16_bit_minimum():
  def scores(q, mask):
    s = jnp.einsum("bqd,bkd->bqk", q, q)
    return jnp.where(mask, s, jnp.finfo(jnp.float32).min)

  fun = jaxamp.autocast(_data_parallel(scores, (P("data"), P())), device_type="cuda")
  out = fun(jnp.ones((2, 4, 8)), jnp.tril(jnp.ones((4, 4), bool)))
  assert out.dtype == jnp.float16 and float(out.min()) == float(jnp.finfo(jnp.float16).min)


# --- a parameter stays a parameter through constraints, barriers and slices ----------------------


def _mesh():
  return jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))


def _constrained(a, spec):
  return lax.with_sharding_constraint(a, jax.sharding.NamedSharding(_mesh(), spec))


PASSED_THROUGH = {
  "with_sharding_constraint": lambda w, b: (
    _constrained(w, P(None, "model")),
    _constrained(b, P("model")),
  ),
  "stop_gradient": lambda w, b: (lax.stop_gradient(w), lax.stop_gradient(b)),
  "optimization_barrier": lambda w, b: lax.optimization_barrier((w, b)),
  "device_put": lambda w, b: jax.device_put((w, b)),
  "reduce_precision": lambda w, b: (
    lax.reduce_precision(w, exponent_bits=8, mantissa_bits=7),
    lax.reduce_precision(b, exponent_bits=8, mantissa_bits=7),
  ),
}


@policies
@pytest.mark.parametrize("name", list(PASSED_THROUGH))
def test_a_bias_passed_through_an_identity_primitive_stays_low(name, device_type, low):
  # torch: F.linear(x, W.detach(), b.detach()) is a linear with a bias
  def linear(w, b, x):
    w, b = PASSED_THROUGH[name](w, b)
    return x @ w + b

  fun = jax.jit(jaxamp.autocast(linear, device_type=device_type))
  assert fun(W.T, B, XS).dtype == low


@policies
def test_a_layer_sliced_from_stacked_parameters_keeps_its_bias_add_low(device_type, low):
  stacked_w, stacked_b = jnp.stack([W.T, W.T]), jnp.stack([B, B])  # torch: F.linear(x, W[0], b[0])
  fun = jaxamp.autocast(lambda ws, bs, x: x @ ws[0] + bs[0], device_type=device_type)
  assert fun(stacked_w, stacked_b, XS).dtype == low


@policies
def test_a_layer_read_from_stacked_parameters_in_a_fori_loop_keeps_its_bias_add_low(
  device_type, low
):
  stacked_w = jnp.stack([jnp.eye(6), jnp.eye(6)])
  stacked_b = jnp.stack([B, B])

  def layers(ws, bs, x):
    step = lambda i, h: (h @ ws[i] + bs[i]).astype(h.dtype)
    return lax.fori_loop(0, 2, step, x)

  jaxpr = jaxpr_utils.traced(
    jaxamp.autocast(layers, device_type=device_type), stacked_w, stacked_b, XS @ W.T
  )
  in_loop = [
    eqn
    for path, eqn in jaxpr_utils.walk(jaxpr)
    if eqn.primitive.name == "add"
    and eqn.outvars[0].aval.shape == (5, 6)
    and any(scope.startswith(("while", "scan")) for scope in path)
  ]
  assert in_loop and all(eqn.outvars[0].aval.dtype == low for eqn in in_loop)


@policies
def test_a_linen_dense_with_logically_partitioned_params_on_a_mesh_is_low(device_type, low):
  dense = nn.Dense(
    6,
    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
  )
  rules = (("embed", None), ("mlp", "model"))
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(rules):
    variables = dense.init(jax.random.key(0), XS)
    out = jax.jit(jaxamp.autocast(dense.apply, device_type=device_type))(variables, XS)
  assert out.dtype == low
