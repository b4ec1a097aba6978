"""Hugging Face's Flax Gemma (transformers 4.x, the `thirdparty` extra) under autocast: finite
logits with left padding (its attention bias is ``finfo(float32).min``), overrides by the
linen module paths transformers gives its layers, and gradients for every weight."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

transformers = pytest.importorskip("transformers", reason="the thirdparty extra: transformers<5")

F16, BF16, F32 = "float16", "bfloat16", "float32"
LAYERS, VOCAB, LENGTH = 2, 64, 8
# Per layer: q, k, v and o projections, scores and weighted values, gate, up and down projections.
LAYER_DOTS, ATTENTION_DOTS, MLP_DOTS = 9, 6, 3

CONFIG = transformers.GemmaConfig(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=LAYERS,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  max_position_embeddings=16,
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)), jnp.int32)
# The second sequence is left-padded: its first three queries see no key at all.
MASK = jnp.ones((2, LENGTH), jnp.int32).at[1, :3].set(0)
POSITIONS = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))


@pytest.fixture(scope="module")
def gemma():
  return transformers.FlaxGemmaForCausalLM(CONFIG, seed=0)


def logits_fn(gemma):
  def logits(params, tokens, mask):
    return gemma.module.apply({"params": params}, tokens, mask, POSITIONS).logits

  return logits


def loss_fn(gemma):
  logits = logits_fn(gemma)

  def loss(params, tokens, mask):
    per_token = optax.softmax_cross_entropy_with_integer_labels(
      logits(params, tokens, mask), tokens
    )
    return (per_token * mask).sum() / mask.sum()

  return loss


def dots(gemma, **options) -> collections.Counter:
  """How many dot_generals each override (None: none) decided, by input dtypes."""
  explanation = jaxamp.explain(logits_fn(gemma), device_type="cuda", **options)
  decisions = explanation(gemma.params, TOKENS, MASK).decisions
  return collections.Counter(
    (d.override, d.inputs) for d in decisions if d.primitive == "dot_general"
  )


@pytest.mark.slow
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_left_padded_rows_give_finite_logits_close_to_float32(gemma, device_type):
  reference = logits_fn(gemma)(gemma.params, TOKENS, MASK)
  logits = jaxamp.autocast(logits_fn(gemma), device_type=device_type)(gemma.params, TOKENS, MASK)
  assert bool(jnp.isfinite(logits).all())
  tolerance = 1e-2 if device_type == "cuda" else 5e-2
  np.testing.assert_allclose(logits, reference, atol=tolerance * float(jnp.abs(reference).max()))


def test_the_tied_lm_head_runs_in_float32_and_every_other_dot_in_float16(gemma):
  assert dots(gemma, overrides={"lm_head": jnp.float32}) == {
    ("lm_head", (F32, F32)): 1,
    (None, (F16, F16)): LAYERS * LAYER_DOTS,
  }


@pytest.mark.slow
def test_one_layers_attention_runs_in_float32(gemma):
  assert dots(gemma, overrides={"model/layers/0/self_attn": jnp.float32}) == {
    ("model/layers/0/self_attn", (F32, F32)): ATTENTION_DOTS,
    (None, (F16, F16)): LAYERS * LAYER_DOTS - ATTENTION_DOTS + 1,
  }


@pytest.mark.slow
def test_none_turns_autocast_off_in_one_decoder_layer(gemma):
  assert dots(gemma, overrides={"model/layers/1": None}) == {
    ("model/layers/1", (F32, F32)): LAYER_DOTS,
    (None, (F16, F16)): LAYER_DOTS + 1,
  }


@pytest.mark.slow
def test_a_glob_runs_every_layers_mlp_in_bfloat16(gemma):
  assert dots(gemma, overrides={"model/layers/*/mlp": jnp.bfloat16}) == {
    ("model/layers/*/mlp", (BF16, BF16)): LAYERS * MLP_DOTS,
    (None, (F16, F16)): LAYERS * (LAYER_DOTS - MLP_DOTS) + 1,
  }


@pytest.mark.slow
def test_every_weight_gets_a_finite_float32_gradient_under_overrides(gemma):
  loss = jaxamp.autocast(
    loss_fn(gemma), device_type="cuda", overrides={"lm_head": jnp.float32, "model/layers/1": None}
  )
  grads = jax.jit(jax.grad(loss))(gemma.params, TOKENS, MASK)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == len(jax.tree.leaves(gemma.params))
  assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in leaves)
  assert all(bool(jnp.any(g != 0)) for g in leaves)


@pytest.mark.slow
def test_training_under_the_float16_policy_follows_float32(gemma):
  def train(loss, steps=15):
    optimizer = optax.adam(3e-3)
    params = gemma.params
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
      value, grads = jax.value_and_grad(loss)(params, TOKENS, MASK)
      updates, state = optimizer.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value

    for _ in range(steps):
      params, state, value = step(params, state)
    return float(value)

  first = float(loss_fn(gemma)(gemma.params, TOKENS, MASK))
  full = train(loss_fn(gemma))
  mixed = train(jaxamp.autocast(loss_fn(gemma), device_type="cuda"))
  assert mixed < 0.8 * first
  assert abs(mixed - full) < 0.05 * first
