"""How each op of torch's autocast reference lists is realised by jaxamp's policy tables.

``coverage(device_type, torch_op)`` answers from the tables' rows; the ops no row realises are
listed in ``NOT_APPLICABLE`` with the reason. torch's reference has no TPU lists: ``TPU_REFERENCE``
holds torch_xla's. ``scripts/make_coverage.py`` writes the table in
``docs/coverage.md`` and ``tests/policies/test_coverage.py`` checks it covers every op of the
reference.
"""

from __future__ import annotations

from jaxamp._src.autocast import fp8
from jaxamp._src.policies import policy
from jaxamp._src.policies.table import Category

# torch ops with no JAX counterpart, per device type, and why.
NOT_APPLICABLE: dict[str, dict[str, str]] = {
  "cuda": {
    "grid_sample": "JAX has no grid sampler (jax.scipy.ndimage.map_coordinates differs); "
    "its elementwise JAX composites promote natively.",
  },
  "xpu": {
    "grid_sample": "JAX has no grid sampler (jax.scipy.ndimage.map_coordinates differs); "
    "its elementwise JAX composites promote natively.",
  },
  "cpu": {
    "grid_sampler": "JAX has no grid sampler.",
    "grid_sampler_2d": "JAX has no grid sampler.",
    "_grid_sampler_2d_cpu_fallback": "JAX has no grid sampler.",
    "grid_sampler_3d": "JAX has no grid sampler.",
    "polar": "produces complex values; complex dtypes are never autocast.",
    "max_unpool2d": "JAX has no max-unpooling op.",
    "max_unpool3d": "JAX has no max-unpooling op.",
    "fractional_max_pool2d": "JAX has no fractional max pooling.",
    "fractional_max_pool3d": "JAX has no fractional max pooling.",
    "fake_quantize_per_tensor_affine": "JAX has no fake-quantisation op.",
  },
}

# torch's op reference has no TPU lists: PyTorch/XLA registers them for the AutocastXLA key in
# torch_xla/csrc/autocast_mode.cpp (pytorch/xla commit 41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf,
# v2.9.0-rc1-37). Every op registered there (overloads once; the ops it comments out as "not
# lowered" are unlisted), by category, in its order.
TPU_REFERENCE: dict[str, tuple[str, ...]] = {
  "lower": (
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "baddbmm",
    "addmm",
    "addbmm",
    "linear",
    "matmul",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "relu",
    "max_pool2d",
    "einsum",
  ),
  "float32": (
    "batch_norm",
    "_softmax",
    "softmax",
    "log_softmax",
    "binary_cross_entropy",
    "pow",
    "prod",
    "cdist",
    "trace",
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
    "qr",
    "svd",
    "triangular_solve",
    "multilabel_margin_loss_forward",
    "linalg_svd",
    "linalg_inv_ex",
  ),
  "promote": ("stack", "cat", "index_copy"),
}

# Rows whose ops are realised by native promotion rather than a region of their own.
NATIVE_PROMOTION = {"addcdiv", "addcmul", "bilinear", "dot"}


def coverage(device_type: str, torch_op: str) -> str:
  """How ``torch_op`` is realised under ``device_type``'s policy, as one line of markdown."""
  table = policy.get_table(device_type)
  for row in table.rows:
    if torch_op in row.torch_ops:
      parts = [f"primitive `{primitive}`" for primitive in row.primitives]
      parts += [f"op region `{o}`" for o in row.ops if o not in NATIVE_PROMOTION]
      if torch_op in NATIVE_PROMOTION:
        parts.append("native promotion of its elementwise primitives")
      return f"{row.category.value}: " + ", ".join(parts)
  reason = NOT_APPLICABLE.get(device_type, {}).get(torch_op)
  if reason is not None:
    return f"not applicable: {reason}"
  raise KeyError(f"{torch_op!r} has no row in the {device_type!r} table")


def fp8_coverage(torch_op: str) -> str:
  """How an op of torch's CUDA lower-precision list runs under ``dtype=jnp.float8_e4m3fn``
  (``autocast/fp8.py``): its matmuls with float8 operands, the rest in bfloat16."""
  line = coverage("cuda", torch_op)
  row = next(r for r in policy.get_table("cuda").rows if torch_op in r.torch_ops)
  quantized = [f"`{p.name}`" for p in row.primitives if p in fp8.MATMULS]
  if row.category is Category.LOWER and quantized:
    return (
      f"float8_e4m3fn: primitive {', '.join(quantized)} (e4m3 operands, e5m2 gradients, "
      "dynamic per-tensor float32 scales; bfloat16 result)"
    )
  return line.replace("lower:", "lower (bfloat16):", 1)
