"""torch.amp's CUDA op lists (float16 by default) as a jaxamp policy table.

Each row names the torch ops it realises; ``docs/coverage.md`` lists every op of the reference
with its row, or why it has no JAX counterpart.
"""

import jax.numpy as jnp

from jaxamp._src import compat
from jaxamp._src.policies import shared
from jaxamp._src.policies.table import Category, Row, Table, Variant, named_op_rows

prims = compat.primitives

L, F, P, N, X = (
  Category.LOWER,
  Category.FLOAT32,
  Category.PROMOTE,
  Category.NATIVE,
  Category.FORBIDDEN,
)

ROWS = (
  # --- float16 ---------------------------------------------------------------------------------
  Row(
    (
      "__matmul__",
      "addbmm",
      "addmm",
      "addmv",
      "addr",
      "baddbmm",
      "bmm",
      "chain_matmul",
      "einsum",  # on torch's source list (not the reference doc), whatever it sums over
      "multi_dot",
      "linear",
      "matmul",
      "mm",
      "mv",
    ),
    L,
    primitives=(prims.dot_general_p,),
  ),
  *shared.GROUPED_MATMUL,
  *shared.RNN_CELL,
  *shared.SPARSE_MATMUL,
  Row(
    ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    L,
    primitives=(prims.conv_general_dilated_p,),
  ),
  Row(("prelu",), L, ops=("prelu",)),
  # torch's source lists scaled_dot_product_attention for CUDA too (not in the reference doc).
  Row(("scaled_dot_product_attention",), L, ops=("scaled_dot_product_attention",)),
  # --- float32: primitives ---------------------------------------------------------------------
  Row(
    ("__pow__", "__rpow__", "pow"), F, primitives=(prims.pow_p, prims.integer_pow_p, prims.square_p)
  ),
  Row(("__rdiv__", "__rtruediv__", "reciprocal"), F, primitives=(Variant(prims.div_p, "rdiv"),)),
  Row(("acos",), F, primitives=(prims.acos_p,)),
  Row(("asin",), F, primitives=(prims.asin_p,)),
  Row(("cosh",), F, primitives=(prims.cosh_p,)),
  Row(("sinh",), F, primitives=(prims.sinh_p,)),
  Row(("tan",), F, primitives=(prims.tan_p,)),
  Row(("erfinv",), F, primitives=(prims.erf_inv_p,)),
  Row(("exp",), F, primitives=(prims.exp_p,)),
  Row(("expm1",), F, primitives=(prims.expm1_p,)),
  Row(("log", "log10", "log2"), F, primitives=(prims.log_p,)),
  Row(("log1p",), F, primitives=(prims.log1p_p,)),
  Row(("rsqrt",), F, primitives=(prims.rsqrt_p,)),
  Row(("sum",), F, primitives=(prims.reduce_sum_p,), ops=("sum",)),
  Row(("prod",), F, primitives=(prims.reduce_prod_p,), ops=("prod",)),
  Row(("cumsum",), F, primitives=(prims.cumsum_p,), ops=("cumsum",)),
  Row(("cumprod",), F, primitives=(prims.cumprod_p,), ops=("cumprod",)),
  # --- float32: composites ---------------------------------------------------------------------
  # logsumexp is in torch's CUDA float32 source list (AT_FORALL_FP32), not the reference doc.
  Row(("logsumexp",), F, ops=("logsumexp",)),
  *named_op_rows(
    F,
    "softmax",
    "softmin",
    "log_softmax",
    "softplus",
    "layer_norm",
    "group_norm",
    "norm",
    "normalize",
    "renorm",
    "dist",
    "cdist",
    "pdist",
    "cosine_similarity",
    "cross_entropy",
    "nll_loss",
    "kl_div",
    "mse_loss",
    "l1_loss",
  ),
  # rms_norm is in torch's CUDA float32 source list (AT_FORALL_FP32, beside layer_norm), not
  # the reference doc.
  Row(("rms_norm",), F, ops=("rms_norm",)),
  Row(("smooth_l1_loss",), F, ops=("smooth_l1_loss", "huber_loss")),
  *named_op_rows(
    F,
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multi_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
  ),
  # --- promote to the widest input type -------------------------------------------------------
  Row(("atan2",), P, primitives=(prims.atan2_p,)),
  Row(
    ("addcdiv", "addcmul", "cross", "tensordot", "bilinear"),
    P,
    ops=("addcdiv", "addcmul", "cross", "tensordot", "bilinear"),
  ),
  # A 1-D by 1-D dot_general is torch's dot / vdot (jnp.dot, jnp.vdot).
  Row(("dot", "vdot"), P, primitives=(Variant(prims.dot_general_p, "vector"),)),
  Row(("scatter_add",), P, primitives=(prims.scatter_add_p,)),
  Row(("index_put",), P, primitives=(prims.scatter_p,)),
  *shared.LINALG_IN_FLOAT32,
  *shared.COMPLEX_IN_FLOAT32,
  *shared.ACCUMULATING_KERNELS,
  *shared.UPSAMPLE_IN_FLOAT32,
  *shared.CTC_IN_FLOAT32,
  shared.BINARY_CROSS_ENTROPY_WITH_LOGITS,
  *shared.SPECIAL_FUNCTIONS_IN_FLOAT32,
  *shared.DATA_MOVEMENT,
  *shared.FACTORIES,
  *shared.EXPLICIT_DTYPE,
  *shared.PARAMETER_CREATION,
  *shared.ACTIVATIONS_IN_OPMATH,
  *shared.ROUND_IN_FLOAT32,
  Row(("instance_norm",), Category.FLOAT32_INSIDE, ops=("instance_norm",)),  # batch_norm's kernel
  # logcumsumexp has no CUDA autocast kernel: its scan kernel returns the input's dtype. Computed
  # in float32 and rounded once, as the CPU table has it, where a float16 scan would round at
  # every step.
  Row(
    ("logcumsumexp",),
    Category.FLOAT32_INSIDE,
    primitives=(prims.cumlogsumexp_p,),
    ops=("logcumsumexp",),
  ),
  # --- raises, as in torch: use binary_cross_entropy_with_logits ------------------------------
  Row(("binary_cross_entropy",), X, ops=("binary_cross_entropy",)),
)

TABLE = Table("cuda", jnp.dtype(jnp.float16), ROWS)
