"""torch's own autocast test lists, ported: every entry runs its JAX spelling under jaxamp.autocast.

torch tests its autocast with ``torch/testing/_internal/autocast_test_lists.py``:
``AutocastTestLists`` (CUDA, float16; run by ``test/test_cuda.py``) and ``AutocastCPUTestLists``
(CPU, bfloat16 and float16; run by ``test/test_autocast.py``). The golden file
``tests/goldens/torch_autocast_lists.json`` (written by ``scripts/record_torch_autocast_lists.py``)
holds every entry: its op, the shapes and dtypes of its tensors, the dtype torch's test expects,
the shapes of its results, and for the CPU lists the dtypes torch's CPU autocast returned.

Here each entry has a JAX spelling (``CUDA``, ``CPU``): a function of the entry's tensors, in
torch's order, written as a user would (jnp, lax, jax.nn, flax, jaxamp.functional), run as
``jax.jit(jaxamp.autocast(spelling, device_type=...))`` on inputs of the entry's shapes and dtypes:

* CUDA entries (policy "cuda", float16) are checked as torch's test checks them: the float16
  lists give float16, the float32 lists float32, the promote list the widest input dtype, the
  builtin-promote lists the entry's out type, and the banned list raises; the values are those of
  the spelling run without autocast on its inputs cast to that dtype (torch's "control" run).
* CPU entries (policy "cpu", bfloat16 and float16) give the dtype torch's CPU autocast gave
  (from the golden file, and with torch installed live, values included) and match the control.

Every entry passes, is a ``DIVERGENCES`` entry or is ``NOT_APPLICABLE``, each with its reason;
``test_every_entry_is_accounted_for`` fails on any other.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import script_modules
from fast_subset import first_of_each_family
from jax import lax
from op_list_entries import (
  CONV,
  FLOATS,
  JAX_DTYPES,
  PRECISION,
  WIDTH,
  In,
  M,
  N,
  Spelling,
  V,
  assert_close,
  bf16,
  conv,
  conv_tbc,
  conv_transpose,
  dtype_names,
  f16,
  f32,
  flat,
  given,
  i32,
  i64,
  low,
  random_values,
  unreduced,
)
from paths import GOLDENS

import jaxamp
from jaxamp import functional

# JAX warns that ``.at[]`` updates with a wider value will raise one day (entries index_put#2 and
# scatter_add#2 spell torch's promotion the way JAX code is written today).
pytestmark = pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")

GOLDEN = GOLDENS / "torch_autocast_lists.json"
RECORDED = json.loads(GOLDEN.read_text())
CPU_MODES = tuple(RECORDED["cpu_modes"])


# --- inputs ------------------------------------------------------------------------------------


def dtype_name(spec: In, mode: str) -> str:
  return mode if spec.dtype == "low" else spec.dtype


# --- JAX spellings -----------------------------------------------------------------------------


def _linear(x, w, b):
  return x @ w.T + b


def _lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
  i, f, g, o = jnp.split(_linear(x, w_ih, b_ih) + _linear(h, w_hh, b_hh), 4, axis=-1)
  c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
  return jax.nn.sigmoid(o) * jnp.tanh(c), c


def _gru_cell(x, h, w_ih, w_hh, b_ih, b_hh):
  i_r, i_z, i_n = jnp.split(_linear(x, w_ih, b_ih), 3, axis=-1)
  h_r, h_z, h_n = jnp.split(_linear(h, w_hh, b_hh), 3, axis=-1)
  r, z = jax.nn.sigmoid(i_r + h_r), jax.nn.sigmoid(i_z + h_z)
  n = jnp.tanh(i_n + r * h_n)
  return (1 - z) * n + z * h


def _rnn_cell(activation):
  return lambda x, h, w_ih, w_hh, b_ih, b_hh: activation(
    _linear(x, w_ih, b_ih) + _linear(h, w_hh, b_hh)
  )


def _multi_head_attention(q, k, v, qkv_weight, qkv_bias, proj_weight, proj_bias, num_heads=4):
  """torch._native_multi_head_attention (batch first, no mask): output, head-averaged weights."""

  def heads(x, w, b):
    y = _linear(x, w, b)
    return y.reshape(*y.shape[:2], num_heads, -1)

  w_q, w_k, w_v = jnp.split(qkv_weight, 3)
  b_q, b_k, b_v = jnp.split(qkv_bias, 3)
  qh, kh, vh = heads(q, w_q, b_q), heads(k, w_k, b_k), heads(v, w_v, b_v)
  logits = jnp.einsum("blhd,bshd->bhls", qh, kh) / math.sqrt(qh.shape[-1])
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhls,bshd->blhd", weights, vh).reshape(q.shape)
  return _linear(out, proj_weight, proj_bias), jnp.mean(weights, axis=1)


def _scatter_add(x, index, src):
  """torch.scatter_add(x, 0, index, src) on 3-D tensors."""
  j = jnp.arange(x.shape[1])[None, :, None]
  k = jnp.arange(x.shape[2])[None, None, :]
  return x.at[index, j, k].add(src)


def _avg_pool3d(x):
  """torch's avg_pool3d on an unbatched (C, D, H, W) input, kernel 3, stride 1."""
  y = nn.avg_pool(jnp.moveaxis(x, 0, -1)[None], (3, 3, 3), strides=(1, 1, 1))
  return jnp.moveaxis(y[0], -1, 0)


H = f16(N)  # pointwise*_fp16
HM = f16(N, N)  # mat*_fp16


def _builtin_promote(mixed: tuple[In, In]) -> dict[str, Spelling]:
  ops = {
    "eq": operator.eq,
    "ge": operator.ge,
    "gt": operator.gt,
    "le": operator.le,
    "lt": operator.lt,
    "ne": operator.ne,
    "add": operator.add,
    "div": operator.truediv,
    "mul": operator.mul,
  }
  return {name: (op, mixed) for name, op in ops.items()}


def _methods_builtin_promote(mixed: tuple[In, In]) -> dict[str, Spelling]:
  return {f"__{name}__": spelling for name, spelling in _builtin_promote(mixed).items()}


def _norm_rows(x: In) -> dict[str, Spelling]:
  return {
    "norm": (jnp.linalg.norm, (x,)),
    "norm#2": (lambda a: jnp.linalg.norm(a, axis=0), (x,)),
    "norm#3": (lambda a: jnp.linalg.norm(a, ord=1), (x,)),
    "norm#4": (lambda a: jnp.linalg.norm(a, ord=1, axis=0), (x,)),
  }


# AutocastTestLists (CUDA): list -> entry id -> (JAX spelling, its tensor arguments).
CUDA: dict[str, dict[str, Spelling]] = {
  "torch_expect_builtin_promote": {
    **_builtin_promote((V, H)),
    "cat": (lambda a, b: jnp.concatenate([a, b]), (H, V)),
    "equal": (jnp.array_equal, (V, H)),
    "stack": (lambda a, b: jnp.stack([a, b]), (H, V)),
  },
  "methods_expect_builtin_promote": _methods_builtin_promote((V, H)),
  "torch_fp16": {
    "_convolution": (conv, (*CONV[2], V)),
    "_convolution#2": (conv, (*CONV[2], V)),
    "conv1d": (conv, CONV[1]),
    "conv2d": (conv, CONV[2]),
    "conv3d": (conv, CONV[3]),
    "conv_tbc": (conv_tbc, (*CONV[1], V)),
    "conv_transpose1d": (conv_transpose, CONV[1]),
    "conv_transpose2d": (conv_transpose, CONV[2]),
    "conv_transpose3d": (conv_transpose, CONV[3]),
    "convolution": (conv, (*CONV[2], V)),
    "cudnn_convolution": (conv, CONV[2]),
    "cudnn_convolution_transpose": (conv_transpose, CONV[2]),
    "prelu": (functional.prelu, (V, f32(1))),
    "addmm": (lambda c, a, b: c + a @ b, (M, M, M)),
    "addmv": (lambda c, a, v: c + a @ v, (V, M, V)),
    "addr": (lambda c, u, v: c + jnp.outer(u, v), (M, V, V)),
    "matmul": (jnp.matmul, (M, M)),
    # torch's test never runs this entry: its operands sit where test_cuda.py reads the ROCm
    # skip flag (and its equation where the operands belong). Here they get the 4 axes the
    # equation names.
    "einsum": (
      lambda a, b: jnp.einsum("bkhd,bqhd->bqkh", a[None, :, None], b[None, :, None]),
      (M, M),
    ),
    "mm": (operator.matmul, (M, M)),
    "mv": (operator.matmul, (M, V)),
    "chain_matmul": (lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), (M, M, M)),
    "addbmm": (
      lambda c, x, y: c + jnp.einsum("bij,bjk->ik", x, y),
      (M, f32(N, N, N), f32(N, N, N)),
    ),
    "baddbmm": (lambda c, x, y: c + x @ y, (f32(N, N, N),) * 3),
    "bmm": (jnp.matmul, (f32(N, N, N),) * 2),
    "lstm_cell": (
      _lstm_cell,
      (M, M, M, f32(4 * N, N), f32(4 * N, N), f32(4 * N), f32(4 * N)),
    ),
    "gru_cell": (_gru_cell, (M, M, f32(3 * N, N), f32(3 * N, N), f32(3 * N), f32(3 * N))),
    "rnn_tanh_cell": (_rnn_cell(jnp.tanh), (M, M, M, M, V, V)),
    "rnn_relu_cell": (_rnn_cell(jax.nn.relu), (M, M, M, M, V, V)),
  },
  "torch_fp32": {
    "acos": (jnp.arccos, (f16(N, kind="unit"),)),
    "asin": (jnp.arcsin, (f16(N, kind="unit"),)),
    "cosh": (jnp.cosh, (H,)),
    "erfinv": (jax.scipy.special.erfinv, (f16(N, kind="unit"),)),
    "exp": (jnp.exp, (H,)),
    "expm1": (jnp.expm1, (H,)),
    "log": (jnp.log, (f16(N, kind="positive"),)),
    "log10": (jnp.log10, (f16(N, kind="positive"),)),
    "log2": (jnp.log2, (f16(N, kind="positive"),)),
    "log1p": (jnp.log1p, (f16(N, kind="positive"),)),
    "reciprocal": (jnp.reciprocal, (H,)),
    "rsqrt": (lax.rsqrt, (f16(N, kind="positive"),)),
    "sinh": (jnp.sinh, (H,)),
    "tan": (jnp.tan, (f16(N, kind="tan"),)),
    "pow": (jnp.power, (f16(N, kind="positive"), H)),
    "pow#2": (lambda x: x**1.7, (f16(N, kind="positive"),)),
    "softmax": (lambda x: jax.nn.softmax(x, axis=0), (H,)),
    "log_softmax": (lambda x: jax.nn.log_softmax(x, axis=0), (H,)),
    "layer_norm": (lambda x: nn.LayerNorm(use_scale=False, use_bias=False).apply({}, x), (H,)),
    "rms_norm": (lambda x: nn.RMSNorm(use_scale=False).apply({}, x), (H,)),
    "group_norm": (lambda x: functional.group_norm(x, 1), (HM,)),
    **_norm_rows(H),
    "cosine_similarity": (functional.cosine_similarity, (HM, HM)),
    "poisson_nll_loss": (
      lambda x, t: functional.poisson_nll_loss(x, t, True, False, eps=1e-8),
      (HM, HM),
    ),
    "cosine_embedding_loss": (
      unreduced(functional.cosine_embedding_loss),
      (given("float16", [[1, 2, 3]]), given("float16", [[1, 3, 4]]), given("int32", [1])),
    ),
    "hinge_embedding_loss": (unreduced(functional.hinge_embedding_loss), (HM, i32(N))),
    "kl_div": (unreduced(functional.kl_div), (HM, f16(N, N, kind="rand"))),
    "margin_ranking_loss": (
      unreduced(functional.margin_ranking_loss),
      (HM, HM, f16(N, kind="ones")),
    ),
    "triplet_margin_loss": (unreduced(functional.triplet_margin_loss), (HM, HM, HM)),
    "binary_cross_entropy_with_logits": (
      unreduced(functional.binary_cross_entropy_with_logits),
      (HM, f16(N, N, kind="rand")),
    ),
    "cumprod": (lambda x: jnp.cumprod(x, axis=0), (H,)),
    "cumsum": (lambda x: jnp.cumsum(x, axis=0), (H,)),
    "dist": (functional.dist, (H, H)),
    "pdist": (functional.pdist, (HM,)),
    "cdist": (functional.cdist, (HM, HM)),
    "prod": (jnp.prod, (H,)),
    "prod#2": (lambda x: jnp.prod(x, axis=0), (H,)),
    "renorm": (lambda x: functional.renorm(x, 2, 0, 1.0), (HM,)),
    "sum": (jnp.sum, (H,)),
    "sum#2": (lambda x: jnp.sum(x, axis=1), (HM,)),
    "logsumexp": (lambda x: jax.nn.logsumexp(x, axis=1), (HM,)),
  },
  "torch_need_autocast_promote": {
    "addcdiv": (lambda t, a, b: t + a / b, (V, H, f16(N, kind="positive"))),
    "addcmul": (lambda t, a, b: t + a * b, (V, H, H)),
    "atan2": (jnp.arctan2, (V, f16(N, kind="positive"))),
    "bilinear": (functional.bilinear, (f16(1, 2), f32(1, 2), f16(1, 2, 2), f32(1))),
    "cross": (jnp.cross, (f32(3), f16(3))),
    "dot": (jnp.dot, (H, V)),
    "vdot": (jnp.vdot, (H, V)),
    "index_put": (lambda x, i, v: x.at[i].set(v), (V, i64(1, kind="ones"), f16(1))),
    "index_put#2": (lambda x, i, v: x.at[i].set(v), (H, i64(1, kind="ones"), f32(1))),
    "tensordot": (jnp.tensordot, (f32(2, 2, 2), f16(2, 2, 2))),
    "scatter_add": (
      _scatter_add,
      (f32(2, 2, 2, kind="zeros"), i64(2, 2, 2, kind="randint2"), f16(2, 2, 2)),
    ),
    "scatter_add#2": (
      _scatter_add,
      (f16(2, 2, 2, kind="zeros"), i64(2, 2, 2, kind="randint2"), f32(2, 2, 2)),
    ),
  },
  "nn_fp16": {
    "linear": (_linear, (M, M, M)),
  },
  "nn_fp32": {
    "softplus": (jax.nn.softplus, (H,)),
    "nll_loss": (unreduced(functional.nll_loss), (f32(N, N, kind="rand"), i64(N))),
    "nll_loss2d": (
      unreduced(functional.nll_loss),
      (f16(N, N, N, N, kind="rand"), i64(N, N, N)),
    ),
    "l1_loss": (unreduced(functional.l1_loss), (HM, HM)),
    "smooth_l1_loss": (unreduced(functional.smooth_l1_loss), (HM, HM)),
    "mse_loss": (unreduced(functional.mse_loss), (HM, HM)),
    "multilabel_margin_loss": (
      unreduced(functional.multilabel_margin_loss),
      (HM, i64(N, N, kind="ones")),
    ),
    "soft_margin_loss": (unreduced(functional.soft_margin_loss), (HM, i64(N, N, kind="ones"))),
    "multi_margin_loss": (unreduced(functional.multi_margin_loss), (HM, i64(N, kind="ones"))),
  },
  "linalg_fp16": {
    "linalg_vecdot": (jnp.linalg.vecdot, (M, M)),
    "linalg_multi_dot": (lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), (M, M, M)),
  },
  "methods_fp16": {
    "__matmul__": (operator.matmul, (M, M)),
  },
  "methods_fp32": {
    "__pow__": (lambda x: x**1.5, (f16(N, kind="rand"),)),
  },
  "banned": {
    "binary_cross_entropy": (
      unreduced(functional.binary_cross_entropy),
      (f32(N, N, kind="rand"), f32(N, N, kind="rand")),
    ),
  },
}

BM = bf16(N, N)  # the CPU lists' mat*_bf16

# AutocastCPUTestLists: list -> entry id -> (JAX spelling, its tensor arguments).
CPU: dict[str, dict[str, Spelling]] = {
  "torch_expect_builtin_promote": _builtin_promote((V, low(N))),
  "methods_expect_builtin_promote": _methods_builtin_promote((V, low(N))),
  "torch_16": {
    "conv1d": (conv, CONV[1]),
    "conv2d": (conv, CONV[2]),
    "conv3d": (conv, CONV[3]),
    "bmm": (jnp.matmul, (f32(N, N, N),) * 2),
    "mm": (operator.matmul, (M, M)),
    "matmul": (jnp.matmul, (M, M)),
    "baddbmm": (lambda c, x, y: c + x @ y, (f32(N, N, N),) * 3),
    "addmm": (lambda c, a, b: c + a @ b, (M, M, M)),
    "_addmm_activation": (lambda c, a, b: jax.nn.gelu(c + a @ b, approximate=False), (M, M, M)),
    "addbmm": (
      lambda c, x, y: c + jnp.einsum("bij,bjk->ik", x, y),
      (M, f32(N, N, N), f32(N, N, N)),
    ),
    "conv_tbc": (conv_tbc, (f32(10, 7, 3), f32(5, 3, 5), f32(5))),
    "conv_transpose1d": (conv_transpose, CONV[1]),
    "conv_transpose2d": (conv_transpose, CONV[2]),
    "conv_transpose3d": (conv_transpose, CONV[3]),
    "prelu": (functional.prelu, (V, f32(1))),
    "_native_multi_head_attention": (
      _multi_head_attention,
      (f32(N, N, N),) * 3 + (f32(3 * N, N), f32(3 * N), M, V),
    ),
  },
  "torch_fp32": {
    "poisson_nll_loss": (
      lambda x, t: functional.poisson_nll_loss(x, t, True, False, eps=1e-8),
      (BM, BM),
    ),
    "cosine_embedding_loss": (
      unreduced(functional.cosine_embedding_loss),
      (given("bfloat16", [[1, 2, 3]]), given("bfloat16", [[1, 3, 4]]), given("int32", [1])),
    ),
    "hinge_embedding_loss": (unreduced(functional.hinge_embedding_loss), (BM, i32(N))),
    "margin_ranking_loss": (
      unreduced(functional.margin_ranking_loss),
      (BM, BM, bf16(N, kind="ones")),
    ),
    "triplet_margin_loss": (unreduced(functional.triplet_margin_loss), (BM, BM, BM)),
    "binary_cross_entropy_with_logits": (
      unreduced(functional.binary_cross_entropy_with_logits),
      (BM, bf16(N, N, kind="rand")),
    ),
  },
  "nn_16": {
    "linear": (lambda x, w: x @ w.T, (M, M)),
  },
  "nn_fp32": {
    "avg_pool3d": (_avg_pool3d, (bf16(N, N, N, N),)),
    "binary_cross_entropy": (
      unreduced(functional.binary_cross_entropy),
      (bf16(N, N, kind="rand"), bf16(N, N, kind="rand")),
    ),
    "reflection_pad1d": (
      lambda x: jnp.pad(x, ((0, 0), (0, 0), (3, 3)), mode="reflect"),
      (bf16(N, N, N),),
    ),
    "nll_loss": (unreduced(functional.nll_loss), (bf16(N, N, kind="rand"), i64(N))),
    "nll_loss2d": (
      unreduced(functional.nll_loss),
      (bf16(N, N, N, N, kind="rand"), i64(N, N, N)),
    ),
    "l1_loss": (unreduced(functional.l1_loss), (BM, BM)),
    "smooth_l1_loss": (unreduced(functional.smooth_l1_loss), (BM, BM)),
    "mse_loss": (unreduced(functional.mse_loss), (BM, BM)),
    "multilabel_margin_loss": (
      unreduced(functional.multilabel_margin_loss),
      (BM, i64(N, N, kind="ones")),
    ),
    "soft_margin_loss": (unreduced(functional.soft_margin_loss), (BM, i64(N, N, kind="ones"))),
    "multi_margin_loss": (unreduced(functional.multi_margin_loss), (BM, i64(N, kind="ones"))),
    "huber_loss": (unreduced(functional.huber_loss), (BM, BM)),
  },
  "torch_need_autocast_promote": {
    "cat": (lambda a, b: jnp.concatenate([a, b]), (low(N), V)),
    "stack": (lambda a, b: jnp.stack([a, b]), (low(N), V)),
  },
}

PORT = {"cuda": CUDA, "cpu": CPU}

# Entries with no JAX counterpart: "device/list/id" -> why.
NOT_APPLICABLE: dict[str, str] = {
  "cuda/torch_need_autocast_promote/grid_sampler": (
    "JAX has no grid sampler (jax.scipy.ndimage.map_coordinates has other coordinate, "
    "padding and align_corners conventions)"
  ),
}

# Entries where jaxamp gives another dtype than torch: "device/list/id" -> (jaxamp's dtype, or
# "values" where only the values differ from torch's control, and why).
FUSED_ADD = (
  "JAX has no fused {op}: its spelling adds an input of batch extent (varying over more "
  "than one operand's free dims) to the product, an addend like an attention mask, not a "
  "linear bias: it promotes as torch's unfused product + input does, where torch's fused "
  "kernel casts that input to the low dtype"
)

DIVERGENCES: dict[str, tuple[str, str]] = {
  "cuda/torch_fp16/addmm": ("float32", FUSED_ADD.format(op="addmm")),
  "cuda/torch_fp16/addbmm": ("float32", FUSED_ADD.format(op="addbmm")),
  "cuda/torch_fp16/baddbmm": ("float32", FUSED_ADD.format(op="baddbmm")),
  "cuda/nn_fp16/linear": ("float32", FUSED_ADD.format(op="linear")),
  "cpu/torch_16/addmm": ("float32", FUSED_ADD.format(op="addmm")),
  "cpu/torch_16/addbmm": ("float32", FUSED_ADD.format(op="addbmm")),
  "cpu/torch_16/baddbmm": ("float32", FUSED_ADD.format(op="baddbmm")),
  "cpu/torch_16/_addmm_activation": ("float32", FUSED_ADD.format(op="addmm_activation")),
  "cuda/torch_expect_builtin_promote/equal": (
    "bool",
    "torch.equal returns a Python bool, whose dtype torch's test does not check; "
    "jnp.array_equal returns a bool array",
  ),
  "cuda/torch_fp16/addr": (
    "float32",
    "jnp.outer is an elementwise product (no dot_general), so it runs in its "
    "inputs' dtype; torch's addr is one float16 kernel",
  ),
  "cuda/torch_fp16/lstm_cell": (
    "float32",
    "torch's lstm_cell casts every input, the cell state cx too, to float16; in "
    "JAX the float32 cell state enters elementwise ops after the gates' dots, "
    "which promote natively (the gates themselves run in float16)",
  ),
  "cuda/torch_fp16/gru_cell": (
    "float32",
    "torch's gru_cell casts the hidden state hx to float16; in JAX the float32 "
    "state enters the gate interpolation after the dots, which promotes natively",
  ),
  "cuda/torch_fp32/pow#2": (
    "values",
    "the Python constant 1.7 is traced as float16 (1.7002) next to the float16 "
    "input; torch's control uses the float32 constant",
  ),
  "cuda/torch_fp32/log10": (
    "values",
    "jnp.log10 multiplies by 1/ln(10) rounded to float16 when traced (0.43433 for "
    "0.43429), next to the float16 input",
  ),
  "cuda/torch_need_autocast_promote/addcdiv": (
    "values",
    "JAX has no fused addcdiv: a / b runs in float16 before the float32 add, "
    "where torch casts all three inputs to float32 first",
  ),
  "cuda/torch_need_autocast_promote/addcmul": (
    "values",
    "JAX has no fused addcmul: a * b runs in float16 before the float32 add, "
    "where torch casts all three inputs to float32 first",
  ),
  "cuda/torch_need_autocast_promote/index_put#2": (
    "float16",
    "x.at[i].set(v) casts v to x's dtype when traced (JAX semantics; JAX warns "
    "it will raise one day), so a float16 x cannot promote to v's float32",
  ),
  "cuda/torch_need_autocast_promote/scatter_add#2": (
    "float16",
    "x.at[i].add(v) casts v to x's dtype when traced (JAX semantics), so a "
    "float16 x cannot promote to v's float32",
  ),
}


# torch's own results that are less precise than their dtype: "device/list/id" -> (relative
# tolerance of the live comparison, why).
LIVE_TOLERANCES: dict[str, tuple[float, str]] = {
  "cpu/torch_16/conv_transpose3d": (
    1e-2,
    "torch's CPU float16 conv_transpose3d accumulates in float16 (0.92 off the exact "
    "result where rounding it to float16 is 0.06 off); XLA accumulates in float32",
  ),
}


def spelling(device: str, key: str) -> Spelling:
  list_name, entry_id = key.split("/", 1)
  return PORT[device][list_name][entry_id]


@functools.cache
def recorded(device: str) -> dict[str, dict]:
  """The golden file's entries of ``device``: "list/id" -> record."""
  return {
    f"{list_name}/{entry['id']}": entry
    for list_name, entries in RECORDED["lists"][device].items()
    for entry in entries
  }


def ported(device: str) -> list[str]:
  return [
    f"{list_name}/{entry_id}" for list_name, entries in PORT[device].items() for entry_id in entries
  ]


# --- running -----------------------------------------------------------------------------------

_LOW = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
CUDA_MODE = "float16"


def modes(device: str) -> tuple[str, ...]:
  return (CUDA_MODE,) if device == "cuda" else CPU_MODES


@functools.cache
def inputs(device: str, key: str, mode: str) -> tuple[jax.Array, ...]:
  """The entry's tensors, drawn from a generator seeded by the entry's name."""
  _, specs = spelling(device, key)
  rng = np.random.default_rng(zlib.crc32(f"{device}/{key}".encode()))
  return tuple(jnp.asarray(random_values(s, rng), JAX_DTYPES[dtype_name(s, mode)]) for s in specs)


@functools.cache
def autocast_outputs(device: str, key: str, mode: str) -> tuple[np.ndarray, ...]:
  """The spelling under ``jax.jit(jaxamp.autocast(..., device_type=device, dtype=mode))``."""
  fn, _ = spelling(device, key)
  run = jax.jit(jaxamp.autocast(fn, device_type=device, dtype=_LOW[mode]))
  return flat(run(*inputs(device, key, mode)))


def run_as(expected: str) -> str:
  """The dtype torch's test casts the control's inputs to (float32 for bool results)."""
  return expected if expected in FLOATS else "float32"


@functools.cache
def control_outputs(device: str, key: str, mode: str, dtype: str) -> tuple[np.ndarray, ...]:
  """The spelling without autocast, its floating inputs cast to ``dtype`` (torch's control)."""
  fn, _ = spelling(device, key)
  cast = [
    x.astype(JAX_DTYPES[dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x
    for x in inputs(device, key, mode)
  ]
  return flat(jax.jit(fn)(*cast))


# The category each CUDA list checks (test_cuda.py): a dtype, "widest" (the widest floating input
# dtype), "out_type" (each entry's own) or "raises".
CUDA_CATEGORIES = {
  "torch_expect_builtin_promote": "out_type",
  "methods_expect_builtin_promote": "out_type",
  "torch_fp16": "float16",
  "torch_fp32": "float32",
  "torch_need_autocast_promote": "widest",
  "nn_fp16": "float16",
  "nn_fp32": "float32",
  "linalg_fp16": "float16",
  "methods_fp16": "float16",
  "methods_fp32": "float32",
  "banned": "raises",
}


def cuda_category_dtype(key: str) -> str:
  """The dtype the entry's CUDA list asks for, by the list's category."""
  list_name = key.split("/", 1)[0]
  category = CUDA_CATEGORIES[list_name]
  if category == "out_type":
    return recorded("cuda")[key]["expect"][CUDA_MODE]
  if category == "widest":
    _, specs = spelling("cuda", key)
    return max((s.dtype for s in specs if s.dtype in FLOATS), key=WIDTH.__getitem__)
  return category


def expected_dtype(device: str, key: str, torch_dtype: str) -> str:
  """torch's dtype, or jaxamp's listed divergence from it."""
  divergence = DIVERGENCES.get(f"{device}/{key}")
  if divergence is not None and divergence[0] != "values":
    return divergence[0]
  return torch_dtype


def tolerance(device: str, key: str, dtypes: list[str]) -> float:
  """Exact up to the output dtype's rounding; a 16-bit step's for listed divergences."""
  rtol = max(PRECISION.get(d, 0.0) for d in dtypes)
  if f"{device}/{key}" in DIVERGENCES:
    rtol = max(rtol, 2 * PRECISION["float16" if device == "cuda" else "bfloat16"])
  return rtol


def _params(device: str) -> list:
  golden = recorded(device)
  return [
    pytest.param(key, mode, id=f"{key}-{mode}")
    for key in ported(device)
    if key in golden
    for mode in modes(device)
  ]


def _list_and_mode(param) -> tuple[str, str]:
  """An entry's family for the fast subset: its list and the autocast dtype."""
  key, mode = param.values
  return key.split("/", 1)[0], mode


CUDA_PARAMS = first_of_each_family(_params("cuda"), _list_and_mode)
CUDA_VALUE_PARAMS = first_of_each_family(
  [param for param in _params("cuda") if cuda_category_dtype(param.values[0]) != "raises"],
  _list_and_mode,
)
CPU_PARAMS = first_of_each_family(_params("cpu"), _list_and_mode)


# --- every entry accounted for -----------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_entry_is_accounted_for(device):
  golden, port = recorded(device), ported(device)
  unaccounted = [
    key for key in golden if key not in port and f"{device}/{key}" not in NOT_APPLICABLE
  ]
  assert not unaccounted, "entries with neither a JAX spelling nor a NOT_APPLICABLE reason"
  assert not [key for key in port if key not in golden], "spellings of entries torch has not"
  assert not [key for key in port if f"{device}/{key}" in NOT_APPLICABLE]


def test_divergences_and_not_applicable_name_recorded_entries():
  keys = {f"{device}/{key}" for device in PORT for key in recorded(device)}
  assert set(DIVERGENCES) <= keys
  assert set(NOT_APPLICABLE) <= keys


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_spellings_take_the_entries_tensors(device):
  golden = recorded(device)
  for key in ported(device):
    _, specs = spelling(device, key)
    for mode in modes(device):
      spelled = [[dtype_name(s, mode), list(s.shape)] for s in specs]
      assert spelled == golden[key]["tensors"][mode], (key, mode)


@pytest.mark.slow  # compiles every entry
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_spellings_give_torchs_result_shapes(device):
  golden = recorded(device)
  for key in ported(device):
    mode = modes(device)[0]
    shapes = golden[key]["shapes"][mode]
    if not shapes:  # torch cannot run it on the CPU, or returns no tensor
      continue
    if golden[key]["expect"][mode] == "raises":
      outputs = control_outputs(device, key, mode, "float32")
    else:
      outputs = autocast_outputs(device, key, mode)
    assert [list(o.shape) for o in outputs] == shapes, key


def test_cuda_list_categories_are_what_torchs_test_expects():
  for key, entry in recorded("cuda").items():
    if key in ported("cuda"):
      assert cuda_category_dtype(key) == entry["expect"][CUDA_MODE], key


# --- CUDA lists (policy "cuda", float16) -------------------------------------------------------


@pytest.mark.parametrize("key, mode", CUDA_PARAMS)
@pytest.mark.slow_after_first
def test_cuda_entry_dtype_is_its_lists(key, mode):
  torch_dtype = cuda_category_dtype(key)
  if torch_dtype == "raises":
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
      autocast_outputs("cuda", key, mode)
    return
  outputs = autocast_outputs("cuda", key, mode)
  expected = expected_dtype("cuda", key, torch_dtype)
  assert dtype_names(outputs) == [expected] * len(outputs)


@pytest.mark.parametrize("key, mode", CUDA_VALUE_PARAMS)
@pytest.mark.slow_after_first
def test_cuda_entry_values_are_the_controls(key, mode):
  torch_dtype = cuda_category_dtype(key)
  outputs = autocast_outputs("cuda", key, mode)
  control = control_outputs("cuda", key, mode, run_as(torch_dtype))
  assert_close(outputs, control, tolerance("cuda", key, dtype_names(control)))


# --- CPU lists (policy "cpu", bfloat16 and float16) --------------------------------------------


def _torch_result(key: str, mode: str) -> list[str]:
  result = recorded("cpu")[key]["results"][mode]
  return result if isinstance(result, list) else [result]


@pytest.mark.parametrize("key, mode", CPU_PARAMS)
@pytest.mark.slow_after_first
def test_cpu_entry_dtype_is_torchs(key, mode):
  outputs = autocast_outputs("cpu", key, mode)
  expected = [expected_dtype("cpu", key, d) for d in _torch_result(key, mode)]
  assert dtype_names(outputs) == expected


@pytest.mark.parametrize("key, mode", CPU_PARAMS)
@pytest.mark.slow_after_first
def test_cpu_entry_values_are_the_controls(key, mode):
  torch_dtype = recorded("cpu")[key]["expect"][mode]
  outputs = autocast_outputs("cpu", key, mode)
  control = control_outputs("cpu", key, mode, run_as(torch_dtype))
  assert_close(outputs, control, tolerance("cpu", key, dtype_names(control)))


@functools.cache
def _recorder():
  return script_modules.load("record_torch_autocast_lists")


def _torch_inputs(key: str, mode: str) -> list:
  import torch

  _, specs = spelling("cpu", key)
  tensors = []
  for spec, x in zip(specs, inputs("cpu", key, mode), strict=True):
    dtype = getattr(torch, dtype_name(spec, mode))
    tensors.append(torch.from_numpy(np.asarray(x, np.float64)).to(dtype))
  return tensors


@pytest.mark.torch
@pytest.mark.parametrize("key, mode", CPU_PARAMS)
def test_cpu_entry_matches_torch_live(key, mode):
  module = _recorder()
  list_name, entry_id = key.split("/", 1)
  entry = next(
    e for e in module.entries() if (e.device, e.list_name, e.id) == ("cpu", list_name, entry_id)
  )
  torch_out = module.run(entry, mode, _torch_inputs(key, mode))
  torch_out = torch_out if isinstance(torch_out, tuple) else (torch_out,)
  outputs = autocast_outputs("cpu", key, mode)
  torch_dtypes = [module.result_dtype(t) for t in torch_out]
  assert dtype_names(outputs) == [expected_dtype("cpu", key, d) for d in torch_dtypes]
  expected = tuple(t.float().numpy() for t in torch_out)
  rtol = max(
    tolerance("cpu", key, torch_dtypes + dtype_names(outputs)),
    1e-4,
    LIVE_TOLERANCES.get(f"cpu/{key}", (0.0, ""))[0],
    _bfloat16_accumulation_tolerance(key, mode),
  )
  assert_close(outputs, expected, rtol)


def _bfloat16_accumulation_tolerance(key: str, mode: str) -> float:
  """Below AVX-512, torch's CPU bfloat16 conv_transpose3d accumulates in bfloat16 (values ~100
  off by up to 10.5, 0.06 of the largest, seen on an AVX2 AMD EPYC), as its float16 one does
  everywhere; the recorded golden, from an AVX-512 machine, is still compared at 2e-2."""
  import torch

  slow_path = torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX")
  return 0.1 if slow_path and mode == "bfloat16" and key == "torch_16/conv_transpose3d" else 0.0


@pytest.mark.torch
@pytest.mark.slow
def test_golden_file_records_the_installed_torchs_lists():
  module = _recorder()
  for device, lists in module.torch_lists().items():
    assert set(vars(lists)) == set(RECORDED["lists"][device]), "a list torch added or removed"
  golden = module.record()
  assert golden["lists"] == RECORDED["lists"], "run python scripts/record_torch_autocast_lists.py"
