"""Overrides by place: parts of real models run under another dtype or policy, or with autocast
off, matched by their module names (flax linen, Haiku, jax.named_scope) or module classes
(Equinox, nnx), without editing the model; the rest runs as before."""

from __future__ import annotations

import collections
import warnings

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax import lax
from jaxpr_utils import dtypes_of, traced
from real_world import equinox_examples, flax_lm1b, flax_nnx_mnist, flax_resnet

import jaxamp
from jaxamp._src.autocast import higher_order

pytestmark = pytest.mark.filterwarnings(
  "ignore:SelfAttention will be deprecated:DeprecationWarning"
)

F16, BF16, F32 = "float16", "bfloat16", "float32"
MATMULS = ("dot_general", "conv_general_dilated")
F16_DTYPE, F32_DTYPE = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

# --- the models ---------------------------------------------------------------------------------

LM1B_CONFIG = flax_lm1b.TransformerConfig(
  vocab_size=32,
  output_vocab_size=32,
  emb_dim=16,
  num_heads=2,
  num_layers=2,
  qkv_dim=16,
  mlp_dim=32,
  max_len=8,
  dropout_rate=0.0,
  attention_dropout_rate=0.0,
  deterministic=True,
)
# q, k, v, scores, weighted values, output, two MLP layers
BLOCK_MATMULS = 8
TOKENS = jnp.asarray(np.random.default_rng(2).integers(1, 32, (4, 8)), jnp.int32)


def lm1b_loss(params, tokens):
  logits = flax_lm1b.TransformerLM(LM1B_CONFIG).apply({"params": params}, tokens)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def lm1b_args():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    params = flax_lm1b.TransformerLM(LM1B_CONFIG).init(jax.random.key(0), TOKENS)["params"]
  return params, TOKENS


IMAGES = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), jnp.float32)


def resnet_apply():
  model = flax_resnet.ResNet(
    stage_sizes=[1, 1], block_cls=flax_resnet.ResNetBlock, num_classes=4, num_filters=4
  )
  variables = model.init(jax.random.key(0), IMAGES[:1], train=False)
  return lambda variables, x: model.apply(variables, x, train=False), variables


def haiku_forward(x):
  net = hk.nets.ResNet(
    blocks_per_group=(1, 1, 1, 1),
    num_classes=4,
    bottleneck=False,
    channels_per_group=(4, 8, 8, 8),
    initial_conv_config={"output_channels": 4},
  )
  return net(x, is_training=True)


def haiku_apply():
  model = hk.transform_with_state(haiku_forward)
  params, state = model.init(jax.random.key(0), IMAGES)
  return lambda params, state, x: model.apply(params, state, None, x)[0], params, state


def explained(fun, *args, **options):
  return jaxamp.explain(fun, device_type="cuda", **options)(*args).decisions


def matmuls(decisions, override=...) -> list:
  """(override, input dtypes) of each dot and conv, of those ``override`` decided if given."""
  return [
    (d.override, d.inputs)
    for d in decisions
    if d.primitive in MATMULS and (override is ... or d.override == override)
  ]


# --- flax linen: module names ------------------------------------------------------------------


@pytest.mark.slow
def test_a_linen_module_name_runs_that_module_in_float32():
  decisions = explained(lm1b_loss, *lm1b_args(), overrides={"logitdense": jnp.float32})
  assert matmuls(decisions, "logitdense") == [("logitdense", (F32, F32))]
  others = matmuls(decisions, None)
  assert others and all(inputs == (F16, F16) for _, inputs in others)


@pytest.mark.slow
def test_parts_an_override_does_not_match_run_as_without_overrides():
  args = lm1b_args()
  plain = explained(lm1b_loss, *args)
  overridden = explained(lm1b_loss, *args, overrides={"encoderdecoderblock_1": None})
  rest = collections.Counter((d.primitive, d.rule) for d in overridden if d.override is None)
  assert rest and not rest - collections.Counter((d.primitive, d.rule) for d in plain)
  assert len(matmuls(overridden, None)) == len(matmuls(plain)) - BLOCK_MATMULS
  assert {i for _, i in matmuls(overridden, None)} == {i for _, i in matmuls(plain)} == {(F16, F16)}


@pytest.mark.slow
def test_none_turns_autocast_off_in_a_module_as_autocast_disabled_does():
  decisions = explained(lm1b_loss, *lm1b_args(), overrides={"encoderdecoderblock_1": None})
  inside = [d for d in decisions if d.override == "encoderdecoderblock_1"]
  assert inside and all(d.rule == "kept" for d in inside)
  assert all(inputs == (F32, F32) for _, inputs in matmuls(inside))
  assert matmuls(decisions, None) and all(i == (F16, F16) for _, i in matmuls(decisions, None))


def test_a_glob_matches_every_module_it_names():
  decisions = explained(lm1b_loss, *lm1b_args(), overrides={"encoderdecoderblock_*/*": None})
  blocks = {d.override for d in decisions if d.rule == "kept"}
  assert blocks == {"encoderdecoderblock_*/*"}
  assert len(matmuls(decisions, "encoderdecoderblock_*/*")) == 2 * BLOCK_MATMULS


@pytest.mark.slow
def test_a_lower_dtype_runs_a_module_autocast_to_it():
  apply, variables = resnet_apply()
  decisions = explained(apply, variables, IMAGES, overrides={"ResNetBlock_1": jnp.bfloat16})
  assert {i for _, i in matmuls(decisions, "ResNetBlock_1")} == {(BF16, BF16)}
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}


@pytest.mark.slow
def test_the_deepest_matching_override_decides():
  apply, variables = resnet_apply()
  overrides = {"ResNetBlock_1/Conv_0": jnp.float32, "ResNetBlock_1": jnp.bfloat16}
  decisions = explained(apply, variables, IMAGES, overrides=overrides)
  assert matmuls(decisions, "ResNetBlock_1/Conv_0") == [("ResNetBlock_1/Conv_0", (F32, F32))]
  assert {i for _, i in matmuls(decisions, "ResNetBlock_1")} == {(BF16, BF16)}


def test_a_policy_value_runs_a_module_under_that_policy():
  policy = jaxamp.policy("cuda").with_rules({"softmax": jaxamp.Category.LOWER})
  decisions = explained(lm1b_loss, *lm1b_args(), overrides={"SelfAttention_0": policy})
  softmax = [d for d in decisions if d.op == "softmax"]
  assert softmax and all(d.override == "SelfAttention_0" for d in softmax)
  assert all(d.category == "lower" for d in softmax)


@pytest.mark.slow
def test_an_overridden_model_differentiates_and_its_gradients_keep_their_dtypes():
  params, tokens = lm1b_args()
  loss = jaxamp.autocast(lm1b_loss, device_type="cuda", overrides={"logitdense": jnp.float32})
  grads = jax.jit(jax.grad(loss))(params, tokens)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


# --- Haiku: module names -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_haiku_module_name_runs_that_module_in_its_dtype():
  apply, params, state = haiku_apply()
  decisions = explained(apply, params, state, IMAGES, overrides={"block_group_3": jnp.bfloat16})
  assert {i for _, i in matmuls(decisions, "block_group_3")} == {(BF16, BF16)}
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}


@pytest.mark.slow
def test_a_haiku_module_class_turns_autocast_off_in_every_instance_as_jmp_does():
  apply, params, state = haiku_apply()
  decisions = explained(apply, params, state, IMAGES, overrides={hk.BatchNorm: None})
  norms = [d for d in decisions if d.override == "BatchNorm"]
  assert {d.primitive for d in norms} >= {"rsqrt", "reduce_sum"}
  assert all(d.rule == "kept" and set(d.inputs) <= {F32, "int32"} for d in norms)
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}
  assert not matmuls(decisions, "BatchNorm")


# --- jax.named_scope, inside higher-order primitives ---------------------------------------------


def test_a_named_scope_inside_a_scan_body_is_matched_through_the_scopes_around_it():
  w = jnp.full((8, 8), 0.1)

  def f(x):
    def body(carry, _):
      with jax.named_scope("router"):
        gate = carry @ w
      return jnp.tanh(gate @ w), None

    with jax.named_scope("moe"):
      return lax.scan(body, x, None, length=3)[0]

  decisions = explained(f, jnp.ones((2, 8)), overrides={"moe/router": jnp.float32})
  assert matmuls(decisions) == [("moe/router", (F32, F32)), (None, (F16, F16))]


# --- Equinox and nnx: module classes -----------------------------------------------------------


@pytest.mark.slow
def test_an_equinox_module_class_turns_autocast_off_in_its_calls():
  model = equinox_examples.CNN(jax.random.key(0))
  x, y = jnp.ones((4, 1, 28, 28)), jnp.zeros((4,), jnp.int32)
  decisions = explained(equinox_examples.loss, model, x, y, overrides={eqx.nn.Linear: None})
  assert {i for _, i in matmuls(decisions, "Linear")} == {(F32, F32)}
  assert {
    (d.primitive, d.inputs) for d in decisions if d.primitive in MATMULS and d.override is None
  } == {("conv_general_dilated", (F16, F16))}


@pytest.mark.slow
def test_an_nnx_module_class_runs_its_calls_in_float32():
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  batch = flax_nnx_mnist.get_fake_batch(8)
  decisions = explained(
    flax_nnx_mnist.loss_fn, model, batch, nnx.Rngs(dropout=1), overrides={nnx.Linear: jnp.float32}
  )
  assert {i for _, i in matmuls(decisions, "Linear")} == {(F32, F32)}
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}


@pytest.mark.slow
def test_an_nnx_attribute_path_runs_that_submodule_in_float32():
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  batch = flax_nnx_mnist.get_fake_batch(8)
  decisions = explained(
    flax_nnx_mnist.loss_fn, model, batch, nnx.Rngs(dropout=1), overrides={"linear2": jnp.float32}
  )
  assert matmuls(decisions, "linear2") == [("linear2", (F32, F32))]
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}  # conv1, conv2, linear1


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.Linear(8, 8, rngs=rngs)
    self.mlp = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return self.mlp(self.attn(x))


class _NnxStack(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([_NnxBlock(rngs), _NnxBlock(rngs)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


@pytest.mark.parametrize(
  "pattern, in_float32",
  [("blocks/0/attn", 1), ("blocks/0", 2), ("blocks/*/mlp", 2), ("0/mlp", 1), ("attn", 2)],
)
def test_a_nested_nnx_attribute_path_names_the_submodules_under_it(pattern, in_float32):
  decisions = explained(
    lambda m, x: m(x), _NnxStack(nnx.Rngs(0)), jnp.ones((2, 8)), overrides={pattern: jnp.float32}
  )
  assert len(matmuls(decisions, pattern)) == in_float32
  assert {i for _, i in matmuls(decisions, pattern)} == {(F32, F32)}
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}
  assert len(matmuls(decisions)) == 4


@pytest.mark.slow
def test_an_nnx_model_under_overrides_keeps_its_state_updates_and_classes():
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  batch = flax_nnx_mnist.get_fake_batch(8)
  call = nnx.Linear.__call__
  before = model.batch_norm1.mean.get_value()
  step = jaxamp.autocast(flax_nnx_mnist.loss_fn, device_type="cuda", overrides={"linear2": None})
  loss, logits = step(model, batch, nnx.Rngs(dropout=1))
  assert logits.dtype == jnp.float32  # linear2 ran as written
  assert not jnp.array_equal(model.batch_norm1.mean.get_value(), before)
  assert model.batch_norm1.mean.get_value().dtype == jnp.float32
  assert nnx.Linear.__call__ is call  # the scopes were added for the trace only


@pytest.mark.slow
def test_an_autocast_module_keeps_its_overrides_through_tree_operations():
  model = equinox_examples.CNN(jax.random.key(0))
  wrapped = jaxamp.autocast(model, device_type="cuda", overrides={eqx.nn.Linear: None})
  rebuilt = jax.tree.map(lambda leaf: leaf, wrapped)
  jaxpr = traced(rebuilt, jnp.ones((1, 28, 28)))
  assert {i for i, _ in dtypes_of(jaxpr, "dot_general")} == {(F32_DTYPE, F32_DTYPE)}
  assert {i for i, _ in dtypes_of(jaxpr, "conv_general_dilated")} == {(F16_DTYPE, F16_DTYPE)}


@pytest.mark.slow
def test_a_train_step_takes_a_policy_and_overrides():
  params, tokens = lm1b_args()
  state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
  policy = jaxamp.policy("cuda").with_rules({"softmax": jaxamp.Category.LOWER})
  step = jaxamp.make_train_step(lm1b_loss, policy=policy, overrides={"logitdense": jnp.float32})
  jaxpr = traced(step, state, tokens)
  dots = {i for i, _ in dtypes_of(jaxpr, "dot_general")}
  assert (F32_DTYPE, F32_DTYPE) in dots and (F16_DTYPE, F16_DTYPE) in dots
  new_state, metrics = jax.jit(step)(state, tokens)
  assert bool(jnp.isfinite(metrics["loss"]))


@pytest.mark.slow
def test_an_nnx_train_step_takes_overrides_by_attribute_path():
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  step = jaxamp.make_nnx_train_step(
    flax_nnx_mnist.loss_fn, device_type="cuda", overrides={"linear2": None}
  )
  metrics = step(model, opt, flax_nnx_mnist.get_fake_batch(8), nnx.Rngs(dropout=1))
  assert metrics["aux"].dtype == jnp.float32  # the logits of linear2, autocast off
  assert bool(jnp.isfinite(metrics["loss"]))


@pytest.mark.slow
def test_precision_report_takes_overrides_and_a_policy():
  def model(x, w):
    h = x @ w
    with jax.named_scope("norm"):  # h * h overflows float16
      return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

  x, w = jnp.linspace(0, 255, 64).reshape(4, 16), jnp.ones((16, 8)) / 4
  plain = jaxamp.precision_report(model, device_type="cuda")(x, w)
  exact = jaxamp.precision_report(model, policy=jaxamp.policy("cuda"), overrides={"norm": None})
  report = exact(x, w)
  assert not np.isfinite(plain.entries[0].accumulated_error)
  assert report.entries[0].accumulated_error < 1e-3


# --- caching -----------------------------------------------------------------------------------


def test_different_overrides_of_one_function_are_not_served_from_one_cache_entry():
  w = jnp.full((8, 8), 0.1)

  def f(x):
    with jax.named_scope("head"):
      return jax.jit(lambda v: v @ w)(x)

  x = jnp.ones((2, 8))
  assert jaxamp.autocast(f, device_type="cuda", overrides={"head": None})(x).dtype == jnp.float32
  assert jaxamp.autocast(f, device_type="cuda")(x).dtype == jnp.float16
  assert jaxamp.autocast(f, device_type="cuda", overrides={"head": jnp.bfloat16})(x).dtype == (
    jnp.bfloat16
  )


def test_one_body_in_places_an_override_treats_alike_is_rewritten_once():
  body = jax.jit(lambda v, w: jnp.tanh(v @ w))
  w = jnp.full((8, 8), 0.1)

  def f(x):
    outs = []
    for i in range(4):
      with jax.named_scope(f"block_{i}"):
        outs.append(body(x, w))
    return outs

  jaxamp.clear_caches()
  jaxamp.autocast(f, device_type="cuda", overrides={"block_*": jnp.bfloat16})(jnp.ones((2, 8)))
  assert len(higher_order._rewrites) == 1


# --- errors that teach -------------------------------------------------------------------------


def test_a_pattern_matching_nothing_lists_the_nearest_scopes_first():
  with pytest.raises(
    ValueError, match=r"'logitdens' matches no scope.*nearest first: '[^']*logitdense'"
  ):
    jaxamp.autocast(lm1b_loss, device_type="cuda", overrides={"logitdens": None})(*lm1b_args())


@pytest.mark.slow
def test_a_class_whose_call_never_runs_lists_the_classes_that_ran():
  model = equinox_examples.CNN(jax.random.key(0))
  with pytest.raises(ValueError, match=r"MultiheadAttention matches nothing.*Linear"):
    jaxamp.autocast(model, device_type="cuda", overrides={eqx.nn.MultiheadAttention: None})(
      jnp.ones((1, 28, 28))
    )


def test_a_pattern_on_a_function_without_scopes_points_to_named_scopes_and_class_keys():
  with pytest.raises(ValueError, match=r"no scope.*jax.named_scope.*class"):
    jaxamp.autocast(lambda x: x @ x, device_type="cuda", overrides={"layers": None})(
      jnp.ones((2, 2))
    )


def test_an_equinox_layer_is_matched_by_the_scope_equinox_gives_it():
  model = equinox_examples.CNN(jax.random.key(0))
  x, y = jnp.ones((4, 1, 28, 28)), jnp.zeros((4,), jnp.int32)
  decisions = explained(equinox_examples.loss, model, x, y, overrides={"eqx.nn.Conv": None})
  assert {i for _, i in matmuls(decisions, "eqx.nn.Conv")} == {(F32, F32)}
  assert {i for _, i in matmuls(decisions, None)} == {(F16, F16)}


@pytest.mark.slow
def test_an_unknown_nnx_attribute_path_lists_the_submodules():
  model = flax_nnx_mnist.CNN(rngs=nnx.Rngs(0))
  batch = flax_nnx_mnist.get_fake_batch(8)
  with pytest.raises(ValueError, match=r"'linear3' matches no scope.*nearest first: 'linear2'"):
    jaxamp.autocast(flax_nnx_mnist.loss_fn, device_type="cuda", overrides={"linear3": None})(
      model, batch, nnx.Rngs(dropout=1)
    )


def test_an_override_value_that_is_not_a_dtype_or_policy_names_the_choices():
  with pytest.raises(ValueError, match=r"None or jnp.float32.*jnp.float16, jnp.bfloat16.*Policy"):
    jaxamp.autocast(lm1b_loss, device_type="cuda", overrides={"logitdense": jnp.int8})


def test_an_override_key_that_is_not_a_pattern_or_class_names_the_choices():
  with pytest.raises(TypeError, match=r"scope pattern.*module class"):
    jaxamp.autocast(lm1b_loss, device_type="cuda", overrides={3: None})


def test_overrides_that_are_not_a_mapping_raise_a_type_error():
  with pytest.raises(TypeError, match="mapping"):
    jaxamp.autocast(lm1b_loss, device_type="cuda", overrides=["logitdense"])
