"""torch.amp's XPU op lists (float16 by default; experimental in torch) as a jaxamp policy table.

The XPU float32 list is shorter than CUDA's: acos, asin, cosh, sinh, tan, erfinv, expm1, log1p,
prod, cumprod, norm and several losses are left out, so they run in their inputs' dtype. Each row
names the torch ops it realises; ``docs/coverage.md`` lists every op of the reference.
"""

import jax.numpy as jnp

from jaxamp._src.policy import Category, Row, Table, register_table

L, F, P, N = Category.LOWER, Category.FLOAT32, Category.PROMOTE, Category.NATIVE

ROWS = (
    # --- float16 ---------------------------------------------------------------------------------
    Row(("addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot",
         "linear", "matmul", "mm", "mv", "GRUCell", "LSTMCell", "RNNCell"),
        L, primitives=("dot_general",)),
    Row(("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        L, primitives=("conv_general_dilated",)),
    # --- float32: primitives ---------------------------------------------------------------------
    Row(("__pow__", "__rpow__", "pow"), F, primitives=("pow", "integer_pow", "square")),
    Row(("__rdiv__", "__rtruediv__", "reciprocal"), F, primitives=("div[rdiv]",)),
    Row(("exp",), F, primitives=("exp",)),
    Row(("log",), F, primitives=("log",)),
    Row(("rsqrt",), F, primitives=("rsqrt",)),
    Row(("sum",), F, primitives=("reduce_sum",), ops=("sum",)),
    Row(("cumsum",), F, primitives=("cumsum",), ops=("cumsum",)),
    # --- float32: composites ---------------------------------------------------------------------
    Row(("softmax",), F, ops=("softmax",)),
    Row(("softmin",), F, ops=("softmin",)),
    Row(("log_softmax",), F, ops=("log_softmax",)),
    Row(("layer_norm",), F, ops=("layer_norm",)),
    Row(("group_norm",), F, ops=("group_norm",)),
    Row(("normalize",), F, ops=("normalize",)),
    Row(("dist",), F, ops=("dist",)),
    Row(("cosine_similarity",), F, ops=("cosine_similarity",)),
    Row(("binary_cross_entropy_with_logits",), F, ops=("binary_cross_entropy_with_logits",)),
    Row(("nll_loss",), F, ops=("nll_loss",)),
    Row(("kl_div",), F, ops=("kl_div",)),
    Row(("l1_loss",), F, ops=("l1_loss",)),
    Row(("poisson_nll_loss",), F, ops=("poisson_nll_loss",)),
    Row(("cosine_embedding_loss",), F, ops=("cosine_embedding_loss",)),
    Row(("hinge_embedding_loss",), F, ops=("hinge_embedding_loss",)),
    Row(("margin_ranking_loss",), F, ops=("margin_ranking_loss",)),
    Row(("soft_margin_loss",), F, ops=("soft_margin_loss",)),
    Row(("triplet_margin_loss",), F, ops=("triplet_margin_loss",)),
    # --- promote to the widest input type -------------------------------------------------------
    Row(("bilinear", "cross", "tensordot"), P, ops=("bilinear", "cross", "tensordot")),
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
    Row(("gelu", "silu", "elu", "celu", "selu", "logsigmoid", "mish", "glu", "softplus", "norm",
         "pdist", "renorm"), N,
        ops=("gelu", "silu", "elu", "celu", "selu", "log_sigmoid", "mish", "glu", "softplus",
             "norm", "pdist", "renorm")),
)

TABLE = register_table(Table("xpu", jnp.dtype(jnp.float16), ROWS))
