"""torch.amp's CUDA op lists (float16 by default) as a jaxamp policy table.

Each row names the torch ops it realises; ``docs/coverage.md`` lists every op of the reference
with its row, or why it has no JAX counterpart.
"""

import jax.numpy as jnp

from jaxamp._src import compat
from jaxamp._src.policies import shared
from jaxamp._src.policies.table import Category, Row, Table, Variant, named_op_rows

p = compat.primitives

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
      "multi_dot",
      "linear",
      "matmul",
      "mm",
      "mv",
      "GRUCell",
      "LSTMCell",
      "RNNCell",
    ),
    L,
    primitives=(p.dot_general_p,),
  ),
  *shared.GROUPED_MATMUL,
  Row(
    ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    L,
    primitives=(p.conv_general_dilated_p,),
  ),
  Row(("prelu",), L, ops=("prelu",)),
  # torch's source lists scaled_dot_product_attention for CUDA too (not in the reference doc).
  Row(("scaled_dot_product_attention",), L, ops=("scaled_dot_product_attention",)),
  # --- float32: primitives ---------------------------------------------------------------------
  Row(("__pow__", "__rpow__", "pow"), F, primitives=(p.pow_p, p.integer_pow_p, p.square_p)),
  Row(("__rdiv__", "__rtruediv__", "reciprocal"), F, primitives=(Variant(p.div_p, "rdiv"),)),
  Row(("acos",), F, primitives=(p.acos_p,)),
  Row(("asin",), F, primitives=(p.asin_p,)),
  Row(("cosh",), F, primitives=(p.cosh_p,)),
  Row(("sinh",), F, primitives=(p.sinh_p,)),
  Row(("tan",), F, primitives=(p.tan_p,)),
  Row(("erfinv",), F, primitives=(p.erf_inv_p,)),
  Row(("exp",), F, primitives=(p.exp_p,)),
  Row(("expm1",), F, primitives=(p.expm1_p,)),
  Row(("log", "log10", "log2"), F, primitives=(p.log_p,)),
  Row(("log1p",), F, primitives=(p.log1p_p,)),
  Row(("rsqrt",), F, primitives=(p.rsqrt_p,)),
  Row(("sum",), F, primitives=(p.reduce_sum_p,), ops=("sum",)),
  Row(("prod",), F, primitives=(p.reduce_prod_p,), ops=("prod",)),
  Row(("cumsum",), F, primitives=(p.cumsum_p,), ops=("cumsum",)),
  Row(("cumprod",), F, primitives=(p.cumprod_p,), ops=("cumprod",)),
  # logcumsumexp is not in the reference list, but is the cumulative form of exp+sum.
  Row(("logcumsumexp",), F, primitives=(p.cumlogsumexp_p,)),
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
    "binary_cross_entropy_with_logits",
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
  Row(("atan2",), P, primitives=(p.atan2_p,)),
  Row(
    ("addcdiv", "addcmul", "cross", "tensordot", "bilinear"),
    P,
    ops=("addcdiv", "addcmul", "cross", "tensordot", "bilinear"),
  ),
  # A 1-D by 1-D dot_general is torch's dot / vdot (jnp.dot, jnp.vdot).
  Row(("dot", "vdot"), P, primitives=(Variant(p.dot_general_p, "vector"),)),
  Row(("scatter_add",), P, primitives=(p.scatter_add_p,)),
  Row(("index_put",), P, primitives=(p.scatter_p,)),
  *shared.LINALG_IN_FLOAT32,
  *shared.COMPLEX_IN_FLOAT32,
  *shared.ACCUMULATING_KERNELS,
  Row(("instance_norm",), Category.FLOAT32_INSIDE, ops=("instance_norm",)),  # batch_norm's kernel
  # --- unlisted single kernels in torch: they run in their inputs' dtype -------------------
  # (without these rows, gelu's x**3 or elu's expm1 would follow the float32 pow/expm1 rows)
  Row(
    ("gelu", "silu", "elu", "celu", "selu", "logsigmoid", "mish", "glu"),
    N,
    ops=("gelu", "silu", "elu", "celu", "selu", "log_sigmoid", "mish", "glu"),
  ),
  # --- raises, as in torch: use binary_cross_entropy_with_logits ------------------------------
  Row(("binary_cross_entropy",), X, ops=("binary_cross_entropy",)),
)

TABLE = Table("cuda", jnp.dtype(jnp.float16), ROWS)
