"""Rows the device tables share, where JAX rather than torch decides."""

from jaxamp._src import compat
from jaxamp._src.policies.table import NO_16_BIT_KERNELS, Category, LazyPrimitive, Row

prims = compat.primitives

# lax.ragged_dot (mixture-of-experts grouped matmuls) is a matmul: the low dtype, like
# dot_general. torch's counterpart, _grouped_mm, is on none of the reference lists.
GROUPED_MATMUL = (Row(("_grouped_mm",), Category.LOWER, primitives=(prims.ragged_dot_general_p,)),)

# A recurrent cell's step (the library cells ``library_ops.LAZY_OPS`` names ``rnn_cell``):
# torch's lstm_cell, gru_cell and rnn_*_cell cast their input, state and weights, so h and c
# come out 16-bit.
RNN_CELL = (Row(("GRUCell", "LSTMCell", "RNNCell"), Category.LOWER, ops=("rnn_cell",)),)

# jax.experimental.sparse's matmuls (BCOO/BCSR @ dense, sparse @ sparse, the sampled product a
# sparse operand's gradient is, the COO/CSR matmat/matvec): torch's ``mm`` on a sparse tensor,
# and torch.sparse's own, run in the autocast dtype as the dense ones do.
SPARSE_MATMUL = (
  Row(
    ("sparse.mm", "sparse.sampled_addmm"),
    Category.LOWER,
    primitives=tuple(
      LazyPrimitive("jax.experimental.sparse", f"{name}_p")
      for name in (
        "bcoo_dot_general",
        "bcoo_dot_general_sampled",
        "bcoo_spdot_general",
        "bcsr_dot_general",
        "coo_matmat",
        "coo_matvec",
        "csr_matmat",
        "csr_matvec",
      )
    ),
  ),
)


# The linear algebra JAX computes with a step before its primitive (``lax.linalg.cholesky`` and
# ``eigh`` symmetrize their input): as ops, that step runs in float32 with the primitive.
LINALG_OPS = ("linalg_cholesky", "linalg_eigh")


def linalg_in_float32(besides: tuple[Row, ...] = ()) -> tuple[Row, ...]:
  """The float32 row of NO_16_BIT_KERNELS and LINALG_OPS, less those ``besides`` lists (CPU's
  torch rows)."""
  listed = {prim for row in besides for prim in row.primitives}
  listed_ops = {op for row in besides for op in row.ops}
  return (
    Row(
      ("linalg (no low-precision kernels)",),
      Category.FLOAT32,
      primitives=tuple(prim for prim in NO_16_BIT_KERNELS if prim not in listed),
      ops=tuple(op for op in LINALG_OPS if op not in listed_ops),
    ),
  )


LINALG_IN_FLOAT32 = linalg_in_float32()

# JAX has no complex32: lax.complex only takes float32/float64 parts.
COMPLEX_IN_FLOAT32 = (Row(("view_as_complex",), Category.FLOAT32, primitives=(prims.complex_p,)),)

# A sum over windows (lax.reduce_window with add: a hand-written average or sum pooling): the sum
# torch's pooling kernels accumulate in float32.
WINDOW_SUM = "window sum (avg_pool's kernel)"

# Unlisted on CUDA and XPU, their kernels accumulate in float32 and return the input's dtype.
ACCUMULATING_KERNELS = (
  Row(("mean",), Category.FLOAT32_INSIDE, ops=("mean",)),
  # nansum is a reduction kernel of its own, not sum's (on the CUDA float32 list): unlisted.
  Row(("nansum",), Category.FLOAT32_INSIDE, ops=("nansum",)),
  Row(("var", "std"), Category.FLOAT32_INSIDE, ops=("var", "std")),
  Row(("batch_norm",), Category.FLOAT32_INSIDE, ops=("batch_norm",)),
  Row(("avg_pool1d", "avg_pool2d", "avg_pool3d"), Category.FLOAT32_INSIDE, ops=("avg_pool",)),
  Row((WINDOW_SUM,), Category.FLOAT32_INSIDE, ops=("window_sum",)),
)

# torch's interpolate kernels (jax.image.resize). On torch 2.13's CUDA and XPU float32 source list
# (AT_FORALL_FP32), not in the reference doc; unlisted on CPU.
UPSAMPLE_OPS = (
  "upsample_nearest1d",
  "upsample_nearest2d",
  "upsample_nearest3d",
  "upsample_linear1d",
  "upsample_bilinear2d",
  "upsample_trilinear3d",
  "upsample_bicubic2d",
)
UPSAMPLE_IN_FLOAT32 = (Row(UPSAMPLE_OPS, Category.FLOAT32, ops=("upsample",)),)

# torch's CTC loss is unlisted on CUDA and XPU and has no 16-bit kernel there (float and double
# only): fed, as torch users feed it, by log_softmax's float32 output, it runs in float32.
# optax's ctc_loss takes logits and computes that log_softmax inside; in 16 bits its one-hot
# products would meet log(0)'s -1e5 as -inf and give NaN.
CTC_IN_FLOAT32 = (Row(("ctc_loss",), Category.FLOAT32, ops=("ctc_loss",)),)

# Keras's binary_crossentropy is torch's binary_cross_entropy on probabilities and, called with
# from_logits=True (its eqns inside jax.nn.log_sigmoid), binary_cross_entropy_with_logits: the
# variant ``[logits]`` (``op_calls``). Where the probability form raises (CUDA, XPU), this row
# keeps the logits form in float32.
BINARY_CROSS_ENTROPY_WITH_LOGITS = Row(
  ("binary_cross_entropy_with_logits",),
  Category.FLOAT32,
  ops=("binary_cross_entropy_with_logits", "binary_cross_entropy[logits]"),
)

# jax.scipy.special functions JAX writes for float32 and float64 only (``library_ops``): run as
# traced, their float32 thresholds and series meet 16-bit values and underflow (log_ndtr gives
# -inf, its gradient NaN). Most reject 16-bit inputs, and torch's CPU kernels of ndtr and log_ndtr
# have none: they run in float32 rather than fail, as the linear algebra does.
SPECIAL_FUNCTION_OPS = (
  "special_ndtr",
  "special_ndtri",
  "special_log_ndtr",
  "special_erfcx",
  "special_dawsn",
  "special_spence",
  "special_expi",
  "special_exp1",
  "special_expn",
  "special_sici",
  "special_hyp1f1",
  "special_hyp2f1",
)
SPECIAL_FUNCTIONS_IN_FLOAT32 = (
  Row(SPECIAL_FUNCTION_OPS, Category.FLOAT32, ops=SPECIAL_FUNCTION_OPS),
)

# Rounding to decimals scales by 10**decimals, which overflows float16 from 655 at two decimals:
# torch's kernel and jnp.round's own float16 path compute in float32.
ROUND_IN_FLOAT32 = (Row(("round",), Category.FLOAT32_INSIDE, ops=("round",)),)

# Factories autocast leaves alone. Random draws: torch's samplers (randn, normal_, uniform_, ...).
# A draw made in a 16-bit dtype (``jax.random.normal(key, shape, jnp.bfloat16)``) samples
# in it, bit for bit as plain JAX; the CUDA list's float32 ``log`` and ``erfinv`` inside its
# transform widened it and changed its values. The gamma family is left to its own rule.
FACTORIES = (
  Row(
    ("normal", "randn", "rand", "uniform", "exponential", "cauchy", "log_normal"),
    Category.NATIVE,
    ops=("random_draw",),
  ),
  # jnp.logspace(..., dtype=jnp.bfloat16) computes its power in the dtype it was given, as
  # torch's logspace factory does; the CUDA list's float32 pow widened it.
  Row(("logspace",), Category.NATIVE, ops=("logspace",)),
)

# Ops called with an explicit ``dtype=`` are not eligible (torch's op reference): they compute in
# and return that dtype. A reduction or scan whose floating result has a dtype none of its
# floating inputs has was given one (``op_calls``: the variant ``[dtype]``); JAX's var and std
# take ``dtype=`` too, and so do flax's norm layers, whose ``dtype=`` is the computation's
# (``nn.LayerNorm(dtype=jnp.bfloat16)`` of a float32 input returns bfloat16). A request equal to
# the traced input's dtype leaves no trace to find.
EXPLICIT_DTYPE_OPS = (
  *("sum", "nansum", "prod", "mean", "var", "std", "cumsum", "cumprod"),
  *("layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm"),
)
EXPLICIT_DTYPE = (
  Row(
    tuple(f"{op}(dtype=...)" for op in EXPLICIT_DTYPE_OPS),
    Category.NATIVE,
    ops=tuple(f"{op}[dtype]" for op in EXPLICIT_DTYPE_OPS),
  ),
)

# Activations torch lists nowhere: single kernels that return their input's dtype and compute in
# float32 inside (torch's opmath), forward and backward. Composed of JAX primitives run in 16
# bits, their gradient would overflow where torch's does not (gelu's and silu's backward
# multiply the cotangent by the input: ``x * dy`` passes 65504 at a float16 ``dy`` far below
# it) and round at every step. Their calls keep only the 16-bit input for the backward
# (``op_calls.RECOMPUTED_OPS``), as torch's kernels do.
ACTIVATION_OPS = ("gelu", "silu", "elu", "celu", "selu", "log_sigmoid", "mish", "glu")
# Elementwise functions torch computes in one kernel each, listed nowhere either: they too return
# their input's dtype, computing in float32 inside. JAX builds them from exp, log, log1p and pow,
# which the CUDA and XPU lists send to float32, so run primitive by primitive they returned
# float32 (and in 16 bits they would round at every step).
ELEMENTWISE_FUNCTION_OPS = (
  *("logaddexp", "logaddexp2", "xlogy", "special_xlog1py", "special_entr", "logit", "hypot"),
  *("i0", "special_i1"),
)
ACTIVATIONS_IN_OPMATH = (
  Row(
    ("gelu", "silu", "elu", "celu", "selu", "logsigmoid", "mish", "glu"),
    Category.FLOAT32_INSIDE,
    ops=ACTIVATION_OPS,
  ),
  Row(ELEMENTWISE_FUNCTION_OPS, Category.FLOAT32_INSIDE, ops=ELEMENTWISE_FUNCTION_OPS),
)

# Parameters are created outside autocast in torch (``nn.Module.__init__``); flax linen's
# ``Module.init`` runs the forward to create them, and a data-dependent initializer (weight
# norm's bias from a first batch) computed under a policy would leave 16-bit master weights.
PARAMETER_CREATION = (Row(("nn.Module.__init__",), Category.NATIVE, ops=("module_init",)),)

# Ops that select or move values, which torch returns in their input's dtype whatever JAX computes
# them with. lax.conv_general_dilated_patches (torch's unfold, im2col) convolves with a one-hot
# kernel made in the traced dtype: exact in float32, it returns the input's dtype. jnp.median is
# a quantile (on CPU's float32 list); torch's median selects one of the input's values.
DATA_MOVEMENT = (
  Row(("im2col",), Category.FLOAT32_INSIDE, ops=("im2col",)),
  Row(("median", "nanmedian"), Category.NATIVE, ops=("median",)),
)
