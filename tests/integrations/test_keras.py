"""Keras 3 on the JAX backend: a model run functionally (``stateless_call``) under autocast.

A Keras user's train step (``KERAS_BACKEND=jax``) calls ``model.stateless_call(trainable,
non_trainable, x, training=True)``, which returns the outputs and the new non-trainable variables
(BatchNorm's moving statistics, a Dropout seed generator's state). Under ``jaxamp.autocast`` the
layers' matmuls and convolutions run in the low dtype, the state comes back in its own dtypes,
and a float16 step with the loss scaler follows the float32 one. No model code changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import optax
import pytest

import jaxamp

keras = pytest.importorskip("keras")  # on JAX: tests/conftest.py sets KERAS_BACKEND=jax

layers = keras.layers
POLICIES = [("cuda", jnp.float16), ("cpu", jnp.bfloat16)]
policies = pytest.mark.parametrize("device_type,low", POLICIES, ids=[p for p, _ in POLICIES])
RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 6)).astype(np.float32)
Y = np.arange(8) % 3


def _classifier() -> keras.Model:
  keras.utils.set_random_seed(0)
  return keras.Sequential(
    [
      keras.Input((6,)),
      layers.Dense(16, activation="relu"),
      layers.BatchNormalization(),
      layers.Dropout(0.25),
      layers.Dense(3),
    ]
  )


def _variables(model: keras.Layer) -> tuple[list, list]:
  return [v.value for v in model.trainable_variables], [
    v.value for v in model.non_trainable_variables
  ]


def _train_step(model: keras.Model, tx, device_type: str | None):
  """A jitted step: the loss under autocast for ``device_type`` (None: float32), scaled when
  ``tx`` is the loss scaler."""
  cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def loss_fn(trainable, non_trainable, x, y):
    logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
    return cross_entropy(y, logits), non_trainable

  if device_type is not None:
    loss_fn = jaxamp.autocast(loss_fn, device_type=device_type)

  @jax.jit
  def step(trainable, non_trainable, opt_state, x, y):
    def scaled(trainable):
      loss, new_state = loss_fn(trainable, non_trainable, x, y)
      if isinstance(opt_state, jaxamp.DynamicLossScaleState):
        return jaxamp.scale_loss(loss, opt_state), (loss, new_state)
      return loss, (loss, new_state)

    grads, (loss, new_state) = jax.grad(scaled, has_aux=True)(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), new_state, opt_state, loss

  return step


def _train(model, tx, device_type, steps=3):
  trainable, non_trainable = _variables(model)
  opt_state = tx.init(trainable)
  step = _train_step(model, tx, device_type)
  losses = []
  for _ in range(steps):
    trainable, non_trainable, opt_state, loss = step(trainable, non_trainable, opt_state, X, Y)
    losses.append(float(loss))
  return trainable, non_trainable, opt_state, losses


@policies
def test_keras_runs_on_jax_and_a_dense_layers_output_is_low(device_type, low):
  assert keras.backend.backend() == "jax"
  dense = layers.Dense(4)
  dense.build((None, 6))
  out, _ = jaxamp.autocast(dense.stateless_call, device_type=device_type)(*_variables(dense), X)
  assert out.dtype == low


@pytest.mark.slow
def test_a_float16_train_step_with_the_loss_scaler_follows_float32():
  model = _classifier()
  params, state, opt_state, losses = _train(
    model, jaxamp.dynamic_loss_scale(optax.adam(1e-2)), "cuda"
  )
  ref_params, ref_state, _, ref_losses = _train(model, optax.adam(1e-2), None)
  assert float(jaxamp.scaler.get_scale(opt_state)) == 2.0**16  # no step skipped
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
  for p, ref in zip(params, ref_params, strict=True):
    assert p.dtype == ref.dtype == jnp.float32
    np.testing.assert_allclose(p, ref, atol=2e-3)
  for s, ref in zip(state, ref_state, strict=True):  # moving stats; the seed generator's state
    assert s.dtype == ref.dtype
    np.testing.assert_allclose(s, ref, rtol=2e-2, atol=1e-3)


@pytest.mark.slow
def test_every_weight_gets_a_finite_float32_gradient():
  model = _classifier()
  trainable, non_trainable = _variables(model)
  cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def loss_fn(trainable):
    logits, _ = model.stateless_call(trainable, non_trainable, X, training=True)
    return cross_entropy(Y, logits)

  grads = jax.jit(jax.grad(jaxamp.autocast(loss_fn, device_type="cuda")))(trainable)
  ref = jax.jit(jax.grad(loss_fn))(trainable)
  for g, r, v in zip(grads, ref, model.trainable_variables, strict=True):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), v.path
    np.testing.assert_allclose(g, r, rtol=5e-2, atol=2e-3, err_msg=v.path)


CONV_AND_RECURRENT_LAYERS = {
  "conv2d": (lambda: layers.Conv2D(4, 3, padding="same"), (2, 6, 6, 3)),
  "depthwise_conv2d": (lambda: layers.DepthwiseConv2D(3, padding="same"), (2, 6, 6, 3)),
  "conv2d_transpose": (lambda: layers.Conv2DTranspose(4, 3, strides=2), (2, 6, 6, 3)),
  "conv1d": (lambda: layers.Conv1D(4, 3), (2, 8, 3)),
  "einsum_dense": (lambda: layers.EinsumDense("abc,cd->abd", (8, 5), bias_axes="d"), (2, 8, 3)),
  "lstm": (lambda: layers.LSTM(5, return_sequences=True), (2, 8, 3)),
  "gru": (lambda: layers.GRU(5, return_sequences=True), (2, 8, 3)),
}


@policies
@pytest.mark.parametrize("name", list(CONV_AND_RECURRENT_LAYERS))
@pytest.mark.slow
def test_every_matmul_and_conv_of_a_keras_layer_runs_in_the_low_dtype(name, device_type, low):
  make, shape = CONV_AND_RECURRENT_LAYERS[name]
  layer = make()
  layer.build(shape)
  weights, state = _variables(layer)  # a recurrent layer's state: its seed generator's
  x = jnp.asarray(RNG.standard_normal(shape), jnp.float32)
  call = jaxamp.autocast(layer.stateless_call, device_type=device_type)
  jaxpr = jaxpr_utils.traced(call, weights, state, x)
  assert {"dot_general", "conv_general_dilated"} & jaxpr_utils.primitive_names(jaxpr)
  assert not jaxpr_utils.matmuls_off_dtype(jaxpr, low)
  out, _ = jax.jit(call)(weights, state, x)
  ref, _ = jax.jit(layer.stateless_call)(weights, state, x)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=5e-2, atol=5e-2)


@policies
@pytest.mark.slow
def test_multi_head_attention_with_fully_masked_rows_is_finite_and_close_to_float32(
  device_type, low
):
  keras.utils.set_random_seed(1)
  attention = layers.MultiHeadAttention(num_heads=2, key_dim=4)
  x = jnp.asarray(RNG.standard_normal((2, 5, 8)), jnp.float32)
  mask = np.ones((2, 5, 5), bool)
  mask[1, :, 3:] = False  # padding keys
  mask[1, 4, :] = False  # a query that sees no key
  attention(x, x, attention_mask=mask)  # builds the weights
  weights = [v.value for v in attention.trainable_variables]

  def run(weights, x):
    return attention.stateless_call(weights, [], x, x, attention_mask=mask)[0]

  out = jax.jit(jaxamp.autocast(run, device_type=device_type))(weights, x)
  ref = jax.jit(run)(weights, x)
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=5e-2, atol=5e-2)


@policies
def test_attention_with_an_all_padding_value_sequence_is_finite_and_close_to_float32(
  device_type, low
):
  # Keras's Attention shifts masked scores by 1e9 (65504 for float16 scores, decided at run
  # time): the shift traced in float32 must not become -inf in 16 bits.
  attention = layers.Attention()
  q = jnp.asarray(RNG.standard_normal((2, 3, 4)), jnp.float32)
  v = jnp.asarray(RNG.standard_normal((2, 5, 4)), jnp.float32)
  value_mask = np.ones((2, 5), bool)
  value_mask[1] = False  # a padding-only sequence

  def run(w, q, v):
    return attention([q @ w, v], mask=[None, value_mask])

  w = jnp.eye(4)
  out = jax.jit(jaxamp.autocast(run, device_type=device_type))(w, q, v)
  assert out.dtype == low and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(np.asarray(out, np.float32), run(w, q, v), rtol=5e-2, atol=5e-2)
  grad = jax.grad(lambda w: jaxamp.autocast(run, device_type=device_type)(w, q, v).sum())(w)
  assert bool(jnp.all(jnp.isfinite(grad)))


# --- Keras's losses and layers as the torch ops they are ------------------------------------------


def _sigmoid_classifier_loss(from_logits: bool, loss=keras.losses.BinaryCrossentropy):
  """A Dense logit, sigmoid or not, into a Keras binary ``loss``; row 0 predicts its label with
  logit 12 (float32's probability 0.999994 rounds to 1.0 in 16 bits)."""
  model = keras.Sequential([keras.Input((4,)), layers.Dense(1)])
  weights = [jnp.ones((4, 1)), jnp.zeros((1,))]
  bce = loss(from_logits=from_logits)

  def loss_fn(weights, x, y):
    logits = model.stateless_call(weights, [], x)[0]
    return bce(y, logits if from_logits else jax.nn.sigmoid(logits))

  x = np.array([[3.0, 3.0, 3.0, 3.0], [-1.0, 0.0, 1.0, 0.0]], np.float32)
  y = np.array([[1.0], [0.0]], np.float32)
  return loss_fn, (weights, x, y)


@pytest.mark.parametrize("from_logits", [False, True])
def test_binary_crossentropy_runs_in_float32_under_the_cpu_list(from_logits):
  """Keras's Loss casts its inputs to float32, a cast a float32 trace does not show; torch's CPU
  list runs binary_cross_entropy in float32. In bfloat16, 1 - 1e-7 rounded to 1: log(0) * 0."""
  loss_fn, args = _sigmoid_classifier_loss(from_logits)
  fun = jaxamp.autocast(loss_fn, device_type="cpu")
  np.testing.assert_allclose(jax.jit(fun)(*args), loss_fn(*args), rtol=1e-3)
  grads = jax.jit(jax.grad(fun))(*args)
  assert all(np.all(np.isfinite(g)) for g in grads)


def test_binary_crossentropy_from_logits_runs_in_float32_under_the_cuda_list():
  loss_fn, args = _sigmoid_classifier_loss(from_logits=True)
  out = jaxamp.autocast(loss_fn, device_type="cuda")(*args)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, loss_fn(*args), rtol=1e-3)


def test_binary_crossentropy_on_probabilities_raises_under_the_cuda_list_as_torch():
  loss_fn, args = _sigmoid_classifier_loss(from_logits=False)
  with pytest.raises(RuntimeError, match=r"from_logits=True"):
    jaxamp.autocast(loss_fn, device_type="cuda")(*args)


def test_binary_focal_crossentropy_from_logits_runs_in_float32_under_the_cuda_list():
  """Keras applies the sigmoid itself, then its probability-form crossentropy: torchvision's
  sigmoid_focal_loss, built on binary_cross_entropy_with_logits (float32 under CUDA)."""
  loss_fn, args = _sigmoid_classifier_loss(True, keras.losses.BinaryFocalCrossentropy)
  fun = jaxamp.autocast(loss_fn, device_type="cuda")
  assert fun(*args).dtype == jnp.float32
  np.testing.assert_allclose(fun(*args), loss_fn(*args), rtol=1e-3)
  assert all(np.all(np.isfinite(g)) for g in jax.grad(fun)(*args))


def test_binary_focal_crossentropy_on_probabilities_raises_under_the_cuda_list_as_torch():
  loss_fn, args = _sigmoid_classifier_loss(False, keras.losses.BinaryFocalCrossentropy)
  with pytest.raises(RuntimeError, match=r"from_logits=True"):
    jaxamp.autocast(loss_fn, device_type="cuda")(*args)


@policies
def test_categorical_crossentropy_on_probabilities_runs_in_float32(device_type, low):
  """A softmax output near one: in 16 bits Keras's clip to 1 - 1e-7 is a clip to 1."""
  model = keras.Sequential([keras.Input((4,)), layers.Dense(3, activation="softmax")])
  weights = [jnp.eye(4, 3) * 12.0, jnp.zeros((3,))]
  cce = keras.losses.SparseCategoricalCrossentropy()
  loss_fn = lambda w, x, y: cce(y, model.stateless_call(w, [], x)[0])
  x, y = np.eye(4, dtype=np.float32)[:3], np.arange(3)
  fun = jaxamp.autocast(loss_fn, device_type=device_type)
  np.testing.assert_allclose(fun(weights, x, y), loss_fn(weights, x, y), rtol=0.05, atol=1e-5)
  assert all(np.all(np.isfinite(g)) for g in jax.grad(fun)(weights, x, y))


LOW_LIST_LAYERS = {  # torch: prelu (lower precision), avg_pool2d and CPU's rms_norm (input dtype)
  "PReLU": lambda: layers.PReLU(),
  "AveragePooling2D(same)": lambda: layers.AveragePooling2D(3, 2, padding="same"),
  "RMSNormalization": lambda: layers.RMSNormalization(),
  "UpSampling2D(nearest)": lambda: layers.UpSampling2D(2, interpolation="nearest"),
  "UpSampling2D(bilinear)": lambda: layers.UpSampling2D(2, interpolation="bilinear"),
}
# On torch's CUDA float32 list: rms_norm, upsample_nearest2d and upsample_bilinear2d.
FLOAT32_UNDER_CUDA = {"RMSNormalization", "UpSampling2D(nearest)", "UpSampling2D(bilinear)"}


@policies
@pytest.mark.parametrize("name", list(LOW_LIST_LAYERS))
def test_a_layer_after_a_conv_has_torchs_dtype(name, device_type, low):
  if name in FLOAT32_UNDER_CUDA and device_type == "cuda":
    low = jnp.float32
  model = keras.Sequential(
    [keras.Input((6, 6, 3)), layers.Conv2D(4, 3, padding="same"), LOW_LIST_LAYERS[name]()]
  )
  trainable, non_trainable = _variables(model)
  call = lambda t, n, x: model.stateless_call(t, n, x)[0]
  # its own draw: the module's generator's state depends on which tests ran before on a worker
  x = np.random.default_rng(1).standard_normal((2, 6, 6, 3)).astype(np.float32)
  out = jaxamp.autocast(call, device_type=device_type)(trainable, non_trainable, x)
  assert out.dtype == low
  np.testing.assert_allclose(
    np.asarray(out, np.float32), call(trainable, non_trainable, x), rtol=0.05, atol=0.05
  )


# --- layers of a 16-bit dtype ---------------------------------------------------------------------

SIXTEEN_BIT_NORMS = {
  "LayerNormalization": lambda dtype: layers.LayerNormalization(dtype=dtype),
  "GroupNormalization": lambda dtype: layers.GroupNormalization(2, dtype=dtype),
  "BatchNormalization": lambda dtype: layers.BatchNormalization(dtype=dtype),
}  # (Keras's RMSNormalization returns float32 for a float32 input, whatever its dtype)


@policies
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(SIXTEEN_BIT_NORMS))
def test_a_16_bit_norm_layer_returns_its_own_dtype_for_a_float32_input(
  name, dtype, device_type, low
):
  # Keras computes the norm in float32 and converts the result to the layer's dtype: an explicit
  # cast, as torch's F.layer_norm(x, ...).half() (float16 under autocast too).
  layer = SIXTEEN_BIT_NORMS[name](dtype)
  layer.build(X.shape)
  trainable, non_trainable = _variables(layer)
  call = lambda t, n, x: layer.stateless_call(t, n, x)[0]
  out = jaxamp.autocast(call, device_type=device_type)(trainable, non_trainable, X)
  assert out.dtype == jnp.dtype(dtype) == call(trainable, non_trainable, X).dtype


@policies
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_batch_norm_keeps_its_16_bit_moving_statistics(dtype, device_type, low):
  # torch: BatchNorm1d(8).half() keeps float16 running stats under autocast (batch_norm is on no
  # list); a float32 layer's stay float32 (test_model_fit_trains_with_compute_loss_and_updates).
  layer = layers.BatchNormalization(dtype=dtype)
  layer.build(X.shape)
  trainable, non_trainable = _variables(layer)
  call = lambda t, n, x: layer.stateless_call(t, n, x, training=True)
  x = X.astype(dtype)
  out, stats = jaxamp.autocast(call, device_type=device_type)(trainable, non_trainable, x)
  want_out, want_stats = call(trainable, non_trainable, x)
  assert [v.dtype for v in stats] == [v.dtype for v in want_stats] == [jnp.dtype(dtype)] * 2
  assert out.dtype == want_out.dtype
  for got, want in zip(stats, want_stats, strict=True):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2)


def test_an_autocast_model_called_eagerly_sees_weights_assigned_since_its_last_call():
  # model(x) reads each variable's value when traced; assigning a variable (a fit, a restored
  # checkpoint) replaces the value its trace read, so the next call traces again.
  model = _classifier()
  amp = jaxamp.autocast(model, device_type="cpu")
  amp(X, training=False)
  for variable in model.trainable_variables:
    variable.assign(np.asarray(variable.value) * 0.5)
  np.testing.assert_allclose(amp(X, training=False), model(X, training=False), rtol=0.05, atol=0.02)


# --- model.fit and recurrent layers ---------------------------------------------------------------


class _AutocastSequential(keras.Sequential):
  """``model.fit`` under autocast: the one override a Keras user writes (a compiled model holds
  a dict keyed by its layers, which the autocast trace of its bound method meets)."""

  seen: dict = {}

  def compute_loss_and_updates(self, *args, training=False, optimizer_variables=None):
    base = super().compute_loss_and_updates

    def step(*args, optimizer_variables):
      return base(*args, training=training, optimizer_variables=optimizer_variables)

    out = jaxamp.autocast(step, device_type="cpu")(*args, optimizer_variables=optimizer_variables)
    self.seen.update(y_pred=out[1][1].dtype, state=[v.dtype for v in out[1][2]])
    return out


def test_model_fit_trains_with_compute_loss_and_updates_under_autocast():
  keras.utils.set_random_seed(0)
  model = _AutocastSequential(
    [
      keras.Input((6,)),
      layers.Dense(16, activation="relu"),
      layers.BatchNormalization(),
      layers.Dense(3),
    ]
  )
  model.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  history = model.fit(X, Y, batch_size=4, epochs=3, verbose=0)
  losses = history.history["loss"]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert model.seen["y_pred"] == jnp.bfloat16
  assert model.seen["state"] == [jnp.float32, jnp.float32]  # BatchNorm's moving statistics
  assert {v.dtype for v in model.variables} == {"float32"}


RECURRENT_LAYERS = {
  "LSTM": lambda: layers.LSTM(5, return_sequences=True),
  "SimpleRNN": lambda: layers.SimpleRNN(5, return_sequences=True),
}


@pytest.mark.parametrize("name", list(RECURRENT_LAYERS))
def test_a_recurrent_layer_runs_its_cells_in_float16_under_cuda_as_torch(name):
  # torch's CUDA list: LSTMCell, GRUCell and RNNCell cast input, state and weights, so the
  # sequence and the state come out float16.
  layer = RECURRENT_LAYERS[name]()
  x = RNG.standard_normal((2, 7, 3)).astype(np.float32)
  layer.build(x.shape)
  trainable, non_trainable = _variables(layer)
  call = lambda t, n, x: layer.stateless_call(t, n, x)[0]
  out = jaxamp.autocast(call, device_type="cuda")(trainable, non_trainable, x)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(
    np.asarray(out, np.float32), call(trainable, non_trainable, x), rtol=0.02, atol=0.02
  )


@pytest.mark.parametrize("unroll, state_dtype", [(False, jnp.float32), (True, jnp.float16)])
def test_an_lstms_returned_state_is_its_carry_in_the_carrys_dtype(unroll, state_dtype):
  # The README's Limits: a scan's carry keeps its declared dtype; unrolled, no scan carries it.
  layer = layers.LSTM(4, return_sequences=True, return_state=True, unroll=unroll)
  x = RNG.standard_normal((2, 5, 3)).astype(np.float32)
  layer.build(x.shape)
  trainable, non_trainable = _variables(layer)
  call = lambda t, n, x: layer.stateless_call(t, n, x)[0]
  sequence, h, c = jaxamp.autocast(call, device_type="cuda")(trainable, non_trainable, x)
  assert (sequence.dtype, h.dtype, c.dtype) == (jnp.float16, state_dtype, state_dtype)
