"""Library functions autocast recognises as one torch op, by identity.

Each entry is (module, attribute path, op name): the function at that path of the module is
recognised by its code object among the frames of an eqn's traceback, wherever the library lives
and whatever its files are called. The op name keys the policy tables: a table row decides the
category; ops without a row run in the dtypes of their inputs, as torch runs its unlisted ops (so
``gelu`` under the CUDA policy does not send its ``x**3`` to float32 the way a bare ``pow`` would).

jax and optax (dependencies, already imported) resolve at import, so a rename fails there (but
for ``EAGER_OPS_IF_PRESENT``, which older jax versions lack); flax, Haiku and Equinox resolve at
the first trace after they are imported, so registering their layers imports none of them.
``tests/autocast/test_library_ops.py`` resolves and exercises every entry.
"""

_LAX_NUMPY = "jax._src.numpy.lax_numpy"  # the pad modes jnp.pad dispatches to are private
_LAX_OTHER = "jax._src.lax.other"  # jnp.logaddexp is a ufunc object calling these functions

# jax.random's samplers taking a ``dtype`` (the gamma family excepted: ``rules``).
RANDOM_SAMPLERS = (
  "normal",
  "truncated_normal",
  "uniform",
  "exponential",
  "gumbel",
  "laplace",
  "logistic",
  "cauchy",
  "lognormal",
  "generalized_normal",
  "rayleigh",
  "wald",
  "weibull_min",
  "pareto",
  "maxwell",
  "double_sided_maxwell",
  "triangular",
  "ball",
  "orthogonal",
)

EAGER_OPS = (
  # jax.nn
  ("jax.nn", "softmax", "softmax"),
  ("jax.nn", "log_softmax", "log_softmax"),
  ("jax.nn", "softplus", "softplus"),
  ("jax.nn", "dot_product_attention", "scaled_dot_product_attention"),
  ("jax.nn", "gelu", "gelu"),
  ("jax.nn", "silu", "silu"),
  ("jax.nn", "elu", "elu"),
  ("jax.nn", "celu", "celu"),
  ("jax.nn", "selu", "selu"),
  ("jax.nn", "log_sigmoid", "log_sigmoid"),
  ("jax.nn", "mish", "mish"),
  ("jax.nn", "glu", "glu"),
  ("jax.nn", "relu", "relu"),  # torch_xla lists relu (lower precision)
  ("jax.nn", "standardize", "layer_norm"),  # layer_norm without scale and bias
  # jax.nn.logsumexp is jax.scipy.special.logsumexp
  ("jax.scipy.special", "logsumexp", "logsumexp"),
  # jax.image: torch's interpolate (upsample_nearest*, upsample_bilinear2d, ...)
  ("jax.image", "resize", "upsample"),
  ("jax.image", "scale_and_translate", "upsample"),
  # jax.numpy
  ("jax.numpy", "tensordot", "tensordot"),
  ("jax.numpy", "cross", "cross"),
  ("jax.numpy", "trace", "trace"),
  ("jax.numpy", "logspace", "logspace"),
  # elementwise functions torch computes in one kernel each
  (_LAX_OTHER, "logaddexp", "logaddexp"),
  (_LAX_OTHER, "logaddexp2", "logaddexp2"),
  ("jax.numpy", "hypot", "hypot"),
  ("jax.numpy", "i0", "i0"),
  ("jax.scipy.special", "i0", "i0"),
  ("jax.scipy.special", "i1", "special_i1"),
  ("jax.scipy.special", "xlogy", "xlogy"),
  ("jax.scipy.special", "xlog1py", "special_xlog1py"),
  ("jax.scipy.special", "entr", "special_entr"),
  ("jax.scipy.special", "logit", "logit"),
  (_LAX_NUMPY, "_pad_symmetric_or_reflect", "reflection_pad"),
  (_LAX_NUMPY, "_pad_edge", "replication_pad"),
  ("jax.numpy.linalg", "norm", "norm"),
  ("jax.numpy.linalg", "pinv", "pinverse"),
  ("jax.numpy.linalg", "inv", "inverse"),
  ("jax.numpy.linalg", "solve", "linalg_solve"),
  ("jax.numpy.linalg", "tensorinv", "linalg_tensorinv"),
  ("jax.numpy.linalg", "tensorsolve", "linalg_tensorsolve"),
  ("jax.numpy.linalg", "lstsq", "linalg_lstsq"),
  # jax.lax.linalg's wrappers (jnp.linalg's and jax.scipy.linalg's too) symmetrize their input
  # before the primitive, ``(a + a^H) / 2``: in 16 bits that sum overflows (a float16 Gram matrix
  # past 32752), where torch's kernels, reading one triangle, have no such step.
  ("jax.lax.linalg", "cholesky", "linalg_cholesky"),
  ("jax.lax.linalg", "eigh", "linalg_eigh"),
  ("jax.numpy", "sum", "sum"),
  ("jax.numpy", "prod", "prod"),
  ("jax.numpy", "mean", "mean"),
  ("jax.numpy", "nanmean", "mean"),
  ("jax.numpy", "nansum", "nansum"),  # its own kernel in torch: not sum
  ("jax.numpy", "var", "var"),
  ("jax.numpy", "nanvar", "var"),
  ("jax.numpy", "std", "std"),
  ("jax.numpy", "nanstd", "std"),
  ("jax.numpy", "cumsum", "cumsum"),
  ("jax.numpy", "cumprod", "cumprod"),
  *(("jax.random", name, "random_draw") for name in RANDOM_SAMPLERS),
  ("jax.numpy", "quantile", "quantile"),
  ("jax.numpy", "nanquantile", "quantile"),
  ("jax.numpy", "round", "round"),  # upcasts float16 itself: a cast a float32 trace lacks
  ("jax.numpy", "around", "round"),
  ("jax.numpy", "median", "median"),  # torch's median selects: no quantile interpolation
  ("jax.numpy", "nanmedian", "median"),
  # jax.lax: the scans and the window sum behind every sum-pooling, however spelled
  ("jax.lax", "cumsum", "cumsum"),
  ("jax.lax", "cumprod", "cumprod"),
  ("jax.lax", "cumlogsumexp", "logcumsumexp"),
  ("jax._src.lax.windowed_reductions", "_reduce_window_sum", "window_sum"),
  ("jax.lax", "conv_general_dilated_patches", "im2col"),  # torch's unfold: a gather, not a conv
  # jax.scipy.special functions written for float32 and float64 only: they pick thresholds,
  # series lengths and constants by the traced dtype, and most reject 16-bit inputs.
  ("jax.scipy.special", "ndtr", "special_ndtr"),
  ("jax.scipy.special", "ndtri", "special_ndtri"),
  ("jax.scipy.special", "log_ndtr", "special_log_ndtr"),
  ("jax.scipy.special", "spence", "special_spence"),
  ("jax.scipy.special", "expi", "special_expi"),
  ("jax.scipy.special", "exp1", "special_exp1"),
  ("jax.scipy.special", "expn", "special_expn"),
  ("jax.scipy.special", "sici", "special_sici"),
  ("jax.scipy.special", "hyp1f1", "special_hyp1f1"),
  ("jax.scipy.special", "hyp2f1", "special_hyp2f1"),
  # optax losses
  ("optax.losses", "sigmoid_binary_cross_entropy", "binary_cross_entropy_with_logits"),
  ("optax.losses", "softmax_cross_entropy", "cross_entropy"),
  ("optax.losses", "safe_softmax_cross_entropy", "cross_entropy"),
  ("optax.losses", "softmax_cross_entropy_with_integer_labels", "cross_entropy"),
  ("optax.losses", "kl_divergence", "kl_div"),
  ("optax.losses", "kl_divergence_with_log_targets", "kl_div"),
  ("optax.losses", "ctc_loss", "ctc_loss"),
  ("optax.losses", "ctc_loss_with_forward_probs", "ctc_loss"),
  ("optax.losses", "multiclass_hinge_loss", "multi_margin_loss"),
  ("optax.losses", "squared_error", "mse_loss"),
  ("optax.losses", "l2_loss", "mse_loss"),
  ("optax.losses", "huber_loss", "huber_loss"),
  ("optax.losses", "cosine_similarity", "cosine_similarity"),
  # 1 - cosine similarity: torch's cosine_embedding_loss of a positive pair (target 1)
  ("optax.losses", "cosine_distance", "cosine_embedding_loss"),
  ("optax.losses", "triplet_margin_loss", "triplet_margin_loss"),
)

# Norm, activation and average-pooling layers of optional libraries (their activation functions
# are jax.nn's). An average pooling dividing by window counts pools a fill made in the traced
# dtype, which torch's kernel would make in the input's: as one op it returns the input's dtype.
# Haiku's InstanceNorm is its LayerNorm's __call__, so it is a layer_norm, as it computes one.
LAZY_OPS = (
  # flax.linen; its Module.init, init_with_output (which nnx.bridge.ToNNX's lazy_init calls)
  # and lazy_init create the parameters, which torch does outside autocast
  ("flax.linen", "Module.init", "module_init"),
  ("flax.linen", "Module.init_with_output", "module_init"),
  ("flax.linen", "Module.lazy_init", "module_init"),
  ("flax.linen", "LayerNorm.__call__", "layer_norm"),
  ("flax.linen", "GroupNorm.__call__", "group_norm"),
  ("flax.linen", "BatchNorm.__call__", "batch_norm"),
  ("flax.linen", "RMSNorm.__call__", "rms_norm"),
  ("flax.linen", "InstanceNorm.__call__", "instance_norm"),
  ("flax.linen", "PReLU.__call__", "prelu"),
  ("flax.linen", "avg_pool", "avg_pool"),  # flax.nnx.avg_pool too
  # flax.nnx
  ("flax.nnx", "LayerNorm.__call__", "layer_norm"),
  ("flax.nnx", "GroupNorm.__call__", "group_norm"),
  ("flax.nnx", "BatchNorm.__call__", "batch_norm"),
  ("flax.nnx", "RMSNorm.__call__", "rms_norm"),
  ("flax.nnx", "InstanceNorm.__call__", "instance_norm"),
  ("flax.nnx", "PReLU.__call__", "prelu"),
  # Haiku; the init of every transform (hk.transform, transform_with_state, multi_transform)
  # runs this closure, which creates the parameters and state
  ("haiku._src.transform", "transform_with_state.<locals>.init_fn", "module_init"),
  ("haiku", "LayerNorm.__call__", "layer_norm"),
  ("haiku", "GroupNorm.__call__", "group_norm"),
  ("haiku", "BatchNorm.__call__", "batch_norm"),
  ("haiku", "RMSNorm.__call__", "rms_norm"),
  ("haiku", "avg_pool", "avg_pool"),  # hk.AvgPool too
  # Equinox
  ("equinox.nn", "LayerNorm.__call__", "layer_norm"),
  ("equinox.nn", "GroupNorm.__call__", "group_norm"),
  ("equinox.nn", "BatchNorm.__call__", "batch_norm"),
  ("equinox.nn", "RMSNorm.__call__", "rms_norm"),
  ("equinox.nn", "PReLU.__call__", "prelu"),
  ("equinox.nn", "AvgPool1d.__call__", "avg_pool"),
  ("equinox.nn", "AvgPool2d.__call__", "avg_pool"),
  ("equinox.nn", "AvgPool3d.__call__", "avg_pool"),
  # torch's adaptive_{avg,max}_pool{1,2,3}d: its dimensions by how many it pools
  # (``op_calls.chained_pooled_dims``), as one code object serves every Equinox adaptive pool
  ("equinox.nn", "AdaptivePool.__call__", "adaptive_pool"),
  # Recurrent cells, one step: torch's GRUCell, LSTMCell and RNNCell (lstm_cell, gru_cell and
  # rnn_*_cell on the CUDA list). Where a table has no row for them (CPU), their matmuls follow
  # the primitive rule, as torch's CPU cells decompose into linear.
  ("flax.linen", "LSTMCell.__call__", "rnn_cell"),
  ("flax.linen", "OptimizedLSTMCell.__call__", "rnn_cell"),
  ("flax.linen", "GRUCell.__call__", "rnn_cell"),
  ("flax.linen", "SimpleCell.__call__", "rnn_cell"),
  ("flax.nnx", "LSTMCell.__call__", "rnn_cell"),
  ("flax.nnx", "OptimizedLSTMCell.__call__", "rnn_cell"),
  ("flax.nnx", "GRUCell.__call__", "rnn_cell"),
  ("flax.nnx", "SimpleCell.__call__", "rnn_cell"),
  ("haiku", "LSTM.__call__", "rnn_cell"),
  ("haiku", "GRU.__call__", "rnn_cell"),
  ("haiku", "VanillaRNN.__call__", "rnn_cell"),
  ("equinox.nn", "LSTMCell.__call__", "rnn_cell"),
  ("equinox.nn", "GRUCell.__call__", "rnn_cell"),
  ("keras.layers", "LSTMCell.call", "rnn_cell"),  # keras.layers.LSTM/GRU/SimpleRNN's steps
  ("keras.layers", "GRUCell.call", "rnn_cell"),
  ("keras.layers", "SimpleRNNCell.call", "rnn_cell"),
  # Keras 3 (its JAX backend): the norm layers upcast a 16-bit input themselves, a cast a float32
  # trace does not hold.
  ("keras.layers", "BatchNormalization.call", "batch_norm"),
  ("keras.layers", "LayerNormalization.call", "layer_norm"),
  ("keras.layers", "GroupNormalization.call", "group_norm"),
  ("keras.layers", "RMSNormalization.call", "rms_norm"),
  ("keras.layers", "PReLU.call", "prelu"),
  # torch's nn.Upsample; nearest repeats (``ops.repeat``), not ``jax.image.resize``.
  ("keras.layers", "UpSampling1D.call", "upsample"),
  ("keras.layers", "UpSampling2D.call", "upsample"),
  ("keras.layers", "UpSampling3D.call", "upsample"),
  # Keras's JAX backend functions behind its pooling layers and losses (keras.ops too). Its
  # losses take their inputs to float32 (Loss.__call__), a cast a float32 trace does not hold.
  # binary_crossentropy is the probability form, or with from_logits=True the ``[logits]``
  # variant (``op_calls.LOGIT_OPS``); so is the binary focal loss, which applies the sigmoid
  # to logits itself (torchvision's sigmoid_focal_loss is built on the with-logits form).
  ("keras.src.backend.jax.nn", "average_pool", "avg_pool"),
  ("keras.src.backend.jax.nn", "categorical_crossentropy", "cross_entropy"),
  ("keras.src.backend.jax.nn", "sparse_categorical_crossentropy", "cross_entropy"),
  ("keras.src.backend.jax.nn", "binary_crossentropy", "binary_cross_entropy"),
  ("keras.src.backend.jax.nn", "ctc_loss", "ctc_loss"),
  ("keras.losses", "binary_focal_crossentropy", "binary_cross_entropy"),
)

# Functions of newer versions than the oldest supported: recognised where the library has them.
EAGER_OPS_IF_PRESENT = (
  ("jax.scipy.special", "erfcx", "special_erfcx"),
  ("jax.scipy.special", "dawsn", "special_dawsn"),
)
LAZY_OPS_IF_PRESENT = (  # Keras 3.13+
  ("keras.src.backend.jax.nn", "adaptive_average_pool", "adaptive_pool"),
  ("keras.src.backend.jax.nn", "adaptive_max_pool", "adaptive_pool"),
)

LIBRARY_OPS = EAGER_OPS + EAGER_OPS_IF_PRESENT + LAZY_OPS + LAZY_OPS_IF_PRESENT
