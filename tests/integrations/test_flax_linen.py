"""Flax linen layers under ``jaxamp.autocast(model.apply, ...)`` behave as torch's nn layers do.

dots and convs (Dense, Conv, ConvTranspose, Embed.attend, attention, RNN cells) run in the policy's
low dtype and their layers return it; normalisation follows torch: float32 under "cuda"
(layer_norm and group_norm are on its float32 list), the input's dtype under "cpu" (unlisted);
values and float32-parameter gradients stay close to the float32 run.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest

import jaxamp

POLICIES = [
  pytest.param("cuda", jnp.float16, id="cuda"),
  pytest.param("xpu", jnp.float16, id="xpu"),
  pytest.param("cpu", jnp.bfloat16, id="cpu"),
]
F32 = jnp.dtype(jnp.float32)
VALUE_RTOL = 3e-2  # relative to the largest float32 value
GRAD_RTOL = 5e-2  # relative to the largest float32 gradient
KEY = jax.random.key(0)

# Tiny models: compile without XLA's backend optimisations, which cost more than they save here.
jit = functools.partial(
  jax.jit,
  compiler_options={"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True},
)


# --- models ------------------------------------------------------------------------------------


class EmbedAttend(nn.Module):
  """Token embedding (a gather: runs in the table's float32) and tied output logits (a dot)."""

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(32, 16)
    return embed.attend(embed(ids))


class DenseThen(nn.Module):
  """A Dense layer feeding ``layer``: the layer sees the low-dtype activation of a real network."""

  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.layer(nn.Dense(16)(x))


class ConvThen(nn.Module):
  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.layer(nn.Conv(8, (3, 3))(x))


class SelfAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)


def _normal(*shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


TOKENS = jnp.array([[1, 5, 7, 31], [0, 2, 2, 9]])

# name -> (module, input)
LAYERS = {
  "dense": (nn.Dense(16), _normal(4, 8)),
  "conv": (nn.Conv(8, (3, 3)), _normal(2, 8, 8, 3)),
  "conv_transpose": (nn.ConvTranspose(8, (3, 3), strides=(2, 2)), _normal(2, 6, 6, 3)),
  "embed_attend": (EmbedAttend(), TOKENS),
  "layer_norm": (DenseThen(nn.LayerNorm()), _normal(4, 8)),
  "group_norm": (ConvThen(nn.GroupNorm(num_groups=4)), _normal(2, 6, 6, 3)),
  "attention": (SelfAttention(), _normal(2, 5, 8)),
  "lstm": (nn.RNN(nn.LSTMCell(16)), _normal(2, 5, 8)),
  "gru": (nn.RNN(nn.GRUCell(16)), _normal(2, 5, 8)),
}
# The layers that run dots or convs.
DOT_LAYERS = ["dense", "conv", "conv_transpose", "embed_attend", "attention", "lstm", "gru"]


def expected_dtype(name, low):
  """The dtype torch's corresponding layer returns under autocast."""
  if name in ("layer_norm", "group_norm"):
    return F32 if low == jnp.float16 else jnp.dtype(low)  # cuda: float32 list; cpu: unlisted
  if name in ("lstm", "gru"):
    # cuda: torch's cells are on the list, each step's h is 16-bit (the scan carry stays
    # float32); cpu: a cell is a composition, its bfloat16 matmuls meet the float32 carry.
    return jnp.dtype(low) if low == jnp.float16 else F32
  return jnp.dtype(low)


def output_dtype_cases():
  cases = []
  for name in LAYERS:
    for policy in POLICIES:
      device_type, low = policy.values
      cases.append(pytest.param(name, device_type, low, id=f"{name}-{device_type}"))
  return cases


@functools.cache
def variables(name):
  module, x = LAYERS[name]
  return jit(module.init)(KEY, x)


@functools.cache
def variable_types(name):
  """The variables' shapes and dtypes: enough for dtype and jaxpr checks, without compiling."""
  module, x = LAYERS[name]
  return jax.eval_shape(module.init, KEY, x)


@functools.cache
def run(name, device_type=None):
  """(output, gradients of a probe loss w.r.t. the params): autocast, or float32 for None."""
  module, x = LAYERS[name]
  apply = module.apply if device_type is None else autocast_apply(module, device_type)
  probe = _normal(*jax.eval_shape(module.apply, variable_types(name), x).shape, seed=2)

  def loss(params):
    out = apply({**variables(name), "params": params}, x)
    return jnp.sum(out.astype(jnp.float32) * probe), out

  grads, out = jit(jax.grad(loss, has_aux=True))(variables(name)["params"])
  return out, grads


def assert_close(actual, expected, rtol):
  """Elementwise closeness, tolerance scaled by the largest magnitude in ``expected``."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def assert_tree_close(actual, expected, rtol):
  scale = max(float(np.abs(np.asarray(leaf)).max()) for leaf in jax.tree.leaves(expected))
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * scale)


def autocast_apply(module, device_type, **kwargs):
  return jaxamp.autocast(functools.partial(module.apply, **kwargs), device_type=device_type)


# --- every layer -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,device_type,low", output_dtype_cases())
@pytest.mark.slow_after_first
def test_layer_output_has_torch_dtype(name, device_type, low):
  module, x = LAYERS[name]
  out = jax.eval_shape(autocast_apply(module, device_type), variable_types(name), x)
  assert out.dtype == expected_dtype(name, low)


@pytest.mark.slow  # every layer under every policy, compiled
@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_output_is_close_to_float32(name, device_type, low):
  out, _ = run(name, device_type)
  assert_close(out, run(name)[0], VALUE_RTOL)


@pytest.mark.slow  # every layer's gradients under every policy
@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_param_gradients_are_float32_and_close_to_float32(name, device_type, low):
  _, grads = run(name, device_type)
  _, expected = run(name)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}
  assert_tree_close(grads, expected, GRAD_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_autocast_jaxpr_is_well_typed(name, device_type, low):
  module, x = LAYERS[name]
  jaxpr = jax.make_jaxpr(autocast_apply(module, device_type))(variable_types(name), x).jaxpr
  jax.extend.core.check_jaxpr(jaxpr)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("name", DOT_LAYERS)
def test_every_dot_and_conv_runs_in_the_low_dtype(name, device_type, low):
  module, x = LAYERS[name]
  jaxpr = jaxpr_utils.traced(autocast_apply(module, device_type), variable_types(name), x)
  found = jaxpr_utils.dtypes_of(jaxpr, "dot_general") + jaxpr_utils.dtypes_of(
    jaxpr, "conv_general_dilated"
  )
  assert found
  assert all(ins == (low, low) and outs == (low,) for ins, outs in found), found


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_rnn_cell_dots_run_in_the_low_dtype_inside_the_scan(name, device_type, low):
  module, x = LAYERS[name]
  jaxpr = jaxpr_utils.traced(autocast_apply(module, device_type), variable_types(name), x)
  in_scan = [
    eqn
    for path, eqn in jaxpr_utils.walk(jaxpr)
    if eqn.primitive.name == "dot_general" and any(scope.startswith("scan:") for scope in path)
  ]
  assert in_scan
  assert all(v.aval.dtype == low for eqn in in_scan for v in eqn.invars + eqn.outvars)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_embedding_lookup_keeps_the_float32_table(device_type, low):
  embed = nn.Embed(32, 16)
  params = embed.init(KEY, TOKENS)
  out = jit(autocast_apply(embed, device_type))(params, TOKENS)
  assert out.dtype == F32  # torch's embedding is unlisted: it returns its weight's dtype
  np.testing.assert_array_equal(out, embed.apply(params, TOKENS))


@pytest.mark.parametrize(
  "device_type,low,softmax_out", [("cuda", jnp.float16, F32), ("cpu", jnp.bfloat16, jnp.bfloat16)]
)
def test_attention_softmax_computes_in_float32_and_returns_the_torch_dtype(
  device_type, low, softmax_out
):
  # CUDA: softmax is on the float32 list. CPU: unlisted, but torch's kernel accumulates in float32
  # and returns the input's bfloat16.
  module, x = LAYERS["attention"]
  jaxpr = jaxpr_utils.traced(autocast_apply(module, device_type), variable_types("attention"), x)
  exps = jaxpr_utils.dtypes_of(jaxpr, "exp")
  assert exps
  assert all(ins == (F32,) for ins, _ in exps), exps
  dots = jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert all(ins == (low, low) for ins, _ in dots), dots


# --- normalisation: the statistics ---------------------------------------------------------------


class OffsetDenseThen(nn.Module):
  """A Dense layer whose bias moves every activation to ~30: a mean far from zero, std ~1."""

  layer: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.layer(nn.Dense(64, bias_init=nn.initializers.constant(30.0))(x))


NORMS = {
  "layer_norm": lambda: nn.LayerNorm(),
  "group_norm": lambda: nn.GroupNorm(num_groups=4),
  "batch_norm": lambda: nn.BatchNorm(use_running_average=False),  # batch statistics
}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.slow
def test_normalization_of_offset_activations_is_accurate(norm, device_type, low):
  model = OffsetDenseThen(NORMS[norm]())
  x = _normal(16, 32)
  v = jit(model.init)(KEY, x)
  out, _ = jit(autocast_apply(model, device_type, mutable=["batch_stats"]))(v, x)
  expected, _ = jit(functools.partial(model.apply, mutable=["batch_stats"]))(v, x)
  # Only the low-dtype rounding of the ~30-sized input (ulp 0.125 in bfloat16) may show.
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=0.3)


# --- BatchNorm ---------------------------------------------------------------------------------


class ConvBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.Conv(8, (3, 3), use_bias=False)(x)  # BatchNorm's bias replaces the conv's
    return nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)


BN_MODEL = ConvBatchNorm()
BN_INPUT = _normal(4, 6, 6, 3)


@functools.cache
def bn_variables():
  return jit(functools.partial(BN_MODEL.init, train=False))(KEY, BN_INPUT)


@functools.cache
def bn_train(device_type=None):
  """(output, {"batch_stats": ...}) of a training step: autocast, or float32 for None."""
  apply = functools.partial(BN_MODEL.apply, train=True, mutable=["batch_stats"])
  if device_type is not None:
    apply = jaxamp.autocast(apply, device_type=device_type)
  return jit(apply)(bn_variables(), BN_INPUT)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_updated_statistics_stay_float32(device_type, low):
  _, updates = bn_train(device_type)
  stats = updates["batch_stats"]["BatchNorm_0"]
  assert {k: v.dtype for k, v in stats.items()} == {"mean": F32, "var": F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_statistics_change_in_training(device_type, low):
  _, updates = bn_train(device_type)
  before = bn_variables()["batch_stats"]["BatchNorm_0"]
  after = updates["batch_stats"]["BatchNorm_0"]
  for k in ("mean", "var"):
    assert not np.allclose(after[k], before[k]), k


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_updated_statistics_are_close_to_float32(device_type, low):
  assert_tree_close(bn_train(device_type)[1], bn_train()[1], VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_training_output_is_close_to_float32(device_type, low):
  assert_close(bn_train(device_type)[0], bn_train()[0], VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_output_keeps_the_low_dtype_of_its_input(device_type, low):
  assert bn_train(device_type)[0].dtype == low


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_batch_norm_evaluation_uses_the_running_statistics(device_type, low):
  evaluate = functools.partial(BN_MODEL.apply, train=False)
  out = jit(jaxamp.autocast(evaluate, device_type=device_type))(bn_variables(), BN_INPUT)
  assert_close(out, jit(evaluate)(bn_variables(), BN_INPUT), VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_batch_norm_param_gradients_are_float32_and_close_to_float32(device_type, low):
  v = bn_variables()
  probe = _normal(*BN_INPUT.shape[:-1], 8, seed=3)
  train = functools.partial(BN_MODEL.apply, train=True, mutable=["batch_stats"])

  def grads(apply):
    def loss(params):
      out, _ = apply({**v, "params": params}, BN_INPUT)
      return jnp.sum(out.astype(jnp.float32) * probe)

    return jit(jax.grad(loss))(v["params"])

  found = grads(jaxamp.autocast(train, device_type=device_type))
  assert {leaf.dtype for leaf in jax.tree.leaves(found)} == {F32}
  assert_tree_close(found, grads(train), GRAD_RTOL)


# --- Dropout and static flags --------------------------------------------------------------------


class DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    h = nn.relu(nn.Dense(32)(x))
    h = nn.Dropout(0.5, deterministic=not train)(h)
    return nn.Dense(8)(h)


MLP = DropoutMLP()
MLP_INPUT = _normal(4, 16)
DROPOUT_KEY = jax.random.key(7)


@functools.cache
def mlp_variables():
  return jit(functools.partial(MLP.init, train=False))(KEY, MLP_INPUT)


@functools.cache
def mlp(device_type=None, train=True):
  """The jitted MLP ``(variables, x, dropout_key) -> out``: autocast, or float32 for None."""
  apply = lambda v, x, k: MLP.apply(v, x, train=train, rngs={"dropout": k})
  if device_type is not None:
    apply = jaxamp.autocast(apply, device_type=device_type)
  return jit(apply)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_dropout_with_rngs_keeps_the_low_dtype(device_type, low):
  assert mlp(device_type)(mlp_variables(), MLP_INPUT, DROPOUT_KEY).dtype == low


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_dropout_uses_the_same_mask_as_the_float32_run(device_type, low):
  out = mlp(device_type)(mlp_variables(), MLP_INPUT, DROPOUT_KEY)
  assert_close(out, mlp()(mlp_variables(), MLP_INPUT, DROPOUT_KEY), VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_dropout_masks_differ_between_keys(device_type, low):
  a = mlp(device_type)(mlp_variables(), MLP_INPUT, jax.random.key(1))
  b = mlp(device_type)(mlp_variables(), MLP_INPUT, jax.random.key(2))
  assert not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow_after_first
def test_dropout_with_deterministic_false_call_argument(device_type, low):
  dropout = nn.Dropout(0.5)
  x = jnp.ones((64,))
  f = jaxamp.autocast(
    lambda x, k: dropout.apply({}, x, deterministic=False, rngs={"dropout": k}),
    device_type=device_type,
  )
  out = jit(f)(x, DROPOUT_KEY)
  assert out.dtype == F32  # dropout is unlisted: a float32 input stays float32
  assert set(np.unique(np.asarray(out)).tolist()) == {0.0, 2.0}


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_static_train_flag_selects_the_behaviour(device_type, low):
  apply = jit(jaxamp.autocast(MLP.apply, device_type=device_type), static_argnames="train")
  evaluated = apply(mlp_variables(), MLP_INPUT, train=False)
  trained = apply(mlp_variables(), MLP_INPUT, train=True, rngs={"dropout": DROPOUT_KEY})
  assert evaluated.dtype == trained.dtype == low
  assert_close(evaluated, mlp(train=False)(mlp_variables(), MLP_INPUT, DROPOUT_KEY), VALUE_RTOL)
  assert_close(trained, mlp()(mlp_variables(), MLP_INPUT, DROPOUT_KEY), VALUE_RTOL)


class DataDependentInit(nn.Module):
  """A bias initialised from the first batch through the layer's own matmul, as weight norm's
  is (flax's PixelCNN++ example)."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (x.shape[-1], 4))
    bias = self.param("bias", lambda key: -jnp.mean(x @ w, 0))
    return x @ w + bias


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_parameters_an_autocast_init_creates_are_those_of_a_float32_init(device_type, low):
  # torch creates parameters outside autocast: init's forward runs as written.
  x = jnp.arange(24.0).reshape(8, 3) / 8
  created = jaxamp.autocast(DataDependentInit().init, device_type=device_type)(KEY, x)
  expected = DataDependentInit().init(KEY, x)
  assert jax.tree.map(lambda a: a.dtype, created) == jax.tree.map(lambda a: a.dtype, expected)
  assert_tree_close(created, expected, 1e-6)


class NormBlock(nn.Module):
  """Norm layers whose parameters and statistics are created inside their op regions."""

  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("method", ["init", "init_with_output", "lazy_init"])
def test_every_linen_init_method_creates_float32_parameters(device_type, low, method):
  x = jnp.arange(32.0).reshape(4, 8) / 8
  init = jaxamp.autocast(getattr(NormBlock(), method), device_type=device_type)
  created = init(KEY, x)
  created = created[1] if method == "init_with_output" else created
  assert {leaf.dtype for leaf in jax.tree.leaves(created)} == {F32}


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_an_nnx_bridge_lazy_init_under_autocast_creates_float32_state(device_type, low):
  from flax import nnx
  from flax.nnx import bridge

  model = bridge.ToNNX(NormBlock(), rngs=nnx.Rngs(0))
  x = jnp.arange(32.0).reshape(4, 8) / 8
  jaxamp.autocast(lambda m, x: bridge.lazy_init(m, x) and None, device_type=device_type)(model, x)
  state = nnx.state(model, nnx.Param, nnx.BatchStat)
  assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {F32}
