"""The cases of torch's CPU autocast goldens, as data: each a torch expression over named inputs.

``scripts/record_torch_autocast_goldens.py`` runs every case in torch and writes
``tests/goldens/torch_cpu_autocast.json``; the tests (``torch_goldens.CASES``) replay the cases
defined here with the inputs and results recorded there, and check the two agree.

Inputs are small, drawn from a seeded numpy generator (``with_inputs``) and rounded to the
bfloat16 grid (so casting them to bfloat16 is exact). An input whose dtype is ``"low"`` is cast
to the autocast dtype (float32 without autocast), which is how the float32-list and unlisted ops
are shown 16-bit values. The expressions see ``torch``, ``F`` (``torch.nn.functional``) and
``disabled`` (runs a thunk under ``torch.autocast("cpu", enabled=False)``). Cases marked
``functional`` use only names that ``jaxamp.functional`` mirrors: with ``F`` and ``torch`` bound
to ``jaxamp.functional`` the same expression is their JAX counterpart.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

SEED = 20240611
# Each case runs inside torch.autocast("cpu", dtype=bfloat16 | float16) and without autocast.
MODES = ("bfloat16", "float16", "none")


# --- inputs ------------------------------------------------------------------------------------


def _bf16_grid(x: np.ndarray) -> np.ndarray:
  """Rounds float32 values to the nearest bfloat16 (round half to even), kept as float32."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def draw(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
  """Values of one input: ``kind`` names a distribution or a structured matrix."""
  name, _, arg = kind.partition(":")
  if name == "normal":  # "normal:s" has standard deviation s
    return _bf16_grid(float(arg or 1.0) * rng.standard_normal(shape))
  if name == "uniform":  # probabilities away from 0 and 1
    return _bf16_grid(rng.uniform(0.05, 0.95, shape))
  if name == "positive":
    return _bf16_grid(rng.uniform(0.5, 2.0, shape))
  if name == "angle":
    return _bf16_grid(rng.uniform(-3.0, 3.0, shape))
  if name == "near_one":  # factors of a long product
    return _bf16_grid(1.0 + rng.uniform(-0.02, 0.02, shape))
  if name == "offset":  # a spread of 4 around 1000: a mean rounded to 16 bits loses it
    return _bf16_grid(1000.0 + 4.0 * rng.standard_normal(shape))
  if name == "sign":
    return rng.choice([-1.0, 1.0], shape).astype(np.float32)
  if name == "binary":
    return rng.choice([0.0, 1.0], shape).astype(np.float32)
  if name == "classes":  # class indices in [low, n)
    lo, _, hi = arg.partition("-") if "-" in arg else ("0", "", arg)
    return rng.integers(int(lo), int(hi), shape).astype(np.int64)
  if name == "ints":
    return rng.integers(-3, 4, shape).astype(np.int64)
  if name == "index":  # a permutation prefix: distinct indices into an axis of length arg
    return rng.permutation(int(arg))[: shape[0]].astype(np.int64)
  if name == "probs":  # rows summing to ~1 over the last axis
    logits = rng.standard_normal(shape)
    return _bf16_grid(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
  if name == "class_probs":  # (N, C, ...) probabilities over axis 1
    logits = rng.standard_normal(shape)
    return _bf16_grid(np.exp(logits) / np.exp(logits).sum(1, keepdims=True))
  if name == "log_probs":  # log-probabilities over the last axis
    logits = rng.standard_normal(shape)
    return _bf16_grid(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
  if name == "spd":  # symmetric positive definite (..., n, n), exactly symmetric after rounding
    n = shape[-1]
    a = rng.standard_normal(shape)
    m = a @ np.swapaxes(a, -1, -2) / n + np.eye(n)
    m = _bf16_grid(m)
    return (np.triu(m) + np.swapaxes(np.triu(m, 1), -1, -2)).astype(np.float32)
  if name == "lower":  # well-conditioned lower-triangular with a positive diagonal
    n = shape[-1]
    m = np.tril(rng.standard_normal(shape) * 0.3)
    return _bf16_grid(m + np.eye(n) * (1.5 + rng.uniform(0, 1, n)))
  if name == "upper":
    return np.swapaxes(draw(rng, "lower", shape), -1, -2).copy()
  if name == "multilabel":  # (N, C) target indices, each row ended by -1 after 1..C-1 labels
    n, c = shape
    t = -np.ones(shape, np.int64)
    for i in range(n):
      k = rng.integers(1, c)
      t[i, :k] = rng.permutation(c)[:k]
    return t
  raise ValueError(f"unknown input kind {kind!r}")


def inp(kind: str, *shape: int, dtype: str = "float32") -> dict[str, Any]:
  """An input spec: a distribution ``kind``, a shape and a dtype ("low" = the autocast dtype)."""
  return {"kind": kind, "shape": list(shape), "dtype": dtype}


def low(kind: str, *shape: int) -> dict[str, Any]:
  return inp(kind, *shape, dtype="low")


# --- cases -------------------------------------------------------------------------------------


def case(
  name: str,
  expr: str,
  group: str,
  torch_op: str,
  functional: bool = False,
  **inputs: dict[str, Any],
) -> dict[str, Any]:
  """One golden case.

  Args:
    name: unique case name (the tests key their JAX counterparts on it).
    expr: a torch expression over the inputs' names.
    group: the op's CPU list: "lower", "float32", "promote" or "unlisted".
    torch_op: the torch op (autocast op-list name) the case exercises.
    functional: the expression only uses names ``jaxamp.functional`` mirrors.
    **inputs: input specs by name (see ``inp``).
  """
  return {
    "name": name,
    "expr": expr,
    "group": group,
    "torch_op": torch_op,
    "functional": functional,
    "inputs": {k: dict(v) for k, v in inputs.items()},
  }


# Shapes used throughout: a (4, 8) batch, (8, 5) weights, (2, 4, 8) batched matrices.
A, B, V = inp("normal", 4, 8), inp("normal", 8, 5), inp("normal", 8)
X3, Y3 = inp("normal", 2, 4, 8), inp("normal", 2, 8, 3)
IMG1, IMG2, IMG3 = inp("normal", 2, 3, 9), inp("normal", 2, 3, 6, 6), inp("normal", 1, 2, 4, 4, 4)
LA, LB, LV = low("normal", 4, 8), low("normal", 4, 8), low("normal", 8)
SPD = low("spd", 4, 4)


def _lower_cases() -> list[dict[str, Any]]:
  return [
    case("mm", "torch.mm(a, b)", "lower", "mm", a=A, b=B),
    case("matmul", "torch.matmul(x, y)", "lower", "matmul", x=X3, y=Y3),
    case("matmul_vector", "torch.matmul(a, v)", "lower", "matmul", a=A, v=V),
    case("bmm", "torch.bmm(x, y)", "lower", "bmm", x=X3, y=Y3),
    case(
      "baddbmm", "torch.baddbmm(c, x, y)", "lower", "baddbmm", c=inp("normal", 2, 4, 3), x=X3, y=Y3
    ),
    case("addmm", "torch.addmm(bias, a, b)", "lower", "addmm", bias=inp("normal", 5), a=A, b=B),
    case(
      "addmm_full_input", "torch.addmm(c, a, b)", "lower", "addmm", c=inp("normal", 4, 5), a=A, b=B
    ),
    case("addbmm", "torch.addbmm(c, x, y)", "lower", "addbmm", c=inp("normal", 4, 3), x=X3, y=Y3),
    case("linear", "F.linear(a, w)", "lower", "linear", a=A, w=inp("normal", 5, 8)),
    case(
      "linear_bias",
      "F.linear(a, w, bias)",
      "lower",
      "linear",
      a=A,
      w=inp("normal", 5, 8),
      bias=inp("normal", 5),
    ),
    case(
      "linalg_vecdot",
      "torch.linalg.vecdot(a, b)",
      "lower",
      "linalg_vecdot",
      a=A,
      b=inp("normal", 4, 8),
    ),
    case("einsum", "torch.einsum('bij,bjk->bik', x, y)", "lower", "matmul", x=X3, y=Y3),
    case("tensordot", "torch.tensordot(a, b, dims=1)", "lower", "matmul", a=A, b=B),
    case("conv1d", "F.conv1d(x, k)", "lower", "conv1d", x=IMG1, k=inp("normal", 4, 3, 3)),
    case("conv2d", "F.conv2d(x, k)", "lower", "conv2d", x=IMG2, k=inp("normal", 4, 3, 3, 3)),
    case(
      "conv2d_bias",
      "F.conv2d(x, k, bias)",
      "lower",
      "conv2d",
      x=IMG2,
      k=inp("normal", 4, 3, 3, 3),
      bias=inp("normal", 4),
    ),
    case(
      "conv2d_stride_padding",
      "F.conv2d(x, k, stride=2, padding=1)",
      "lower",
      "conv2d",
      x=IMG2,
      k=inp("normal", 4, 3, 3, 3),
    ),
    case("conv3d", "F.conv3d(x, k)", "lower", "conv3d", x=IMG3, k=inp("normal", 3, 2, 2, 2, 2)),
    case(
      "conv_transpose1d",
      "F.conv_transpose1d(x, k, stride=2)",
      "lower",
      "conv_transpose1d",
      x=IMG1,
      k=inp("normal", 3, 4, 3),
    ),
    case(
      "conv_transpose2d",
      "F.conv_transpose2d(x, k, stride=2, padding=1)",
      "lower",
      "conv_transpose2d",
      x=IMG2,
      k=inp("normal", 3, 4, 3, 3),
    ),
    case(
      "conv_transpose3d",
      "F.conv_transpose3d(x, k)",
      "lower",
      "conv_transpose3d",
      x=IMG3,
      k=inp("normal", 2, 3, 2, 2, 2),
    ),
    case(
      "conv_tbc",
      "torch.conv_tbc(x, k, bias, 1)",
      "lower",
      "conv_tbc",
      x=inp("normal", 7, 2, 3),
      k=inp("normal", 3, 3, 4),
      bias=inp("normal", 4),
    ),
    case(
      "lstm_layer",
      "torch.lstm(x, (h, c), [w_ih, w_hh, b_ih, b_hh], True, 1, 0.0, False, False, False)[0]",
      "lower",
      "mkldnn_rnn_layer",
      x=inp("normal", 5, 2, 4),
      h=inp("normal", 1, 2, 3),
      c=inp("normal", 1, 2, 3),
      w_ih=inp("normal", 12, 4),
      w_hh=inp("normal", 12, 3),
      b_ih=inp("normal", 12),
      b_hh=inp("normal", 12),
    ),
    case("prelu", "F.prelu(a, w)", "lower", "prelu", functional=True, a=A, w=inp("positive", 1)),
    case(
      "prelu_channels",
      "F.prelu(x, w)",
      "lower",
      "prelu",
      functional=True,
      x=IMG2,
      w=inp("positive", 3),
    ),
    case(
      "scaled_dot_product_attention",
      "F.scaled_dot_product_attention(q, k, v)",
      "lower",
      "scaled_dot_product_attention",
      q=inp("normal", 2, 2, 4, 8),
      k=inp("normal", 2, 2, 5, 8),
      v=inp("normal", 2, 2, 5, 8),
    ),
    # matrix-vector and vector-vector products are not on torch's CPU list
    case("mv", "torch.mv(a, v)", "unlisted", "mv", a=A, v=V),
    case("dot", "torch.dot(v, w)", "unlisted", "dot", v=V, w=inp("normal", 8)),
    case("addmv", "torch.addmv(c, a, v)", "unlisted", "addmv", c=inp("normal", 4), a=A, v=V),
    case(
      "bilinear",
      "F.bilinear(x, y, w, bias)",
      "unlisted",
      "bilinear",
      x=inp("normal", 4, 3),
      y=inp("normal", 4, 5),
      w=inp("normal", 2, 3, 5),
      bias=inp("normal", 2),
    ),
    case(
      "lstm_cell",
      "torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)[0]",
      "unlisted",
      "lstm_cell",
      x=inp("normal", 2, 4),
      h=inp("normal", 2, 3),
      c=inp("normal", 2, 3),
      w_ih=inp("normal", 12, 4),
      w_hh=inp("normal", 12, 3),
      b_ih=inp("normal", 12),
      b_hh=inp("normal", 12),
    ),
  ]


def _float32_cases() -> list[dict[str, Any]]:
  sig = low("normal", 2, 8)
  vol = low("normal", 1, 2, 4, 4, 4)
  return [
    case("prod", "torch.prod(a, dim=1)", "float32", "prod", a=LA),
    case("prod_all", "torch.prod(a)", "float32", "prod", a=low("positive", 3, 4)),
    case("quantile", "torch.quantile(a, 0.3, dim=1)", "float32", "quantile", a=LA),
    case("nanquantile", "torch.nanquantile(a, 0.7, dim=0)", "float32", "nanquantile", a=LA),
    case("trace", "torch.trace(m)", "float32", "trace", m=low("normal", 4, 4)),
    case(
      "view_as_complex",
      "torch.view_as_complex(z)",
      "float32",
      "view_as_complex",
      z=low("normal", 4, 2),
    ),
    case("linalg_cholesky", "torch.linalg.cholesky(m)", "float32", "linalg_cholesky", m=SPD),
    case("cholesky", "torch.cholesky(m)", "float32", "cholesky", m=SPD),
    case(
      "linalg_cholesky_ex", "torch.linalg.cholesky_ex(m).L", "float32", "linalg_cholesky_ex", m=SPD
    ),
    case(
      "cholesky_inverse",
      "torch.cholesky_inverse(chol)",
      "float32",
      "cholesky_inverse",
      chol=low("lower", 4, 4),
    ),
    case(
      "cholesky_solve",
      "torch.cholesky_solve(b, chol)",
      "float32",
      "cholesky_solve",
      b=low("normal", 4, 2),
      chol=low("lower", 4, 4),
    ),
    case("inverse", "torch.inverse(m)", "float32", "inverse", m=SPD),
    case("linalg_inv", "torch.linalg.inv(m)", "float32", "linalg_inv", m=SPD),
    case("linalg_inv_ex", "torch.linalg.inv_ex(m).inverse", "float32", "linalg_inv_ex", m=SPD),
    case(
      "linalg_solve",
      "torch.linalg.solve(m, b)",
      "float32",
      "linalg_solve",
      m=SPD,
      b=low("normal", 4, 2),
    ),
    case(
      "lu_solve",
      "torch.lu_solve(b, *torch.linalg.lu_factor(m))",
      "float32",
      "lu_solve",
      b=low("normal", 4, 2),
      m=inp("spd", 4, 4),
    ),
    case("lu", "torch.lu(m)[0]", "float32", "_lu_with_info", m=low("normal", 4, 4)),
    case(
      "triangular_solve",
      "torch.triangular_solve(b, u).solution",
      "float32",
      "triangular_solve",
      b=low("normal", 4, 2),
      u=low("upper", 4, 4),
    ),
    case(
      "linalg_householder_product",
      "torch.linalg.householder_product(a, tau)",
      "float32",
      "linalg_householder_product",
      a=low("normal", 4, 3),
      tau=low("uniform", 3),
    ),
    case(
      "orgqr",
      "torch.orgqr(a, tau)",
      "float32",
      "orgqr",
      a=low("normal", 4, 3),
      tau=low("uniform", 3),
    ),
    case(
      "ormqr",
      "torch.ormqr(a, tau, c)",
      "float32",
      "ormqr",
      a=low("normal", 4, 3),
      tau=low("uniform", 3),
      c=low("normal", 4, 2),
    ),
    case("linalg_qr", "torch.linalg.qr(a).R", "float32", "linalg_qr", a=low("normal", 4, 3)),
    case("qr", "torch.qr(a).R", "float32", "qr", a=low("normal", 4, 3)),
    case("linalg_svd", "torch.linalg.svd(a).S", "float32", "linalg_svd", a=LA),
    case("svd", "torch.svd(a).S", "float32", "svd", a=LA),
    case("linalg_svdvals", "torch.linalg.svdvals(a)", "float32", "linalg_svdvals", a=LA),
    case("pinverse", "torch.pinverse(a)", "float32", "pinverse", a=LA),
    case(
      "linalg_matrix_rank", "torch.linalg.matrix_rank(a)", "float32", "linalg_matrix_rank", a=LA
    ),
    case("linalg_cond", "torch.linalg.cond(m)", "float32", "linalg_cond", m=SPD),
    case("linalg_eigh", "torch.linalg.eigh(m).eigenvalues", "float32", "linalg_eigh", m=SPD),
    case("linalg_eigvalsh", "torch.linalg.eigvalsh(m)", "float32", "linalg_eigvalsh", m=SPD),
    case(
      "linalg_eig",
      "torch.sort(torch.linalg.eig(m).eigenvalues.real).values",
      "float32",
      "linalg_eig",
      m=SPD,
    ),
    case(
      "linalg_eigvals",
      "torch.sort(torch.linalg.eigvals(m).real).values",
      "float32",
      "linalg_eigvals",
      m=SPD,
    ),
    case(
      "linalg_lstsq",
      "torch.linalg.lstsq(a, b).solution",
      "float32",
      "linalg_lstsq",
      a=low("normal", 6, 3),
      b=low("normal", 6, 2),
    ),
    case(
      "linalg_tensorinv",
      "torch.linalg.tensorinv(m.reshape(2, 4, 8), ind=2)",
      "float32",
      "linalg_tensorinv",
      m=low("spd", 8, 8),
    ),
    case(
      "linalg_tensorsolve",
      "torch.linalg.tensorsolve(m.reshape(2, 4, 8), b)",
      "float32",
      "linalg_tensorsolve",
      m=low("spd", 8, 8),
      b=low("normal", 2, 4),
    ),
    case("fft_fft", "torch.fft.fft(x)", "float32", "fft_fft", x=sig),
    case("fft_ifft", "torch.fft.ifft(x)", "float32", "fft_ifft", x=sig),
    case("fft_fft2", "torch.fft.fft2(x)", "float32", "fft_fft2", x=low("normal", 2, 4, 4)),
    case("fft_ifft2", "torch.fft.ifft2(x)", "float32", "fft_ifft2", x=low("normal", 2, 4, 4)),
    case("fft_fftn", "torch.fft.fftn(x)", "float32", "fft_fftn", x=low("normal", 2, 4, 4)),
    case("fft_ifftn", "torch.fft.ifftn(x)", "float32", "fft_ifftn", x=low("normal", 2, 4, 4)),
    case("fft_rfft", "torch.fft.rfft(x)", "float32", "fft_rfft", x=sig),
    case("fft_irfft", "torch.fft.irfft(x)", "float32", "fft_irfft", x=sig),
    case("fft_rfft2", "torch.fft.rfft2(x)", "float32", "fft_rfft2", x=low("normal", 2, 4, 4)),
    case("fft_irfft2", "torch.fft.irfft2(x)", "float32", "fft_irfft2", x=low("normal", 2, 4, 4)),
    case("fft_rfftn", "torch.fft.rfftn(x)", "float32", "fft_rfftn", x=low("normal", 2, 4, 4)),
    case("fft_irfftn", "torch.fft.irfftn(x)", "float32", "fft_irfftn", x=low("normal", 2, 4, 4)),
    case("fft_hfft", "torch.fft.hfft(x)", "float32", "fft_hfft", x=sig),
    case("fft_ihfft", "torch.fft.ihfft(x)", "float32", "fft_ihfft", x=sig),
    case("avg_pool3d", "F.avg_pool3d(x, 2)", "float32", "avg_pool3d", x=vol),
    case(
      "adaptive_avg_pool3d", "F.adaptive_avg_pool3d(x, 2)", "float32", "adaptive_avg_pool3d", x=vol
    ),
    case("max_pool3d", "F.max_pool3d(x, 2)", "float32", "max_pool3d", x=vol),
    case(
      "adaptive_max_pool3d", "F.adaptive_max_pool3d(x, 2)", "float32", "adaptive_max_pool3d", x=vol
    ),
    case(
      "reflection_pad1d",
      "F.pad(x, (2, 1), mode='reflect')",
      "float32",
      "reflection_pad1d",
      x=low("normal", 2, 3, 6),
    ),
    case(
      "reflection_pad2d",
      "F.pad(x, (1, 2, 2, 1), mode='reflect')",
      "float32",
      "reflection_pad2d",
      x=low("normal", 1, 2, 4, 4),
    ),
    case(
      "replication_pad1d",
      "F.pad(x, (2, 1), mode='replicate')",
      "float32",
      "replication_pad1d",
      x=low("normal", 2, 3, 6),
    ),
    case(
      "replication_pad2d",
      "F.pad(x, (1, 2, 2, 1), mode='replicate')",
      "float32",
      "replication_pad2d",
      x=low("normal", 1, 2, 4, 4),
    ),
    case(
      "replication_pad3d",
      "F.pad(x, (1, 1, 0, 1, 1, 0), mode='replicate')",
      "float32",
      "replication_pad3d",
      x=vol,
    ),
    case(
      "ctc_loss",
      "F.ctc_loss(log_probs, targets, torch.full((2,), 6), torch.full((2,), 3), reduction='none')",
      "float32",
      "ctc_loss",
      log_probs=low("log_probs", 6, 2, 5),
      targets=inp("classes:1-5", 2, 3, dtype="int64"),
    ),
    # torch's weighted mse_loss / l1_loss are Python code over unlisted ops (pow, abs, sum)
    case(
      "mse_loss_weighted_low",
      "F.mse_loss(x, y, weight=w)",
      "unlisted",
      "mse_loss",
      functional=True,
      x=LA,
      y=LB,
      w=low("positive", 4, 8),
    ),
    case(
      "l1_loss_weighted_low",
      "F.l1_loss(x, y, weight=w, reduction='sum')",
      "unlisted",
      "l1_loss",
      functional=True,
      x=LA,
      y=LB,
      w=low("positive", 4, 8),
    ),
  ] + _loss_cases()


def _loss_cases() -> list[dict[str, Any]]:
  """The float32-list losses (on CPU and CUDA): ``jaxamp.functional`` counterparts."""
  n, c = 4, 5
  logits = low("normal", n, c)
  labels = inp(f"classes:{c}", n, dtype="int64")
  cw = inp("positive", c)
  probs = low("uniform", n, c)
  t01 = low("binary", n, c)
  sign = low("sign", n)

  def loss(name, expr, torch_op, **inputs):
    return case(name, expr, "float32", torch_op, functional=True, **inputs)

  cases = []
  for red in ("mean", "sum", "none"):
    cases += [
      loss(f"mse_loss_{red}", f"F.mse_loss(x, y, reduction='{red}')", "mse_loss", x=LA, y=LB),
      loss(f"l1_loss_{red}", f"F.l1_loss(x, y, reduction='{red}')", "l1_loss", x=LA, y=LB),
      loss(
        f"smooth_l1_loss_{red}",
        f"F.smooth_l1_loss(x, y, reduction='{red}', beta=0.5)",
        "smooth_l1_loss",
        x=LA,
        y=LB,
      ),
      loss(
        f"huber_loss_{red}",
        f"F.huber_loss(x, y, reduction='{red}', delta=0.7)",
        "huber_loss",
        x=LA,
        y=LB,
      ),
      loss(
        f"cross_entropy_{red}",
        f"F.cross_entropy(x, t, reduction='{red}')",
        "cross_entropy_loss",
        x=logits,
        t=labels,
      ),
      loss(
        f"nll_loss_{red}",
        f"F.nll_loss(x, t, reduction='{red}')",
        "nll_loss",
        x=low("log_probs", n, c),
        t=labels,
      ),
      loss(
        f"kl_div_{red}",
        f"F.kl_div(x, t, reduction='{red}')",
        "kl_div",
        x=low("log_probs", n, c),
        t=low("probs", n, c),
      ),
      loss(
        f"binary_cross_entropy_{red}",
        f"F.binary_cross_entropy(p, t, reduction='{red}')",
        "binary_cross_entropy",
        p=probs,
        t=t01,
      ),
      loss(
        f"binary_cross_entropy_with_logits_{red}",
        f"F.binary_cross_entropy_with_logits(x, t, reduction='{red}')",
        "binary_cross_entropy_with_logits",
        x=logits,
        t=low("uniform", n, c),
      ),
      loss(
        f"poisson_nll_loss_{red}",
        f"F.poisson_nll_loss(x, t, reduction='{red}')",
        "poisson_nll_loss",
        x=logits,
        t=low("positive", n, c),
      ),
      loss(
        f"cosine_embedding_loss_{red}",
        f"F.cosine_embedding_loss(x, y, t, margin=0.2, reduction='{red}')",
        "cosine_embedding_loss",
        x=LA,
        y=LB,
        t=sign,
      ),
      loss(
        f"hinge_embedding_loss_{red}",
        f"F.hinge_embedding_loss(x, t, margin=0.5, reduction='{red}')",
        "hinge_embedding_loss",
        x=low("normal", n),
        t=sign,
      ),
      loss(
        f"margin_ranking_loss_{red}",
        f"F.margin_ranking_loss(x, y, t, margin=0.1, reduction='{red}')",
        "margin_ranking_loss",
        x=low("normal", n),
        y=low("normal", n),
        t=sign,
      ),
      loss(
        f"soft_margin_loss_{red}",
        f"F.soft_margin_loss(x, t, reduction='{red}')",
        "soft_margin_loss",
        x=logits,
        t=low("sign", n, c),
      ),
      loss(
        f"triplet_margin_loss_{red}",
        f"F.triplet_margin_loss(a, p, n, reduction='{red}')",
        "triplet_margin_loss",
        a=LA,
        p=LB,
        n=low("normal", 4, 8),
      ),
      loss(
        f"multi_margin_loss_{red}",
        f"F.multi_margin_loss(x, t, reduction='{red}')",
        "multi_margin_loss",
        x=logits,
        t=labels,
      ),
      loss(
        f"multilabel_margin_loss_{red}",
        f"F.multilabel_margin_loss(x, t, reduction='{red}')",
        "multilabel_margin_loss",
        x=logits,
        t=inp("multilabel", n, c, dtype="int64"),
      ),
    ]
  ignored = inp(f"classes:{c}", n, dtype="int64")
  cases += [
    loss(
      "cross_entropy_weight",
      "F.cross_entropy(x, t, w)",
      "cross_entropy_loss",
      x=logits,
      t=labels,
      w=cw,
    ),
    loss(
      "cross_entropy_ignore_index",
      "F.cross_entropy(x, t, ignore_index=2)",
      "cross_entropy_loss",
      x=logits,
      t=ignored,
    ),
    loss(
      "cross_entropy_label_smoothing",
      "F.cross_entropy(x, t, label_smoothing=0.1)",
      "cross_entropy_loss",
      x=logits,
      t=labels,
    ),
    loss(
      "cross_entropy_smoothing_weight_ignore",
      "F.cross_entropy(x, t, w, ignore_index=2, label_smoothing=0.2)",
      "cross_entropy_loss",
      x=logits,
      t=ignored,
      w=cw,
    ),
    loss(
      "cross_entropy_smoothing_sum",
      "F.cross_entropy(x, t, reduction='sum', label_smoothing=0.2, ignore_index=1)",
      "cross_entropy_loss",
      x=logits,
      t=ignored,
    ),
    loss(
      "cross_entropy_smoothing_none",
      "F.cross_entropy(x, t, reduction='none', label_smoothing=0.2, ignore_index=1)",
      "cross_entropy_loss",
      x=logits,
      t=ignored,
    ),
    loss(
      "cross_entropy_probs",
      "F.cross_entropy(x, t)",
      "cross_entropy_loss",
      x=logits,
      t=low("probs", n, c),
    ),
    loss(
      "cross_entropy_probs_weight_smoothing",
      "F.cross_entropy(x, t, w, label_smoothing=0.3)",
      "cross_entropy_loss",
      x=logits,
      t=low("probs", n, c),
      w=cw,
    ),
    loss(
      "cross_entropy_probs_none",
      "F.cross_entropy(x, t, reduction='none')",
      "cross_entropy_loss",
      x=logits,
      t=low("probs", n, c),
    ),
    loss(
      "cross_entropy_spatial",
      "F.cross_entropy(x, t)",
      "cross_entropy_loss",
      x=low("normal", 2, c, 3, 2),
      t=inp(f"classes:{c}", 2, 3, 2, dtype="int64"),
    ),
    loss(
      "cross_entropy_spatial_probs",
      "F.cross_entropy(x, t, label_smoothing=0.1)",
      "cross_entropy_loss",
      x=low("normal", 2, c, 3),
      t=low("class_probs", 2, c, 3),
    ),
    loss(
      "cross_entropy_unbatched",
      "F.cross_entropy(x, t)",
      "cross_entropy_loss",
      x=low("normal", c),
      t=inp(f"classes:{c}", dtype="int64"),
    ),
    loss(
      "nll_loss_weight_ignore",
      "F.nll_loss(x, t, w, ignore_index=0)",
      "nll_loss",
      x=low("log_probs", n, c),
      t=ignored,
      w=cw,
    ),
    loss(
      "nll_loss2d",
      "F.nll_loss(x, t)",
      "nll_loss2d",
      x=low("normal", 2, c, 3, 2),
      t=inp(f"classes:{c}", 2, 3, 2, dtype="int64"),
    ),
    loss(
      "kl_div_batchmean",
      "F.kl_div(x, t, reduction='batchmean')",
      "kl_div",
      x=low("log_probs", n, c),
      t=low("probs", n, c),
    ),
    loss(
      "kl_div_log_target",
      "F.kl_div(x, t, reduction='sum', log_target=True)",
      "kl_div",
      x=low("log_probs", n, c),
      t=low("log_probs", n, c),
    ),
    loss(
      "binary_cross_entropy_weight",
      "F.binary_cross_entropy(p, t, w)",
      "binary_cross_entropy",
      p=probs,
      t=t01,
      w=low("positive", n, c),
    ),
    loss(
      "binary_cross_entropy_with_logits_weights",
      "F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw)",
      "binary_cross_entropy_with_logits",
      x=logits,
      t=t01,
      w=low("positive", n, c),
      pw=low("positive", c),
    ),
    loss(
      "poisson_nll_loss_full",
      "F.poisson_nll_loss(x, t, False, True)",
      "poisson_nll_loss",
      x=low("positive", n, c),
      t=low("positive", n, c),
    ),
    loss(
      "poisson_nll_loss_counts",
      "F.poisson_nll_loss(x, t, full=True)",
      "poisson_nll_loss",
      x=logits,
      t=inp("classes:6", n, c),
    ),
    loss(
      "triplet_margin_loss_swap_p1",
      "F.triplet_margin_loss(a, p, n, margin=0.5, p=1, swap=True)",
      "triplet_margin_loss",
      a=LA,
      p=LB,
      n=low("normal", 4, 8),
    ),
    loss(
      "multi_margin_loss_p2_weight",
      "F.multi_margin_loss(x, t, p=2, margin=0.5, weight=w)",
      "multi_margin_loss",
      x=logits,
      t=labels,
      w=cw,
    ),
    loss(
      "l1_loss_weighted",
      "F.l1_loss(x, y, weight=w)",
      "l1_loss",
      x=LA,
      y=LB,
      w=inp("positive", 4, 8),
    ),
    loss(
      "huber_loss_weighted",
      "F.huber_loss(x, y, weight=w)",
      "huber_loss",
      x=LA,
      y=LB,
      w=inp("positive", 4, 8),
    ),
    loss("smooth_l1_loss_beta0", "F.smooth_l1_loss(x, y, beta=0.0)", "smooth_l1_loss", x=LA, y=LB),
    loss("cdist", "torch.cdist(x, y)", "cdist", x=low("normal", 5, 3), y=low("normal", 4, 3)),
    loss(
      "cdist_p1_batched",
      "torch.cdist(x, y, p=1.0)",
      "cdist",
      x=low("normal", 2, 5, 3),
      y=low("normal", 2, 4, 3),
    ),
    loss(
      "cdist_mm",
      "torch.cdist(x, y, compute_mode='use_mm_for_euclid_dist')",
      "cdist",
      x=low("normal", 5, 3),
      y=low("normal", 4, 3),
    ),
    loss(
      "cdist_large", "torch.cdist(x, y)", "cdist", x=low("normal", 30, 3), y=low("normal", 4, 3)
    ),
  ]
  return cases


def _promote_cases() -> list[dict[str, Any]]:
  return [
    case("cat_mixed", "torch.cat([x, y])", "promote", "cat", x=LA, y=A),
    case("cat_low", "torch.cat([x, y], dim=1)", "promote", "cat", x=LA, y=LB),
    case("stack_mixed", "torch.stack([x, y])", "promote", "stack", x=LA, y=A),
    case("stack_low", "torch.stack([x, y], dim=1)", "promote", "stack", x=LA, y=LB),
    case(
      "index_copy_mixed",
      "x.index_copy(0, i, s)",
      "promote",
      "index_copy",
      x=LA,
      i=inp("index:4", 2, dtype="int64"),
      s=inp("normal", 2, 8),
    ),
    case(
      "index_copy_low",
      "x.index_copy(0, i, s)",
      "promote",
      "index_copy",
      x=LA,
      i=inp("index:4", 2, dtype="int64"),
      s=low("normal", 2, 8),
    ),
  ]


def _unlisted_cases() -> list[dict[str, Any]]:
  def fn(name, expr, torch_op, **inputs):
    return case(name, expr, "unlisted", torch_op, functional=True, **inputs)

  pos = low("positive", 4, 8)
  x4 = low("normal", 2, 4, 3, 3)
  return [
    case("exp", "torch.exp(x)", "unlisted", "exp", x=LA),
    case("exp_float32", "torch.exp(x)", "unlisted", "exp", x=A),
    case("log", "torch.log(x)", "unlisted", "log", x=pos),
    case("expm1", "torch.expm1(x)", "unlisted", "expm1", x=LA),
    case("log1p", "torch.log1p(x)", "unlisted", "log1p", x=pos),
    case("pow", "torch.pow(x, 2)", "unlisted", "pow", x=LA),
    case("pow_tensor", "torch.pow(x, y)", "unlisted", "pow", x=pos, y=LB),
    case("rsqrt", "torch.rsqrt(x)", "unlisted", "rsqrt", x=pos),
    case("reciprocal", "torch.reciprocal(x)", "unlisted", "reciprocal", x=pos),
    case("tan", "torch.tan(x)", "unlisted", "tan", x=low("uniform", 4, 8)),
    case("erfinv", "torch.erfinv(x)", "unlisted", "erfinv", x=low("uniform", 4, 8)),
    case("sum", "torch.sum(x, dim=1)", "unlisted", "sum", x=LA),
    case("sum_all", "torch.sum(x)", "unlisted", "sum", x=LA),
    case("mean", "torch.mean(x, dim=1)", "unlisted", "mean", x=LA),
    case("cumsum", "torch.cumsum(x, dim=1)", "unlisted", "cumsum", x=LA),
    case("cumprod", "torch.cumprod(x, dim=1)", "unlisted", "cumprod", x=pos),
    case("logsumexp", "torch.logsumexp(x, dim=1)", "unlisted", "logsumexp", x=LA),
    case("gelu", "F.gelu(x)", "unlisted", "gelu", x=LA),
    case("gelu_tanh", "F.gelu(x, approximate='tanh')", "unlisted", "gelu", x=LA),
    case("relu", "F.relu(x)", "unlisted", "relu", x=LA),
    case("tanh", "torch.tanh(x)", "unlisted", "tanh", x=LA),
    case("sigmoid", "torch.sigmoid(x)", "unlisted", "sigmoid", x=LA),
    case("silu", "F.silu(x)", "unlisted", "silu", x=LA),
    case(
      "batch_norm",
      "F.batch_norm(x, rm, rv, w, b)",
      "unlisted",
      "batch_norm",
      x=x4,
      rm=inp("normal", 4),
      rv=inp("positive", 4),
      w=inp("positive", 4),
      b=inp("normal", 4),
    ),
    fn("softmax", "F.softmax(x, dim=-1)", "softmax", x=LA),
    fn("softmax_float32", "F.softmax(x, dim=1)", "softmax", x=A),
    fn("softmax_dtype", "F.softmax(x, dim=1, dtype=torch.float32)", "softmax", x=LA),
    fn("log_softmax", "F.log_softmax(x, dim=1)", "log_softmax", x=LA),
    fn("softmin", "F.softmin(x, dim=0)", "softmin", x=LA),
    fn("softplus", "F.softplus(x)", "softplus", x=LA),
    fn("softplus_beta_threshold", "F.softplus(x, beta=2.0, threshold=1.0)", "softplus", x=LA),
    fn(
      "layer_norm",
      "F.layer_norm(x, (8,), w, b)",
      "layer_norm",
      x=LA,
      w=inp("positive", 8),
      b=inp("normal", 8),
    ),
    fn("layer_norm_no_affine", "F.layer_norm(x, (3, 3))", "layer_norm", x=x4),
    fn(
      "group_norm",
      "F.group_norm(x, 2, w, b)",
      "group_norm",
      x=x4,
      w=inp("positive", 4),
      b=inp("normal", 4),
    ),
    fn("group_norm_no_affine", "F.group_norm(x, 4)", "group_norm", x=x4),
    fn("cosine_similarity", "F.cosine_similarity(x, y)", "cosine_similarity", x=LA, y=LB),
    fn(
      "cosine_similarity_dim0_broadcast",
      "F.cosine_similarity(x, y, dim=0)",
      "cosine_similarity",
      x=LA,
      y=low("normal", 4, 1),
    ),
    fn("pdist", "F.pdist(x)", "pdist", x=low("normal", 5, 3)),
    fn("pdist_p1", "F.pdist(x, p=1.0)", "pdist", x=low("normal", 5, 3)),
    fn("pdist_float32", "F.pdist(x)", "pdist", x=inp("normal", 5, 3)),
    fn("pdist_inf", "F.pdist(x, p=float('inf'))", "pdist", x=low("normal", 5, 3)),
    fn("dist", "torch.dist(x, y)", "dist", x=LA, y=LB),
    fn("dist_p3", "torch.dist(x, y, 3.0)", "dist", x=LA, y=LV),
    fn("normalize", "F.normalize(x)", "normalize", x=LA),
    fn("normalize_p1_dim0", "F.normalize(x, p=1.0, dim=0)", "normalize", x=LA),
    fn("norm", "torch.norm(x)", "norm", x=LA),
    fn("norm_p1_dim", "torch.norm(x, p=1, dim=1)", "norm", x=LA),
    fn("norm_inf_keepdim", "torch.norm(x, p=float('inf'), dim=0, keepdim=True)", "norm", x=LA),
    fn("norm_p3_dims", "torch.norm(x, p=3, dim=(1, 2))", "norm", x=x4),
    fn("norm_nuc", "torch.norm(x, p='nuc')", "norm", x=LA),
    fn("norm_fro_dims", "torch.norm(x, p='fro', dim=(0, 1))", "norm", x=LA),
    fn("renorm", "torch.renorm(x, 2, 0, 2.5)", "renorm", x=LA),
    fn("renorm_p1_dim1", "torch.renorm(x, 1, 1, 1.0)", "renorm", x=LA),
    fn(
      "cosine_similarity_float32",
      "F.cosine_similarity(x, y)",
      "cosine_similarity",
      x=A,
      y=inp("normal", 4, 8),
    ),
    # native promotion, bias adds, nesting, ineligible dtypes
    case("add_mixed", "x + y", "unlisted", "add", x=LA, y=A),
    case("mul_python_scalar", "x * 0.5", "unlisted", "mul", x=LA),
    case(
      "mm_plus_bias",
      "torch.mm(a, w.t()) + bias",
      "unlisted",
      "add",
      a=A,
      w=inp("normal", 5, 8),
      bias=inp("normal", 5),
    ),
    case("mm_then_exp", "torch.exp(torch.mm(a, b))", "unlisted", "exp", a=A, b=B),
    case("mm_then_softmax", "F.softmax(torch.mm(a, b), dim=1)", "unlisted", "softmax", a=A, b=B),
    case(
      "mm_then_mse_loss",
      "F.mse_loss(torch.mm(a, b), y)",
      "float32",
      "mse_loss",
      a=A,
      b=B,
      y=inp("normal", 4, 5),
    ),
    case(
      "mse_none_then_mean",
      "F.mse_loss(x, y, reduction='none').mean()",
      "float32",
      "mse_loss",
      x=LA,
      y=LB,
    ),
    case(
      "linear_then_layer_norm",
      "F.layer_norm(F.linear(a, w), (5,), g, b)",
      "unlisted",
      "layer_norm",
      a=A,
      w=inp("normal", 5, 8),
      g=inp("positive", 5),
      b=inp("normal", 5),
    ),
    case("autocast_disabled", "disabled(lambda: torch.mm(a, b))", "unlisted", "autocast", a=A, b=B),
    case(
      "autocast_disabled_mixed",
      "torch.mm(a, b) + disabled(lambda: torch.mm(a, b))",
      "unlisted",
      "autocast",
      a=A,
      b=B,
    ),
    case(
      "float64_mm",
      "torch.mm(a, b)",
      "unlisted",
      "mm",
      a=inp("normal", 4, 8, dtype="float64"),
      b=inp("normal", 8, 5, dtype="float64"),
    ),
    case("float64_exp", "torch.exp(x)", "unlisted", "exp", x=inp("normal", 4, 8, dtype="float64")),
    case(
      "int_mm",
      "torch.mm(a, b)",
      "unlisted",
      "mm",
      a=inp("ints", 4, 8, dtype="int64"),
      b=inp("ints", 8, 5, dtype="int64"),
    ),
    case("int_sum", "torch.sum(a)", "unlisted", "sum", a=inp("ints", 4, 8, dtype="int64")),
    case("int_plus_low", "a + x", "unlisted", "add", a=inp("ints", 4, 8, dtype="int64"), x=LA),
    case(
      "bool_where",
      "torch.where(m, x, y)",
      "unlisted",
      "where",
      m=inp("binary", 4, 8, dtype="bool"),
      x=LA,
      y=A,
    ),
  ]


def _sparse_cases() -> list[dict[str, Any]]:
  # A sparse COO operand (a with the zeros of m): jax.experimental.sparse's BCOO.
  return [
    case(
      "sparse_mm",
      "torch.mm((a * m).to_sparse(), b)",
      "lower",
      "mm",
      a=A,
      m=inp("binary", 4, 8),
      b=B,
    ),
  ]


def _norm_cases() -> list[dict[str, Any]]:
  # Norms of a 16-bit matmul's output: CPU autocast lists no norm, so they run in bfloat16.
  # jnp's max-based norms add a float32 literal (``max(0.0, ...)``) that must not promote them.
  return [
    case(
      f"norm_{label}_of_mm",
      f"torch.linalg.norm(torch.mm(a, b){order})",
      "unlisted",
      op,
      a=A,
      b=B,
    )
    for label, order, op in (
      ("fro", "", "linalg_vector_norm"),
      ("inf", ', float("inf")', "linalg_matrix_norm"),
      ("1", ", 1", "linalg_matrix_norm"),
      ("vector_inf", '.reshape(-1), float("inf")', "linalg_vector_norm"),
    )
  ]


def _fill_cases() -> list[dict[str, Any]]:
  # Arrays made inside (torch.zeros: float32) meeting a 16-bit matmul's output: an accumulator,
  # a concatenated block and a buffer written into promote; zeros_like of it is 16-bit.
  return [
    case("zeros_plus_mm", "torch.zeros(4, 5) + torch.mm(a, b)", "unlisted", "add", a=A, b=B),
    case(
      "cat_zeros_and_mm",
      "torch.cat([torch.zeros(2, 5), torch.mm(a, b)])",
      "promote",
      "cat",
      a=A,
      b=B,
    ),
    case(
      "index_copy_mm_into_zeros",
      "torch.zeros(6, 5).index_copy(0, i, torch.mm(a, b))",
      "promote",
      "index_copy",
      a=A,
      b=B,
      i=inp("index:6", 4, dtype="int64"),
    ),
    case(
      "where_mm_or_zeros_like",
      "torch.where(torch.mm(a, b) > 0, torch.mm(a, b), torch.zeros_like(torch.mm(a, b)))",
      "unlisted",
      "where",
      a=A,
      b=B,
    ),
  ]


def _accumulation_cases() -> list[dict[str, Any]]:
  # Long 16-bit reductions and scans: torch's kernels accumulate in float32 and round once.
  def unlisted(name, expr, torch_op, x):
    return case(name, expr, "unlisted", torch_op, x=x)

  long_row, offset = low("positive", 2, 512), low("offset", 3, 8)
  return [
    unlisted("cumsum_long", "torch.cumsum(x, dim=1)", "cumsum", long_row),
    unlisted("cumprod_long", "torch.cumprod(x, dim=1)", "cumprod", low("near_one", 2, 512)),
    unlisted("logcumsumexp_long", "torch.logcumsumexp(x, dim=1)", "logcumsumexp", long_row),
    unlisted("var_offset", "torch.var(x, dim=1)", "var", offset),
    unlisted("std_offset", "torch.std(x, dim=1)", "std", offset),
    unlisted("nanmean", "torch.nanmean(x, dim=1)", "nanmean", LA),
    unlisted("median", "torch.median(x, dim=1).values", "median", low("normal", 4, 9)),
    unlisted("avg_pool2d_wide", "F.avg_pool2d(x, 16)", "avg_pool2d", low("positive", 1, 2, 16, 32)),
    unlisted("unfold", "F.unfold(x, 2, stride=2)", "im2col", inp("normal", 1, 2, 4, 4)),
    unlisted("unfold_low", "F.unfold(x, 2, stride=2)", "im2col", low("normal", 1, 2, 4, 4)),
  ]


def _attention_cases() -> list[dict[str, Any]]:
  # torch's SDPA kernels compute the scores and softmax of 16-bit inputs in float32.
  def sdpa(name, scale, seq):
    return case(
      name,
      "F.scaled_dot_product_attention(q, k, v)",
      "lower",
      "scaled_dot_product_attention",
      q=inp(f"normal:{scale}", 1, 2, seq, 16),
      k=inp(f"normal:{scale}", 1, 2, seq, 16),
      v=inp("normal", 1, 2, seq, 16),
    )

  # Long rows (rounding each probability to 16 bits before the sum loses precision) and scores
  # past float16's range (q . k of 100-sigma entries).
  return [sdpa("sdpa_long", 3, 256), sdpa("sdpa_large_logits", 100, 8)]


def _operand_kind_cases() -> list[dict[str, Any]]:
  # Python scalars yield to a 0-dim tensor, integer tensors to a float one of any rank, and
  # torch's einsum and linalg_vecdot of two vectors are matmuls (its dot is not listed).
  top = "torch.mm(a, b).amax()"
  lengths = inp("classes:1-9", 4, dtype="int64")
  u, v = inp("normal", 8), inp("normal", 8)
  return [
    case(
      "where_0dim_or_scalar", f"torch.where({top} > 0, {top}, 0.0)", "unlisted", "where", a=A, b=B
    ),
    case("clamp_0dim", f"torch.clamp({top}, 0.0, 1.0)", "unlisted", "clamp", a=A, b=B),
    case("nan_to_num_0dim", f"torch.nan_to_num({top})", "unlisted", "nan_to_num", a=A, b=B),
    case(
      "mm_sum_over_int_lengths",
      "torch.mm(a, b).sum(1) / n",
      "unlisted",
      "div",
      a=A,
      b=B,
      n=lengths,
    ),
    case("mm_plus_arange", "torch.mm(a, b) + torch.arange(5)", "unlisted", "add", a=A, b=B),
    case(
      "mm_times_int_column", "torch.mm(a, b) * n[:, None]", "unlisted", "mul", a=A, b=B, n=lengths
    ),
    case("vecdot_of_vectors", "torch.linalg.vecdot(u, v)", "lower", "linalg_vecdot", u=u, v=v),
    case("einsum_of_vectors", "torch.einsum('i,i->', u, v)", "lower", "matmul", u=u, v=v),
    case(
      "int_sum_to_bfloat16",
      "torch.sum(n, dtype=torch.bfloat16)",
      "unlisted",
      "sum",
      n=inp("ints", 4, 8, dtype="int64"),
    ),
    case(
      "mm_times_tril_of_ones_like",
      "torch.mm(a, b) * torch.tril(torch.ones_like(torch.mm(a, b)))",
      "unlisted",
      "mul",
      a=A,
      b=B,
    ),
    case(
      "mm_over_cumsum_of_ones_like",
      "torch.mm(a, b) / torch.cumsum(torch.ones_like(torch.mm(a, b)), 1)",
      "unlisted",
      "div",
      a=A,
      b=B,
    ),
    case(
      "mm_plus_twice_zeros_like",
      "torch.mm(a, b) + 2 * torch.zeros_like(torch.mm(a, b))",
      "unlisted",
      "add",
      a=A,
      b=B,
    ),
    case(
      "cat_slice_of_zeros_like",
      "torch.cat([torch.zeros_like(torch.mm(a, b))[:1], torch.mm(a, b)[1:]])",
      "promote",
      "cat",
      a=A,
      b=B,
    ),
    case(
      "einsum_without_a_summed_index",
      "torch.einsum('ij,j->ij', torch.mm(a, b), v)",
      "unlisted",
      "mul",
      a=A,
      b=B,
      v=inp("normal", 5),
    ),
    case(
      "mm_sum_over_float_lengths",
      "torch.mm(a, b).sum(1) / n.float()",
      "unlisted",
      "div",
      a=A,
      b=B,
      n=inp("classes:1-9", 4, dtype="int64"),
    ),
  ]


def _dimension_count_cases() -> list[dict[str, Any]]:
  # Ops listed for some numbers of dimensions only: CPU's float32 list has reflection_pad1d and
  # reflection_pad2d, not reflection_pad3d.
  return [
    case(
      "reflection_pad3d",
      "F.pad(x, (1, 1, 2, 1, 1, 2), mode='reflect')",
      "unlisted",
      "reflection_pad3d",
      x=low("normal", 1, 2, 4, 4, 4),
    ),
  ]


def _elementwise_function_cases() -> list[dict[str, Any]]:
  # Elementwise functions torch computes in one kernel each, on no list: its input's dtype.
  pos, prob = low("positive", 4, 8), low("uniform", 4, 8)
  return [
    case("logaddexp", "torch.logaddexp(x, y)", "unlisted", "logaddexp", x=LA, y=LB),
    case("logaddexp2", "torch.logaddexp2(x, y)", "unlisted", "logaddexp2", x=LA, y=LB),
    case("xlogy", "torch.xlogy(x, y)", "unlisted", "xlogy", x=LA, y=pos),
    case("xlog1py", "torch.special.xlog1py(x, y)", "unlisted", "special_xlog1py", x=LA, y=pos),
    case("entr", "torch.special.entr(x)", "unlisted", "special_entr", x=pos),
    case("logit", "torch.logit(x)", "unlisted", "logit", x=prob),
    case("hypot", "torch.hypot(x, y)", "unlisted", "hypot", x=LA, y=LB),
    case("i0", "torch.i0(x)", "unlisted", "i0", x=LA),
    case("i1", "torch.special.i1(x)", "unlisted", "special_i1", x=LA),
    case("nansum", "torch.nansum(x, dim=1)", "unlisted", "nansum", x=LA),
  ]


def _summed_size_one_cases() -> list[dict[str, Any]]:
  # torch's composite einsum takes a summed index of size one as a broadcast: a mul, unlisted.
  name, expr = "einsum_summing_an_index_of_size_one", "torch.einsum('bi,ik->bk', a[:, :1], w)"
  return [case(name, expr, "unlisted", "mul", a=A, w=inp("normal", 1, 6))]


def _zero_dim_tensor_cases() -> list[dict[str, Any]]:
  # A 0-dim float32 tensor beside a 16-bit one: type promotion keeps the 16-bit dtype, autocast's
  # promote (torch's prioritize) counts every floating tensor and widens to float32.
  mm, s = {"a": A, "b": B}, inp("normal")
  return [
    case("mm_plus_0dim", "torch.mm(a, b) + s", "unlisted", "add", **mm, s=s),
    case("atan2_of_mm_and_0dim", "torch.atan2(torch.mm(a, b), s)", "unlisted", "atan2", **mm, s=s),
    case(
      "index_copy_0dim_into_mm",
      "torch.mm(a, b)[0].index_copy(0, i, s)",
      "promote",
      "index_copy",
      **mm,
      i=inp("classes:5", dtype="int64"),
      s=s,
    ),
    case(
      "cat_mm_and_0dim", "torch.cat([torch.mm(a, b)[0], s.reshape(1)])", "promote", "cat", **mm, s=s
    ),
  ]


def _long_sum_cases() -> list[dict[str, Any]]:
  # A long 16-bit sum: torch's sum kernel accumulates in float32 and rounds once, however the sum
  # is spelled in JAX (jnp.sum, or the bare lax.reduce_sum a transposed broadcast is).
  long_row, mm = low("positive", 2, 4096), {"a": inp("uniform", 64, 4), "b": inp("uniform", 4, 512)}
  return [
    case("sum_long", "torch.sum(x, dim=1)", "unlisted", "sum", x=long_row),
    case("sum_long_of_mm", "torch.mm(a, b).sum()", "unlisted", "sum", **mm),
  ]


def all_cases() -> list[dict[str, Any]]:
  """Every case's definition (no input values), in the golden file's order. Inputs are drawn in
  this order from one generator: new cases go last, so the recorded inputs of others stay."""
  cases = (
    _lower_cases()
    + _float32_cases()
    + _promote_cases()
    + _unlisted_cases()
    + _sparse_cases()
    + _norm_cases()
    + _fill_cases()
    + _accumulation_cases()
    + _attention_cases()
    + _operand_kind_cases()
    + _dimension_count_cases()
    + _elementwise_function_cases()
    + _summed_size_one_cases()
    + _zero_dim_tensor_cases()
    + _long_sum_cases()
  )
  names = [c["name"] for c in cases]
  duplicates = {n for n in names if names.count(n) > 1}
  if duplicates:
    raise ValueError(f"duplicate case names: {sorted(duplicates)}")
  return cases


def with_inputs(seed: int = SEED) -> list[dict[str, Any]]:
  """``all_cases`` with each input's ``kind`` replaced by the values drawn for it (flattened),
  from one generator seeded with ``seed`` in case order: the golden file's inputs."""
  rng = np.random.default_rng(seed)
  cases = all_cases()
  for c in cases:
    for spec in c["inputs"].values():
      spec["values"] = draw(rng, spec.pop("kind"), tuple(spec["shape"])).reshape(-1).tolist()
  return cases
