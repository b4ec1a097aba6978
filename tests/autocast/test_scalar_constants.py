"""A 16-bit value combined with a Python scalar gives torch's answer.

torch's kernels compute ``half_tensor * scalar`` in float32 ("opmath") and round the result to
the tensor's dtype: the product is right where it fits and an infinity where it overflows. A
scalar that fits the 16-bit dtype gives the same answer computed in 16 bits (no converts added);
one that does not (``x * 1e5`` in float16, ``x * 1e-8`` flushed to zero) makes the op compute in
float32 and round. Fills (``jnp.where(m, x, finfo.min)``) still saturate: the value is used as
it is.

The goldens (``tests/goldens/torch_scalar_opmath.json``, recorded by
``scripts/record_scalar_opmath_goldens.py``) hold the opmath answer of every case (torch's CUDA
kernels') and what torch's CPU kernel returns; the CPU kernels of ``*`` and ``/`` compute in
opmath too and are compared as well. With torch installed each case is also run live.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import script_modules
from fast_subset import first_of_each_family
from paths import GOLDENS

import jaxamp

GOLDEN = GOLDENS / "torch_scalar_opmath.json"
CASES = json.loads(GOLDEN.read_text())["cases"]
IDS = [f"{c['op']}-{c['dtype']}-{c['scalar']:g}" for c in CASES]
# The fast subset: the first scalar of each op and dtype.
cases = pytest.mark.parametrize(
  "case",
  first_of_each_family(
    [pytest.param(c, id=i) for c, i in zip(CASES, IDS, strict=True)],
    lambda param: (param.values[0]["op"], param.values[0]["dtype"]),
  ),
)
CPU_OPMATH = [c for c in CASES if c["op"] in ("mul", "div")]
cpu_opmath_cases = pytest.mark.parametrize(
  "case", CPU_OPMATH, ids=[f"{c['op']}-{c['dtype']}-{c['scalar']:g}" for c in CPU_OPMATH]
)

OPS = {
  "mul": lambda x, s: x * s,
  "div": lambda x, s: x / s,
  "rdiv": lambda x, s: s / x,
  "add": lambda x, s: x + s,
  "sub": lambda x, s: x - s,
  "rsub": lambda x, s: s - x,
  "pow": lambda x, s: x**s,
  "clamp": lambda x, s: jnp.clip(x, -s, s),
  "maximum": lambda x, s: jnp.maximum(x, -s),
  "lt": lambda x, s: x < s,
}


def autocast_answer(case) -> jax.Array:
  """``op(x, scalar)`` for a 16-bit ``x`` made by autocast (an exact matmul with the identity),
  under the CPU policy with the case's dtype, whose lists leave every op here in its input
  dtype."""
  op, scalar = OPS[case["op"]], case["scalar"]
  x = jnp.asarray(case["inputs"], jnp.float32)
  fun = jaxamp.autocast(
    lambda x, eye: op(x @ eye, scalar), device_type="cpu", dtype=jnp.dtype(case["dtype"])
  )
  return jax.jit(fun)(x[None], jnp.eye(len(x)))[0]


def assert_same(out: jax.Array, expected: dict, exact: bool) -> None:
  """Equal, infinities and NaN included; within one rounding where ``exact`` is False (a
  scalar that fits computes in 16 bits, opmath in float32 and rounds: 1 ulp apart at most).
  float32 subnormals count as zero: XLA:CPU flushes them."""
  assert str(out.dtype) == expected["dtype"]
  actual, desired = np.asarray(out, np.float64), np.asarray(expected["values"], np.float64)
  tiny = float(jnp.finfo(jnp.float32).tiny)
  actual, desired = (np.where(np.abs(v) < tiny, 0.0, v) for v in (actual, desired))
  if exact or expected["dtype"] == "bool":
    np.testing.assert_array_equal(actual, desired)
  else:
    np.testing.assert_allclose(actual, desired, rtol=float(jnp.finfo(out.dtype).eps))


@cases
@pytest.mark.slow
def test_a_scalar_op_on_a_16_bit_value_gives_the_opmath_answer(case):
  assert_same(autocast_answer(case), case["opmath"], exact=not case["fits"])


@cpu_opmath_cases
@pytest.mark.slow_after_first
def test_a_product_or_quotient_with_a_scalar_gives_torch_cpus_answer(case):
  assert_same(autocast_answer(case), case["torch_cpu"], exact=not case["fits"])


@pytest.mark.torch
@cases
@pytest.mark.slow_after_first
def test_a_scalar_op_on_a_16_bit_value_matches_torch_live(case):
  pytest.importorskip("torch")
  recorder = script_modules.load("record_scalar_opmath_goldens")
  torch = recorder.torch
  x = torch.tensor(case["inputs"], dtype=torch.float32).to(getattr(torch, case["dtype"]))
  out = autocast_answer(case)
  assert_same(out, recorder.encode(recorder.opmath(case["expr"], x, case["scalar"])), False)
  if case["op"] in recorder.CPU_OPMATH:
    expected = recorder.encode(recorder.torch_cpu(case["expr"], x, case["scalar"]))
    assert_same(out, expected, exact=not case["fits"])


def test_the_issue_example_overflows_where_torch_does():
  x, w = jnp.array([[1e-3, 0.5, 0.7, 2.0]]), jnp.eye(4)
  out = jaxamp.autocast(lambda x, w: (x @ w) * 1e5, device_type="cuda")(x, w)
  assert out.dtype == jnp.float16
  assert np.isinf(np.asarray(out[0, 2:])).all()  # torch: [100.06, 49984, inf, inf]
  np.testing.assert_allclose(np.asarray(out[0, :2], np.float32), [100.06, 49984], rtol=1e-3)


def converts(fun, *args) -> int:
  jaxpr = jax.make_jaxpr(fun)(*args)
  return sum(e.primitive.name == "convert_element_type" for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("scalar", [0.5, 3.0, -1.5, 1e4])
def test_a_scalar_that_fits_adds_no_converts(scalar):
  x, w = jnp.ones((2, 4)), jnp.eye(4)
  plain = jaxamp.autocast(lambda x, w: x @ w, device_type="cuda")
  scaled = jaxamp.autocast(lambda x, w: (x @ w) * scalar + scalar, device_type="cuda")
  assert converts(scaled, x, w) == converts(plain, x, w)


def test_a_scalar_that_does_not_fit_computes_in_float32_and_rounds():
  x, w = jnp.ones((2, 4)), jnp.eye(4)
  jaxpr = jax.make_jaxpr(jaxamp.autocast(lambda x, w: (x @ w) * 1e5, device_type="cuda"))(x, w)
  mul = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul")
  assert mul.outvars[0].aval.dtype == jnp.float32
  assert jaxpr.out_avals[0].dtype == jnp.float16


@pytest.mark.slow
def test_a_clip_bound_that_does_not_fit_does_not_clip_an_infinity():
  # torch: clamp(x, -1e5, 1e5) computed in float32 leaves inf at 1e5, which rounds to inf.
  fun = jaxamp.autocast(lambda x, w: jnp.clip((x @ w) * 2, -1e5, 1e5), device_type="cuda")
  out = fun(jnp.array([[6e4, 0.5]]), jnp.eye(2))  # 1.2e5 overflows float16
  assert out.dtype == jnp.float16
  assert np.isposinf(np.asarray(out[0, 0])) and float(out[0, 1]) == 1.0


@pytest.mark.slow
def test_a_comparison_with_a_scalar_that_does_not_fit_is_exact():
  fun = jaxamp.autocast(lambda x, w: (x @ w) < 1e5, device_type="cuda")
  assert bool(fun(jnp.array([[65504.0]]), jnp.eye(1)).all())  # 65504 < 1e5, as in torch


def test_a_fill_that_does_not_fit_still_saturates():
  fun = jaxamp.autocast(
    lambda x, w: jnp.where(x @ w > 0, x @ w, jnp.finfo(jnp.float32).min), device_type="cuda"
  )
  out = fun(jnp.array([[-1.0, 2.0]]), jnp.eye(2))
  assert out.dtype == jnp.float16
  assert float(out[0, 0]) == float(jnp.finfo(jnp.float16).min)
