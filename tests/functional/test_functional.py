"""``jaxamp.functional`` against torch.nn.functional, in float32 and without autocast.

The cases are the ``functional`` cases of ``tests/torch_autocast_cases.py`` (recorded in
``tests/goldens/torch_cpu_autocast.json``): their torch expression, evaluated with ``F`` and
``torch`` bound to ``jaxamp.functional``, is the JAX counterpart. The stored float32 results check
values without torch; when torch is installed the same cases are also compared live, gradients
included.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch_goldens

from jaxamp import functional
from jaxamp._src.autocast import regions

CASES = {name: c for name, c in torch_goldens.CASES.items() if c["functional"]}
NAMES = sorted(CASES)

# ``F`` and ``torch`` in the stored expressions, seen from JAX.
JAX_TORCH = types.SimpleNamespace(
  **{name: getattr(functional, name) for name in functional.__all__},
  float32=jnp.float32,
  float16=jnp.float16,
  bfloat16=jnp.bfloat16,
)
_JAX_DTYPES = {
  "float32": jnp.float32,
  "float64": jnp.float64,
  "int64": jnp.int32,
  "bool": jnp.bool_,
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
}

# Region name of every public function (the torch op it realises).
REGION_NAMES = {name: name for name in functional.__all__}


def jax_inputs(case: dict, low: str = "float32") -> dict[str, jax.Array]:
  """A case's stored inputs as JAX arrays; ``"low"`` inputs get dtype ``low``."""
  out = {}
  for name, spec in case["inputs"].items():
    dtype = low if spec["dtype"] == "low" else spec["dtype"]
    values = np.asarray(spec["values"]).reshape(spec["shape"])
    out[name] = jnp.asarray(values, _JAX_DTYPES[dtype])
  return out


def run_jax(case: dict, inputs: dict[str, jax.Array]) -> jax.Array:
  return eval(case["expr"], {"F": JAX_TORCH, "torch": JAX_TORCH}, dict(inputs))  # noqa: S307


@functools.cache
def jax_output(name: str, low: str = "float32") -> jax.Array:
  """The jitted JAX counterpart of case ``name`` on its inputs ("low" inputs as ``low``)."""
  case = CASES[name]
  return jax.jit(lambda kw: run_jax(case, kw))(jax_inputs(case, low))


@functools.cache
def jax_output_and_grad(name: str) -> tuple[jax.Array, jax.Array]:
  """Float32 output of case ``name`` and the gradient of its sum wrt its first float input."""
  case = CASES[name]
  wrt = _first_float_input(case)

  def output_and_grad(x, rest):
    out, vjp = jax.vjp(lambda x: run_jax(case, {**rest, wrt: x}), x)
    return out, vjp(jnp.ones_like(out))[0]

  inputs = jax_inputs(case)
  return jax.jit(output_and_grad)(inputs.pop(wrt), inputs)


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-5) -> None:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * scale)


def _first_float_input(case: dict) -> str:
  return next(n for n, s in case["inputs"].items() if s["dtype"] in ("low", "float32"))


# --- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow_after_first
def test_matches_golden_float32(name):
  case = CASES[name]
  expected = case["results"]["none"]
  out, _ = jax_output_and_grad(name)
  assert out.dtype == jnp.float32
  assert list(out.shape) == expected["shape"]
  assert_close(out, np.reshape(expected["values"], expected["shape"]))


@pytest.mark.parametrize("name", NAMES)
def test_matches_torch_float32(name):
  module = torch_goldens.recorder()
  case = CASES[name]
  torch_out = module.run_case(case["expr"], module.torch_inputs(case["inputs"], "none"), "none")
  out, _ = jax_output_and_grad(name)
  assert list(out.shape) == list(torch_out.shape)
  assert_close(out, torch_out.double().numpy())


@pytest.mark.parametrize("name", NAMES)
def test_gradient_matches_torch(name):
  module = torch_goldens.recorder()
  case = CASES[name]
  wrt = _first_float_input(case)
  inputs = module.torch_inputs(case["inputs"], "none")
  inputs[wrt] = inputs[wrt].clone().requires_grad_(True)
  module.run_case(case["expr"], inputs, "none").sum().backward()
  expected = inputs[wrt].grad.double().numpy()
  _, grad = jax_output_and_grad(name)
  assert_close(grad, expected, rtol=1e-4, atol=1e-5)


# --- dtypes ------------------------------------------------------------------------------------

# One case per function whose float inputs are all 16-bit and that torch runs in bfloat16.
_LOW_ONLY = sorted(
  {
    CASES[n]["expr"].split("(")[0]: n
    for n in reversed(NAMES)
    if all(s["dtype"] != "float32" for s in CASES[n]["inputs"].values())
    and "dtype=" not in CASES[n]["expr"]
    and "error" not in CASES[n]["results"]["bfloat16"]
  }.values()
)


@pytest.mark.parametrize("name", _LOW_ONLY)
@pytest.mark.slow_after_first
def test_bfloat16_inputs_give_bfloat16_output(name):
  case = CASES[name]
  out = jax_output(name, "bfloat16")
  assert out.dtype == jnp.bfloat16
  expected = case["results"]["none"]
  assert_close(out, np.reshape(expected["values"], expected["shape"]), rtol=3e-2, atol=3e-2)


def test_explicit_dtype_overrides_input_dtype():
  x = jnp.ones((2, 3), jnp.bfloat16)
  assert functional.softmax(x, dim=1, dtype=jnp.float32).dtype == jnp.float32


def test_mixed_input_dtypes_promote():
  x = jnp.ones((2, 3), jnp.bfloat16)
  assert functional.mse_loss(x, jnp.zeros((2, 3), jnp.float32)).dtype == jnp.float32


# --- regions and errors ------------------------------------------------------------------------


def _example_args(name: str) -> tuple:
  x = jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6)
  t = jnp.array([0, 2, 1, 5])
  sign = jnp.array([1.0, -1.0, 1.0, -1.0])
  special = {
    "cross_entropy": (x, t),
    "bilinear": (x, x, jnp.ones((3, 6, 6))),
    "nll_loss": (x, t),
    "multi_margin_loss": (x, t),
    "multilabel_margin_loss": (x, jnp.array([[0, 1, -1, 0, 0, 0]] * 4)),
    "cosine_embedding_loss": (x, x + 1, sign),
    "hinge_embedding_loss": (x[:, 0], sign),
    "margin_ranking_loss": (x[:, 0], x[:, 1], sign),
    "triplet_margin_loss": (x, x + 1, x - 1),
    "layer_norm": (x, (6,)),
    "group_norm": (x.reshape(2, 4, 3), 2),
    "prelu": (x, jnp.array([0.25])),
    "renorm": (x, 2, 0, 1.0),
    "softmax": (x, 1),
    "log_softmax": (x, 1),
    "softmin": (x, 1),
    "binary_cross_entropy": (jax.nn.sigmoid(x), jnp.zeros_like(x)),
  }
  if name in special:
    return special[name]
  if name in ("cdist", "cosine_similarity", "dist", "kl_div", "poisson_nll_loss"):
    return (x, x * 0.5)
  if name in ("pdist", "normalize", "norm", "softplus"):
    return (x,)
  return (x, x * 0.5)


@pytest.mark.parametrize("name", sorted(REGION_NAMES))
def test_is_registered_op_region(name):
  fn = getattr(functional, name)
  jaxpr = jax.make_jaxpr(fn, static_argnums=_static_argnums(name))(*_example_args(name))
  assert jaxpr.jaxpr.eqns
  for eqn in jaxpr.jaxpr.eqns:
    ops = regions.marks_of(eqn).ops  # enclosing op regions, outermost first
    assert ops and ops[0].name == REGION_NAMES[name], eqn


def _static_argnums(name: str) -> tuple[int, ...]:
  return {
    "layer_norm": (1,),
    "group_norm": (1,),
    "renorm": (1, 2, 3),
    "softmax": (1,),
    "log_softmax": (1,),
    "softmin": (1,),
  }.get(name, ())


@pytest.mark.parametrize(
  "fn",
  [functional.mse_loss, functional.l1_loss, functional.smooth_l1_loss, functional.soft_margin_loss],
)
@pytest.mark.slow_after_first
def test_invalid_reduction_raises(fn):
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="reduction"):
    fn(x, x, reduction="average")


@pytest.mark.slow
def test_kl_div_accepts_batchmean():
  x = jnp.log(jnp.full((2, 4), 0.25))
  assert functional.kl_div(x, jnp.full((2, 4), 0.25), reduction="batchmean") == 0


def test_softmax_without_dim_warns():
  with pytest.warns(UserWarning, match="Implicit dimension"):
    functional.softmax(jnp.ones((2, 3)))


def test_pdist_rejects_non_matrix():
  with pytest.raises(ValueError, match="2-D"):
    functional.pdist(jnp.ones((2, 3, 4)))


@pytest.mark.slow
def test_cross_entropy_all_ignored_is_nan():
  x = jnp.zeros((2, 3))
  out = functional.cross_entropy(x, jnp.array([-100, -100]))
  assert jnp.isnan(out)


@pytest.mark.slow
def test_pdist_gradient_is_finite_for_equal_rows():
  x = jnp.ones((3, 2))
  assert jnp.all(jnp.isfinite(jax.grad(lambda x: functional.pdist(x).sum())(x)))
