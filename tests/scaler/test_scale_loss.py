"""``jaxamp.scale_loss``, torch's ``scaler.scale(outputs)``, and ``jaxamp.scaler.get_scale``.

Where torch defines the behaviour the reference is torch itself: ``gradscaler_scale_dtypes.json``
(``gradscaler_goldens``) holds the dtype, shape and bits torch returns for every dtype, rank and
scale, and the same runs are made live when torch is installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from gradscaler_goldens import DTYPE_GOLDENS, assert_bitwise_equal, recorder

import jaxamp

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}


def scaler(**kwargs):
  kwargs.setdefault("init_scale", 1024.0)
  return jaxamp.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


# --- get_scale ------------------------------------------------------------------------------------


def test_get_scale_is_a_float32_scalar_array():
  scale = jaxamp.scaler.get_scale(scaler().init(PARAMS))
  assert isinstance(scale, jax.Array) and scale.dtype == jnp.float32 and scale.shape == ()
  assert scale == 1024.0


def test_get_scale_of_a_disabled_scaler_is_one():
  assert jaxamp.scaler.get_scale(scaler(enabled=False).init(PARAMS)) == 1.0


# --- scale_loss: dtypes and bits, as torch's scaler.scale -----------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_loss_multiplies_by_the_scale_in_float32(dtype):
  state = scaler(init_scale=2.0**16).init(PARAMS)
  scaled = jax.jit(jaxamp.scale_loss)(jnp.asarray(60000.0, dtype), state)
  assert scaled.dtype == jnp.float32  # a float16 product would be inf
  assert scaled == np.float32(jnp.asarray(60000.0, dtype)) * 2.0**16


def case_id(case):
  return f"{case['input']['dtype']}{case['input']['shape']}x{case['init_scale']}"


def scale_like_torch(case):
  """jaxamp's ``scale_loss`` of a golden case's input, under jit (float64 needs x64)."""
  x = recorder.decode(case["input"])
  state = scaler(init_scale=case["init_scale"]).init(PARAMS)
  with jax.enable_x64(x.dtype == np.float64):
    return np.asarray(jax.jit(jaxamp.scale_loss)(jnp.asarray(x), state))


@pytest.mark.parametrize("case", DTYPE_GOLDENS["single"], ids=case_id)
@pytest.mark.slow_after_first
def test_scale_loss_returns_torch_dtype_shape_and_bits(case):
  assert_bitwise_equal(scale_like_torch(case), recorder.decode(case["output"]))


def test_scale_loss_goldens_cover_every_dtype_rank_and_scale():
  inputs = [
    (c["input"]["dtype"], len(c["input"]["shape"]), c["init_scale"])
    for c in DTYPE_GOLDENS["single"]
  ]
  assert {d for d, _, _ in inputs} == {"float32", "float16", "bfloat16", "float64", "int32", "bool"}
  assert {r for _, r, _ in inputs} == {0, 1, 2}
  assert {s for _, _, s in inputs} == {2.0**16, 30001.7, 0.1}


def test_scale_loss_of_nd_float16_outputs_is_float16_and_overflows_like_torch():
  state = scaler(init_scale=2.0**16).init(PARAMS)
  outputs = jax.jit(jaxamp.scale_loss)(jnp.array([0.25, 1.0], jnp.float16), state)
  assert outputs.dtype == jnp.float16
  assert outputs.tolist() == [16384.0, float("inf")]  # 65536 is past float16's max, as in torch


def test_scale_loss_of_float16_outputs_rounds_the_float32_product_once_to_float16():
  # torch multiplies by the float32 scale, then rounds: 1.37 * 30001.7 -> 41120, whereas rounding
  # the scale to float16 first (30000) would give 41088.
  state = scaler(init_scale=30001.7).init(PARAMS)
  out = jax.jit(jaxamp.scale_loss)(jnp.array([1.37], jnp.float16), state)
  assert out.tolist() == [41120.0]


def test_scale_loss_matches_live_torch():
  pytest.importorskip("torch")
  for case in recorder.scale_cases() + recorder.structure_cases():
    if "dtype" in case["output"]:
      assert_bitwise_equal(scale_like_torch(case), recorder.decode(case["output"]))
  assert case["output"] == DTYPE_GOLDENS["structures"][-1]["output"]  # the goldens are current


# --- scale_loss: structures -----------------------------------------------------------------------


def from_structure(tree):
  """A golden list/tuple tree as Python lists/tuples of NumPy arrays."""
  if "dtype" in tree:
    return recorder.decode(tree)
  ((kind, items),) = tree.items()
  return {"list": list, "tuple": tuple}[kind](from_structure(x) for x in items)


@pytest.mark.parametrize("index", range(len(DTYPE_GOLDENS["structures"])))
def test_scale_loss_keeps_lists_tuples_and_nesting_with_torch_dtypes_and_bits(index):
  case = DTYPE_GOLDENS["structures"][index]
  inputs = jax.tree.map(jnp.asarray, from_structure(case["input"]))
  state = scaler(init_scale=case["init_scale"]).init(PARAMS)
  out = jax.jit(jaxamp.scale_loss)(inputs, state)
  expected = from_structure(case["output"])
  assert jax.tree.structure(out) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
    assert_bitwise_equal(a, b)


def test_scale_loss_scales_every_leaf_of_any_pytree_keeping_its_structure_and_none_leaves():
  state = scaler(init_scale=4.0).init(PARAMS)
  losses = {
    "main": jnp.float32(1.0),
    "aux": [jnp.ones(2, jnp.bfloat16)],
    "pair": (jnp.float32(2.0),),
    "none": None,
  }
  out = jax.jit(jaxamp.scale_loss)(losses, state)
  assert jax.tree.structure(out) == jax.tree.structure(losses) and out["none"] is None
  assert out["main"] == 4.0 and out["pair"] == (8.0,)
  assert out["aux"][0].dtype == jnp.bfloat16 and out["aux"][0].tolist() == [4.0, 4.0]


def test_scale_loss_of_an_empty_array_is_empty():
  assert jaxamp.scale_loss(jnp.ones((0,)), scaler().init(PARAMS)).shape == (0,)


# --- scale_loss: gradients, disabled scaler -------------------------------------------------------


@pytest.mark.slow
def test_scale_loss_scales_the_gradient_and_not_the_scale():
  state = scaler(init_scale=8.0).init(PARAMS)
  grads, grad_of_state = jax.grad(
    lambda params, s: jaxamp.scale_loss(jnp.sum(params["w"] ** 2), s),
    argnums=(0, 1),
    allow_int=True,
  )(PARAMS, state)
  np.testing.assert_array_equal(grads["w"], 8.0 * 2 * PARAMS["w"])
  assert grad_of_state.scale == 0.0


def test_disabled_scaler_leaves_the_loss_unscaled():
  state = jaxamp.dynamic_loss_scale(optax.sgd(0.1), enabled=False).init(PARAMS)
  loss = jnp.float16(3.0)
  assert jaxamp.scale_loss(loss, state) is loss


# --- scale_loss: bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "loss, got",
  [
    ("loss", "of type str: 'loss'"),
    (["loss"], "of type str: 'loss'"),
    (object(), "of type object"),
  ],
)
def test_scale_loss_rejects_leaves_that_are_not_arrays(loss, got):
  with pytest.raises(
    TypeError,
    match=r"`loss` must be an array or a pytree of arrays "
    rf"\(torch: a Tensor or an iterable of Tensors\), got a leaf {got}",
  ):
    jaxamp.scale_loss(loss, scaler().init(PARAMS))


def test_scale_loss_of_none_is_a_type_error():
  with pytest.raises(TypeError, match="`loss` must be an array"):
    jaxamp.scale_loss(None, scaler().init(PARAMS))
