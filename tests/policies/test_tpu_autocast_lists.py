"""PyTorch/XLA's TPU autocast test lists, ported: every entry runs its JAX spelling under "tpu".

torch_xla tests its XLA autocast (``torch_xla/csrc/autocast_mode.cpp``, realised by
``jaxamp/_src/policies/tpu.py``) with ``AutocastTPUTestLists`` in ``test/test_autocast.py`` (read at
pytorch/xla commit 41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf). Each entry is an op and its tensors;
each list expects one dtype of the op's result under ``torch_xla.amp.autocast`` (bfloat16):

* ``torch_bf16``, ``nn_bf16``, ``methods_bf16``: bfloat16;
* ``torch_fp32``, ``nn_fp32``: float32 (``methods_fp32`` is empty);
* ``torch_need_autocast_promote``: the widest input dtype, float32;
* ``torch_expect_builtin_promote``, ``methods_expect_builtin_promote``: the entry's out type.

Here each entry has a JAX spelling: a function of the entry's tensors, in torch's order, written
as a user would (jnp, lax, jax.nn, jaxamp.functional), run as
``jax.jit(jaxamp.autocast(spelling, device_type="tpu"))``. Its result has the list's dtype, and its
values are the spelling's without autocast on its inputs cast to that dtype (torch's control run),
as ``_run_autocast_outofplace`` checks them.
"""

from __future__ import annotations

import functools
import operator
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_subset import first_of_each_family
from op_list_entries import (
  CONV,
  FLOATS,
  JAX_DTYPES,
  PRECISION,
  WIDTH,
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
  f32,
  flat,
  given,
  i32,
  i64,
  random_values,
  unreduced,
)

import jaxamp
from jaxamp import functional
from jaxamp._src.policies import policy

# --- inputs ------------------------------------------------------------------------------------


# --- JAX spellings -----------------------------------------------------------------------------


def _builtin_promote(prefix: str = "", suffix: str = "") -> dict[str, Spelling]:
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
  return {f"{prefix}{name}{suffix}": (op, (V, P16)) for name, op in ops.items()}


P16 = bf16(N)  # pointwise*_bf16
M16 = bf16(N, N)  # mat*_bf16
B3 = f32(N, N, N)  # the (n, n, n) float32 tensors of bmm, baddbmm and addbmm


# AutocastTPUTestLists: list -> op -> (JAX spelling, its tensor arguments).
TPU: dict[str, dict[str, Spelling]] = {
  "torch_expect_builtin_promote": _builtin_promote(),
  "methods_expect_builtin_promote": _builtin_promote("__", "__"),
  "torch_bf16": {
    "conv1d": (conv, CONV[1]),
    "conv2d": (conv, CONV[2]),
    "conv3d": (conv, CONV[3]),
    "bmm": (jnp.matmul, (B3, B3)),
    "mm": (operator.matmul, (M, M)),
    "matmul": (jnp.matmul, (M, M)),
    "baddbmm": (lambda c, x, y: c + x @ y, (B3, B3, B3)),
    "addmm": (lambda c, a, b: c + a @ b, (M, M, M)),
    "addbmm": (lambda c, x, y: c + jnp.einsum("bij,bjk->ik", x, y), (M, B3, B3)),
    "conv_tbc": (conv_tbc, (f32(10, 7, 3), f32(5, 3, 5), f32(5))),
    "conv_transpose1d": (conv_transpose, CONV[1]),
    "conv_transpose2d": (conv_transpose, CONV[2]),
    "conv_transpose3d": (conv_transpose, CONV[3]),
    "prelu": (functional.prelu, (V, f32(1))),
    # torch_xla's entry passes (pointwise0_fp32, element0_fp32), but torch.relu takes one
    # tensor (TestAutocastTPU runs neither torch_bf16 nor nn_bf16): relu of the first.
    "relu": (jax.nn.relu, (V,)),
  },
  "torch_fp32": {
    "cosine_embedding_loss": (
      unreduced(functional.cosine_embedding_loss),
      (given("bfloat16", [[1, 2, 3]]), given("bfloat16", [[1, 3, 4]]), given("int32", [1])),
    ),
    "hinge_embedding_loss": (unreduced(functional.hinge_embedding_loss), (M16, i32(N))),
    "margin_ranking_loss": (
      unreduced(functional.margin_ranking_loss),
      (M16, M16, bf16(N, kind="ones")),
    ),
    "triplet_margin_loss": (unreduced(functional.triplet_margin_loss), (M16, M16, M16)),
    "binary_cross_entropy_with_logits": (
      unreduced(functional.binary_cross_entropy_with_logits),
      (M16, bf16(N, N, kind="rand")),
    ),
  },
  "nn_bf16": {
    "linear": (lambda x, w: x @ w.T, (M, M)),
  },
  "nn_fp32": {
    "nll_loss": (unreduced(functional.nll_loss), (f32(N, N, kind="rand"), i64(N))),
    "nll_loss2d": (
      unreduced(functional.nll_loss),
      (bf16(N, N, N, N, kind="rand"), i64(N, N, N)),
    ),
    "l1_loss": (unreduced(functional.l1_loss), (M16, M16)),
    "smooth_l1_loss": (unreduced(functional.smooth_l1_loss), (M16, M16)),
    "mse_loss": (unreduced(functional.mse_loss), (M16, M16)),
    "multilabel_margin_loss": (
      unreduced(functional.multilabel_margin_loss),
      (M16, i64(N, N, kind="ones")),
    ),
    "soft_margin_loss": (unreduced(functional.soft_margin_loss), (M16, i64(N, N, kind="ones"))),
    "multi_margin_loss": (unreduced(functional.multi_margin_loss), (M16, i64(N, kind="ones"))),
  },
  "torch_need_autocast_promote": {
    "cat": (lambda a, b: jnp.concatenate([a, b]), (P16, V)),
    "stack": (lambda a, b: jnp.stack([a, b]), (P16, V)),
  },
  "methods_fp32": {},
  "methods_bf16": {
    "__matmul__": (operator.matmul, (M16, M)),
  },
}

# The dtype each list expects: a dtype, "widest" (the widest floating input's) or "out_type".
CATEGORIES = {
  "torch_expect_builtin_promote": "out_type",
  "methods_expect_builtin_promote": "out_type",
  "torch_bf16": "bfloat16",
  "torch_fp32": "float32",
  "nn_bf16": "bfloat16",
  "nn_fp32": "float32",
  "torch_need_autocast_promote": "widest",
  "methods_fp32": "float32",
  "methods_bf16": "bfloat16",
}

# The builtin-promote entries' out types, as torch_xla's lists give them.
OUT_TYPES = {
  "eq": "bool",
  "ge": "bool",
  "gt": "bool",
  "le": "bool",
  "lt": "bool",
  "ne": "bool",
  "add": "float32",
  "div": "float32",
  "mul": "float32",
}

KEYS = [f"{list_name}/{op}" for list_name, entries in TPU.items() for op in entries]
# The fast subset: the first entry of each list.
KEY_PARAMS = first_of_each_family(
  [pytest.param(key, id=key) for key in KEYS], lambda param: param.values[0].split("/", 1)[0]
)


def spelling(key: str) -> Spelling:
  list_name, op = key.split("/", 1)
  return TPU[list_name][op]


# Entries where jaxamp gives another dtype than the list: key -> (dtype, why).
DIVERGENCES: dict[str, tuple[str, str]] = {
  f"torch_bf16/{op}": (
    "float32",
    f"JAX has no fused {op}: its spelling adds an input of batch extent (varying over more "
    "than one operand's free dims) to the product, an addend like an attention mask, not a "
    "linear bias: it promotes as an unfused product + input does, where the fused kernel "
    "casts that input to the low dtype",
  )
  for op in ("addmm", "addbmm", "baddbmm")
}


def expected_dtype(key: str) -> str:
  if key in DIVERGENCES:
    return DIVERGENCES[key][0]
  list_name, op = key.split("/", 1)
  category = CATEGORIES[list_name]
  if category == "out_type":
    return OUT_TYPES[op.strip("_")]
  if category == "widest":
    _, specs = spelling(key)
    return max((s.dtype for s in specs if s.dtype in FLOATS), key=WIDTH.__getitem__)
  return category


@functools.cache
def inputs(key: str) -> tuple[jax.Array, ...]:
  """The entry's tensors, drawn from a generator seeded by the entry's name."""
  _, specs = spelling(key)
  rng = np.random.default_rng(zlib.crc32(f"tpu/{key}".encode()))
  return tuple(jnp.asarray(random_values(s, rng), JAX_DTYPES[s.dtype]) for s in specs)


def autocast_outputs(key: str, dtype=None) -> tuple[np.ndarray, ...]:
  fn, _ = spelling(key)
  return flat(jax.jit(jaxamp.autocast(fn, device_type="tpu", dtype=dtype))(*inputs(key)))


def control_outputs(key: str, dtype: str) -> tuple[np.ndarray, ...]:
  """The spelling without autocast, its floating inputs cast to ``dtype`` (torch's control)."""
  fn, _ = spelling(key)
  cast = [
    x.astype(JAX_DTYPES[dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs(key)
  ]
  return flat(jax.jit(fn)(*cast))


# --- the lists ---------------------------------------------------------------------------------


def test_every_list_of_torch_xlas_tpu_test_has_a_category_and_its_entries_spellings():
  assert set(TPU) == set(CATEGORIES)
  assert sum(len(entries) for entries in TPU.values()) == 50  # as AutocastTPUTestLists has


@pytest.mark.parametrize("key", KEY_PARAMS)
@pytest.mark.slow_after_first
def test_entry_dtype_is_its_lists(key):
  outputs = autocast_outputs(key)
  assert dtype_names(outputs) == [expected_dtype(key)] * len(outputs)


@pytest.mark.parametrize("key", KEY_PARAMS)
@pytest.mark.slow_after_first
def test_entry_values_are_the_controls(key):
  expected = "bfloat16" if key in DIVERGENCES else expected_dtype(key)  # the list's products
  control = control_outputs(key, expected if expected in FLOATS else "float32")
  rtol = max(PRECISION[d] for d in dtype_names(control))
  assert_close(autocast_outputs(key), control, rtol)


@pytest.mark.slow
def test_batch_norm_returns_float32_on_tpus():
  # torch_xla's TestOtherOps.test_batch_norm_tpu: BatchNorm2d of a bfloat16 input is float32.
  x = jax.random.normal(jax.random.key(0), (4, 32, 32, 16), jnp.bfloat16)  # NHWC
  layer = nn.BatchNorm(use_running_average=False)
  variables = layer.init(jax.random.key(1), x)
  run = jaxamp.autocast(lambda v, x: layer.apply(v, x, mutable=["batch_stats"]), device_type="tpu")
  out, _ = jax.jit(run)(variables, x)
  assert out.dtype == jnp.float32


# --- the "tpu" device type ----------------------------------------------------------------------


def test_tpu_autocast_is_available_and_bfloat16_by_default():
  assert jaxamp.is_autocast_available("tpu")
  assert "tpu" in policy.device_types()
  assert jaxamp.get_autocast_dtype("tpu") == jnp.bfloat16


@pytest.mark.slow
def test_tpu_takes_float16_with_the_same_lists():
  # torch_xla disables its TPU autocast for float16 (test_autocast_tpu_check_dtype); jaxamp runs
  # the same lists in float16, as it does on every device type.
  x = jnp.ones((4, 4), jnp.float32)
  run = jax.jit(
    jaxamp.autocast(
      lambda a, b: (a @ b, jax.nn.softmax(a @ b)), device_type="tpu", dtype=jnp.float16
    )
  )
  matmul, softmax = run(x, x)
  assert (matmul.dtype, softmax.dtype) == (jnp.float16, jnp.float32)
  assert dtype_names(autocast_outputs("torch_bf16/conv2d", jnp.float16)) == ["float16"]
  assert dtype_names(autocast_outputs("nn_fp32/mse_loss", jnp.float16)) == ["float32"]


def test_tpu_is_the_default_device_type_on_a_tpu_backend(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert policy.default_device_type() == "tpu"
  # softmax is on torch_xla's float32 list; CPU's softmax returns its input's bfloat16.
  x = jnp.ones((4, 4), jnp.float32)
  out = jaxamp.autocast(lambda a, b: jax.nn.softmax(a @ b))(x, x)
  assert out.dtype == jnp.float32


@pytest.mark.slow
def test_ops_torch_xla_leaves_unlisted_run_in_their_inputs_dtype():
  # exp, log and sum are on CUDA's float32 list, not torch_xla's; binary_cross_entropy, which
  # CUDA's autocast refuses, is on torch_xla's float32 list.
  x = jax.random.uniform(jax.random.key(0), (4, 4), jnp.float32, 0.1, 0.9)
  run = jax.jit(
    jaxamp.autocast(
      lambda a, b: (
        jnp.exp(a @ b),
        jnp.log(a @ b),
        jnp.sum(a @ b),
        functional.binary_cross_entropy(jax.nn.sigmoid(a @ b), b),
      ),
      device_type="tpu",
    )
  )
  assert [o.dtype for o in run(x, x)] == [jnp.bfloat16] * 3 + [jnp.float32]
