"""Library composites are recognised by identity: the registered function's code object among the
frames of an eqn's traceback. Every entry resolves, every entry is exercised, and the norm layers
of flax, Haiku and Equinox compute in float32 inside with torch's output dtype."""

from __future__ import annotations

import importlib
import subprocess
import sys

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jaxpr_utils import float_dtypes_of, primitive_names, traced, walk

import jaxamp
from jaxamp._src.autocast import library_ops, regions

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
KEY = jax.random.key(0)


def x_of(*shape, dtype=jnp.float32):
  """Distinct positive values of ``shape`` (well conditioned for the linear algebra below)."""
  size = int(np.prod(shape))
  return jnp.asarray(1.0 + np.arange(size).reshape(shape) / size, dtype)


def spd(n=3):
  return jnp.eye(n) * 3.0 + x_of(n, n) * 0.1


def ops_traced(fun, *args) -> set[str]:
  """The op names of every eqn (sub-jaxprs included) that ``fun(*args)`` traces to."""
  jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
  return {op.name for _, eqn in walk(jaxpr) for op in regions.marks_of(eqn).ops}


def linen(module, *args, mutable=False):
  variables = module.init(KEY, *args)
  return lambda v, *a: module.apply(v, *a, mutable=["batch_stats"] if mutable else False), (
    variables,
    *args,
  )


def nnx_call(module, *args):
  graphdef, state = nnx.split(module)
  return lambda s, *a: nnx.merge(graphdef, s)(*a), (state, *args)


def haiku(layer, *args, with_state=False):
  if with_state:
    model = hk.transform_with_state(layer)
    params, state = model.init(KEY, *args)
    return lambda params, s, *a: model.apply(params, s, None, *a)[0], (params, state, *args)
  model = hk.transform(layer)
  return lambda params, *a: model.apply(params, None, *a), (model.init(KEY, *args), *args)


def eqx_batch_norm(x):
  # mode="ema" fails on bfloat16 inputs with or without autocast (lax.select of f32 and bf16).
  norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
    x.shape[-1], axis_name="batch", mode="batch"
  )
  return lambda x, s: jax.vmap(lambda r: norm(r, s)[0], axis_name="batch")(x), (x, state)


def keras_layer(name: str, training: bool = False, inputs=None, **kwargs):
  """A Keras 3 layer's ``stateless_call`` on ``inputs`` (X); None without Keras (the
  ``thirdparty`` extra)."""
  inputs = X if inputs is None else inputs
  try:
    import keras  # noqa: PLC0415 (tests/conftest.py picks the JAX backend before this import)
  except ImportError:
    return None, ()
  layer = getattr(keras.layers, name)(**kwargs)
  layer.build(inputs.shape)
  variables = (
    [v.value for v in layer.trainable_variables],
    [v.value for v in layer.non_trainable_variables],
  )
  call_kwargs = {"training": True} if training else {}
  return (lambda t, n, x: layer.stateless_call(t, n, x, **call_kwargs)[0]), (*variables, inputs)


def keras_rnn(cell: str):
  """A Keras 3 ``RNN`` layer of a ``cell`` of 4 units over a sequence; None without Keras."""
  try:
    import keras  # noqa: PLC0415 (see keras_layer)
  except ImportError:
    return None, ()
  return keras_layer("RNN", inputs=x_of(2, 3, 4), cell=getattr(keras.layers, cell)(4))


def keras_function(name: str, fun, *args, module: str = "keras.src.backend.jax.nn"):
  """``fun(f, *args)`` of Keras's function ``name`` (of its JAX backend unless ``module``
  says); None without Keras."""
  try:
    keras_module = importlib.import_module(module)  # see keras_layer
  except ImportError:
    return None, ()
  return (lambda *a: fun(getattr(keras_module, name), *a)), args


X, V = x_of(2, 4), x_of(4)
LOGITS, LABELS = x_of(3, 5), jax.nn.one_hot(jnp.arange(3), 5)
INT_LABELS = jnp.arange(3)
CTC = (x_of(2, 6, 4), jnp.zeros((2, 6)), jnp.ones((2, 2), jnp.int32), jnp.zeros((2, 2)))
QKV = (x_of(1, 3, 2, 4),) * 3

# (module, attribute path) of every entry -> a function calling it and its arguments.
EXAMPLES = {
  ("jax.nn", "softmax"): (jax.nn.softmax, (X,)),
  ("jax.nn", "log_softmax"): (jax.nn.log_softmax, (X,)),
  ("jax.nn", "softplus"): (jax.nn.softplus, (X,)),
  ("jax.nn", "dot_product_attention"): (jax.nn.dot_product_attention, QKV),
  ("jax.nn", "gelu"): (jax.nn.gelu, (X,)),
  ("jax.nn", "silu"): (jax.nn.silu, (X,)),
  ("jax.nn", "elu"): (jax.nn.elu, (X,)),
  ("jax.nn", "celu"): (jax.nn.celu, (X,)),
  ("jax.nn", "selu"): (jax.nn.selu, (X,)),
  ("jax.nn", "log_sigmoid"): (jax.nn.log_sigmoid, (X,)),
  ("jax.nn", "mish"): (jax.nn.mish, (X,)),
  ("jax.nn", "glu"): (jax.nn.glu, (X,)),
  ("jax.nn", "relu"): (jax.nn.relu, (X,)),
  ("jax.nn", "standardize"): (jax.nn.standardize, (X,)),
  ("jax.scipy.special", "logsumexp"): (jax.nn.logsumexp, (X,)),
  ("jax.image", "resize"): (lambda a: jax.image.resize(a, (8, 8), "bilinear"), (X,)),
  ("jax.image", "scale_and_translate"): (
    lambda a: jax.image.scale_and_translate(
      a, (8, 8), (0, 1), jnp.array([2.0, 2.0]), jnp.zeros(2), "linear"
    ),
    (X,),
  ),
  ("jax.numpy", "tensordot"): (lambda a: jnp.tensordot(a, a.T, 1), (X,)),
  ("jax.numpy", "cross"): (lambda a: jnp.cross(a, a[::-1]), (x_of(3),)),
  ("jax.numpy", "trace"): (jnp.trace, (spd(),)),
  ("jax.numpy", "logspace"): (lambda a: a * jnp.logspace(0.0, 1.0, 4), (V,)),
  (library_ops._LAX_OTHER, "logaddexp"): (jnp.logaddexp, (X, X)),
  (library_ops._LAX_OTHER, "logaddexp2"): (jnp.logaddexp2, (X, X)),
  ("jax.numpy", "hypot"): (jnp.hypot, (X, X)),
  ("jax.numpy", "i0"): (jnp.i0, (X,)),
  ("jax.scipy.special", "i0"): (jax.scipy.special.i0, (X,)),
  ("jax.scipy.special", "i1"): (jax.scipy.special.i1, (X,)),
  ("jax.scipy.special", "xlogy"): (jax.scipy.special.xlogy, (X, X)),
  ("jax.scipy.special", "xlog1py"): (jax.scipy.special.xlog1py, (X, X)),
  ("jax.scipy.special", "entr"): (jax.scipy.special.entr, (X,)),
  ("jax.scipy.special", "logit"): (jax.scipy.special.logit, (X * 0.4,)),
  (library_ops._LAX_NUMPY, "_pad_symmetric_or_reflect"): (
    lambda a: jnp.pad(a, 1, mode="reflect"),
    (X,),
  ),
  (library_ops._LAX_NUMPY, "_pad_edge"): (lambda a: jnp.pad(a, 1, mode="edge"), (X,)),
  ("jax.numpy.linalg", "norm"): (jnp.linalg.norm, (X,)),
  ("jax.numpy.linalg", "pinv"): (jnp.linalg.pinv, (X,)),
  ("jax.numpy.linalg", "inv"): (jnp.linalg.inv, (spd(),)),
  ("jax.numpy.linalg", "solve"): (jnp.linalg.solve, (spd(), x_of(3))),
  ("jax.numpy.linalg", "tensorinv"): (
    lambda a: jnp.linalg.tensorinv(a.reshape(2, 2, 4), 2),
    (spd(4),),
  ),
  ("jax.numpy.linalg", "tensorsolve"): (
    lambda a, b: jnp.linalg.tensorsolve(a.reshape(2, 2, 4), b.reshape(2, 2)),
    (spd(4), x_of(4)),
  ),
  ("jax.numpy.linalg", "lstsq"): (lambda a, b: jnp.linalg.lstsq(a, b)[0], (spd(), x_of(3))),
  ("jax.lax.linalg", "cholesky"): (jnp.linalg.cholesky, (spd(),)),
  ("jax.lax.linalg", "eigh"): (lambda a: jnp.linalg.eigh(a)[0], (spd(),)),
  ("jax.numpy", "sum"): (jnp.sum, (X,)),
  ("jax.numpy", "prod"): (jnp.prod, (X,)),
  ("jax.numpy", "mean"): (jnp.mean, (X,)),
  ("jax.numpy", "cumsum"): (jnp.cumsum, (X,)),
  ("jax.numpy", "cumprod"): (jnp.cumprod, (X,)),
  ("jax.numpy", "quantile"): (lambda a: jnp.quantile(a, 0.5), (X,)),
  ("jax.numpy", "nanquantile"): (lambda a: jnp.nanquantile(a, 0.5), (X,)),
  ("jax.numpy", "nanmean"): (jnp.nanmean, (X,)),
  ("jax.numpy", "nansum"): (jnp.nansum, (X,)),
  ("jax.numpy", "var"): (jnp.var, (X,)),
  ("jax.numpy", "nanvar"): (jnp.nanvar, (X,)),
  ("jax.numpy", "std"): (jnp.std, (X,)),
  ("jax.numpy", "nanstd"): (jnp.nanstd, (X,)),
  ("jax.numpy", "round"): (lambda a: jnp.round(a, 2), (X,)),
  ("jax.numpy", "around"): (lambda a: jnp.around(a, 2), (X,)),
  ("jax.numpy", "median"): (jnp.median, (X,)),
  ("jax.numpy", "nanmedian"): (jnp.nanmedian, (X,)),
  ("jax.lax", "cumsum"): (jax.lax.cumsum, (X,)),
  ("jax.lax", "cumprod"): (jax.lax.cumprod, (X,)),
  ("jax.lax", "cumlogsumexp"): (jax.lax.cumlogsumexp, (X,)),
  ("jax._src.lax.windowed_reductions", "_reduce_window_sum"): (
    lambda a: jax.lax.reduce_window(a, 0.0, jax.lax.add, (1, 2), (1, 1), "VALID"),
    (X,),
  ),
  ("jax.lax", "conv_general_dilated_patches"): (
    lambda a: jax.lax.conv_general_dilated_patches(a, (2, 2), (1, 1), "VALID"),
    (x_of(1, 2, 3, 3),),
  ),
  ("jax.scipy.special", "ndtr"): (jax.scipy.special.ndtr, (X,)),
  ("jax.scipy.special", "ndtri"): (jax.scipy.special.ndtri, (X * 0.1,)),
  ("jax.scipy.special", "log_ndtr"): (jax.scipy.special.log_ndtr, (X,)),
  ("jax.scipy.special", "spence"): (jax.scipy.special.spence, (X,)),
  ("jax.scipy.special", "expi"): (jax.scipy.special.expi, (X,)),
  ("jax.scipy.special", "exp1"): (jax.scipy.special.exp1, (X,)),
  ("jax.scipy.special", "expn"): (lambda a: jax.scipy.special.expn(2, a), (X,)),
  ("jax.scipy.special", "sici"): (lambda a: jax.scipy.special.sici(a)[0], (X,)),
  ("jax.scipy.special", "hyp1f1"): (lambda a: jax.scipy.special.hyp1f1(1.0, 2.0, a), (X,)),
  ("jax.scipy.special", "hyp2f1"): (
    lambda a: jax.scipy.special.hyp2f1(1.0, 2.0, 3.0, a * 0.1),
    (X,),
  ),
  ("jax.scipy.special", "erfcx"): (lambda a: jax.scipy.special.erfcx(a), (X,)),
  ("jax.scipy.special", "dawsn"): (lambda a: jax.scipy.special.dawsn(a), (X,)),
  ("optax.losses", "sigmoid_binary_cross_entropy"): (
    optax.losses.sigmoid_binary_cross_entropy,
    (LOGITS, LABELS),
  ),
  ("optax.losses", "softmax_cross_entropy"): (optax.losses.softmax_cross_entropy, (LOGITS, LABELS)),
  ("optax.losses", "safe_softmax_cross_entropy"): (
    optax.losses.safe_softmax_cross_entropy,
    (LOGITS, LABELS),
  ),
  ("optax.losses", "softmax_cross_entropy_with_integer_labels"): (
    optax.losses.softmax_cross_entropy_with_integer_labels,
    (LOGITS, INT_LABELS),
  ),
  ("optax.losses", "kl_divergence"): (
    optax.losses.kl_divergence,
    (jax.nn.log_softmax(LOGITS), LABELS),
  ),
  ("optax.losses", "kl_divergence_with_log_targets"): (
    optax.losses.kl_divergence_with_log_targets,
    (jax.nn.log_softmax(LOGITS),) * 2,
  ),
  ("optax.losses", "ctc_loss"): (optax.losses.ctc_loss, CTC),
  ("optax.losses", "ctc_loss_with_forward_probs"): (
    lambda *a: optax.losses.ctc_loss_with_forward_probs(*a)[0],
    CTC,
  ),
  ("optax.losses", "multiclass_hinge_loss"): (
    optax.losses.multiclass_hinge_loss,
    (LOGITS, INT_LABELS),
  ),
  ("optax.losses", "squared_error"): (optax.losses.squared_error, (X, X * 0.5)),
  ("optax.losses", "l2_loss"): (optax.losses.l2_loss, (X, X * 0.5)),
  ("optax.losses", "huber_loss"): (optax.losses.huber_loss, (X, X * 0.5)),
  ("optax.losses", "cosine_similarity"): (optax.losses.cosine_similarity, (X, X[::-1])),
  ("optax.losses", "cosine_distance"): (optax.losses.cosine_distance, (X, X[::-1])),
  ("optax.losses", "triplet_margin_loss"): (
    optax.losses.triplet_margin_loss,
    (X, X * 0.5, X[::-1]),
  ),
  ("flax.linen", "Module.init"): (lambda x: nn.Dense(3).init(KEY, x), (X,)),
  ("flax.linen", "Module.init_with_output"): (
    lambda x: nn.Dense(3).init_with_output(KEY, x)[1],
    (X,),
  ),
  ("flax.linen", "Module.lazy_init"): (lambda x: nn.Dense(3).lazy_init(KEY, x), (X,)),
  ("flax.linen", "LayerNorm.__call__"): linen(nn.LayerNorm(), X),
  ("flax.linen", "GroupNorm.__call__"): linen(nn.GroupNorm(num_groups=2), X),
  ("flax.linen", "BatchNorm.__call__"): linen(
    nn.BatchNorm(use_running_average=False), X, mutable=True
  ),
  ("flax.linen", "RMSNorm.__call__"): linen(nn.RMSNorm(), X),
  ("flax.linen", "InstanceNorm.__call__"): linen(nn.InstanceNorm(), x_of(2, 3, 4)),
  ("flax.linen", "PReLU.__call__"): linen(nn.PReLU(), X),
  ("flax.linen", "avg_pool"): (lambda a: nn.avg_pool(a, (2,), padding="SAME"), (x_of(2, 3, 4),)),
  ("flax.nnx", "LayerNorm.__call__"): nnx_call(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), X),
  ("flax.nnx", "GroupNorm.__call__"): nnx_call(nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0)), X),
  ("flax.nnx", "BatchNorm.__call__"): nnx_call(nnx.BatchNorm(4, rngs=nnx.Rngs(0)), X),
  ("flax.nnx", "RMSNorm.__call__"): nnx_call(nnx.RMSNorm(4, rngs=nnx.Rngs(0)), X),
  ("flax.nnx", "InstanceNorm.__call__"): nnx_call(
    nnx.InstanceNorm(4, rngs=nnx.Rngs(0)), x_of(2, 3, 4)
  ),
  ("flax.nnx", "PReLU.__call__"): nnx_call(nnx.PReLU(), X),
  ("haiku._src.transform", "transform_with_state.<locals>.init_fn"): (
    lambda x: hk.transform(lambda x: hk.Linear(3)(x)).init(KEY, x),
    (X,),
  ),
  ("haiku", "LayerNorm.__call__"): haiku(lambda x: hk.LayerNorm(-1, True, True)(x), X),
  ("haiku", "GroupNorm.__call__"): haiku(lambda x: hk.GroupNorm(2)(x), x_of(2, 3, 4)),
  ("haiku", "BatchNorm.__call__"): haiku(
    lambda x: hk.BatchNorm(True, True, 0.9)(x, is_training=True), X, with_state=True
  ),
  ("haiku", "RMSNorm.__call__"): haiku(lambda x: hk.RMSNorm(-1)(x), X),
  ("haiku", "avg_pool"): (lambda a: hk.avg_pool(a, (1, 2, 1), (1, 2, 1), "SAME"), (x_of(2, 3, 4),)),
  ("equinox.nn", "LayerNorm.__call__"): (eqx.nn.LayerNorm(4), (V,)),
  ("equinox.nn", "GroupNorm.__call__"): (eqx.nn.GroupNorm(2, 4), (x_of(4, 3),)),
  ("equinox.nn", "BatchNorm.__call__"): eqx_batch_norm(X),
  ("equinox.nn", "RMSNorm.__call__"): (eqx.nn.RMSNorm(4), (V,)),
  ("equinox.nn", "PReLU.__call__"): (eqx.nn.PReLU(), (V,)),
  ("equinox.nn", "AvgPool1d.__call__"): (eqx.nn.AvgPool1d(2), (x_of(3, 4),)),
  ("equinox.nn", "AvgPool2d.__call__"): (eqx.nn.AvgPool2d(2), (x_of(3, 4, 4),)),
  ("equinox.nn", "AvgPool3d.__call__"): (eqx.nn.AvgPool3d(2), (x_of(3, 4, 4, 4),)),
  ("equinox.nn", "AdaptivePool.__call__"): (eqx.nn.AdaptiveAvgPool2d(2), (x_of(3, 4, 4),)),
  ("flax.linen", "LSTMCell.__call__"): linen(nn.LSTMCell(4), (X, X), X),
  ("flax.linen", "OptimizedLSTMCell.__call__"): linen(nn.OptimizedLSTMCell(4), (X, X), X),
  ("flax.linen", "GRUCell.__call__"): linen(nn.GRUCell(4), X, X),
  ("flax.linen", "SimpleCell.__call__"): linen(nn.SimpleCell(4), X, X),
  ("flax.nnx", "LSTMCell.__call__"): nnx_call(nnx.LSTMCell(4, 4, rngs=nnx.Rngs(0)), (X, X), X),
  ("flax.nnx", "OptimizedLSTMCell.__call__"): nnx_call(
    nnx.OptimizedLSTMCell(4, 4, rngs=nnx.Rngs(0)), (X, X), X
  ),
  ("flax.nnx", "GRUCell.__call__"): nnx_call(nnx.GRUCell(4, 4, rngs=nnx.Rngs(0)), X, X),
  ("flax.nnx", "SimpleCell.__call__"): nnx_call(nnx.SimpleCell(4, 4, rngs=nnx.Rngs(0)), X, X),
  ("haiku", "LSTM.__call__"): haiku(lambda x: hk.LSTM(4)(x, hk.LSTMState(x, x)), X),
  ("haiku", "GRU.__call__"): haiku(lambda x: hk.GRU(4)(x, x), X),
  ("haiku", "VanillaRNN.__call__"): haiku(lambda x: hk.VanillaRNN(4)(x, x), X),
  ("equinox.nn", "LSTMCell.__call__"): (eqx.nn.LSTMCell(4, 4, key=KEY), (V, (V, V))),
  ("equinox.nn", "GRUCell.__call__"): (eqx.nn.GRUCell(4, 4, key=KEY), (V, V)),
  ("keras.layers", "BatchNormalization.call"): keras_layer("BatchNormalization", training=True),
  ("keras.layers", "LayerNormalization.call"): keras_layer("LayerNormalization"),
  ("keras.layers", "GroupNormalization.call"): keras_layer("GroupNormalization", groups=2),
  ("keras.layers", "RMSNormalization.call"): keras_layer("RMSNormalization"),
  ("keras.layers", "PReLU.call"): keras_layer("PReLU"),
  ("keras.layers", "LSTMCell.call"): keras_rnn("LSTMCell"),
  ("keras.layers", "GRUCell.call"): keras_rnn("GRUCell"),
  ("keras.layers", "SimpleRNNCell.call"): keras_rnn("SimpleRNNCell"),
  ("keras.layers", "UpSampling1D.call"): keras_layer("UpSampling1D", inputs=x_of(2, 3, 4)),
  ("keras.layers", "UpSampling2D.call"): keras_layer("UpSampling2D", inputs=x_of(2, 3, 3, 4)),
  ("keras.layers", "UpSampling3D.call"): keras_layer("UpSampling3D", inputs=x_of(2, 2, 2, 2, 3)),
  ("keras.src.backend.jax.nn", "average_pool"): keras_function(
    "average_pool", lambda f, x: f(x, (2, 2), (2, 2), padding="same"), x_of(2, 3, 3, 4)
  ),
  ("keras.src.backend.jax.nn", "adaptive_average_pool"): keras_function(
    "adaptive_average_pool", lambda f, x: f(x, 2), x_of(2, 4, 4, 3)
  ),
  ("keras.src.backend.jax.nn", "adaptive_max_pool"): keras_function(
    "adaptive_max_pool", lambda f, x: f(x, 2), x_of(2, 4, 4, 3)
  ),
  ("keras.src.backend.jax.nn", "categorical_crossentropy"): keras_function(
    "categorical_crossentropy", lambda f, p, y: f(y, p), jax.nn.softmax(LOGITS), LABELS
  ),
  ("keras.src.backend.jax.nn", "sparse_categorical_crossentropy"): keras_function(
    "sparse_categorical_crossentropy", lambda f, p, y: f(y, p), jax.nn.softmax(LOGITS), INT_LABELS
  ),
  ("keras.src.backend.jax.nn", "binary_crossentropy"): keras_function(
    "binary_crossentropy", lambda f, p, y: f(y, p), jax.nn.sigmoid(X), jnp.ones_like(X)
  ),
  ("keras.losses", "binary_focal_crossentropy"): keras_function(
    "binary_focal_crossentropy",
    lambda f, logits, y: f(y, logits, from_logits=True),
    X,
    jnp.ones_like(X),
    module="keras.losses",
  ),
  ("keras.src.backend.jax.nn", "ctc_loss"): keras_function(
    "ctc_loss",
    lambda f, logits, labels: f(labels, logits, jnp.array([2, 1]), jnp.array([6, 6])),
    x_of(2, 6, 4),
    jnp.array([[1, 2], [3, 0]]),
  ),
}


# Each sampler of jax.random, drawing in bfloat16 with its other parameters at their defaults.
RANDOM_ARGS = {
  "truncated_normal": (-1.0, 1.0),
  "lognormal": (0.5,),
  "generalized_normal": (1.5,),
  "rayleigh": (1.0,),
  "wald": (1.0,),
  "weibull_min": (1.0, 1.5),
  "pareto": (2.0,),
  "double_sided_maxwell": (0.0, 1.0),
  "triangular": (0.0, 0.5, 1.0),
  "ball": (3,),
  "orthogonal": (3,),
}


def random_draw(name: str):
  """jax.random's sampler ``name`` drawing in bfloat16, and its arguments."""
  sampler, args = getattr(jax.random, name), RANDOM_ARGS.get(name, ())
  shape = () if name == "orthogonal" else (4,)
  return (lambda key: sampler(key, *args, shape=shape, dtype=jnp.bfloat16)), (KEY,)


EXAMPLES.update({("jax.random", name): random_draw(name) for name in library_ops.RANDOM_SAMPLERS})


def _entry_id(entry):
  return f"{entry[0]}.{entry[1]}"


def test_every_entry_has_an_example():
  assert {(module, path) for module, path, _ in library_ops.LIBRARY_OPS} == set(EXAMPLES)


def _skip_where_the_library_lacks_it(entry) -> None:
  module, path, _ = entry
  if entry not in library_ops.EAGER_OPS_IF_PRESENT + library_ops.LAZY_OPS_IF_PRESENT:
    return
  try:
    regions.resolve(module, path)
  except ImportError:
    pytest.skip(f"{module} is not installed (the thirdparty extra)")
  except AttributeError:
    pytest.skip(f"{module}.{path} is newer than the installed {module}")


@pytest.mark.parametrize("entry", library_ops.LIBRARY_OPS, ids=_entry_id)
def test_every_entry_resolves_to_a_python_function(entry):
  _skip_where_the_library_lacks_it(entry)
  module, path, _ = entry
  if EXAMPLES[module, path][0] is None:
    pytest.skip(f"{module} is not installed (the thirdparty extra)")
  importlib.import_module(module)
  assert regions.code_of(regions.resolve(module, path)).co_name == path.rpartition(".")[2]


@pytest.mark.parametrize("entry", library_ops.LIBRARY_OPS, ids=_entry_id)
def test_eqns_traced_inside_every_entry_are_recognised_as_its_op(entry):
  _skip_where_the_library_lacks_it(entry)
  module, path, name = entry
  fun, args = EXAMPLES[module, path]
  if fun is None:
    pytest.skip(f"{module} is not installed (the thirdparty extra)")
  assert name in ops_traced(fun, *args)


def test_a_function_is_recognised_by_its_code_not_by_its_name():
  def softmax(x):  # jax.nn.softmax's name, another function
    return jnp.exp(x) / jnp.sum(jnp.exp(x))

  assert "softmax" not in ops_traced(softmax, X)


@pytest.mark.slow
def test_importing_jaxamp_imports_none_of_the_optional_libraries():
  script = (
    "import sys, jaxamp; print(sorted(m for m in ('flax', 'haiku', 'equinox') if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# Norm layers under the CPU policy: float32 inside, the input's dtype out, as torch's kernels.

XB = (x_of(2, 3, 8) * 4.0).astype(jnp.bfloat16)


def _eqx_vmapped(layer):
  return lambda m, x: jax.vmap(jax.vmap(m))(x), (layer, XB)


def _eqx_batch_norm_state():
  return eqx_batch_norm(XB.reshape(6, 8))


NORM_LAYERS = {
  "jax.nn.standardize": (lambda x: jax.nn.standardize(x, axis=-1), (XB,)),
  "haiku.LayerNorm": haiku(lambda x: hk.LayerNorm(-1, True, True)(x), XB),
  "haiku.BatchNorm": haiku(
    lambda x: hk.BatchNorm(True, True, 0.9)(x, is_training=True), XB, with_state=True
  ),
  "haiku.RMSNorm": haiku(lambda x: hk.RMSNorm(-1)(x), XB),
  "equinox.LayerNorm": _eqx_vmapped(eqx.nn.LayerNorm(8)),
  "equinox.RMSNorm": _eqx_vmapped(eqx.nn.RMSNorm(8)),
  "equinox.GroupNorm": (lambda m, x: jax.vmap(m)(x), (eqx.nn.GroupNorm(3, 3), XB)),
  "equinox.BatchNorm": _eqx_batch_norm_state(),
  "flax.linen.RMSNorm": linen(nn.RMSNorm(), XB),
  "flax.linen.InstanceNorm": linen(nn.InstanceNorm(), XB),
  "flax.nnx.RMSNorm": nnx_call(nnx.RMSNorm(8, rngs=nnx.Rngs(0)), XB),
}


@pytest.mark.parametrize("layer", sorted(NORM_LAYERS))
def test_norm_layer_normalises_in_float32_and_returns_the_input_dtype_on_cpu(layer):
  fun, args = NORM_LAYERS[layer]
  jaxpr = traced(jaxamp.autocast(fun, device_type="cpu"), *args)
  normalising = primitive_names(jaxpr) & {"rsqrt", "div"}
  assert normalising, primitive_names(jaxpr)
  for primitive in normalising:
    assert float_dtypes_of(jaxpr, primitive) == {F32}, primitive
  assert [v.aval.dtype for v in jaxpr.outvars] == [BF16]


# ------------------------------------------------------------------------------------------------
# Average pooling and interpolation: torch's kernels, whatever the library computes them with.

F16 = jnp.dtype(jnp.float16)
CONV_KERNEL = x_of(3, 3, 4, 4) * 0.1


def _conv(x):
  return jax.lax.conv_general_dilated(
    x, CONV_KERNEL, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


AVERAGE_POOLS = {  # each divides a 16-bit window sum by window counts pooled from a float32 fill
  "flax.linen.avg_pool(count_include_pad=False)": lambda h: nn.avg_pool(
    h, (3, 3), (2, 2), padding="SAME", count_include_pad=False
  ),
  "flax.nnx.avg_pool(count_include_pad=False)": lambda h: nnx.avg_pool(
    h, (3, 3), (2, 2), padding="SAME", count_include_pad=False
  ),
  "haiku.avg_pool(SAME)": lambda h: hk.avg_pool(h, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
  "haiku.AvgPool(SAME)": lambda h: hk.transform(
    lambda h: hk.AvgPool((1, 3, 3, 1), (1, 2, 2, 1), "SAME")(h)
  ).apply({}, None, h),
}


@pytest.mark.parametrize("device_type, low", [("cuda", F16), ("cpu", BF16), ("tpu", BF16)])
@pytest.mark.parametrize("name", sorted(AVERAGE_POOLS))
def test_an_average_pool_returns_its_inputs_16_bit_dtype(name, device_type, low):
  # torch's avg_pool2d is on no list: its kernel accumulates in float32 and returns the input's
  # dtype, also with count_include_pad=False (checked: bfloat16 under autocast("cpu")).
  pool = AVERAGE_POOLS[name]
  fun = jaxamp.autocast(lambda x: pool(_conv(x)), device_type=device_type)
  x = x_of(2, 6, 6, 4)
  out = jax.jit(fun)(x)
  assert out.dtype == low
  np.testing.assert_allclose(np.asarray(out, np.float32), pool(_conv(x)), rtol=1e-2)


def _keras_average_pool(h):
  keras = pytest.importorskip("keras")
  return keras.layers.AveragePooling2D(3, 2, padding="same")(h)


AVERAGE_POOLS["keras.layers.AveragePooling2D(same)"] = _keras_average_pool

POOLS_2D = {  # the unbatched Equinox layers add a batch axis of their own, vmap another
  "eqx.nn.MaxPool2d": lambda h: eqx.nn.MaxPool2d(2, 2)(h),
  "eqx.nn.AvgPool2d": lambda h: eqx.nn.AvgPool2d(2, 2)(h),
  "flax max_pool of one example": lambda h: nn.max_pool(h[None], (2, 2), (2, 2))[0],
}
POOLS_3D = {
  "eqx.nn.MaxPool3d": lambda h: eqx.nn.MaxPool3d(2, 2)(h),
  "eqx.nn.AvgPool3d": lambda h: eqx.nn.AvgPool3d(2, 2)(h),
  "flax max_pool of one example": lambda h: nn.max_pool(h[None], (2, 2, 2), (2, 2, 2))[0],
}


def _keras_adaptive_pool(name: str, size):
  def pool(h):
    keras = pytest.importorskip("keras")
    if not hasattr(keras.layers, name):
      pytest.skip(f"keras.layers.{name} is newer than Keras {keras.__version__}")
    return getattr(keras.layers, name)(size)(h[None])[0]

  return pool


# Adaptive pools (torch's adaptive_{avg,max}_pool*d): Equinox's reduce one axis after another with
# jnp.mean or jnp.max, Keras's with 1-D window reductions; sizes 4 -> 2 split evenly, 4 -> 3 not.
for size in (2, 3):
  POOLS_2D |= {
    f"eqx.nn.AdaptiveAvgPool2d({size})": eqx.nn.AdaptiveAvgPool2d(size),
    f"eqx.nn.AdaptiveMaxPool2d({size})": eqx.nn.AdaptiveMaxPool2d(size),
    f"keras AdaptiveAveragePooling2D({size})": _keras_adaptive_pool(
      "AdaptiveAveragePooling2D", size
    ),
    f"keras AdaptiveMaxPooling2D({size})": _keras_adaptive_pool("AdaptiveMaxPooling2D", size),
  }
  POOLS_3D |= {
    f"eqx.nn.AdaptiveAvgPool3d({size})": eqx.nn.AdaptiveAvgPool3d(size),
    f"eqx.nn.AdaptiveMaxPool3d({size})": eqx.nn.AdaptiveMaxPool3d(size),
    f"keras AdaptiveAveragePooling3D({size})": _keras_adaptive_pool(
      "AdaptiveAveragePooling3D", size
    ),
    f"keras AdaptiveMaxPooling3D({size})": _keras_adaptive_pool("AdaptiveMaxPooling3D", size),
  }


def _pooled_under_cpu(pool, example_shape, batched):
  """The dtype of ``pool`` (or a pad) of a bfloat16 product under "cpu", on one example or
  vmapped."""
  w = x_of(example_shape[-1], example_shape[-1])
  one = lambda x: pool(x @ w)
  fun = jax.vmap(one) if batched else one
  shape = (2, *example_shape) if batched else example_shape
  return jaxamp.autocast(fun, device_type="cpu")(x_of(*shape)).dtype


@pytest.mark.parametrize("batched", [False, True], ids=["one example", "vmapped"])
@pytest.mark.parametrize("name", sorted(POOLS_2D))
def test_a_2d_pool_is_bfloat16_on_cpu_whatever_the_batch_axes(name, batched):
  """torch's CPU list has only the 3-D pools: which one a pooling is goes by how many dimensions
  its window spans, not by its operand's rank (a vmapped 2-D pool has rank 5)."""
  assert _pooled_under_cpu(POOLS_2D[name], (3, 4, 4), batched) == BF16


@pytest.mark.parametrize("batched", [False, True], ids=["one example", "vmapped"])
@pytest.mark.parametrize("name", sorted(POOLS_3D))
def test_a_3d_pool_is_float32_on_cpu_whatever_the_batch_axes(name, batched):
  assert _pooled_under_cpu(POOLS_3D[name], (3, 4, 4, 4), batched) == F32


@pytest.mark.parametrize("batched", [False, True], ids=["one example", "vmapped"])
@pytest.mark.parametrize("mode", ["reflect", "symmetric"])
@pytest.mark.parametrize("dims, dtype", [(1, F32), (2, F32), (3, BF16)], ids=["1d", "2d", "3d"])
def test_a_reflection_pad_is_float32_on_cpu_but_in_3d(dims, dtype, mode, batched):
  """torch's CPU float32 list has reflection_pad1d and reflection_pad2d, not reflection_pad3d:
  which one a jnp.pad is goes by how many axes it pads, not by its operand's rank."""
  widths = ((0, 0),) + ((2, 1),) * dims + ((0, 0),) * (3 - dims)
  pad = lambda h: jnp.pad(h, widths, mode=mode)
  assert _pooled_under_cpu(pad, (3, 4, 4, 4), batched) == dtype


@pytest.mark.parametrize("device_type, low", [("cuda", F16), ("cpu", F32)])
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_a_3d_average_pool_is_torchs_avg_pool3d(device_type, low, count_include_pad):
  # avg_pool3d is on torch's CPU float32 list, unlisted on CUDA.
  pool = lambda x, w: nn.avg_pool(
    x @ w, (2, 2, 2), padding="SAME", count_include_pad=count_include_pad
  )
  out = jaxamp.autocast(pool, device_type=device_type)(x_of(2, 4, 4, 4, 3), x_of(3, 3))
  assert out.dtype == low


@pytest.mark.parametrize("method", ["nearest", "bilinear", "bicubic", "lanczos3"])
@pytest.mark.parametrize("device_type, out_dtype", [("cuda", F32), ("xpu", F32), ("cpu", BF16)])
def test_jax_image_resize_is_torchs_interpolate(method, device_type, out_dtype):
  # torch 2.13 lists upsample_* as float32 for CUDA and XPU (AT_FORALL_FP32); on CPU they are
  # unlisted and return the input's dtype (checked: bfloat16 under autocast("cpu")).
  resize = lambda x, w: jax.image.resize(x @ w, (2, 8, 8, 3), method)
  out = jaxamp.autocast(resize, device_type=device_type)(x_of(2, 4, 4, 3), x_of(3, 3))
  assert out.dtype == out_dtype


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "cpu", "tpu"])
def test_optax_ctc_loss_runs_in_float32_and_stays_finite_where_float32_is(device_type):
  # torch's CTC loss has no 16-bit kernel on CUDA and XPU and is on CPU's float32 list. In 16
  # bits optax's one-hot products met log(0)'s -1e5 as -inf: a NaN for the padded label row.
  logits = jax.random.normal(jax.random.key(0), (2, 6, 20))
  labels = jnp.array([[3, 4, 5, 6, 7], [6, 7, 0, 0, 0]])
  label_paddings = jnp.array([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]], jnp.float32)

  def loss(logits):
    return optax.ctc_loss(logits, jnp.zeros(logits.shape[:2]), labels, label_paddings)

  out = jax.jit(jaxamp.autocast(loss, device_type=device_type))(logits)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, jax.jit(loss)(logits), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# jaxamp.register_op on a function object: recognised by identity, not wrapped.


def third_party_rms_norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


# A Gram matrix made by a float16 matmul, finite, with entries past 32752: symmetrizing it in
# float16 (``a + a.T``) overflows. dynamax's InverseWishart prior builds one (through TFP).
GRAM_FACTOR = jnp.array([[189.5, 0.0], [121.2, 23.9]])
SYMMETRIZED = {
  "cholesky": jnp.linalg.cholesky,
  "eigh": lambda a: jnp.linalg.eigh(a)[0],
  "eigvalsh": jnp.linalg.eigvalsh,
  "scipy_eigh": lambda a: jax.scipy.linalg.eigh(a)[0],
  "lax_cholesky": jax.lax.linalg.cholesky,
}


@pytest.mark.parametrize("device_type", ["cuda", "cpu", "xpu", "tpu"])
@pytest.mark.parametrize("name", sorted(SYMMETRIZED))
def test_linear_algebra_symmetrizes_a_16_bit_input_in_float32(name, device_type):
  fun = lambda y: SYMMETRIZED[name](y.T @ y)
  got = jax.jit(jaxamp.autocast(fun, device_type=device_type))(GRAM_FACTOR)
  gram = jaxamp.autocast(lambda y: y.T @ y, device_type=device_type)(GRAM_FACTOR)
  expected = SYMMETRIZED[name](gram.astype(jnp.float32))  # the 16-bit matrix, in float32
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=1e-2)  # XLA may keep the product unrounded


@pytest.mark.parametrize("device_type", ["cuda", "cpu", "xpu", "tpu"])
def test_optax_cosine_distance_is_torchs_cosine_embedding_loss_in_float32(device_type):
  # 1 - cos of nearly aligned 16-bit embeddings: computed in bfloat16 it rounds to 0 or 0.004.
  low = jaxamp.get_autocast_dtype(device_type)
  a = jax.random.normal(KEY, (4, 64)).astype(low)
  b = (a + 1e-2 * jax.random.normal(jax.random.key(1), (4, 64))).astype(low)
  got = jax.jit(jaxamp.autocast(optax.losses.cosine_distance, device_type=device_type))(a, b)
  expected = optax.losses.cosine_distance(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, expected, rtol=1e-2)  # float32 rounds 1 - cos too


def test_register_op_recognises_a_function_object_without_wrapping_it():
  assert jaxamp.register_op(third_party_rms_norm, name="rms_norm") is third_party_rms_norm
  jaxpr = traced(jaxamp.autocast(third_party_rms_norm, device_type="cpu"), XB)
  assert float_dtypes_of(jaxpr, "rsqrt") == {F32}
  assert [v.aval.dtype for v in jaxpr.outvars] == [BF16]


def test_register_op_of_a_function_object_gives_its_default_category():
  def scaled(x):
    return jnp.exp(x) * 2.0

  jaxamp.register_op(scaled, name="test_library_ops.scaled", category="float32")
  jaxpr = traced(jaxamp.autocast(scaled, device_type="cpu"), XB)
  assert float_dtypes_of(jaxpr, "exp") == {F32}


def test_register_op_of_a_function_object_needs_a_name():
  with pytest.raises(TypeError, match="`name` must be a non-empty string"):
    jaxamp.register_op(third_party_rms_norm)


def test_register_op_of_a_callable_without_python_code_is_a_type_error():
  with pytest.raises(TypeError, match="no Python code object"):
    jaxamp.register_op(len, name="len")


def test_register_op_again_with_another_category_raises():
  jaxamp.register_op("test_library_ops.twice", category="float32")
  jaxamp.register_op("test_library_ops.twice", category="float32")  # the same: allowed
  jaxamp.register_op("test_library_ops.twice")  # no category: keeps float32
  assert regions._user_defaults["test_library_ops.twice"] is jaxamp.Category.FLOAT32
  with pytest.raises(ValueError, match="registered with category 'float32'"):
    jaxamp.register_op("test_library_ops.twice", category="lower")


# ------------------------------------------------------------------------------------------------
# Window sums, variances and scans of 16-bit values: torch's kernels accumulate in float32 and
# round once, whatever spelling the JAX program uses.

LOW_DTYPES = [("cuda", F16), ("cpu", BF16), ("tpu", BF16), ("xpu", F16)]


def _within_one_ulp(actual, exact_float32, low) -> None:
  expected = np.asarray(exact_float32).astype(low)
  one_ulp = np.spacing(np.abs(expected)).astype(np.float64)
  error = np.abs(np.asarray(actual, np.float64) - expected.astype(np.float64))
  assert (error <= one_ulp).all(), float((error / one_ulp).max())


def _through_a_dot(x):
  """``x`` and an identity: ``x @ w`` is 16-bit under autocast, float32 when traced."""
  return x, jnp.eye(x.shape[-1], dtype=jnp.float32)


def _sum_pool_16(h):
  return jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 16, 16, 1), (1, 16, 16, 1), "VALID") / 256


@pytest.mark.parametrize("device_type, low", LOW_DTYPES)
def test_a_hand_written_window_sum_accumulates_in_float32(device_type, low):
  pool = _sum_pool_16
  x, w = _through_a_dot(x_of(1, 16, 16, 2) + 0.5)
  out = jax.jit(jaxamp.autocast(lambda x, w: pool(x @ w), device_type=device_type))(x, w)
  assert out.dtype == low
  _within_one_ulp(out, pool(x.astype(low).astype(F32)), low)


OFFSET_ROWS = jnp.asarray(
  1000.0 + 4.0 * np.random.default_rng(0).standard_normal((3, 8)), jnp.float32
)


@pytest.mark.parametrize("device_type, low", LOW_DTYPES)
@pytest.mark.parametrize("reduction", [jnp.var, jnp.std, jnp.nanvar, jnp.nanstd])
def test_a_variance_centres_on_a_float32_mean(reduction, device_type, low):
  # A mean rounded to 16 bits first is off by up to half a unit at 1000 (2 in bfloat16), which
  # the variance of values 4 apart cannot absorb.
  x, w = _through_a_dot(OFFSET_ROWS)
  fun = lambda x, w: reduction(x @ w, axis=-1)
  out = jax.jit(jaxamp.autocast(fun, device_type=device_type))(x, w)
  assert out.dtype == low
  _within_one_ulp(out, reduction(x.astype(low).astype(F32), axis=-1), low)


def test_logcumsumexp_returns_float16_under_cuda_accumulated_in_float32():
  # Not on torch's CUDA lists: its kernel returns the input's dtype.
  x, w = _through_a_dot(x_of(2, 256) + 0.5)
  fun = lambda x, w: jax.lax.cumlogsumexp(x @ w, axis=1)
  out = jax.jit(jaxamp.autocast(fun, device_type="cuda"))(x, w)
  assert out.dtype == F16
  _within_one_ulp(out, jax.lax.cumlogsumexp(x.astype(F16).astype(F32), axis=1), F16)


@pytest.mark.parametrize("scan", [jnp.cumsum, jax.lax.cumsum, jax.lax.cumlogsumexp])
def test_a_scan_accumulates_in_float32_on_cpu(scan):
  x, w = _through_a_dot(x_of(2, 256) + 0.5)
  out = jax.jit(jaxamp.autocast(lambda x, w: scan(x @ w, axis=1), device_type="cpu"))(x, w)
  assert out.dtype == BF16
  _within_one_ulp(out, scan(x.astype(BF16).astype(F32), axis=1), BF16)


@pytest.mark.parametrize("device_type, low", LOW_DTYPES)
@pytest.mark.parametrize("rounding", [jnp.round, jnp.around])
def test_rounding_to_decimals_computes_in_float32(rounding, device_type, low):
  # 700 * 10**2 overflows float16: jnp.round upcasts float16 itself, which a float32 trace lacks.
  x, w = _through_a_dot(jnp.asarray([[0.333, 1.0, 700.0, 3000.0]]))
  out = jax.jit(jaxamp.autocast(lambda x, w: rounding(x @ w, 2), device_type=device_type))(x, w)
  assert out.dtype == low
  _within_one_ulp(out, rounding(x.astype(low).astype(F32), 2), low)


@pytest.mark.parametrize("device_type, low", [("cuda", F16), ("cpu", BF16)])
def test_a_prelu_with_a_weakly_typed_slope_runs_in_the_low_dtype(device_type, low):
  """``jnp.full((n,), 0.25)`` is weakly typed: JAX makes it strong with a convert to float32,
  which inside torch's lower-precision ``prelu`` is no dtype request."""
  prelu = eqx.nn.PReLU(jnp.full((4,), 0.25))
  assert prelu.negative_slope.weak_type
  fun = lambda p, x, w: p(x @ w)
  out = jaxamp.autocast(fun, device_type=device_type)(prelu, V, x_of(4, 4) - 1.5)
  assert out.dtype == low
  np.testing.assert_allclose(
    np.asarray(out, np.float32), fun(prelu, V, x_of(4, 4) - 1.5), rtol=1e-2
  )
