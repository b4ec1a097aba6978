"""A ``dot_general`` that sums over no index is told apart by the torch op it spells.

torch's einsum is on the CUDA, XPU and XLA lower-precision lists whatever it sums; on CPU it is
unlisted, and its composite computes a product summing nothing with ``mul`` (its inputs' dtypes,
the widest winning). A ``jnp.tensordot(a, b, 0)`` is torch's tensordot, which reshapes into
``mm`` (CPU: lower precision) and is on the CUDA promote list; a bare ``lax.dot_general`` is a
matmul.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

import jaxamp

_A = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
A = jnp.asarray(_A)
U, V = A[0], A[1]

NO_SUM_EINSUMS = {
  "outer": (lambda u, v: jnp.einsum("i,j->ij", u, v), "i,j->ij"),
  "hadamard": (lambda u, v: jnp.einsum("i,i->i", u, v), "i,i->i"),
  "head_mask": (lambda u, v: jnp.einsum("qk,k->qk", jnp.outer(u, v), v), None),
}


@pytest.mark.parametrize("name", sorted(NO_SUM_EINSUMS))
@pytest.mark.parametrize("device_type", ["cuda", "xpu", "tpu"])
def test_an_einsum_summing_over_no_index_is_lower_precision_where_torch_lists_einsum(
  name, device_type
):
  fun = NO_SUM_EINSUMS[name][0]
  out = jax.jit(jaxamp.autocast(fun, device_type=device_type))(U, V)
  assert out.dtype == jaxamp.get_autocast_dtype(device_type)


@pytest.mark.parametrize("name", ["outer", "hadamard"])
def test_an_einsum_summing_over_no_index_is_torchs_mul_on_cpu(name):
  fun, spec = NO_SUM_EINSUMS[name]
  out = jaxamp.autocast(fun, device_type="cpu")(U, V)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    expected = torch.einsum(spec, torch.from_numpy(_A[0]), torch.from_numpy(_A[1]))
  assert expected.dtype == torch.float32 and out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected.numpy(), rtol=1e-6)


def test_a_tensordot_summing_over_no_index_is_torchs_mm_on_cpu():
  out = jaxamp.autocast(lambda a: jnp.tensordot(a, a, 0), device_type="cpu")(A)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    expected = torch.tensordot(torch.from_numpy(_A), torch.from_numpy(_A), 0)
  assert expected.dtype == torch.bfloat16 and out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out, np.float32), expected.float().numpy(), rtol=1e-2, atol=1e-2
  )


def test_a_tensordot_summing_over_no_index_promotes_under_cuda():
  out = jaxamp.autocast(lambda a: jnp.tensordot(a, a, 0), device_type="cuda")(A)
  assert out.dtype == jnp.float32


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_bare_dot_general_summing_over_no_index_is_a_matmul(device_type):
  dot = lambda a, b: lax.dot_general(a, b, (((), ()), ((), ())))
  out = jaxamp.autocast(dot, device_type=device_type)(A, A)
  assert out.dtype == jaxamp.get_autocast_dtype(device_type)
