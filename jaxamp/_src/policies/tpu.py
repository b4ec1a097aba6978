"""PyTorch/XLA's autocast op lists for XLA devices (bfloat16 by default) as a jaxamp policy table.

torch has no TPU lists of its own: PyTorch/XLA registers them for the ``AutocastXLA`` dispatch key
in ``torch_xla/csrc/autocast_mode.cpp`` and tests them with ``AutocastTPUTestLists`` in
``test/test_autocast.py`` (both read at pytorch/xla commit 41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf,
v2.9.0-rc1-37, April 2026; the lists last changed in #8684, "Added pow to autocast policy").
This table realises the ops that file registers:

* lower precision: the convolutions and matmuls (``einsum`` too), ``prelu``, ``relu`` and
  ``max_pool2d``;
* float32: ``batch_norm``, ``softmax`` / ``log_softmax``, ``pow`` (``Tensor_Scalar``), ``prod``,
  ``cdist``, ``trace``, the losses (``binary_cross_entropy`` among them: unlike CUDA's, it does not
  raise), the padding ops and the linear algebra it lowers;
* promote: ``cat``, ``stack``, ``index_copy``.

The ops it leaves commented out ("included in the AutoCastCPU policy, but not lowered": ``fft_*``,
most of ``linalg_*``, ``quantile``, ``stft``, ``poisson_nll_loss``, ``huber_loss``, ...) are
unlisted on XLA devices and run in their inputs' dtype, as do ``exp``, ``log``, ``sum`` and
``layer_norm``, which CUDA's float32 list names. Rows below the lists say where JAX, not torch_xla,
decides. torch_xla's autocast disables itself for float16 on TPUs; jaxamp takes float16 as it does
on every device type (``dtype=jnp.float16``: the same lists).

Each row names the torch ops it realises; ``docs/coverage.md`` lists every op of torch_xla's lists
(``coverage.TPU_REFERENCE``) with its row.
"""

import jax.numpy as jnp

from jaxamp._src import compat
from jaxamp._src.policies import shared
from jaxamp._src.policies.table import Category, Row, Table, Variant, named_op_rows

prims = compat.primitives

L, F, P, N, F_IN = (
  Category.LOWER,
  Category.FLOAT32,
  Category.PROMOTE,
  Category.NATIVE,
  Category.FLOAT32_INSIDE,
)

ROWS = (
  # --- bfloat16 --------------------------------------------------------------------------------
  Row(
    ("bmm", "mm", "baddbmm", "addmm", "addbmm", "linear", "matmul", "einsum", "__matmul__"),
    L,
    primitives=(prims.dot_general_p,),
  ),
  *shared.GROUPED_MATMUL,
  *shared.SPARSE_MATMUL,
  Row(
    (
      "conv1d",
      "conv2d",
      "conv3d",
      "conv_tbc",
      "conv_transpose1d",
      "conv_transpose2d",
      "conv_transpose3d",
    ),
    L,
    primitives=(prims.conv_general_dilated_p,),
  ),
  Row(("prelu",), L, ops=("prelu",)),
  # jax.nn.relu (flax's nn.relu): a max with 0, exact in bfloat16 (the cast is the rounding).
  Row(("relu",), L, ops=("relu",)),
  # Max pooling (lax.reduce_window with max: flax's nn.max_pool, Haiku's, Equinox's) of any rank
  # but 3-D: the primitive does not say 1-D from 2-D, which torch_xla leaves unlisted.
  Row(("max_pool2d",), L, primitives=(prims.reduce_window_max_p,)),
  Row(("max_pool3d",), N, primitives=(Variant(prims.reduce_window_max_p, "3d"),)),
  # torch_xla comments scaled_dot_product_attention out ("undefined symbol with official torch
  # whl"), so torch decomposes it on XLA: its matmuls run in bfloat16 and its softmax in float32.
  # It has no row here either: jax.nn.dot_product_attention's dots and softmax follow their rows.
  # --- float32: primitives ---------------------------------------------------------------------
  # pow.Tensor_Scalar: x ** 2.0 is integer_pow or square, x ** 1.7 pow with a scalar exponent.
  # pow_p does not say a scalar exponent from a tensor one, so jnp.power(x, y) runs in float32
  # too (torch_xla leaves pow.Tensor_Tensor unlisted).
  Row(("pow",), F, primitives=(prims.pow_p, prims.integer_pow_p, prims.square_p)),
  Row(("prod",), F, primitives=(prims.reduce_prod_p,), ops=("prod",)),
  Row(
    ("cholesky", "cholesky_inverse", "cholesky_solve"),
    F,
    primitives=(prims.cholesky_p,),
    ops=("linalg_cholesky",),
  ),
  Row(("triangular_solve",), F, primitives=(prims.triangular_solve_p,)),
  Row(("qr",), F, primitives=(prims.qr_p,)),
  Row(("svd", "linalg_svd"), F, primitives=(prims.svd_p,)),
  # --- float32: composites ---------------------------------------------------------------------
  Row(("inverse", "linalg_inv_ex"), F, ops=("inverse",)),
  Row(("trace",), F, ops=("trace",)),
  Row(("cdist",), F, ops=("cdist",)),
  Row(("reflection_pad1d", "reflection_pad2d"), F, ops=("reflection_pad",)),
  Row(("reflection_pad3d",), N, ops=("reflection_pad[3d]",)),  # on no list: its input's dtype
  Row(("replication_pad1d", "replication_pad2d", "replication_pad3d"), F, ops=("replication_pad",)),
  # softmax.int and _softmax; softmin is torch's softmax of -x.
  Row(("softmax", "_softmax"), F, ops=("softmax",)),
  Row(("softmin",), F, ops=("softmin",)),
  Row(("log_softmax",), F, ops=("log_softmax",)),
  # batch_norm returns float32 on TPUs (torch_xla's test_batch_norm_tpu); instance_norm is
  # torch's batch_norm of the reshaped input.
  Row(("batch_norm",), F, ops=("batch_norm",)),
  Row(("instance_norm",), F, ops=("instance_norm",)),
  *named_op_rows(
    F,
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
  ),
  Row(("cross_entropy_loss",), F, ops=("cross_entropy",)),
  Row(("nll_loss", "nll_loss2d"), F, ops=("nll_loss",)),
  Row(
    ("multilabel_margin_loss", "multilabel_margin_loss_forward"), F, ops=("multilabel_margin_loss",)
  ),
  # --- promote to the widest input type -------------------------------------------------------
  # jnp.stack concatenates its expanded inputs. index_put (x.at[i].set) is the same primitive as
  # index_copy, so it promotes too, as on CUDA.
  Row(("cat", "stack"), P, primitives=(prims.concatenate_p,)),
  Row(("index_copy", "index_put"), P, primitives=(prims.scatter_p,)),
  # --- where JAX decides -----------------------------------------------------------------------
  *shared.COMPLEX_IN_FLOAT32,
  # Reductions and norms torch_xla leaves unlisted return their input's dtype. jnp.mean and
  # flax's norm layers accumulate a 16-bit input in float32 and XLA reduces bfloat16 on TPUs in
  # float32, which a program traced on float32 inputs would lose: they compute in float32 inside
  # (as shared.ACCUMULATING_KERNELS' mean; its batch_norm is on torch_xla's float32 list).
  Row(
    ("mean", "sum", "var", "std", "layer_norm", "group_norm", "rms_norm"),
    F_IN,
    ops=("mean", "sum", "var", "std", "layer_norm", "group_norm", "rms_norm"),
  ),
  # Unlisted average pooling and interpolation kernels return their input's dtype too.
  Row(("avg_pool1d", "avg_pool2d", "avg_pool3d"), F_IN, ops=("avg_pool",)),
  Row((shared.WINDOW_SUM,), F_IN, ops=("window_sum",)),
  *shared.SPECIAL_FUNCTIONS_IN_FLOAT32,
  *shared.DATA_MOVEMENT,
  *shared.FACTORIES,
  *shared.EXPLICIT_DTYPE,
  *shared.PARAMETER_CREATION,
  *shared.ACTIVATIONS_IN_OPMATH,
  *shared.ROUND_IN_FLOAT32,
  Row(shared.UPSAMPLE_OPS, F_IN, ops=("upsample",)),
  # --- unlisted single kernels: they run in their inputs' dtype -------------------------------
  # (without these rows, gelu's x**3 or norm's x**2 would follow the float32 pow row)
  Row(
    (
      "softplus",
      "norm",
      "normalize",
      "dist",
      "pdist",
      "renorm",
      "cosine_similarity",
      "poisson_nll_loss",
      "huber_loss",
      "cross",
      "bilinear",
    ),
    N,
    ops=(
      "softplus",
      "norm",
      "normalize",
      "dist",
      "pdist",
      "renorm",
      "cosine_similarity",
      "poisson_nll_loss",
      "huber_loss",
      "cross",
      "bilinear",
    ),
  ),
  # A 1-D by 1-D dot_general is torch's dot / vdot, which torch_xla leaves unlisted.
  Row(("dot", "vdot"), N, primitives=(Variant(prims.dot_general_p, "vector"),)),
)

# The linear algebra and fft torch_xla's list does not name (commented out there, or never on
# it: eigh, lu, schur, ...): JAX has no 16-bit kernels for it, so it runs in float32.
ROWS += shared.linalg_in_float32(besides=ROWS)

TABLE = Table("tpu", jnp.dtype(jnp.bfloat16), ROWS)
