"""Library functions autocast recognises as one torch op, from their eqns' tracebacks.

Each entry is (path suffix of the defining file, function's qualified name, op name). The op name
keys the policy tables: a table row decides the category; ops without a row run in the dtypes
of their inputs, as torch runs its unlisted ops (so ``gelu`` under the CUDA policy does not send
its ``x**3`` to float32 the way a bare ``pow`` would).
"""

from jaxamp._src import regions

_NN = "jax/_src/nn/functions.py"
_NUMPY = "jax/_src/numpy/"
_OPTAX_CLS = "optax/losses/_classification.py"
_OPTAX_REG = "optax/losses/_regression.py"
_OPTAX_SELF = "optax/losses/_self_supervised.py"

LIBRARY_OPS = (
    # jax.nn
    (_NN, "softmax", "softmax"),
    (_NN, "log_softmax", "log_softmax"),
    (_NN, "softplus", "softplus"),
    (_NN, "dot_product_attention", "scaled_dot_product_attention"),
    (_NN, "gelu", "gelu"),
    (_NN, "silu", "silu"),
    (_NN, "elu", "elu"),
    (_NN, "celu", "celu"),
    (_NN, "selu", "selu"),
    (_NN, "log_sigmoid", "log_sigmoid"),
    (_NN, "mish", "mish"),
    (_NN, "glu", "glu"),
    # jax.numpy
    (_NUMPY + "tensor_contractions.py", "tensordot", "tensordot"),
    (_NUMPY + "lax_numpy.py", "cross", "cross"),
    (_NUMPY + "lax_numpy.py", "trace", "trace"),
    (_NUMPY + "lax_numpy.py", "_pad_symmetric_or_reflect", "reflection_pad"),
    (_NUMPY + "lax_numpy.py", "_pad_edge", "replication_pad"),
    (_NUMPY + "linalg.py", "norm", "norm"),
    (_NUMPY + "linalg.py", "pinv", "pinverse"),
    (_NUMPY + "linalg.py", "inv", "inverse"),
    (_NUMPY + "linalg.py", "solve", "linalg_solve"),
    (_NUMPY + "linalg.py", "tensorinv", "linalg_tensorinv"),
    (_NUMPY + "linalg.py", "tensorsolve", "linalg_tensorsolve"),
    (_NUMPY + "linalg.py", "lstsq", "linalg_lstsq"),
    (_NUMPY + "reductions.py", "sum", "sum"),
    (_NUMPY + "reductions.py", "prod", "prod"),
    (_NUMPY + "reductions.py", "mean", "mean"),
    (_NUMPY + "reductions.py", "cumsum", "cumsum"),
    (_NUMPY + "reductions.py", "cumprod", "cumprod"),
    (_NUMPY + "reductions.py", "quantile", "quantile"),
    (_NUMPY + "reductions.py", "nanquantile", "quantile"),
    # optax losses
    (_OPTAX_CLS, "sigmoid_binary_cross_entropy", "binary_cross_entropy_with_logits"),
    (_OPTAX_CLS, "softmax_cross_entropy", "cross_entropy"),
    (_OPTAX_CLS, "safe_softmax_cross_entropy", "cross_entropy"),
    (_OPTAX_CLS, "softmax_cross_entropy_with_integer_labels", "cross_entropy"),
    (_OPTAX_CLS, "kl_divergence", "kl_div"),
    (_OPTAX_CLS, "kl_divergence_with_log_targets", "kl_div"),
    (_OPTAX_CLS, "ctc_loss", "ctc_loss"),
    (_OPTAX_CLS, "ctc_loss_with_forward_probs", "ctc_loss"),
    (_OPTAX_CLS, "multiclass_hinge_loss", "multi_margin_loss"),
    (_OPTAX_REG, "squared_error", "mse_loss"),
    (_OPTAX_REG, "l2_loss", "mse_loss"),
    (_OPTAX_REG, "huber_loss", "huber_loss"),
    (_OPTAX_REG, "cosine_similarity", "cosine_similarity"),
    (_OPTAX_SELF, "triplet_margin_loss", "triplet_margin_loss"),
    # flax normalisation layers
    ("flax/linen/normalization.py", "LayerNorm.__call__", "layer_norm"),
    ("flax/linen/normalization.py", "GroupNorm.__call__", "group_norm"),
    ("flax/nnx/nn/normalization.py", "LayerNorm.__call__", "layer_norm"),
    ("flax/nnx/nn/normalization.py", "GroupNorm.__call__", "group_norm"),
    ("flax/linen/normalization.py", "BatchNorm.__call__", "batch_norm"),
    ("flax/nnx/nn/normalization.py", "BatchNorm.__call__", "batch_norm"),
)

for _path, _function, _name in LIBRARY_OPS:
  regions.register_library_op(_path, _function, _name)
