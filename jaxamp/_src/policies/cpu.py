"""torch.amp's CPU op lists (bfloat16 by default; float16 shares them) as a jaxamp policy table.

Unlike CUDA, exp, sum, softmax and layer_norm are not on CPU's float32 list: they run in the
dtype of their inputs. Each row names the torch ops it realises; ``docs/coverage.md`` lists every
op of the reference with its row, or why it has no JAX counterpart.
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
    (
      "bmm",
      "mm",
      "linalg_vecdot",
      "baddbmm",
      "addmm",
      "addbmm",
      "linear",
      "matmul",
      "mkldnn_rnn_layer",
    ),
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
      "_convolution",
      "conv_tbc",
      "conv_transpose1d",
      "conv_transpose2d",
      "conv_transpose3d",
    ),
    L,
    primitives=(prims.conv_general_dilated_p,),
  ),
  Row(("prelu",), L, ops=("prelu",)),
  Row(
    ("scaled_dot_product_attention", "_native_multi_head_attention"),
    L,
    ops=("scaled_dot_product_attention",),
  ),
  # --- float32: primitives ---------------------------------------------------------------------
  Row(("prod",), F, primitives=(prims.reduce_prod_p,), ops=("prod",)),
  Row(
    ("cholesky", "linalg_cholesky", "linalg_cholesky_ex", "cholesky_inverse", "cholesky_solve"),
    F,
    primitives=(prims.cholesky_p,),
    ops=("linalg_cholesky",),
  ),
  Row(("triangular_solve", "lu_solve"), F, primitives=(prims.triangular_solve_p,)),
  Row(("_lu_with_info",), F, primitives=(prims.lu_p,)),
  Row(("inverse", "linalg_inv", "linalg_inv_ex"), F, ops=("inverse",)),
  *named_op_rows(F, "linalg_solve", "linalg_tensorinv", "linalg_tensorsolve"),
  Row(("qr", "linalg_qr", "geqrf"), F, primitives=(prims.qr_p, prims.geqrf_p, prims.geqp3_p)),
  Row(("orgqr", "linalg_householder_product"), F, primitives=(prims.householder_product_p,)),
  Row(("ormqr",), F, primitives=(prims.ormqr_p,)),
  Row(
    ("svd", "linalg_svd", "linalg_svdvals", "linalg_matrix_rank", "linalg_cond"),
    F,
    primitives=(prims.svd_p,),
  ),
  *named_op_rows(F, "pinverse", "linalg_lstsq"),
  Row(("linalg_eigh", "linalg_eigvalsh"), F, primitives=(prims.eigh_p,), ops=("linalg_eigh",)),
  Row(("linalg_eig", "linalg_eigvals"), F, primitives=(prims.eig_p,)),
  Row(
    (
      "fft_fft",
      "fft_ifft",
      "fft_fft2",
      "fft_ifft2",
      "fft_fftn",
      "fft_ifftn",
      "fft_rfft",
      "fft_irfft",
      "fft_rfft2",
      "fft_irfft2",
      "fft_rfftn",
      "fft_irfftn",
      "fft_hfft",
      "fft_ihfft",
      "stft",
    ),
    F,
    primitives=(prims.fft_p,),
  ),
  Row(
    ("avg_pool3d",),
    F,
    primitives=(Variant(prims.reduce_window_sum_p, "3d"),),
    ops=("avg_pool[3d]", "window_sum[3d]"),
  ),
  Row(("max_pool3d",), F, primitives=(Variant(prims.reduce_window_max_p, "3d"),)),
  Row(("adaptive_avg_pool3d", "adaptive_max_pool3d"), F, ops=("adaptive_pool[3d]",)),
  # --- float32: composites ---------------------------------------------------------------------
  Row(("trace",), F, ops=("trace",)),
  *shared.COMPLEX_IN_FLOAT32,
  Row(("quantile", "nanquantile"), F, ops=("quantile",)),
  Row(("cdist",), F, ops=("cdist",)),
  Row(("reflection_pad1d", "reflection_pad2d"), F, ops=("reflection_pad",)),
  Row(("reflection_pad3d",), N, ops=("reflection_pad[3d]",)),  # on no list: its input's dtype
  Row(("replication_pad1d", "replication_pad2d", "replication_pad3d"), F, ops=("replication_pad",)),
  *named_op_rows(F, "mse_loss", "l1_loss"),
  Row(("huber_loss",), F, ops=("huber_loss", "smooth_l1_loss")),
  Row(("cross_entropy_loss",), F, ops=("cross_entropy",)),
  Row(("nll_loss", "nll_loss2d"), F, ops=("nll_loss",)),
  *named_op_rows(
    F,
    "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
  ),
  Row(
    ("multilabel_margin_loss", "multilabel_margin_loss_forward"), F, ops=("multilabel_margin_loss",)
  ),
  Row(("ctc_loss",), F, ops=("ctc_loss",)),
  # --- unlisted single kernels in torch: they return their input's dtype -----------------
  # torch's CPU softmax, norm, reduction and scan kernels accumulate in float32 and return the
  # input dtype (rms_norm and cumsum too, checked on torch 2.13: bitwise the float32 result
  # rounded).
  # Their primitives too: a bare ``lax.reduce_sum`` (the transpose of a broadcast, when
  # ``jax.grad`` runs inside an autocast function) would accumulate in bfloat16 on XLA:CPU.
  Row(("sum",), F_IN, primitives=(prims.reduce_sum_p,), ops=("sum",)),
  Row(("cumsum",), F_IN, primitives=(prims.cumsum_p,), ops=("cumsum",)),
  Row(("cumprod",), F_IN, primitives=(prims.cumprod_p,), ops=("cumprod",)),
  Row(("logcumsumexp",), F_IN, primitives=(prims.cumlogsumexp_p,), ops=("logcumsumexp",)),
  Row(("avg_pool1d", "avg_pool2d"), F_IN, ops=("avg_pool",)),
  Row((shared.WINDOW_SUM,), F_IN, ops=("window_sum",)),
  Row(shared.UPSAMPLE_OPS, F_IN, ops=("upsample",)),
  Row(
    (
      "softmax",
      "softmin",
      "log_softmax",
      "layer_norm",
      "group_norm",
      "batch_norm",
      "mean",
      "var",
      "std",
      "rms_norm",
      "instance_norm",
    ),
    F_IN,
    ops=(
      "softmax",
      "softmin",
      "log_softmax",
      "layer_norm",
      "group_norm",
      "batch_norm",
      "mean",
      "var",
      "std",
      "rms_norm",
      "instance_norm",
    ),
  ),
  # Ops torch decomposes into listed ones, like tensordot into mm, have no row: their
  # primitives follow their own rules.
  Row(
    (
      "softplus",
      "norm",
      "normalize",
      "dist",
      "pdist",
      "renorm",
      "cosine_similarity",
      "cross",
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
      "cross",
    ),
  ),
  # A 1-D by 1-D dot_general is torch's dot / vdot; bilinear runs its own (_trilinear) kernel.
  Row(("dot", "vdot"), N, primitives=(Variant(prims.dot_general_p, "vector"),)),
  # An einsum that sums over no index (``einsum("...hqk,h->...hqk")``, HF Flax BERT's head
  # mask; RoFormer's rotary ``einsum("bslh,...sh->bslh")``) is a product: einsum is on no CPU
  # list, and torch's composite einsum computes it with ``mul``, unlisted, not with ``bmm``, so
  # it runs in its inputs' dtypes, the widest winning. (The CUDA, XPU and XLA lists have einsum
  # itself, lower precision whatever it sums.)
  Row(("mul",), N, primitives=(Variant(prims.dot_general_p, "elementwise"),)),
  Row(("bilinear",), N, ops=("bilinear",)),
  *shared.SPECIAL_FUNCTIONS_IN_FLOAT32,
  *shared.DATA_MOVEMENT,
  *shared.FACTORIES,
  *shared.EXPLICIT_DTYPE,
  *shared.PARAMETER_CREATION,
  *shared.ACTIVATIONS_IN_OPMATH,
  *shared.ROUND_IN_FLOAT32,
  # --- promote to the widest input type -------------------------------------------------------
  Row(("cat", "stack"), P, primitives=(prims.concatenate_p,)),
  Row(("index_copy",), P, primitives=(prims.scatter_p,)),
)

# The linear algebra torch's CPU list does not name (schur, hessenberg, tridiagonal_solve, ...):
# JAX has no 16-bit kernels for it either, so it runs in float32 too.
ROWS += shared.linalg_in_float32(besides=ROWS)

TABLE = Table("cpu", jnp.dtype(jnp.bfloat16), ROWS)
