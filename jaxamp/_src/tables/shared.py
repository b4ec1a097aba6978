"""Rows the device tables share, where JAX rather than torch decides."""

from jaxamp._src.policy import Category, Row

# JAX has no float16 or bfloat16 kernels for these: they run in float32 rather than fail. torch
# raises on low-precision linear algebra on CUDA and XPU; on CPU its own lists cover them.
LINALG_IN_FLOAT32 = (
    Row(("linalg (no low-precision kernels)",), Category.FLOAT32,
        primitives=("lu", "cholesky", "triangular_solve", "qr", "geqrf", "geqp3",
                    "householder_product", "ormqr", "svd", "eigh", "eig", "fft")),
)

# JAX has no complex32: lax.complex only takes float32/float64 parts.
COMPLEX_IN_FLOAT32 = (Row(("view_as_complex",), Category.FLOAT32, primitives=("complex",)),)

# Unlisted on CUDA and XPU, their kernels accumulate in float32 and return the input's dtype.
ACCUMULATING_KERNELS = (
    Row(("mean",), Category.FLOAT32_INSIDE, ops=("mean",)),
    Row(("batch_norm",), Category.FLOAT32_INSIDE, ops=("batch_norm",)),
)
