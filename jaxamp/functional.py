"""JAX versions of the ``torch.nn.functional`` ops on torch.amp's autocast lists.

Each function has torch's name, signature and semantics (``reduction="mean" | "sum" | "none"``,
``ignore_index``, ``label_smoothing``, ...) and matches torch's values in float32. Each one is a
registered autocast op region named after the torch op, so ``jaxamp.autocast`` casts its inputs as
torch's autocast casts that op on the active device (float32 for the losses, the autocast dtype
for ``prelu``, the inputs' own dtype for ops a device does not list).

As torch's kernels do, 16-bit inputs are computed in float32 internally and the result is returned
in the inputs' (promoted) dtype. Deprecated torch arguments (``size_average``, ``reduce``, ``out``)
are left out; options after them are keyword-only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src import regions

__all__ = [
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "cdist",
    "cosine_embedding_loss",
    "cosine_similarity",
    "cross_entropy",
    "dist",
    "group_norm",
    "hinge_embedding_loss",
    "huber_loss",
    "kl_div",
    "l1_loss",
    "layer_norm",
    "log_softmax",
    "margin_ranking_loss",
    "mse_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "nll_loss",
    "norm",
    "normalize",
    "pdist",
    "poisson_nll_loss",
    "prelu",
    "renorm",
    "smooth_l1_loss",
    "soft_margin_loss",
    "softmax",
    "softmin",
    "softplus",
    "triplet_margin_loss",
]

Array = jax.Array
_REDUCTIONS = ("none", "mean", "sum")
_LOW = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# --- helpers -----------------------------------------------------------------------------------


def _dtypes(*xs) -> tuple[np.dtype, np.dtype]:
  """(compute dtype, result dtype) of float inputs ``xs``: 16-bit floats compute in float32."""
  out = jnp.result_type(*[x for x in xs if x is not None])
  if not jnp.issubdtype(out, jnp.inexact):
    out = jnp.promote_types(out, jnp.float32)
  compute = jnp.dtype(jnp.float32) if out in _LOW else out
  return compute, out


def _cast(dtype, *xs):
  return tuple(None if x is None else jnp.asarray(x).astype(dtype) for x in xs)


def _check_reduction(reduction: str) -> None:
  if reduction not in _REDUCTIONS:
    raise ValueError(f"`reduction` must be one of {_REDUCTIONS}; got {reduction!r}.")


def _reduce(loss: Array, reduction: str) -> Array:
  _check_reduction(reduction)
  if reduction == "mean":
    return jnp.mean(loss)
  if reduction == "sum":
    return jnp.sum(loss)
  return loss


def _weighted_reduce(loss: Array, weight: Array | None, reduction: str) -> Array:
  """torch's Python-level ``weight=`` path of mse/l1/huber loss."""
  if weight is None:
    return _reduce(loss, reduction)
  _check_reduction(reduction)
  weighted = loss * weight
  if reduction == "mean":
    return jnp.sum(weighted) / jnp.sum(weight)
  if reduction == "sum":
    return jnp.sum(weighted)
  return weighted


def _safe_sqrt(x: Array) -> Array:
  """sqrt with a zero (sub)gradient at 0, as torch's norm backward."""
  positive = x > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1)), 0)


def _vector_norm(x: Array, p: float, axis=None, keepdims: bool = False) -> Array:
  """``torch.linalg.vector_norm``: the p-norm of ``x`` over ``axis`` (all axes for None)."""
  a = jnp.abs(x)
  if p == math.inf:
    return jnp.max(a, axis=axis, keepdims=keepdims)
  if p == -math.inf:
    return jnp.min(a, axis=axis, keepdims=keepdims)
  if p == 0:
    return jnp.sum((a != 0).astype(x.dtype), axis=axis, keepdims=keepdims)
  if p == 1:
    return jnp.sum(a, axis=axis, keepdims=keepdims)
  if p == 2:
    return _safe_sqrt(jnp.sum(x * x, axis=axis, keepdims=keepdims))
  return jnp.sum(a**p, axis=axis, keepdims=keepdims) ** (1.0 / p)


def _softmax_dim(name: str, ndim: int, dim: int | None) -> int:
  if dim is not None:
    return dim
  warnings.warn(
      f"Implicit dimension choice for {name} has been deprecated in torch; pass `dim`.",
      stacklevel=3,
  )
  return 0 if ndim in (0, 1, 3) else 1


def _log_softmax(x: Array, axis: int) -> Array:
  shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def _softmax(x: Array, axis: int) -> Array:
  unnormalized = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
  return unnormalized / jnp.sum(unnormalized, axis=axis, keepdims=True)


def _softplus(x: Array, beta: float = 1.0, threshold: float = 20.0) -> Array:
  scaled = x * beta
  safe = jnp.where(scaled > threshold, 0, scaled)
  return jnp.where(scaled > threshold, x, jnp.log1p(jnp.exp(safe)) / beta)


# --- regression losses -------------------------------------------------------------------------


@regions.register_op("mse_loss")
def mse_loss(
    input: Array, target: Array, *, reduction: str = "mean", weight: Array | None = None
) -> Array:
  """``torch.nn.functional.mse_loss``."""
  compute, out = _dtypes(input, target)
  x, y, w = _cast(compute, input, target, weight)
  return _weighted_reduce(jnp.square(x - y), w, reduction).astype(out)


@regions.register_op("l1_loss")
def l1_loss(
    input: Array, target: Array, *, reduction: str = "mean", weight: Array | None = None
) -> Array:
  """``torch.nn.functional.l1_loss``."""
  compute, out = _dtypes(input, target)
  x, y, w = _cast(compute, input, target, weight)
  return _weighted_reduce(jnp.abs(x - y), w, reduction).astype(out)


@regions.register_op("smooth_l1_loss")
def smooth_l1_loss(
    input: Array, target: Array, *, reduction: str = "mean", beta: float = 1.0
) -> Array:
  """``torch.nn.functional.smooth_l1_loss``."""
  compute, out = _dtypes(input, target)
  x, y = _cast(compute, input, target)
  z = jnp.abs(x - y)
  if beta == 0:
    loss = z
  else:
    loss = jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
  return _reduce(loss, reduction).astype(out)


@regions.register_op("huber_loss")
def huber_loss(
    input: Array,
    target: Array,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Array | None = None,
) -> Array:
  """``torch.nn.functional.huber_loss``."""
  compute, out = _dtypes(input, target)
  x, y, w = _cast(compute, input, target, weight)
  z = jnp.abs(x - y)
  loss = jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
  if w is None:
    return _reduce(loss, reduction).astype(out)
  _check_reduction(reduction)
  return _reduce(loss * w, reduction).astype(out)


# --- binary and classification losses ----------------------------------------------------------


@regions.register_op("binary_cross_entropy")
def binary_cross_entropy(
    input: Array, target: Array, weight: Array | None = None, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.binary_cross_entropy`` (on probabilities; log clamped at -100)."""
  compute, out = _dtypes(input, target)
  p, t, w = _cast(compute, input, target, weight)
  log_p = jnp.maximum(jnp.log(p), -100.0)
  log_1mp = jnp.maximum(jnp.log1p(-p), -100.0)
  loss = -(t * log_p + (1 - t) * log_1mp)
  if w is not None:
    loss = loss * w
  return _reduce(loss, reduction).astype(out)


@regions.register_op("binary_cross_entropy_with_logits")
def binary_cross_entropy_with_logits(
    input: Array,
    target: Array,
    weight: Array | None = None,
    *,
    reduction: str = "mean",
    pos_weight: Array | None = None,
) -> Array:
  """``torch.nn.functional.binary_cross_entropy_with_logits``."""
  compute, out = _dtypes(input, target)
  x, t, w, pw = _cast(compute, input, target, weight, pos_weight)
  log_sigmoid = jax.nn.log_sigmoid(x)
  if pw is not None:
    log_sigmoid = log_sigmoid * ((pw - 1) * t + 1)
  loss = (1 - t) * x - log_sigmoid
  if w is not None:
    loss = loss * w
  return _reduce(loss, reduction).astype(out)


def _class_weights(weight: Array | None, n_classes: int, dtype) -> Array:
  if weight is None:
    return jnp.ones((n_classes,), dtype)
  return weight.astype(dtype)


def _nll(
    logp: Array, target: Array, weight: Array | None, ignore_index: int, reduction: str
) -> Array:
  """torch's nll_loss on log-probabilities ``logp`` of shape (N, C, d...) or (C,)."""
  _check_reduction(reduction)
  class_axis = 0 if logp.ndim == 1 else 1
  n_classes = logp.shape[class_axis]
  target = jnp.asarray(target)
  valid = target != ignore_index
  safe = jnp.where(valid, target, 0).astype(jnp.int32)
  picked = jnp.take_along_axis(logp, jnp.expand_dims(safe, class_axis), axis=class_axis)
  picked = jnp.squeeze(picked, class_axis)
  w = jnp.where(valid, _class_weights(weight, n_classes, logp.dtype)[safe], 0)
  loss = -picked * w
  if reduction == "none":
    return loss
  if reduction == "sum":
    return jnp.sum(loss)
  return jnp.sum(loss) / jnp.sum(w)


@regions.register_op("nll_loss")
def nll_loss(
    input: Array,
    target: Array,
    weight: Array | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Array:
  """``torch.nn.functional.nll_loss`` (input (N, C, d...) or (C,), class-index target)."""
  compute, out = _dtypes(input)
  (logp,) = _cast(compute, input)
  return _nll(logp, target, weight, ignore_index, reduction).astype(out)


@regions.register_op("cross_entropy")
def cross_entropy(
    input: Array,
    target: Array,
    weight: Array | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Array:
  """``torch.nn.functional.cross_entropy`` (class-index or class-probability targets)."""
  _check_reduction(reduction)
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"`label_smoothing` must be in [0, 1]; got {label_smoothing!r}.")
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  class_axis = 0 if x.ndim == 1 else 1
  n_classes = x.shape[class_axis]
  logp = _log_softmax(x, class_axis)
  w_shape = [1] * x.ndim
  w_shape[class_axis] = n_classes
  target = jnp.asarray(target)

  if jnp.issubdtype(target.dtype, jnp.floating):  # class probabilities
    t = target.astype(compute)
    if label_smoothing > 0:
      t = t * (1 - label_smoothing) + label_smoothing / n_classes
    terms = logp * t
    if weight is not None:
      terms = terms * weight.astype(compute).reshape(w_shape)
    loss = -jnp.sum(terms, axis=class_axis)
    if reduction == "mean":
      return (jnp.sum(loss) / (x.size // n_classes)).astype(out)
    return _reduce(loss, reduction).astype(out)

  nll = _nll(logp, target, weight, ignore_index, reduction)
  if label_smoothing == 0:
    return nll.astype(out)
  valid = target != ignore_index
  terms = logp if weight is None else logp * weight.astype(compute).reshape(w_shape)
  smooth = jnp.where(valid, -jnp.sum(terms, axis=class_axis), 0)
  if reduction == "none":
    smooth_red = smooth
  elif reduction == "sum":
    smooth_red = jnp.sum(smooth)
  elif weight is None:
    smooth_red = jnp.sum(smooth) / jnp.sum(valid)
  else:
    safe = jnp.where(valid, target, 0).astype(jnp.int32)
    smooth_red = jnp.sum(smooth) / jnp.sum(jnp.where(valid, weight.astype(compute)[safe], 0))
  loss = (1 - label_smoothing) * nll + smooth_red * (label_smoothing / n_classes)
  return loss.astype(out)


@regions.register_op("kl_div")
def kl_div(
    input: Array, target: Array, *, reduction: str = "mean", log_target: bool = False
) -> Array:
  """``torch.nn.functional.kl_div`` (``input`` holds log-probabilities; "batchmean" too)."""
  if reduction not in _REDUCTIONS + ("batchmean",):
    raise ValueError(
        f"`reduction` must be one of {_REDUCTIONS + ('batchmean',)}; got {reduction!r}."
    )
  compute, out = _dtypes(input, target)
  x, t = _cast(compute, input, target)
  if log_target:
    loss = jnp.exp(t) * (t - x)
  else:
    loss = jax.scipy.special.xlogy(t, t) - t * x
  if reduction == "batchmean":
    total = jnp.sum(loss)
    return (total / x.shape[0] if x.ndim else total).astype(out)
  return _reduce(loss, reduction).astype(out)


@regions.register_op("poisson_nll_loss")
def poisson_nll_loss(
    input: Array,
    target: Array,
    log_input: bool = True,
    full: bool = False,
    *,
    eps: float = 1e-8,
    reduction: str = "mean",
) -> Array:
  """``torch.nn.functional.poisson_nll_loss``."""
  compute, out = _dtypes(input, target)
  x, t = _cast(compute, input, target)
  if log_input:
    loss = jnp.exp(x) - t * x
  else:
    loss = x - t * jnp.log(x + eps)
  if full:
    safe_t = jnp.where(t > 1, t, 1)
    stirling = safe_t * jnp.log(safe_t) - safe_t + 0.5 * jnp.log(2 * math.pi * safe_t)
    loss = loss + jnp.where(t > 1, stirling, 0)
  return _reduce(loss, reduction).astype(out)


# --- margin and embedding losses ---------------------------------------------------------------


@regions.register_op("cosine_embedding_loss")
def cosine_embedding_loss(
    input1: Array, input2: Array, target: Array, margin: float = 0.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.cosine_embedding_loss``."""
  compute, out = _dtypes(input1, input2)
  x1, x2 = _cast(compute, input1, input2)
  axis = x1.ndim - 1
  eps = 1e-12
  prod = jnp.sum(x1 * x2, axis=axis)
  mag1 = jnp.sum(x1 * x1, axis=axis) + eps
  mag2 = jnp.sum(x2 * x2, axis=axis) + eps
  cos = prod / jnp.sqrt(mag1 * mag2)
  target = jnp.asarray(target)
  loss = jnp.where(target == 1, 1 - cos, 0) + jnp.where(
      target == -1, jnp.maximum(cos - margin, 0), 0
  )
  return _reduce(loss, reduction).astype(out)


@regions.register_op("hinge_embedding_loss")
def hinge_embedding_loss(
    input: Array, target: Array, margin: float = 1.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.hinge_embedding_loss``."""
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  target = jnp.asarray(target)
  loss = jnp.where(target != 1, jnp.maximum(margin - x, 0), 0) + jnp.where(target != -1, x, 0)
  return _reduce(loss, reduction).astype(out)


@regions.register_op("margin_ranking_loss")
def margin_ranking_loss(
    input1: Array, input2: Array, target: Array, margin: float = 0.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.margin_ranking_loss``."""
  compute, out = _dtypes(input1, input2, target)
  x1, x2, y = _cast(compute, input1, input2, target)
  loss = jnp.maximum(-y * (x1 - x2) + margin, 0)
  return _reduce(loss, reduction).astype(out)


@regions.register_op("soft_margin_loss")
def soft_margin_loss(input: Array, target: Array, *, reduction: str = "mean") -> Array:
  """``torch.nn.functional.soft_margin_loss``."""
  compute, out = _dtypes(input, target)
  x, y = _cast(compute, input, target)
  loss = jnp.log1p(jnp.exp(-y * x))
  return _reduce(loss, reduction).astype(out)


def _pairwise_distance(x1: Array, x2: Array, p: float, eps: float) -> Array:
  """``torch.pairwise_distance``: the p-norm of ``x1 - x2 + eps`` over the last axis."""
  axis = max(x1.ndim, x2.ndim) - 1
  return _vector_norm(x1 - x2 + eps, p, axis=axis)


@regions.register_op("triplet_margin_loss")
def triplet_margin_loss(
    anchor: Array,
    positive: Array,
    negative: Array,
    margin: float = 1.0,
    p: float = 2,
    eps: float = 1e-6,
    swap: bool = False,
    *,
    reduction: str = "mean",
) -> Array:
  """``torch.nn.functional.triplet_margin_loss``."""
  compute, out = _dtypes(anchor, positive, negative)
  a, pos, neg = _cast(compute, anchor, positive, negative)
  d_pos = _pairwise_distance(a, pos, p, eps)
  d_neg = _pairwise_distance(a, neg, p, eps)
  if swap:
    d_neg = jnp.minimum(d_neg, _pairwise_distance(pos, neg, p, eps))
  loss = jnp.maximum(margin + d_pos - d_neg, 0)
  return _reduce(loss, reduction).astype(out)


@regions.register_op("multi_margin_loss")
def multi_margin_loss(
    input: Array,
    target: Array,
    p: int = 1,
    margin: float = 1.0,
    weight: Array | None = None,
    *,
    reduction: str = "mean",
) -> Array:
  """``torch.nn.functional.multi_margin_loss`` (input (N, C) or (C,), class-index target)."""
  if p not in (1, 2):
    raise ValueError(f"`p` must be 1 or 2; got {p!r}.")
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  x2 = x if x.ndim == 2 else x[None]
  t = jnp.asarray(target).reshape(-1).astype(jnp.int32)
  n_classes = x2.shape[1]
  picked = jnp.take_along_axis(x2, t[:, None], axis=1)
  z = jnp.maximum(margin - picked + x2, 0)
  if p == 2:
    z = z * z
  if weight is not None:
    z = z * weight.astype(compute)[t][:, None]
  not_target = jnp.arange(n_classes)[None, :] != t[:, None]
  loss = jnp.sum(jnp.where(not_target, z, 0), axis=1) / n_classes
  if x.ndim == 1:
    loss = loss[0]
  return _reduce(loss, reduction).astype(out)


@regions.register_op("multilabel_margin_loss")
def multilabel_margin_loss(input: Array, target: Array, *, reduction: str = "mean") -> Array:
  """``torch.nn.functional.multilabel_margin_loss`` (targets end at the first -1)."""
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  x2 = x if x.ndim == 2 else x[None]
  t = jnp.asarray(target).reshape(x2.shape).astype(jnp.int32)
  n_classes = x2.shape[1]
  # A target slot counts while no -1 precedes it.
  active = jnp.cumprod((t >= 0).astype(jnp.int32), axis=1).astype(bool)
  safe = jnp.where(active, t, 0)
  is_target = jnp.any(
      active[:, :, None] & (safe[:, :, None] == jnp.arange(n_classes)[None, None, :]), axis=1
  )
  picked = jnp.take_along_axis(x2, safe, axis=1)  # (N, slots)
  hinge = jnp.maximum(1 - (picked[:, :, None] - x2[:, None, :]), 0)  # (N, slots, C)
  mask = active[:, :, None] & ~is_target[:, None, :]
  loss = jnp.sum(jnp.where(mask, hinge, 0), axis=(1, 2)) / n_classes
  if x.ndim == 1:
    loss = loss[0]
  return _reduce(loss, reduction).astype(out)


# --- distances and norms -----------------------------------------------------------------------


@regions.register_op("cosine_similarity")
def cosine_similarity(x1: Array, x2: Array, dim: int = 1, eps: float = 1e-8) -> Array:
  """``torch.nn.functional.cosine_similarity``."""
  compute, out = _dtypes(x1, x2)
  a, b = _cast(compute, x1, x2)
  a, b = jnp.broadcast_arrays(a, b)
  norm_a = jnp.maximum(_vector_norm(a, 2, axis=dim, keepdims=True), eps)
  norm_b = jnp.maximum(_vector_norm(b, 2, axis=dim, keepdims=True), eps)
  return jnp.sum((a / norm_a) * (b / norm_b), axis=dim).astype(out)


@regions.register_op("pdist")
def pdist(input: Array, p: float = 2.0) -> Array:
  """``torch.nn.functional.pdist``: distances between the rows of an (N, M) input, i < j."""
  if input.ndim != 2:
    raise ValueError(f"pdist expects a 2-D input; got shape {input.shape}.")
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  i, j = np.triu_indices(x.shape[0], k=1)
  return _vector_norm(x[i] - x[j], p, axis=-1).astype(out)


def _euclidean_cdist(a: Array, b: Array) -> Array:
  """torch's matmul form of the Euclidean distance (its ``use_mm_for_euclid_dist`` mode)."""
  a_norm = jnp.sum(a * a, axis=-1, keepdims=True)
  b_norm = jnp.sum(b * b, axis=-1, keepdims=True)
  a_aug = jnp.concatenate([-2 * a, a_norm, jnp.ones_like(a_norm)], axis=-1)
  b_aug = jnp.concatenate([b, jnp.ones_like(b_norm), b_norm], axis=-1)
  squared = jnp.matmul(a_aug, jnp.swapaxes(b_aug, -1, -2))
  return jnp.sqrt(jnp.maximum(squared, 1e-30))


@regions.register_op("cdist")
def cdist(
    x1: Array,
    x2: Array,
    p: float = 2.0,
    compute_mode: str = "use_mm_for_euclid_dist_if_necessary",
) -> Array:
  """``torch.cdist``: p-norm distances between the rows of (..., P, M) and (..., R, M)."""
  modes = (
      "use_mm_for_euclid_dist_if_necessary",
      "use_mm_for_euclid_dist",
      "donot_use_mm_for_euclid_dist",
  )
  if compute_mode not in modes:
    raise ValueError(f"`compute_mode` must be one of {modes}; got {compute_mode!r}.")
  compute, out = _dtypes(x1, x2)
  a, b = _cast(compute, x1, x2)
  use_mm = p == 2 and (
      compute_mode == "use_mm_for_euclid_dist"
      or (compute_mode == modes[0] and (a.shape[-2] > 25 or b.shape[-2] > 25))
  )
  if use_mm:
    return _euclidean_cdist(a, b).astype(out)
  diff = a[..., :, None, :] - b[..., None, :, :]
  return _vector_norm(diff, p, axis=-1).astype(out)


@regions.register_op("dist")
def dist(input: Array, other: Array, p: float = 2.0) -> Array:
  """``torch.dist``: the p-norm of ``input - other`` (broadcast), over all elements."""
  compute, out = _dtypes(input, other)
  a, b = _cast(compute, input, other)
  return _vector_norm(a - b, p).astype(out)


@regions.register_op("normalize")
def normalize(input: Array, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Array:
  """``torch.nn.functional.normalize``: ``input`` over its p-norm along ``dim`` (at least eps)."""
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  denom = jnp.maximum(_vector_norm(x, p, axis=dim, keepdims=True), eps)
  return (x / denom).astype(out)


@regions.register_op("norm")
def norm(
    input: Array,
    p: float | str | None = "fro",
    dim: int | Sequence[int] | None = None,
    keepdim: bool = False,
    dtype=None,
) -> Array:
  """``torch.norm``: vector p-norms, or "fro" / "nuc" matrix norms."""
  if dtype is not None:
    input = jnp.asarray(input).astype(dtype)
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  axis = tuple(dim) if isinstance(dim, Sequence) else dim
  if p == "nuc":
    axes = (x.ndim - 2, x.ndim - 1) if axis is None else axis
    return jnp.linalg.norm(x, "nuc", axis=axes, keepdims=keepdim).astype(out)
  if isinstance(p, str) and p != "fro":
    raise ValueError(f"`p` must be a number, 'fro' or 'nuc'; got {p!r}.")
  order = 2 if p in ("fro", None) else p
  return _vector_norm(x, order, axis=axis, keepdims=keepdim).astype(out)


@regions.register_op("renorm")
def renorm(input: Array, p: float, dim: int, maxnorm: float) -> Array:
  """``torch.renorm``: rescales each slice along ``dim`` whose p-norm exceeds ``maxnorm``."""
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  dim = dim % x.ndim
  axes = tuple(a for a in range(x.ndim) if a != dim)
  n = _vector_norm(x, p, axis=axes, keepdims=True)
  factor = jnp.where(n > maxnorm, maxnorm / (n + 1e-7), 1.0)
  return (x * factor).astype(out)


# --- activations and normalisation -------------------------------------------------------------


def _explicit_dtype(input: Array, dtype) -> Array:
  return jnp.asarray(input) if dtype is None else jnp.asarray(input).astype(dtype)


@regions.register_op("softmax")
def softmax(input: Array, dim: int | None = None, *, dtype=None) -> Array:
  """``torch.nn.functional.softmax`` (``dtype`` casts the input first, as in torch)."""
  input = _explicit_dtype(input, dtype)
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  return _softmax(x, _softmax_dim("softmax", x.ndim, dim)).astype(out)


@regions.register_op("log_softmax")
def log_softmax(input: Array, dim: int | None = None, *, dtype=None) -> Array:
  """``torch.nn.functional.log_softmax``."""
  input = _explicit_dtype(input, dtype)
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  return _log_softmax(x, _softmax_dim("log_softmax", x.ndim, dim)).astype(out)


@regions.register_op("softmin")
def softmin(input: Array, dim: int | None = None, *, dtype=None) -> Array:
  """``torch.nn.functional.softmin``: ``softmax(-input)``."""
  input = _explicit_dtype(input, dtype)
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  return _softmax(-x, _softmax_dim("softmin", x.ndim, dim)).astype(out)


@regions.register_op("softplus")
def softplus(input: Array, beta: float = 1.0, threshold: float = 20.0) -> Array:
  """``torch.nn.functional.softplus``: linear where ``input * beta > threshold``."""
  compute, out = _dtypes(input)
  (x,) = _cast(compute, input)
  return _softplus(x, beta, threshold).astype(out)


@regions.register_op("layer_norm")
def layer_norm(
    input: Array,
    normalized_shape: int | Sequence[int],
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
) -> Array:
  """``torch.nn.functional.layer_norm`` over the trailing ``normalized_shape`` axes."""
  shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
  if tuple(input.shape[input.ndim - len(shape):]) != shape:
    raise ValueError(f"input shape {input.shape} does not end in normalized_shape {shape}.")
  compute, out = _dtypes(input)
  x, w, b = _cast(compute, input, weight, bias)
  axes = tuple(range(x.ndim - len(shape), x.ndim))
  mean = jnp.mean(x, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + eps)
  if w is not None:
    y = y * w
  if b is not None:
    y = y + b
  return y.astype(out)


@regions.register_op("group_norm")
def group_norm(
    input: Array,
    num_groups: int,
    weight: Array | None = None,
    bias: Array | None = None,
    eps: float = 1e-5,
) -> Array:
  """``torch.nn.functional.group_norm`` on an (N, C, ...) input."""
  n, c = input.shape[:2]
  if c % num_groups:
    raise ValueError(f"{c} channels are not divisible into {num_groups} groups.")
  compute, out = _dtypes(input)
  x, w, b = _cast(compute, input, weight, bias)
  grouped = x.reshape(n, num_groups, -1)
  mean = jnp.mean(grouped, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(grouped - mean), axis=-1, keepdims=True)
  y = ((grouped - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape)
  channel_shape = (1, c) + (1,) * (x.ndim - 2)
  if w is not None:
    y = y * w.reshape(channel_shape)
  if b is not None:
    y = y + b.reshape(channel_shape)
  return y.astype(out)


@regions.register_op("prelu")
def prelu(input: Array, weight: Array) -> Array:
  """``torch.nn.functional.prelu``: ``weight`` has 1 or C (channel axis 1) elements."""
  x = jnp.asarray(input)
  w = jnp.asarray(weight)
  out = jnp.result_type(x, w)
  if w.size != 1 and x.ndim >= 2:
    w = w.reshape((1, w.size) + (1,) * (x.ndim - 2))
  elif w.size == 1:
    w = w.reshape(())
  return jnp.where(x > 0, x, w * x).astype(out)
