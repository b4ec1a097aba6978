"""JAX versions of the ``torch.nn.functional`` ops on torch.amp's autocast lists.

Each function has torch's name, signature and semantics (``reduction="mean" | "sum" | "none"``,
``ignore_index``, ``label_smoothing``, ...) and matches torch's values in float32. Each one is a
registered autocast op region named after the torch op, so ``jaxamp.autocast`` casts its inputs as
torch's autocast casts that op on the active device (float32 for the losses, the autocast dtype
for ``prelu``, the inputs' own dtype for ops a device does not list).

Each op computes in the (promoted) dtype of its inputs and never casts its result: autocast
re-evaluates a region's inside with the dtypes its inputs get, and a trailing cast would undo
that. The exceptions follow torch: an explicit ``dtype=`` casts the input first, and the affine
parameters of ``layer_norm`` / ``group_norm`` take the input's dtype (torch's mixed-dtype
kernels return the input's dtype). Deprecated torch arguments (``size_average``, ``reduce``,
``out``) are left out; options after them are keyword-only.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.autocast import regions

Array = jax.Array
_REDUCTIONS = ("none", "mean", "sum")


# --- helpers -----------------------------------------------------------------------------------


def _arrays(*xs) -> tuple:
  """``xs`` as arrays (None stays None). No casts: each op runs in its inputs' dtypes."""
  return tuple(None if x is None else jnp.asarray(x) for x in xs)


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


def _clamp_min0(x: Array) -> Array:
  """``clamp_min(x, 0)`` with torch's gradient (1 where ``x >= 0``)."""
  return jnp.where(x >= 0, x, 0)


def _hinge(x: Array) -> Array:
  """``max(x, 0)`` as torch's margin-loss kernels differentiate it (0 where ``x <= 0``)."""
  return jnp.where(x > 0, x, 0)


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
  x, y, w = _arrays(input, target, weight)
  return _weighted_reduce(jnp.square(x - y), w, reduction)


@regions.register_op("l1_loss")
def l1_loss(
  input: Array, target: Array, *, reduction: str = "mean", weight: Array | None = None
) -> Array:
  """``torch.nn.functional.l1_loss``."""
  x, y, w = _arrays(input, target, weight)
  return _weighted_reduce(jnp.abs(x - y), w, reduction)


@regions.register_op("smooth_l1_loss")
def smooth_l1_loss(
  input: Array, target: Array, *, reduction: str = "mean", beta: float = 1.0
) -> Array:
  """``torch.nn.functional.smooth_l1_loss``."""
  x, y = _arrays(input, target)
  z = jnp.abs(x - y)
  if beta == 0:
    loss = z
  else:
    loss = jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
  return _reduce(loss, reduction)


@regions.register_op("huber_loss")
def huber_loss(
  input: Array,
  target: Array,
  reduction: str = "mean",
  delta: float = 1.0,
  weight: Array | None = None,
) -> Array:
  """``torch.nn.functional.huber_loss``."""
  x, y, w = _arrays(input, target, weight)
  z = jnp.abs(x - y)
  loss = jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
  if w is None:
    return _reduce(loss, reduction)
  _check_reduction(reduction)
  return _reduce(loss * w, reduction)


# --- binary and classification losses ----------------------------------------------------------


@regions.register_op("binary_cross_entropy")
def binary_cross_entropy(
  input: Array, target: Array, weight: Array | None = None, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.binary_cross_entropy`` (on probabilities; log clamped at -100)."""
  p, t, w = _arrays(input, target, weight)
  log_p = jnp.maximum(jnp.log(p), -100.0)
  log_1mp = jnp.maximum(jnp.log1p(-p), -100.0)
  loss = -(t * log_p + (1 - t) * log_1mp)
  if w is not None:
    loss = loss * w
  return _reduce(loss, reduction)


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
  x, t, w, pw = _arrays(input, target, weight, pos_weight)
  log_sigmoid = jax.nn.log_sigmoid(x)
  if pw is not None:
    log_sigmoid = log_sigmoid * ((pw - 1) * t + 1)
  loss = (1 - t) * x - log_sigmoid
  if w is not None:
    loss = loss * w
  return _reduce(loss, reduction)


def _nll(
  logp: Array, target: Array, weight: Array | None, ignore_index: int, reduction: str
) -> Array:
  """torch's nll_loss on log-probabilities ``logp`` of shape (N, C, d...) or (C,)."""
  _check_reduction(reduction)
  class_axis = 0 if logp.ndim == 1 else 1
  target = jnp.asarray(target)
  valid = target != ignore_index
  safe = jnp.where(valid, target, 0).astype(jnp.int32)
  picked = jnp.take_along_axis(logp, jnp.expand_dims(safe, class_axis), axis=class_axis)
  picked = jnp.squeeze(picked, class_axis)
  if weight is None:
    w = valid.astype(logp.dtype)
  else:
    w = jnp.where(valid, jnp.asarray(weight)[safe], 0)
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
  (logp,) = _arrays(input)
  return _nll(logp, target, weight, ignore_index, reduction)


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
  (x,) = _arrays(input)
  class_axis = 0 if x.ndim == 1 else 1
  n_classes = x.shape[class_axis]
  logp = _log_softmax(x, class_axis)
  w_shape = [1] * x.ndim
  w_shape[class_axis] = n_classes
  target = jnp.asarray(target)

  if jnp.issubdtype(target.dtype, jnp.floating):  # class probabilities
    t = target
    if label_smoothing > 0:
      t = t * (1 - label_smoothing) + label_smoothing / n_classes
    terms = logp * t
    if weight is not None:
      terms = terms * jnp.asarray(weight).reshape(w_shape)
    loss = -jnp.sum(terms, axis=class_axis)
    if reduction == "mean":
      return jnp.sum(loss) / (x.size // n_classes)
    return _reduce(loss, reduction)

  nll = _nll(logp, target, weight, ignore_index, reduction)
  if label_smoothing == 0:
    return nll
  valid = target != ignore_index
  terms = logp if weight is None else logp * jnp.asarray(weight).reshape(w_shape)
  smooth = jnp.where(valid, -jnp.sum(terms, axis=class_axis), 0)
  if reduction == "none":
    smooth_red = smooth
  elif reduction == "sum":
    smooth_red = jnp.sum(smooth)
  elif weight is None:
    smooth_red = jnp.sum(smooth) / jnp.sum(valid)
  else:
    safe = jnp.where(valid, target, 0).astype(jnp.int32)
    smooth_red = jnp.sum(smooth) / jnp.sum(jnp.where(valid, jnp.asarray(weight)[safe], 0))
  return (1 - label_smoothing) * nll + smooth_red * (label_smoothing / n_classes)


@regions.register_op("kl_div")
def kl_div(
  input: Array, target: Array, *, reduction: str = "mean", log_target: bool = False
) -> Array:
  """``torch.nn.functional.kl_div`` (``input`` holds log-probabilities; "batchmean" too)."""
  if reduction not in _REDUCTIONS + ("batchmean",):
    raise ValueError(
      f"`reduction` must be one of {_REDUCTIONS + ('batchmean',)}; got {reduction!r}."
    )
  x, t = _arrays(input, target)
  if log_target:
    loss = jnp.exp(t) * (t - x)
  else:
    loss = jax.scipy.special.xlogy(t, t) - t * x
  if reduction == "batchmean":
    total = jnp.sum(loss)
    return total / x.shape[0] if x.ndim else total
  return _reduce(loss, reduction)


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
  x, t = _arrays(input, target)
  if log_input:
    loss = jnp.exp(x) - t * x
  else:
    loss = x - t * jnp.log(x + eps)
  if full:
    safe_t = jnp.where(t > 1, t, 1)
    stirling = safe_t * jnp.log(safe_t) - safe_t + 0.5 * jnp.log(2 * math.pi * safe_t)
    loss = loss + jnp.where(t > 1, stirling, 0)
  return _reduce(loss, reduction)


# --- margin and embedding losses ---------------------------------------------------------------


@regions.register_op("cosine_embedding_loss")
def cosine_embedding_loss(
  input1: Array, input2: Array, target: Array, margin: float = 0.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.cosine_embedding_loss``."""
  x1, x2 = _arrays(input1, input2)
  axis = x1.ndim - 1
  eps = 1e-12
  prod = jnp.sum(x1 * x2, axis=axis)
  mag1 = jnp.sum(x1 * x1, axis=axis) + eps
  mag2 = jnp.sum(x2 * x2, axis=axis) + eps
  cos = prod / jnp.sqrt(mag1 * mag2)
  target = jnp.asarray(target)
  loss = jnp.where(target == 1, 1 - cos, 0) + jnp.where(target == -1, _clamp_min0(cos - margin), 0)
  return _reduce(loss, reduction)


@regions.register_op("hinge_embedding_loss")
def hinge_embedding_loss(
  input: Array, target: Array, margin: float = 1.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.hinge_embedding_loss``."""
  (x,) = _arrays(input)
  target = jnp.asarray(target)
  loss = jnp.where(target != 1, _clamp_min0(margin - x), 0) + jnp.where(target != -1, x, 0)
  return _reduce(loss, reduction)


@regions.register_op("margin_ranking_loss")
def margin_ranking_loss(
  input1: Array, input2: Array, target: Array, margin: float = 0.0, *, reduction: str = "mean"
) -> Array:
  """``torch.nn.functional.margin_ranking_loss``."""
  x1, x2, y = _arrays(input1, input2, target)
  loss = _clamp_min0(-y * (x1 - x2) + margin)
  return _reduce(loss, reduction)


@regions.register_op("soft_margin_loss")
def soft_margin_loss(input: Array, target: Array, *, reduction: str = "mean") -> Array:
  """``torch.nn.functional.soft_margin_loss``."""
  x, y = _arrays(input, target)
  loss = jnp.log1p(jnp.exp(-y * x))
  return _reduce(loss, reduction)


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
  a, pos, neg = _arrays(anchor, positive, negative)
  d_pos = _pairwise_distance(a, pos, p, eps)
  d_neg = _pairwise_distance(a, neg, p, eps)
  if swap:
    d_neg = jnp.minimum(d_neg, _pairwise_distance(pos, neg, p, eps))
  loss = _clamp_min0(margin + d_pos - d_neg)
  return _reduce(loss, reduction)


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
  (x,) = _arrays(input)
  x2 = x if x.ndim == 2 else x[None]
  t = jnp.asarray(target).reshape(-1).astype(jnp.int32)
  n_classes = x2.shape[1]
  picked = jnp.take_along_axis(x2, t[:, None], axis=1)
  z = _hinge(margin - picked + x2)
  if p == 2:
    z = z * z
  if weight is not None:
    z = z * jnp.asarray(weight)[t][:, None]
  not_target = jnp.arange(n_classes)[None, :] != t[:, None]
  loss = jnp.sum(jnp.where(not_target, z, 0), axis=1) / n_classes
  if x.ndim == 1:
    loss = loss[0]
  return _reduce(loss, reduction)


@regions.register_op("multilabel_margin_loss")
def multilabel_margin_loss(input: Array, target: Array, *, reduction: str = "mean") -> Array:
  """``torch.nn.functional.multilabel_margin_loss`` (targets end at the first -1)."""
  (x,) = _arrays(input)
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
  hinge = _hinge(1 - (picked[:, :, None] - x2[:, None, :]))  # (N, slots, C)
  mask = active[:, :, None] & ~is_target[:, None, :]
  loss = jnp.sum(jnp.where(mask, hinge, 0), axis=(1, 2)) / n_classes
  if x.ndim == 1:
    loss = loss[0]
  return _reduce(loss, reduction)


# --- distances and norms -----------------------------------------------------------------------


@regions.register_op("cosine_similarity")
def cosine_similarity(x1: Array, x2: Array, dim: int = 1, eps: float = 1e-8) -> Array:
  """``torch.nn.functional.cosine_similarity``."""
  a, b = _arrays(x1, x2)
  a, b = jnp.broadcast_arrays(a, b)
  norm_a = jnp.maximum(_vector_norm(a, 2, axis=dim, keepdims=True), eps)
  norm_b = jnp.maximum(_vector_norm(b, 2, axis=dim, keepdims=True), eps)
  return jnp.sum((a / norm_a) * (b / norm_b), axis=dim)


@regions.register_op("pdist")
def pdist(input: Array, p: float = 2.0) -> Array:
  """``torch.nn.functional.pdist``: distances between the rows of an (N, M) input, i < j."""
  if input.ndim != 2:
    raise ValueError(f"pdist expects a 2-D input; got shape {input.shape}.")
  (x,) = _arrays(input)
  i, j = np.triu_indices(x.shape[0], k=1)
  return _vector_norm(x[i] - x[j], p, axis=-1)


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
  a, b = _arrays(x1, x2)
  use_mm = p == 2 and (
    compute_mode == "use_mm_for_euclid_dist"
    or (compute_mode == modes[0] and (a.shape[-2] > 25 or b.shape[-2] > 25))
  )
  if use_mm:
    return _euclidean_cdist(a, b)
  diff = a[..., :, None, :] - b[..., None, :, :]
  return _vector_norm(diff, p, axis=-1)


@regions.register_op("dist")
def dist(input: Array, other: Array, p: float = 2.0) -> Array:
  """``torch.dist``: the p-norm of ``input - other`` (broadcast), over all elements."""
  a, b = _arrays(input, other)
  return _vector_norm(a - b, p)


@regions.register_op("normalize")
def normalize(input: Array, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Array:
  """``torch.nn.functional.normalize``: ``input`` over its p-norm along ``dim`` (at least eps)."""
  (x,) = _arrays(input)
  denom = jnp.maximum(_vector_norm(x, p, axis=dim, keepdims=True), eps)
  return x / denom


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
  (x,) = _arrays(input)
  axis = tuple(dim) if isinstance(dim, Sequence) else dim
  if p == "nuc":
    axes = (x.ndim - 2, x.ndim - 1) if axis is None else axis
    return jnp.linalg.norm(x, "nuc", axis=axes, keepdims=keepdim)
  if isinstance(p, str) and p != "fro":
    raise ValueError(f"`p` must be a number, 'fro' or 'nuc'; got {p!r}.")
  order = 2 if p in ("fro", None) else p
  return _vector_norm(x, order, axis=axis, keepdims=keepdim)


@regions.register_op("renorm")
def renorm(input: Array, p: float, dim: int, maxnorm: float) -> Array:
  """``torch.renorm``: rescales each slice along ``dim`` whose p-norm exceeds ``maxnorm``."""
  (x,) = _arrays(input)
  dim = dim % x.ndim
  axes = tuple(a for a in range(x.ndim) if a != dim)
  n = _vector_norm(x, p, axis=axes, keepdims=True)
  factor = jnp.where(n > maxnorm, maxnorm / (n + 1e-7), 1.0)
  return x * factor


# --- activations and normalisation -------------------------------------------------------------


def _explicit_dtype(op: Callable[..., Array]) -> Callable[..., Array]:
  """torch: an op called with an explicit ``dtype=`` is not autocast; it runs in that dtype."""

  @functools.wraps(op)
  def wrapped(input: Array, dim: int | None = None, *, dtype=None) -> Array:
    if dtype is None:
      return op(input, dim)
    with regions.kept_region():
      return op(jnp.asarray(input).astype(dtype), dim)

  return wrapped


@_explicit_dtype
@regions.register_op("softmax")
def softmax(input: Array, dim: int | None = None) -> Array:
  """``torch.nn.functional.softmax`` (``dtype`` casts the input first, as in torch)."""
  (x,) = _arrays(input)
  return _softmax(x, _softmax_dim("softmax", x.ndim, dim))


@_explicit_dtype
@regions.register_op("log_softmax")
def log_softmax(input: Array, dim: int | None = None) -> Array:
  """``torch.nn.functional.log_softmax``."""
  (x,) = _arrays(input)
  return _log_softmax(x, _softmax_dim("log_softmax", x.ndim, dim))


@_explicit_dtype
@regions.register_op("softmin")
def softmin(input: Array, dim: int | None = None) -> Array:
  """``torch.nn.functional.softmin``: ``softmax(-input)``."""
  (x,) = _arrays(input)
  return _softmax(-x, _softmax_dim("softmin", x.ndim, dim))


@regions.register_op("softplus")
def softplus(input: Array, beta: float = 1.0, threshold: float = 20.0) -> Array:
  """``torch.nn.functional.softplus``: linear where ``input * beta > threshold``."""
  (x,) = _arrays(input)
  return _softplus(x, beta, threshold)


def _affine(input, weight, bias) -> tuple:
  """The input, and affine parameters in its dtype (torch's norms return the input's dtype)."""
  x, w, b = _arrays(input, weight, bias)
  w = None if w is None else w.astype(x.dtype)
  b = None if b is None else b.astype(x.dtype)
  return x, w, b


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
  if tuple(input.shape[input.ndim - len(shape) :]) != shape:
    raise ValueError(f"input shape {input.shape} does not end in normalized_shape {shape}.")
  x, w, b = _affine(input, weight, bias)
  axes = tuple(range(x.ndim - len(shape), x.ndim))
  mean = jnp.mean(x, axis=axes, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + eps)
  if w is not None:
    y = y * w
  if b is not None:
    y = y + b
  return y


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
  x, w, b = _affine(input, weight, bias)
  grouped = x.reshape(n, num_groups, -1)
  mean = jnp.mean(grouped, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(grouped - mean), axis=-1, keepdims=True)
  y = ((grouped - mean) * jax.lax.rsqrt(var + eps)).reshape(x.shape)
  channel_shape = (1, c) + (1,) * (x.ndim - 2)
  if w is not None:
    y = y * w.reshape(channel_shape)
  if b is not None:
    y = y + b.reshape(channel_shape)
  return y


@regions.register_op("prelu")
def prelu(input: Array, weight: Array) -> Array:
  """``torch.nn.functional.prelu``: ``weight`` has 1 or C (channel axis 1) elements."""
  x, w = _arrays(input, weight)
  if w.size != 1 and x.ndim >= 2:
    w = w.reshape((1, w.size) + (1,) * (x.ndim - 2))
  elif w.size == 1:
    w = w.reshape(())
  return jnp.where(x > 0, x, w * x)


# --- linear layers -----------------------------------------------------------------------------


@regions.register_op("bilinear")
def bilinear(input1: Array, input2: Array, weight: Array, bias: Array | None = None) -> Array:
  """``torch.nn.functional.bilinear``: ``y[..., o] = x1[..., i] W[o, i, j] x2[..., j] + b[o]``.

  The inputs are brought to their promoted dtype first, so the whole op runs in one dtype, as
  torch's ``bilinear`` (on the promote lists of CUDA and XPU) does.
  """
  x1, x2, w, b = _arrays(input1, input2, weight, bias)
  dtype = jnp.result_type(*(a for a in (x1, x2, w, b) if a is not None))
  y = jnp.einsum("...i,oij,...j->...o", x1.astype(dtype), w.astype(dtype), x2.astype(dtype))
  return y if b is None else y + b.astype(dtype)
