"""torch.amp's XPU op lists (float16 by default; experimental in torch) as a jaxamp policy table.

The XPU float32 list is shorter than CUDA's: acos, asin, cosh, sinh, tan, erfinv, expm1, log1p,
prod, cumprod, norm and several losses are left out, so they run in their inputs' dtype. Each row
names the torch ops it realises; ``docs/coverage.md`` lists every op of the reference.
"""

import jax.numpy as jnp

from jaxamp._src import compat
from jaxamp._src.policies import shared
from jaxamp._src.policies.table import Category, Row, Table, Variant, named_op_rows

prims = compat.primitives

L, F, P, N = Category.LOWER, Category.FLOAT32, Category.PROMOTE, Category.NATIVE

ROWS = (
  # --- float16 ---------------------------------------------------------------------------------
  Row(
    (
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
  # --- float32: primitives ---------------------------------------------------------------------
  Row(
    ("__pow__", "__rpow__", "pow"), F, primitives=(prims.pow_p, prims.integer_pow_p, prims.square_p)
  ),
  Row(("__rdiv__", "__rtruediv__", "reciprocal"), F, primitives=(Variant(prims.div_p, "rdiv"),)),
  Row(("exp",), F, primitives=(prims.exp_p,)),
  Row(("log",), F, primitives=(prims.log_p,)),
  Row(("rsqrt",), F, primitives=(prims.rsqrt_p,)),
  Row(("sum",), F, primitives=(prims.reduce_sum_p,), ops=("sum",)),
  Row(("cumsum",), F, primitives=(prims.cumsum_p,), ops=("cumsum",)),
  # --- float32: composites ---------------------------------------------------------------------
  *named_op_rows(
    F,
    "softmax",
    "softmin",
    "log_softmax",
    "layer_norm",
    "group_norm",
    "normalize",
    "dist",
    "cosine_similarity",
    "nll_loss",
    "kl_div",
    "l1_loss",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
  ),
  # torch 2.13 registers rms_norm for AutocastXPU beside layer_norm (not in the reference doc).
  Row(("rms_norm",), F, ops=("rms_norm",)),
  # --- promote to the widest input type -------------------------------------------------------
  Row(("bilinear", "cross", "tensordot"), P, ops=("bilinear", "cross", "tensordot")),
  # A 1-D by 1-D dot_general is torch's dot / vdot, which XPU leaves unlisted.
  Row(("dot", "vdot"), N, primitives=(Variant(prims.dot_general_p, "vector"),)),
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
  # --- unlisted single kernels in torch: they run in their inputs' dtype -------------------
  Row(
    (
      "softplus",
      "norm",
      "pdist",
      "renorm",
    ),
    N,
    ops=(
      "softplus",
      "norm",
      "pdist",
      "renorm",
    ),
  ),
)

TABLE = Table("xpu", jnp.dtype(jnp.float16), ROWS)
