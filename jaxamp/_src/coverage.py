"""How each op of torch's autocast reference lists is realised by jaxamp's policy tables.

``coverage(device_type, torch_op)`` answers from the tables' rows; the ops no row realises are
listed in ``NOT_APPLICABLE`` with the reason. ``scripts/make_coverage.py`` writes the table in
``docs/coverage.md`` and ``tests/test_coverage.py`` checks it covers every op of the reference.
"""

from __future__ import annotations

from jaxamp._src import policy

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

# Rows whose ops are realised by native promotion rather than a region of their own.
NATIVE_PROMOTION = {"addcdiv", "addcmul", "bilinear", "dot"}


def coverage(device_type: str, torch_op: str) -> str:
  """How ``torch_op`` is realised under ``device_type``'s policy, as one line of markdown."""
  table = policy.get_table(device_type)
  for row in table.rows:
    if torch_op in row.torch_ops:
      parts = [f"primitive `{p}`" for p in row.primitives]
      parts += [f"op region `{o}`" for o in row.ops if o not in NATIVE_PROMOTION]
      if torch_op in NATIVE_PROMOTION:
        parts.append("native promotion of its elementwise primitives")
      return f"{row.category.value}: " + ", ".join(parts)
  reason = NOT_APPLICABLE.get(device_type, {}).get(torch_op)
  if reason is not None:
    return f"not applicable: {reason}"
  raise KeyError(f"{torch_op!r} has no row in the {device_type!r} table")
