"""torch.amp's CUDA op lists (float16 by default) as a jaxamp policy table.

Each row names the torch ops it realises; ``docs/coverage.md`` lists every op of the reference
with its row, or why it has no JAX counterpart.
"""

import jax.numpy as jnp

from jaxamp._src.policy import Category, Row, Table, register_table

L, F, P, N, X = (Category.LOWER, Category.FLOAT32, Category.PROMOTE, Category.NATIVE,
                 Category.FORBIDDEN)

ROWS = (
    # --- float16 ---------------------------------------------------------------------------------
    Row(("__matmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul",
         "multi_dot", "linear", "matmul", "mm", "mv", "GRUCell", "LSTMCell", "RNNCell"),
        L, primitives=("dot_general",)),
    Row(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        L, primitives=("conv_general_dilated",)),
    Row(("prelu",), L, ops=("prelu",)),
    # torch's source lists scaled_dot_product_attention for CUDA too (not in the reference doc).
    Row(("scaled_dot_product_attention",), L, ops=("scaled_dot_product_attention",)),
    # --- float32: primitives ---------------------------------------------------------------------
    Row(("__pow__", "__rpow__", "pow"), F, primitives=("pow", "integer_pow", "square")),
    Row(("__rdiv__", "__rtruediv__", "reciprocal"), F, primitives=("div[rdiv]",)),
    Row(("acos",), F, primitives=("acos",)),
    Row(("asin",), F, primitives=("asin",)),
    Row(("cosh",), F, primitives=("cosh",)),
    Row(("sinh",), F, primitives=("sinh",)),
    Row(("tan",), F, primitives=("tan",)),
    Row(("erfinv",), F, primitives=("erf_inv",)),
    Row(("exp",), F, primitives=("exp",)),
    Row(("expm1",), F, primitives=("expm1",)),
    Row(("log", "log10", "log2"), F, primitives=("log",)),
    Row(("log1p",), F, primitives=("log1p",)),
    Row(("rsqrt",), F, primitives=("rsqrt",)),
    Row(("sum",), F, primitives=("reduce_sum",), ops=("sum",)),
    Row(("prod",), F, primitives=("reduce_prod",), ops=("prod",)),
    Row(("cumsum",), F, primitives=("cumsum",), ops=("cumsum",)),
    Row(("cumprod",), F, primitives=("cumprod",), ops=("cumprod",)),
    # logcumsumexp is not in the reference list, but is the cumulative form of exp+sum.
    Row(("logcumsumexp",), F, primitives=("cumlogsumexp",)),
    # --- float32: composites ---------------------------------------------------------------------
    Row(("softmax",), F, ops=("softmax",)),
    Row(("softmin",), F, ops=("softmin",)),
    Row(("log_softmax",), F, ops=("log_softmax",)),
    Row(("softplus",), F, ops=("softplus",)),
    Row(("layer_norm",), F, ops=("layer_norm",)),
    Row(("group_norm",), F, ops=("group_norm",)),
    Row(("norm",), F, ops=("norm",)),
    Row(("normalize",), F, ops=("normalize",)),
    Row(("renorm",), F, ops=("renorm",)),
    Row(("dist",), F, ops=("dist",)),
    Row(("cdist",), F, ops=("cdist",)),
    Row(("pdist",), F, ops=("pdist",)),
    Row(("cosine_similarity",), F, ops=("cosine_similarity",)),
    Row(("binary_cross_entropy_with_logits",), F, ops=("binary_cross_entropy_with_logits",)),
    Row(("cross_entropy",), F, ops=("cross_entropy",)),
    Row(("nll_loss",), F, ops=("nll_loss",)),
    Row(("kl_div",), F, ops=("kl_div",)),
    Row(("mse_loss",), F, ops=("mse_loss",)),
    Row(("l1_loss",), F, ops=("l1_loss",)),
    Row(("smooth_l1_loss",), F, ops=("smooth_l1_loss", "huber_loss")),
    Row(("poisson_nll_loss",), F, ops=("poisson_nll_loss",)),
    Row(("cosine_embedding_loss",), F, ops=("cosine_embedding_loss",)),
    Row(("hinge_embedding_loss",), F, ops=("hinge_embedding_loss",)),
    Row(("margin_ranking_loss",), F, ops=("margin_ranking_loss",)),
    Row(("multilabel_margin_loss",), F, ops=("multilabel_margin_loss",)),
    Row(("multi_margin_loss",), F, ops=("multi_margin_loss",)),
    Row(("soft_margin_loss",), F, ops=("soft_margin_loss",)),
    Row(("triplet_margin_loss",), F, ops=("triplet_margin_loss",)),
    # --- promote to the widest input type -------------------------------------------------------
    Row(("atan2",), P, primitives=("atan2",)),
    Row(("addcdiv", "addcmul", "cross", "tensordot", "dot", "bilinear"), P,
        ops=("addcdiv", "addcmul", "cross", "tensordot", "dot", "bilinear")),
    Row(("scatter_add",), P, primitives=("scatter-add", "scatter_add")),
    Row(("index_put",), P, primitives=("scatter",)),
    # --- not in torch's list (torch raises on low-precision linear algebra); JAX has no float16
    # or bfloat16 kernels for these either, so they run in float32 rather than fail.
    Row(("linalg (no low-precision kernels)",), F,
        primitives=("lu", "cholesky", "triangular_solve", "qr", "geqrf", "geqp3",
                    "householder_product", "ormqr", "svd", "eigh", "eig", "fft")),
    # --- JAX has no complex32: lax.complex only takes float32/float64 parts ------------------
    Row(("view_as_complex",), F, primitives=("complex",)),
    # --- mean is unlisted: torch's kernel accumulates in float32, returns the input dtype ----
    Row(("mean",), Category.FLOAT32_INSIDE, ops=("mean",)),
    # --- batch_norm is unlisted: its kernel computes in float32 and returns the input dtype ---
    Row(("batch_norm",), Category.FLOAT32_INSIDE, ops=("batch_norm",)),
    # --- unlisted single kernels in torch: they run in their inputs' dtype -------------------
    # (without these rows, gelu's x**3 or elu's expm1 would follow the float32 pow/expm1 rows)
    Row(("gelu", "silu", "elu", "celu", "selu", "logsigmoid", "mish", "glu"), N,
        ops=("gelu", "silu", "elu", "celu", "selu", "log_sigmoid", "mish", "glu")),
    # --- raises, as in torch: use binary_cross_entropy_with_logits ------------------------------
    Row(("binary_cross_entropy",), X, ops=("binary_cross_entropy",)),
)

TABLE = register_table(Table("cuda", jnp.dtype(jnp.float16), ROWS))
