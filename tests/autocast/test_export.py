"""An autocast model exported with ``jax.export`` carries the policy's dtypes into its StableHLO.

CUDA-targeted StableHLO is produced on this CPU-only machine: dots in float16, softmax
and layer-norm math (exponential, sums, rsqrt) in float32. The "cpu" policy exported for CPU has
bfloat16 dots, and its softmax runs in the dtype of its input.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

TENSOR_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*(\w+)>")


class MLP(nn.Module):
  """Dense -> LayerNorm -> relu -> Dense -> softmax."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.LayerNorm()(nn.Dense(32)(x)))
    return jax.nn.softmax(nn.Dense(10)(h), axis=-1)


MODEL = MLP()
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16), np.float32))


@functools.cache
def exported(device_type, platform):
  variables = jax.eval_shape(MODEL.init, jax.random.key(0), X)
  fun = jax.jit(jaxamp.autocast(MODEL.apply, device_type=device_type))
  return jax.export.export(fun, platforms=[platform])(variables, X)


@functools.cache
def stablehlo(device_type, platform):
  return exported(device_type, platform).mlir_module()


def ops(text, op):
  """(line, element types of its signature) for each ``stablehlo.<op>`` in ``text``.

  ``%2 = stablehlo.dot_general %0, %1, ... : (tensor<4x16xf16>, tensor<16x32xf16>) ->
  tensor<4x32xf16> loc(#loc12)`` gives ``["f16", "f16", "f16"]``; an elementwise op prints one
  type, ``%5 = stablehlo.exponential %4 : tensor<4x10xf32>`` gives ``["f32"]``.
  """
  found = []
  for line in text.splitlines():
    if re.search(rf"= stablehlo\.{op}\b", line):
      found.append((line, TENSOR_TYPE.findall(line.rsplit(" : ", 1)[1])))
  return found


def element_types(text, op):
  return [types for _, types in ops(text, op)]


def location(text, line):
  """The name of the location an op line refers to (``loc(#loc12)`` -> its ``#loc12 = ...``)."""
  ref = re.search(r"loc\((#loc\d+)\)\s*$", line)
  if ref is None:
    return ""
  definition = re.search(rf"^{ref.group(1)} = loc\((.*)\)$", text, re.MULTILINE)
  return definition.group(1) if definition else ""


def sums(text, scope=""):
  """The element types of every adding ``stablehlo.reduce`` whose location names ``scope``."""
  return [
    types
    for line, types in ops(text, "reduce")
    if "applies stablehlo.add" in line and scope in location(text, line)
  ]


# --- the "cuda" policy, exported for CUDA ---------------------------------------------------------


def test_cuda_export_runs_dots_in_float16():
  dots = element_types(stablehlo("cuda", "cuda"), "dot_general")
  assert len(dots) == 2
  assert all(types == ["f16", "f16", "f16"] for types in dots), dots


def test_cuda_export_runs_the_softmax_exponential_in_float32():
  exps = element_types(stablehlo("cuda", "cuda"), "exponential")
  assert exps
  assert all(types == ["f32"] for types in exps), exps


def test_cuda_export_runs_softmax_and_layer_norm_sums_in_float32():
  found = sums(stablehlo("cuda", "cuda"))
  assert len(found) == 3  # layer norm: mean and mean of squares; softmax: the normaliser
  assert all(set(types) == {"f32"} for types in found), found


def test_cuda_export_runs_the_layer_norm_rsqrt_in_float32():
  rsqrts = element_types(stablehlo("cuda", "cuda"), "rsqrt")
  assert rsqrts
  assert all(types == ["f32"] for types in rsqrts), rsqrts


def test_cuda_export_returns_float32_probabilities():
  (out,) = exported("cuda", "cuda").out_avals
  assert out.dtype == jnp.float32  # softmax is on CUDA's float32 list


def test_cuda_export_targets_cuda():
  assert exported("cuda", "cuda").platforms == ("cuda",)


# --- the "cpu" policy, exported for CPU ---------------------------------------------------------


def test_cpu_export_runs_dots_in_bfloat16():
  dots = element_types(stablehlo("cpu", "cpu"), "dot_general")
  assert len(dots) == 2
  assert all(types == ["bf16", "bf16", "bf16"] for types in dots), dots


def test_cpu_export_runs_the_softmax_in_float32_like_torchs_cpu_kernel():
  exps = element_types(stablehlo("cpu", "cpu"), "exponential")
  assert exps
  assert all(types == ["f32"] for types in exps), exps  # unlisted, float32 accumulation


def test_cpu_export_accumulates_layer_norm_statistics_in_float32():
  found = sums(stablehlo("cpu", "cpu"), scope="LayerNorm")
  assert len(found) == 2  # mean and mean of squares
  assert all(set(types) == {"f32"} for types in found), found


@pytest.mark.slow
def test_cpu_export_runs_and_is_close_to_float32():
  variables = jax.jit(MODEL.init)(jax.random.key(0), X)
  out = exported("cpu", "cpu").call(variables, X)
  assert out.dtype == jnp.bfloat16  # the softmax of bfloat16 logits (unlisted on CPU)
  expected = jax.jit(MODEL.apply)(variables, X)
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-2)
