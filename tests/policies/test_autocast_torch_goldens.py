"""``jaxamp.autocast(device_type="cpu")`` against torch's CPU autocast.

Each case of ``tests/goldens/torch_cpu_autocast.json`` (recorded by
``scripts/record_torch_autocast_goldens.py``) is a torch expression run under
``torch.autocast("cpu", dtype=bfloat16 | float16)``. Here its JAX counterpart (jnp, lax, jax.nn,
jnp.linalg, jnp.fft, optax, flax or ``jaxamp.functional``) runs under ``jaxamp.autocast`` inside
``jax.jit``; the output dtype must be torch's and the values must agree to the low dtype's
precision. With torch installed the comparison is also made live.

``NOT_APPLICABLE`` lists the ops of torch's autocast lists that have no JAX counterpart (no case);
``DIVERGENCES`` the cases where jaxamp deliberately or necessarily gives another dtype than torch.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import optax
import pytest
import torch_goldens
from fast_subset import first_of_each_family
from jax import lax
from jax.experimental import sparse

import jaxamp
from jaxamp import functional

CASES = torch_goldens.CASES
MODES = ("bfloat16", "float16")

# Ops of torch's autocast op lists (CPU and CUDA, docs and source) with no JAX counterpart.
NOT_APPLICABLE: dict[str, str] = {
  "grid_sampler": "no grid_sample in JAX (jax.scipy.ndimage.map_coordinates has other "
  "coordinate, padding and align_corners conventions)",
  "grid_sampler_2d": "internal kernel of grid_sample; no JAX grid_sample",
  "grid_sampler_3d": "internal kernel of grid_sample; no JAX grid_sample",
  "_grid_sampler_2d_cpu_fallback": "internal CPU kernel of grid_sample; no JAX grid_sample",
  "grid_sample": "CUDA promote list; no JAX grid_sample",
  "polar": "no polar op in JAX; r * exp(1j * theta) is written from elementwise ops",
  "stft": "jax.scipy.signal.stft follows scipy (scaling, padding, window, layout), not "
  "torch.stft; no value-compatible counterpart",
  "geqrf": "no public geqrf in JAX (jnp.linalg.qr / lax.linalg.qr use it internally; "
  "cases qr, linalg_qr)",
  "max_unpool2d": "no unpooling in JAX (its max pools return no indices)",
  "max_unpool3d": "no unpooling in JAX (its max pools return no indices)",
  "fractional_max_pool2d": "no fractional (random-region) max pooling in JAX",
  "fractional_max_pool3d": "no fractional (random-region) max pooling in JAX",
  "fake_quantize_per_tensor_affine": "no fake-quantisation op in JAX",
  "_native_multi_head_attention": "internal inference fast path of nn.MultiheadAttention; "
  "JAX attention is dot_general (cases mm, "
  "scaled_dot_product_attention)",
  "multilabel_margin_loss_forward": "internal kernel of multilabel_margin_loss (case "
  "multilabel_margin_loss_*)",
  "_addmm_activation": "internal fused addmm + relu/gelu of torch's CPU linear layers; in JAX "
  "a dot_general, a bias add and the activation (cases addmm, "
  "linear_bias, relu, gelu)",
  "_convolution": "internal op behind every torch conv; JAX convs are conv_general_dilated "
  "(cases conv*)",
  "_thnn_fused_lstm_cell": "CUDA fused kernel behind LSTMCell; JAX cells are dot_general",
  "_thnn_fused_gru_cell": "CUDA fused kernel behind GRUCell; JAX cells are dot_general",
  "cudnn_convolution": "cuDNN kernel behind CUDA convs; JAX convs are conv_general_dilated",
  "cudnn_convolution_transpose": "cuDNN kernel behind CUDA transposed convs",
  "_scaled_dot_product_flash_attention": "CUDA kernel behind scaled_dot_product_attention",
}

# Cases where jaxamp's dtype differs from torch's CPU autocast: case -> (jaxamp's dtype, reason).
# "low" is the autocast dtype. A jaxpr cannot tell these torch ops from listed ones.
DIVERGENCES: dict[str, tuple[str, str]] = {
  "mm_plus_bias": (
    "low",
    "a bias add after a dot runs in the low dtype, so torch.mm(x, W) + b is F.linear(x, W, b)",
  ),
  "mv": ("low", "torch's CPU list has mm/matmul but not mv; both are dot_general in JAX"),
  **{
    name: (
      "float32",
      "JAX has no fused addmm/addbmm/baddbmm: c + a @ b with a c of batch extent (varying over "
      "a's rows too) is an addend like an attention mask, not a linear bias, and promotes as "
      "torch's unfused product + c does; torch's fused kernel casts c to the low dtype",
    )
    for name in ("addmm_full_input", "addbmm", "baddbmm")
  },
  "addmv": (
    "low",
    "torch's CPU list has addmm but not addmv; c + A @ v is a dot_general and "
    "a parameter added to it in JAX, as addmm (torch's CUDA list has addmv)",
  ),
  "lstm_layer": (
    "float32",
    "a JAX LSTM layer is a scan, whose carries keep their declared "
    "(float32) dtypes; torch's oneDNN layer "
    "returns bfloat16",
  ),
  "index_copy_mixed": (
    "low",
    "x.at[i].set(s) takes s in x's dtype (JAX semantics: the case "
    "casts it), so a 16-bit x traced as such cannot promote; with x "
    "traced as float32 (case index_copy_mixed@lowered) the scatter "
    "promotes",
  ),
  "bilinear": (
    "low",
    "torch's bilinear is unlisted on CPU (runs _trilinear in float32); the "
    "JAX einsum is dot_general",
  ),
  "mse_loss_weighted_low": (
    "float32",
    "torch's weighted mse_loss is Python over unlisted ops "
    "(no mse_loss kernel call); jaxamp's mse_loss region "
    "is float32 whatever its arguments",
  ),
  "l1_loss_weighted_low": (
    "float32",
    "torch's weighted l1_loss is Python over unlisted ops; jaxamp's l1_loss region is float32",
  ),
}


# Direct (16-bit traced) cases whose Python constants or dtype-derived defaults are traced in the
# 16-bit dtype: the jaxpr keeps 0.7 as bfloat16(0.69921875), pinv's default cutoff comes from
# bfloat16's epsilon. Autocast cannot recover the float32 values; the @lowered variants (traced in
# float32, the usual autocast flow) match torch to float32 precision.
TRACED_LOW_CONSTANTS: dict[str, str] = {
  "huber_loss_mean": "delta=0.7 traced as a bfloat16 literal",
  "huber_loss_sum@optax": "delta traced as a bfloat16 literal",
  "cross_entropy_label_smoothing": "label_smoothing traced as a bfloat16 literal",
  "cross_entropy_spatial_probs": "the class-probability weights' constants traced in bfloat16",
}
TRACED_LOW_DEFAULTS: dict[str, str] = {
  "pinverse": "pinv's default rtol is 10 * max(M, N) * eps of the traced (bfloat16) dtype",
}


# --- JAX counterparts --------------------------------------------------------------------------


def _conv(x, k, stride=1, padding=0):
  n = x.ndim - 2
  spatial = "DHW"[3 - n :]
  dn = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
  return lax.conv_general_dilated(
    x, k, (stride,) * n, [(padding, padding)] * n, dimension_numbers=dn
  )


def _conv_transpose(x, k, stride=1, padding=0):
  """torch's conv_transpose (weight (Cin, Cout, *K)) as a dilated convolution."""
  n = x.ndim - 2
  spatial = "DHW"[3 - n :]
  kernel = jnp.swapaxes(jnp.flip(k, tuple(range(2, k.ndim))), 0, 1)
  pads = [(s - 1 - padding, s - 1 - padding) for s in k.shape[2:]]
  return lax.conv_general_dilated(
    x,
    kernel,
    (1,) * n,
    pads,
    lhs_dilation=(stride,) * n,
    dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
  )


def _lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
  gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh
  i, f, g, o = jnp.split(gates, 4, axis=-1)
  c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
  return jax.nn.sigmoid(o) * jnp.tanh(c), c


def _lstm_layer(x, h, c, w_ih, w_hh, b_ih, b_hh):
  def step(carry, xt):
    h, c = _lstm_cell(xt, *carry, w_ih, w_hh, b_ih, b_hh)
    return (h, c), h

  return lax.scan(step, (h[0], c[0]), x)[1]


def _pool3d(x, kind):
  pool = nn.avg_pool if kind == "avg" else nn.max_pool
  y = pool(jnp.moveaxis(x, 1, -1), (2, 2, 2), strides=(2, 2, 2))
  return jnp.moveaxis(y, -1, 1)


def _batch_norm(x, rm, rv, w, b):
  variables = {"params": {"scale": w, "bias": b}, "batch_stats": {"mean": rm, "var": rv}}
  return nn.BatchNorm(use_running_average=True, axis=1, epsilon=1e-5).apply(variables, x)


def _sdpa(q, k, v):
  t = lambda a: jnp.swapaxes(a, 1, 2)  # torch (B, H, T, D) <-> jax (B, T, H, D)
  return t(jax.nn.dot_product_attention(t(q), t(k), t(v)))


def _disabled_mm(a, b):
  with jaxamp.autocast_disabled():
    return a @ b


def _ctc(log_probs, targets):
  """torch's ctc_loss on log-probabilities (full lengths) from optax's on logits.

  optax log-softmaxes its logits; torch takes the log-probabilities as given, so the two differ
  by the sum over time of each step's log-normaliser (zero for exactly normalised inputs).
  """
  logits = jnp.swapaxes(log_probs, 0, 1)
  loss = optax.ctc_loss(logits, jnp.zeros(logits.shape[:2]), targets, jnp.zeros(targets.shape))
  with jaxamp.autocast_disabled():  # the adapter's correction, not part of torch's op: float32
    log_norm = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return loss - jnp.sum(log_norm, axis=-1)


JAX_COUNTERPARTS: dict[str, Callable[..., jax.Array]] = {
  # lower precision
  "mm": lambda a, b: a @ b,
  "matmul": jnp.matmul,
  "matmul_vector": jnp.matmul,
  "bmm": jnp.matmul,
  "baddbmm": lambda c, x, y: c + jnp.matmul(x, y),
  "addmm": lambda bias, a, b: bias + a @ b,
  "addmm_full_input": lambda c, a, b: c + a @ b,
  "addbmm": lambda c, x, y: c + jnp.einsum("bij,bjk->ik", x, y),
  "linear": lambda a, w: a @ w.T,
  "linear_bias": lambda a, w, bias: a @ w.T + bias,
  "linalg_vecdot": lambda a, b: jnp.linalg.vecdot(a, b),
  "einsum": lambda x, y: jnp.einsum("bij,bjk->bik", x, y),
  "tensordot": lambda a, b: jnp.tensordot(a, b, axes=1),
  "sparse_mm": lambda a, m, b: sparse.BCOO.fromdense(a * m, nse=a.size) @ b,
  "norm_fro_of_mm": lambda a, b: jnp.linalg.norm(a @ b),
  "norm_inf_of_mm": lambda a, b: jnp.linalg.norm(a @ b, ord=jnp.inf),
  "norm_1_of_mm": lambda a, b: jnp.linalg.norm(a @ b, ord=1),
  "norm_vector_inf_of_mm": lambda a, b: jnp.linalg.norm((a @ b).reshape(-1), ord=jnp.inf),
  # fills: jnp.zeros(shape) is float32 as torch.zeros is; zeros_like follows its argument
  "zeros_plus_mm": lambda a, b: jnp.zeros((4, 5)) + a @ b,
  "cat_zeros_and_mm": lambda a, b: jnp.concatenate([jnp.zeros((2, 5)), a @ b]),
  "index_copy_mm_into_zeros": lambda a, b, i: jnp.zeros((6, 5)).at[i].set(a @ b),
  "where_mm_or_zeros_like": lambda a, b: jnp.where(a @ b > 0, a @ b, jnp.zeros_like(a @ b)),
  "conv1d": lambda x, k: _conv(x, k),
  "conv2d": lambda x, k: _conv(x, k),
  "conv2d_bias": lambda x, k, bias: _conv(x, k) + bias[:, None, None],
  "conv2d_stride_padding": lambda x, k: _conv(x, k, stride=2, padding=1),
  "conv3d": lambda x, k: _conv(x, k),
  "conv_tbc": lambda x, k, bias: (
    lax.conv_general_dilated(x, k, (1,), [(1, 1)], dimension_numbers=("HNC", "HIO", "HNC")) + bias
  ),
  "conv_transpose1d": lambda x, k: _conv_transpose(x, k, stride=2),
  "conv_transpose2d": lambda x, k: _conv_transpose(x, k, stride=2, padding=1),
  "conv_transpose3d": lambda x, k: _conv_transpose(x, k),
  "lstm_layer": _lstm_layer,
  "scaled_dot_product_attention": _sdpa,
  "mv": lambda a, v: a @ v,
  "dot": jnp.dot,
  "addmv": lambda c, a, v: c + a @ v,
  "bilinear": lambda x, y, w, bias: jnp.einsum("bi,oij,bj->bo", x, w, y) + bias,
  "lstm_cell": lambda *args: _lstm_cell(*args)[0],
  # float32
  "prod": lambda a: jnp.prod(a, axis=1),
  "prod_all": jnp.prod,
  "quantile": lambda a: jnp.quantile(a, 0.3, axis=1),
  "nanquantile": lambda a: jnp.nanquantile(a, 0.7, axis=0),
  "trace": jnp.trace,
  "view_as_complex": lambda z: lax.complex(z[..., 0], z[..., 1]),
  "linalg_cholesky": jnp.linalg.cholesky,
  "cholesky": jnp.linalg.cholesky,
  "linalg_cholesky_ex": jnp.linalg.cholesky,
  "cholesky_inverse": lambda chol: jsl.cho_solve(
    (chol, True), jnp.eye(chol.shape[0], dtype=chol.dtype)
  ),
  "cholesky_solve": lambda b, chol: jsl.cho_solve((chol, True), b),
  "inverse": jnp.linalg.inv,
  "linalg_inv": jnp.linalg.inv,
  "linalg_inv_ex": jnp.linalg.inv,
  "linalg_solve": jnp.linalg.solve,
  "lu_solve": lambda b, m: jsl.lu_solve(jsl.lu_factor(m), b),
  "lu": lambda m: lax.linalg.lu(m)[0],
  "triangular_solve": lambda b, u: jsl.solve_triangular(u, b, lower=False),
  "linalg_householder_product": lax.linalg.householder_product,
  "orgqr": lax.linalg.householder_product,
  "ormqr": lax.linalg.ormqr,
  "linalg_qr": lambda a: jnp.linalg.qr(a)[1],
  "qr": lambda a: jnp.linalg.qr(a)[1],
  "linalg_svd": lambda a: jnp.linalg.svd(a, compute_uv=False),
  "svd": lambda a: jnp.linalg.svd(a, compute_uv=False),
  "linalg_svdvals": jnp.linalg.svdvals,
  "pinverse": jnp.linalg.pinv,
  "linalg_matrix_rank": jnp.linalg.matrix_rank,
  "linalg_cond": jnp.linalg.cond,
  "linalg_eigh": lambda m: jnp.linalg.eigh(m)[0],
  "linalg_eigvalsh": jnp.linalg.eigvalsh,
  "linalg_eig": lambda m: jnp.sort(jnp.linalg.eig(m)[0].real),
  "linalg_eigvals": lambda m: jnp.sort(jnp.linalg.eigvals(m).real),
  "linalg_lstsq": lambda a, b: jnp.linalg.lstsq(a, b)[0],
  "linalg_tensorinv": lambda m: jnp.linalg.tensorinv(m.reshape(2, 4, 8), ind=2),
  "linalg_tensorsolve": lambda m, b: jnp.linalg.tensorsolve(m.reshape(2, 4, 8), b),
  **{
    f"fft_{n}": getattr(jnp.fft, n)
    for n in (
      "fft",
      "ifft",
      "fft2",
      "ifft2",
      "fftn",
      "ifftn",
      "rfft",
      "irfft",
      "rfft2",
      "irfft2",
      "rfftn",
      "irfftn",
      "hfft",
      "ihfft",
    )
  },
  "avg_pool3d": lambda x: _pool3d(x, "avg"),
  "adaptive_avg_pool3d": lambda x: _pool3d(x, "avg"),
  "max_pool3d": lambda x: _pool3d(x, "max"),
  "adaptive_max_pool3d": lambda x: _pool3d(x, "max"),
  "reflection_pad1d": lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1)), mode="reflect"),
  "reflection_pad2d": lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1), (1, 2)), mode="reflect"),
  "reflection_pad3d": lambda x: jnp.pad(
    x, ((0, 0), (0, 0), (1, 2), (2, 1), (1, 1)), mode="reflect"
  ),
  "replication_pad1d": lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1)), mode="edge"),
  "replication_pad2d": lambda x: jnp.pad(x, ((0, 0), (0, 0), (2, 1), (1, 2)), mode="edge"),
  "replication_pad3d": lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 0), (0, 1), (1, 1)), mode="edge"),
  "ctc_loss": _ctc,
  # promote
  "cat_mixed": lambda x, y: jnp.concatenate([x, y]),
  "cat_low": lambda x, y: jnp.concatenate([x, y], axis=1),
  "stack_mixed": lambda x, y: jnp.stack([x, y]),
  "stack_low": lambda x, y: jnp.stack([x, y], axis=1),
  # JAX's x.at[i].set(s) needs s in x's dtype (an implicit narrowing warns, and will raise).
  "index_copy_mixed": lambda x, i, s: x.at[i].set(s.astype(x.dtype)),
  "index_copy_low": lambda x, i, s: x.at[i].set(s),
  # unlisted on CPU
  "exp": jnp.exp,
  "exp_float32": jnp.exp,
  "log": jnp.log,
  "expm1": jnp.expm1,
  "log1p": jnp.log1p,
  "pow": lambda x: x**2,
  "pow_tensor": jnp.power,
  "rsqrt": lax.rsqrt,
  "reciprocal": jnp.reciprocal,
  "tan": jnp.tan,
  "erfinv": jax.scipy.special.erfinv,
  "sum": lambda x: jnp.sum(x, axis=1),
  "sum_all": jnp.sum,
  "mean": lambda x: jnp.mean(x, axis=1),
  "cumsum": lambda x: jnp.cumsum(x, axis=1),
  "cumprod": lambda x: jnp.cumprod(x, axis=1),
  "logsumexp": lambda x: jax.nn.logsumexp(x, axis=1),
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "relu": jax.nn.relu,
  "tanh": jnp.tanh,
  "sigmoid": jax.nn.sigmoid,
  "silu": jax.nn.silu,
  "batch_norm": _batch_norm,
  "add_mixed": lambda x, y: x + y,
  "mul_python_scalar": lambda x: x * 0.5,
  "mm_plus_bias": lambda a, w, bias: a @ w.T + bias,
  "mm_then_exp": lambda a, b: jnp.exp(a @ b),
  "mm_then_softmax": lambda a, b: jax.nn.softmax(a @ b, axis=1),
  "mm_then_mse_loss": lambda a, b, y: functional.mse_loss(a @ b, y),
  "mse_none_then_mean": lambda x, y: functional.mse_loss(x, y, reduction="none").mean(),
  "linear_then_layer_norm": lambda a, w, g, b: functional.layer_norm(a @ w.T, (5,), g, b),
  "autocast_disabled": _disabled_mm,
  "autocast_disabled_mixed": lambda a, b: a @ b + _disabled_mm(a, b),
  "float64_mm": lambda a, b: a @ b,
  "float64_exp": jnp.exp,
  "int_mm": lambda a, b: a @ b,
  "int_sum": jnp.sum,
  "int_plus_low": lambda a, x: a + x,
  "bool_where": jnp.where,
  "cumsum_long": lambda x: jnp.cumsum(x, axis=1),
  "sum_long": lambda x: jnp.sum(x, axis=1),
  "sum_long_of_mm": lambda a, b: jnp.sum(a @ b),
  "cumprod_long": lambda x: jnp.cumprod(x, axis=1),
  "logcumsumexp_long": lambda x: lax.cumlogsumexp(x, axis=1),
  "var_offset": lambda x: jnp.var(x, axis=1, ddof=1),
  "std_offset": lambda x: jnp.std(x, axis=1, ddof=1),
  "nanmean": lambda x: jnp.nanmean(x, axis=1),
  "median": lambda x: jnp.median(x, axis=1),
  "avg_pool2d_wide": lambda x: (
    lax.reduce_window(x, 0.0, lax.add, (1, 1, 16, 16), (1, 1, 16, 16), "VALID") / 256
  ),
  "unfold": lambda x: lax.conv_general_dilated_patches(x, (2, 2), (2, 2), "VALID").reshape(1, 8, 4),
  "unfold_low": lambda x: lax.conv_general_dilated_patches(x, (2, 2), (2, 2), "VALID").reshape(
    1, 8, 4
  ),
  "sdpa_long": _sdpa,
  "sdpa_large_logits": _sdpa,
  "where_0dim_or_scalar": lambda a, b: jnp.where((a @ b).max() > 0, (a @ b).max(), 0.0),
  "clamp_0dim": lambda a, b: jnp.clip((a @ b).max(), 0.0, 1.0),
  "nan_to_num_0dim": lambda a, b: jnp.nan_to_num((a @ b).max()),
  "mm_sum_over_int_lengths": lambda a, b, n: (a @ b).sum(1) / n,
  "mm_plus_arange": lambda a, b: a @ b + jnp.arange(5),
  "mm_times_int_column": lambda a, b, n: (a @ b) * n[:, None],
  "vecdot_of_vectors": jnp.linalg.vecdot,
  "einsum_of_vectors": lambda u, v: jnp.einsum("i,i->", u, v),
  "int_sum_to_bfloat16": lambda n: jnp.sum(n, dtype=jnp.bfloat16),
  "mm_times_tril_of_ones_like": lambda a, b: (a @ b) * jnp.tril(jnp.ones_like(a @ b)),
  "mm_over_cumsum_of_ones_like": lambda a, b: (a @ b) / jnp.cumsum(jnp.ones_like(a @ b), 1),
  "mm_plus_twice_zeros_like": lambda a, b: (a @ b) + 2 * jnp.zeros_like(a @ b),
  "mm_sum_over_float_lengths": lambda a, b, n: (a @ b).sum(1) / n.astype(jnp.float32),
  "einsum_without_a_summed_index": lambda a, b, v: jnp.einsum("ij,j->ij", a @ b, v),
  "einsum_summing_an_index_of_size_one": lambda a, w: jnp.einsum("bi,ik->bk", a[:, :1], w),
  "cat_slice_of_zeros_like": lambda a, b: jnp.concatenate([jnp.zeros_like(a @ b)[:1], (a @ b)[1:]]),
  "logaddexp": jnp.logaddexp,
  "logaddexp2": jnp.logaddexp2,
  "xlogy": jax.scipy.special.xlogy,
  "xlog1py": jax.scipy.special.xlog1py,
  "entr": jax.scipy.special.entr,
  "logit": jax.scipy.special.logit,
  "hypot": jnp.hypot,
  "i0": jnp.i0,
  "i1": jax.scipy.special.i1,
  "nansum": lambda x: jnp.nansum(x, axis=1),
  "mm_plus_0dim": lambda a, b, s: a @ b + s,
  "atan2_of_mm_and_0dim": lambda a, b, s: jnp.arctan2(a @ b, s),
  "index_copy_0dim_into_mm": lambda a, b, i, s: (a @ b)[0].at[i].set(s),
  "cat_mm_and_0dim": lambda a, b, s: jnp.concatenate([(a @ b)[0], s.reshape(1)]),
}

# The same cases through library functions autocast recognises (optax, jax.nn, flax).
LIBRARY_COUNTERPARTS: dict[str, tuple[str, Callable[..., jax.Array]]] = {
  "softmax@jax.nn": ("softmax", lambda x: jax.nn.softmax(x, axis=-1)),
  "log_softmax@jax.nn": ("log_softmax", lambda x: jax.nn.log_softmax(x, axis=1)),
  "softplus@jax.nn": ("softplus", jax.nn.softplus),
  "linear_then_layer_norm@flax": (
    "linear_then_layer_norm",
    lambda a, w, g, b: nn.LayerNorm(epsilon=1e-5).apply(
      {"params": {"scale": g, "bias": b}}, a @ w.T
    ),
  ),
  "layer_norm@flax": (
    "layer_norm_no_affine",
    lambda x: nn.LayerNorm(
      epsilon=1e-5, use_scale=False, use_bias=False, reduction_axes=(-2, -1)
    ).apply({}, x),
  ),
  "cross_entropy_mean@optax": (
    "cross_entropy_mean",
    lambda x, t: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, t)),
  ),
  "cross_entropy_probs@optax": (
    "cross_entropy_probs",
    lambda x, t: jnp.mean(optax.softmax_cross_entropy(x, t)),
  ),
  "mse_loss_mean@optax": ("mse_loss_mean", lambda x, y: jnp.mean(optax.squared_error(x, y))),
  "huber_loss_sum@optax": (
    "huber_loss_sum",
    lambda x, y: jnp.sum(optax.huber_loss(x, y, delta=0.7)),
  ),
  "binary_cross_entropy_with_logits_mean@optax": (
    "binary_cross_entropy_with_logits_mean",
    lambda x, t: jnp.mean(optax.sigmoid_binary_cross_entropy(x, t)),
  ),
  "kl_div_sum@optax": ("kl_div_sum", lambda x, t: jnp.sum(optax.kl_divergence(x, t))),
  "logsumexp@jax.scipy": ("logsumexp", lambda x: jax.scipy.special.logsumexp(x, axis=1)),
  "cumsum_long@lax": ("cumsum_long", lambda x: lax.cumsum(x, axis=1)),
  "sum_long@lax": ("sum_long", lambda x: lax.reduce_sum(x, (1,))),
  "sum_long_of_mm@lax": ("sum_long_of_mm", lambda a, b: lax.reduce_sum(a @ b, (0, 1))),
  "adaptive_avg_pool3d@equinox": (
    "adaptive_avg_pool3d",
    lambda x: jax.vmap(eqx.nn.AdaptiveAvgPool3d(2))(x),
  ),
  "adaptive_max_pool3d@equinox": (
    "adaptive_max_pool3d",
    lambda x: jax.vmap(eqx.nn.AdaptiveMaxPool3d(2))(x),
  ),
  "avg_pool2d_wide@flax": (
    "avg_pool2d_wide",
    lambda x: nn.avg_pool(x.transpose(0, 2, 3, 1), (16, 16), (16, 16)).transpose(0, 3, 1, 2),
  ),
}

_JAX_TORCH = types.SimpleNamespace(
  **{name: getattr(functional, name) for name in functional.__all__},
  float32=jnp.float32,
  float16=jnp.float16,
  bfloat16=jnp.bfloat16,
)


LOWERED = "@lowered"
# Unlisted cases also run lowered: JAX computes them in float32 when traced on float32 (jnp.var
# upcasts a 16-bit input itself), which a 16-bit value reaching them at run time must not lose.
TRACED_AS_FLOAT32 = frozenset(
  {
    "cumsum_long",
    "cumprod_long",
    "logcumsumexp_long",
    "var_offset",
    "std_offset",
    "nanmean",
    "median",
    "avg_pool2d_wide",
    "unfold_low",
    "sum_long",
  }
)

# Cases plain JAX cannot trace on 16-bit inputs: they only run with lowered inputs.
DIRECT_UNSUPPORTED: dict[str, str] = {
  **{
    f"fft_{n}": "jnp.fft real transforms reject 16-bit inputs"
    for n in ("rfft", "rfft2", "rfftn", "ihfft")
  },
  "view_as_complex": "lax.complex rejects 16-bit inputs",
}


def _lowered(x: jax.Array) -> jax.Array:
  """``x`` through an exact dot: float32 when traced, the autocast dtype when run."""
  return jnp.matmul(x[..., None], jnp.ones((1, 1), x.dtype))[..., 0]  # a matmul, not a mul


def counterpart(label: str) -> tuple[dict, Callable[..., jax.Array]]:
  """(golden case, JAX function of its inputs) for a case name or a variant label.

  ``name@lowered`` runs case ``name`` with its 16-bit ("low") inputs passed as float32 and sent
  through a dot, so they are float32 when traced and 16-bit when run (the usual autocast flow).
  Other ``name@library`` labels run a library counterpart (LIBRARY_COUNTERPARTS).
  """
  if label in LIBRARY_COUNTERPARTS:
    name, fn = LIBRARY_COUNTERPARTS[label]
    return CASES[name], fn
  if label.endswith(LOWERED):
    case, fn = counterpart(label.removesuffix(LOWERED))
    low = [s["dtype"] == "low" for s in case["inputs"].values()]
    return case, lambda *args: fn(
      *[_lowered(a) if m else a for a, m in zip(args, low, strict=True)]
    )
  case = CASES[label]
  if label in JAX_COUNTERPARTS:
    return case, JAX_COUNTERPARTS[label]
  if case["functional"]:
    expr, names = case["expr"], list(case["inputs"])
    scope = {"F": _JAX_TORCH, "torch": _JAX_TORCH}
    return case, lambda *args: eval(expr, scope, dict(zip(names, args, strict=True)))  # noqa: S307
  raise KeyError(f"no JAX counterpart for golden case {label!r}")


_JAX_DTYPES = {
  "float32": jnp.float32,
  "float64": jnp.float64,
  "int64": jnp.int32,
  "bool": jnp.bool_,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
}


def _needs_x64(case: dict) -> bool:
  """float64 cases run with x64 enabled (without it JAX has no float64 to pass through)."""
  return any(s["dtype"] == "float64" for s in case["inputs"].values())


def jax_inputs(case: dict, mode: str) -> dict[str, jax.Array]:
  """A case's stored inputs as JAX arrays; ``"low"`` inputs in the autocast dtype."""
  out = {}
  for name, spec in case["inputs"].items():
    dtype = mode if spec["dtype"] == "low" else spec["dtype"]
    values = np.asarray(spec["values"]).reshape(spec["shape"])
    out[name] = jnp.asarray(values, _JAX_DTYPES[dtype])
  return out


@functools.cache
def autocast_output(label: str, mode: str) -> tuple[np.dtype, np.ndarray]:
  """The counterpart of ``label`` under jit(autocast(cpu, mode)): (dtype, values)."""
  case, fn = counterpart(label)
  low = jnp.bfloat16 if mode == "bfloat16" else jnp.float16
  run = jax.jit(jaxamp.autocast(fn, device_type="cpu", dtype=low))
  with jax.enable_x64(_needs_x64(case)):
    inputs = jax_inputs(case, "float32" if label.endswith(LOWERED) else mode)
    out = run(*inputs.values())
    return out.dtype, np.asarray(out)


def expected_dtype(label: str, torch_dtype: str, mode: str) -> np.dtype:
  """torch's result dtype as JAX spells it, or jaxamp's documented divergence."""
  if label in DIVERGENCES:
    torch_dtype = DIVERGENCES[label][0]
  if torch_dtype == "low":
    torch_dtype = mode
  if torch_dtype == "int64":
    return np.dtype(np.int32)
  return np.dtype(jnp.bfloat16) if torch_dtype == "bfloat16" else np.dtype(torch_dtype)


def tolerance(label: str, mode: str) -> float:
  """Relative tolerance: float32-list ops fed 16-bit inputs cast exactly, so float32 precision."""
  case, _ = counterpart(label)
  float_inputs = [s["dtype"] for s in case["inputs"].values() if s["dtype"] != "int64"]
  exact = case["group"] == "float32" and all(d == "low" for d in float_inputs)
  if exact and label not in DIVERGENCES and label not in TRACED_LOW_CONSTANTS:
    return 1e-4
  return 2e-2 if mode == "bfloat16" else 4e-3


def assert_values_close(actual: np.ndarray, expected: dict, rtol: float) -> None:
  values = np.reshape(expected["values"], expected["shape"])
  if "imag" in expected:
    values = values + 1j * np.reshape(expected["imag"], expected["shape"])
  actual = np.asarray(actual).astype(np.complex128 if "imag" in expected else np.float64)
  scale = max(1.0, float(np.max(np.abs(values)))) if values.size else 1.0
  np.testing.assert_allclose(actual, values, rtol=rtol, atol=rtol * scale)


def _variants() -> list[tuple[str, tuple[str, ...]]]:
  """(label, modes) to test, chosen to keep the run short.

  float16 shares torch's CPU lists with bfloat16, so it runs where the result is 16-bit
  (lower-precision, promote and unlisted ops, not jaxamp.functional's); float32-list and promote
  ops run in bfloat16 both directly and with lowered inputs. The "_sum" / "_none" reduction
  variants of the losses differ from "_mean" only in values, which test_functional.py checks.
  """
  variants = []
  for name, case in sorted(CASES.items()):
    if case["functional"] and name.endswith(("_sum", "_none")):
      continue
    float32_list = case["group"] == "float32"
    variants.append((name, ("bfloat16",) if float32_list or case["functional"] else MODES))
    if (float32_list or case["group"] == "promote" or name in TRACED_AS_FLOAT32) and any(
      s["dtype"] == "low" for s in case["inputs"].values()
    ):
      variants.append((name + LOWERED, ("bfloat16",)))
  variants += [(label, ("bfloat16",)) for label in sorted(LIBRARY_COUNTERPARTS)]
  return variants


def _uncompared_reason(label: str, mode: str) -> str | None:
  """Why a case is not compared with torch (torch or JAX rejects its inputs, or only its
  lowered variant is comparable), or None."""
  case, _ = counterpart(label)
  error = case["results"][mode].get("error")
  if label in TRACED_LOW_DEFAULTS:
    return TRACED_LOW_DEFAULTS[label]
  if label in DIRECT_UNSUPPORTED:
    return DIRECT_UNSUPPORTED[label]
  return f"torch raises: {error}" if error else None


# (label, mode) -> why it is not compared (None: compared with torch). Each reason is checked by
# a test of its own below.
REASONS = {
  (label, mode): _uncompared_reason(label, mode) for label, modes in _variants() for mode in modes
}
UNCOMPARED = {key: reason for key, reason in REASONS.items() if reason is not None}
COMPARED = [key for key, reason in REASONS.items() if reason is None]


def _params() -> list:
  return [pytest.param(label, mode, id=f"{label}-{mode}") for label, mode in COMPARED]


def _family(param) -> tuple:
  """A case's family for the fast subset: its list, jaxamp.functional's or not, direct, lowered
  or a library's counterpart, and the autocast dtype."""
  label, mode = param.values
  case, _ = counterpart(label)
  if label in LIBRARY_COUNTERPARTS:
    kind = "library"
  else:
    kind = "lowered" if label.endswith(LOWERED) else "direct"
  return case["group"], case["functional"], kind, mode


PARAMS = first_of_each_family(_params(), _family)


# --- tests -------------------------------------------------------------------------------------


def test_every_case_has_a_jax_counterpart():
  missing = [n for n, c in CASES.items() if n not in JAX_COUNTERPARTS and not c["functional"]]
  assert not missing


def test_not_applicable_ops_have_no_case():
  assert not set(NOT_APPLICABLE) & {c["torch_op"] for c in CASES.values()}


def _uncompared(kind: str) -> list:
  return [pytest.param(*key, id="-".join(key)) for key, r in UNCOMPARED.items() if kind in r]


@pytest.mark.torch
@pytest.mark.parametrize("label, mode", _uncompared("torch raises"))
def test_torch_still_rejects_the_cases_recorded_with_an_error(label, mode):
  module = torch_goldens.recorder()
  case, _ = counterpart(label)
  recorded = case["results"][mode]["error"]
  with pytest.raises(Exception) as raised:
    module.run_case(case["expr"], module.torch_inputs(case["inputs"], mode), mode)
  assert recorded.startswith(type(raised.value).__name__)


@pytest.mark.parametrize("label", sorted(DIRECT_UNSUPPORTED))
def test_an_op_jax_runs_only_in_float32_raises_on_16_bit_inputs_and_its_lowered_case_is_compared(
  label,
):
  with pytest.raises((TypeError, ValueError)):
    autocast_output(label, "bfloat16")
  assert (label + LOWERED, "bfloat16") in COMPARED


@pytest.mark.parametrize("label", sorted(TRACED_LOW_DEFAULTS))
def test_an_op_whose_defaults_follow_the_traced_dtype_is_compared_lowered(label):
  assert (label, "bfloat16") in UNCOMPARED
  assert (label + LOWERED, "bfloat16") in COMPARED


@pytest.mark.parametrize("label, mode", PARAMS)
@pytest.mark.slow_after_first
def test_dtype_matches_torch_golden(label, mode):
  case, _ = counterpart(label)
  dtype, _ = autocast_output(label, mode)
  assert dtype == expected_dtype(label, case["results"][mode]["dtype"], mode)


@pytest.mark.parametrize("label, mode", PARAMS)
def test_values_match_torch_golden(label, mode):
  case, _ = counterpart(label)
  expected = case["results"][mode]
  _, values = autocast_output(label, mode)
  assert list(values.shape) == expected["shape"]
  assert_values_close(values, expected, tolerance(label, mode))


@pytest.mark.torch
@pytest.mark.parametrize("label, mode", PARAMS)
def test_matches_torch_live(label, mode):
  module = torch_goldens.recorder()
  case, _ = counterpart(label)
  try:
    torch_out = module.run_case(case["expr"], module.torch_inputs(case["inputs"], mode), mode)
  except RuntimeError as error:
    if "could not create a primitive descriptor" not in str(error):
      raise
    # oneDNN's bfloat16 kernels (torch's CPU LSTM) need AVX-512 BF16 or AMX, which some CPUs lack.
    pytest.skip(f"torch cannot run {label} on this CPU ({error}); the recorded golden is compared")
  expected = module.encode(torch_out)
  dtype, values = autocast_output(label, mode)
  assert dtype == expected_dtype(label, expected["dtype"], mode)
  assert_values_close(values, expected, tolerance(label, mode))


# torch's CPU reduction, scan and pooling kernels accumulate a 16-bit input in float32 and round
# once: jaxamp's result is torch's to within one unit in the last place (the float32 additions
# may come in another order), where a 16-bit accumulation is off by many.
ROUNDED_ONCE = [
  "sum_long",
  "sum_long@lax",
  "sum_long_of_mm",
  "sum_long_of_mm@lax",
  "cumsum_long",
  "cumsum_long@lax",
  "cumprod_long",
  "logcumsumexp_long",
  "var_offset",
  "std_offset",
  "avg_pool2d_wide",
  "avg_pool2d_wide@flax",
]


@pytest.mark.parametrize(
  "label, mode",
  [(label, mode) for label in ROUNDED_ONCE for mode in MODES]
  + [(label + LOWERED, "bfloat16") for label in ROUNDED_ONCE],
)
def test_an_accumulating_kernel_is_within_one_ulp_of_torchs(label, mode):
  case, _ = counterpart(label)
  expected = case["results"][mode]
  dtype, values = autocast_output(label, mode)
  torch_values = np.reshape(expected["values"], expected["shape"]).astype(dtype)
  one_ulp = np.spacing(np.abs(torch_values)).astype(np.float64)
  error = np.abs(values.astype(np.float64) - torch_values.astype(np.float64))
  assert (error <= one_ulp).all(), float((error / one_ulp).max())


@pytest.mark.parametrize("mode", MODES)
def test_attention_of_long_rows_keeps_float32_scores_and_softmax(mode):
  # torch's SDPA computes the scores and softmax of 16-bit inputs in float32 and rounds the
  # probabilities once, unnormalised (the largest is exactly 1); jaxamp rounds them normalised,
  # as JAX's own 16-bit attention does: 1.2x torch's error against float32 at 256 keys, where
  # a 16-bit softmax was 1.8x.
  case, _ = counterpart("sdpa_long")
  exact = np.reshape(case["results"]["none"]["values"], case["results"]["none"]["shape"])
  torch_values = np.reshape(case["results"][mode]["values"], case["results"][mode]["shape"])
  _, values = autocast_output("sdpa_long", mode)
  error = np.abs(values.astype(np.float64) - exact).mean()
  assert error <= 1.3 * np.abs(torch_values - exact).mean()
