"""Hugging Face's Flax BERT (transformers 4.x, the `thirdparty` extra) under autocast: the
attention probabilities it returns go through ``einsum("...hqk,h->...hqk", probs, head_mask)``,
a product that sums over no index. On CPU torch's einsum is unlisted and computes it with
``mul``: they stay float32. The CUDA list has einsum itself: float16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

transformers = pytest.importorskip("transformers", reason="the thirdparty extra: transformers<5")

CONFIG = transformers.BertConfig(
  vocab_size=64,
  hidden_size=32,
  num_hidden_layers=2,
  num_attention_heads=4,
  intermediate_size=64,
  max_position_embeddings=16,
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
MASK = jnp.ones((2, 8), jnp.int32).at[1, 5:].set(0)  # the second sequence is padded


@pytest.fixture(scope="module")
def bert():
  return transformers.FlaxBertModel(CONFIG, seed=0)


@pytest.mark.parametrize(
  "device_type, dtype", [("cpu", jnp.float32), ("cuda", jnp.float16)], ids=["cpu", "cuda"]
)
def test_the_attentions_bert_returns_are_torchs_einsums_dtype_and_close(bert, device_type, dtype):
  def attentions(params, tokens, mask):
    # the model's __call__ passes a head mask of ones (None: all heads) to its module
    return bert(tokens, mask, params=params, output_attentions=True).attentions

  got = jaxamp.autocast(attentions, device_type=device_type)(bert.params, TOKENS, MASK)
  expected = attentions(bert.params, TOKENS, MASK)
  for layer, reference in zip(got, expected, strict=True):
    assert layer.dtype == dtype
    np.testing.assert_allclose(np.asarray(layer, np.float32), reference, atol=2e-2)


def test_a_head_mask_product_keeps_the_widest_dtype():
  probs = jax.nn.softmax(jnp.arange(32.0).reshape(2, 4, 4) / 8)
  head_mask = jnp.ones((2,))
  fun = jaxamp.autocast(lambda p, h: jnp.einsum("hqk,h->hqk", p @ p, h), device_type="cpu")
  assert fun(probs, head_mask).dtype == jnp.float32
