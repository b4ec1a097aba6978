"""jaxamp.precision_report: the error each primitive of an autocast function introduces, and the
error accumulated up to it, against the float32 program, inside sub-jaxprs too."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from report_models import deep_model

import jaxamp

F16_ROUNDING = 2.0**-11  # float16's unit roundoff: the largest relative error of one rounding
BF16_ROUNDING = 2.0**-8
# Drawn by numpy: the reports' claims hold for these values whichever bits jax.random draws.
_RNG = np.random.default_rng(0)
X = jnp.asarray(_RNG.standard_normal((4, 8)), jnp.float32)
W = jnp.asarray(_RNG.standard_normal((8, 8)) / 3, jnp.float32)
LAYERS = jnp.asarray(_RNG.standard_normal((3, 8, 8)) / 3, jnp.float32)


def entries(report, primitive, path=None):
  return [
    e for e in report.entries if e.primitive == primitive and (path is None or e.path == path)
  ]


def test_a_function_autocast_leaves_in_float32_has_no_error():
  # exp and sum run in float32 under "cuda"; mul runs in its inputs' float32.
  report = jaxamp.precision_report(lambda x: jnp.sum(jnp.exp(x) * 2.0), device_type="cuda")(X)
  assert report.entries and {e.compute_dtype for e in report.entries} == {"float32"}
  assert all(e.local_error == 0.0 and e.accumulated_error == 0.0 for e in report.entries)


def test_a_float16_dot_loses_a_float16_rounding_and_names_its_torch_op():
  report = jaxamp.precision_report(lambda x, w: x @ w, device_type="cuda")(X, W)
  (dot,) = report.entries
  assert dot.primitive == "dot_general" and dot.rule == "lower"
  assert dot.compute_dtype == "float16" and {"matmul", "mm"} <= set(dot.torch_ops)
  assert 0 < dot.local_error <= F16_ROUNDING  # the output's rounding: the inputs are the same
  assert 0 < dot.accumulated_error <= 4 * F16_ROUNDING  # and the casts of the inputs
  assert dot.source.startswith(__file__ + ":") and dot.count == 1
  assert dot.max_abs == pytest.approx(float(jnp.max(jnp.abs(X @ W))), rel=1e-2)


def chain(x, w):
  h = jnp.sin(x @ w)
  h = jnp.sin(h @ w)
  return jnp.tanh(h @ w)


def test_errors_accumulate_along_a_chain():
  report = jaxamp.precision_report(chain, device_type="cpu")(X, W)
  (first, *_) = [e for e in report.entries if e.primitive == "dot_general"]
  (last,) = entries(report, "tanh")
  assert last.accumulated_error >= last.local_error
  assert last.accumulated_error > max(e.local_error for e in entries(report, "dot_general"))


def test_the_accumulated_error_of_the_output_is_that_of_autocast_against_float32():
  report = jaxamp.precision_report(chain, device_type="cpu")(X, W)
  (last,) = entries(report, "tanh")
  autocast = np.asarray(jaxamp.autocast(chain, device_type="cpu")(X, W), np.float64)
  exact = np.asarray(chain(X, W), np.float64)
  expected = np.max(np.abs(autocast - exact)) / np.max(np.abs(exact))
  assert last.accumulated_error == pytest.approx(expected, rel=1e-6)


def layered(x, w, layers):
  h = jax.jit(lambda a: jnp.tanh(a @ w))(x)
  h = lax.scan(lambda c, layer: (jax.nn.relu(c @ layer), None), h, layers)[0]
  h = lax.cond(jnp.sum(h) > -1e9, lambda h: h * 2, lambda h: h - 1, h)
  h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, h))[1]
  return h


@pytest.mark.slow
def test_every_primitive_inside_sub_jaxprs_is_reported_with_its_path():
  report = jaxamp.precision_report(layered, device_type="cuda")(X, W, LAYERS)
  paths = {(e.path, e.primitive) for e in report.entries}
  assert {
    ("jit(<lambda>)", "dot_general"),
    ("jit(<lambda>)", "tanh"),
    ("scan", "dot_general"),
    ("scan/custom_jvp_call/jit(relu)", "max"),  # jax.nn.relu is a custom_jvp
    ("cond.branch1", "mul"),  # the branch taken
    ("while.cond", "lt"),
    ("while.body", "dot_general"),
    ("while.body", "sin"),
  } <= paths
  assert not any(e.path == "cond.branch0" for e in report.entries)
  # Higher-order eqns are reported through their bodies, not as a whole.
  assert not {"jit", "scan", "cond", "while", "custom_jvp_call"} & {
    e.primitive for e in report.entries
  }


def test_loop_bodies_are_one_entry_per_eqn_over_their_iterations():
  report = jaxamp.precision_report(layered, device_type="cuda")(X, W, LAYERS)
  (scan_dot,) = entries(report, "dot_general", "scan")
  (body_dot,) = entries(report, "dot_general", "while.body")
  (cond_lt,) = entries(report, "lt", "while.cond")
  assert (scan_dot.count, body_dot.count, cond_lt.count) == (3, 2, 3)
  assert scan_dot.accumulated_error > scan_dot.local_error > 0
  assert cond_lt.local_error is None and cond_lt.compute_dtype is None  # no floats


def branchy(x, w):
  # 0.5001 is 0.5 in float16: the two programs take different branches.
  y = (x @ w)[0, 0]
  return lax.cond(y > 0.5, lambda y: jnp.sin(y), lambda y: jnp.cos(y), y)


@pytest.mark.slow
def test_an_eqn_the_float32_program_did_not_evaluate_has_no_accumulated_error():
  x, w = jnp.full((1, 1), 0.5001), jnp.ones((1, 1))
  report = jaxamp.precision_report(branchy, device_type="cuda")(x, w)
  (cos,) = entries(report, "cos", "cond.branch0")  # float32 took branch1 (sin)
  assert cos.accumulated_error is None and 0 < cos.local_error <= F16_ROUNDING
  assert not entries(report, "sin")


def test_entries_are_sorted_worst_first():
  report = jaxamp.precision_report(layered, device_type="cpu")(X, W, LAYERS)
  accumulated = [e.accumulated_error for e in report.entries if e.accumulated_error is not None]
  assert accumulated == sorted(accumulated, reverse=True) and accumulated[0] > 0
  by_local = report.sorted_by("local")
  assert by_local.order == "local" and sorted(by_local.entries) == sorted(report.entries)
  local = [e.local_error for e in by_local.entries if e.local_error is not None]
  assert local == sorted(local, reverse=True)
  assert report.worst(3).entries == report.entries[:3]
  with pytest.raises(ValueError, match="`order` must be one of"):
    report.sorted_by("relative")


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.Dense(32)(h)
    h = nn.gelu(h)
    return jax.nn.log_softmax(nn.Dense(4)(h))


MLP_X = jax.random.normal(jax.random.key(3), (16, 8))
MLP_PARAMS = Mlp().init(jax.random.key(4), MLP_X)


@pytest.mark.parametrize(
  "device_type,dtype,rounding",
  [("cpu", "bfloat16", BF16_ROUNDING), ("cuda", "float16", F16_ROUNDING)],
)
@pytest.mark.slow  # a flax model, evaluated twice eagerly
def test_a_flax_model_report_is_plausible(device_type, dtype, rounding):
  model = Mlp()
  x = jax.random.normal(jax.random.key(3), (16, 8))
  params = model.init(jax.random.key(4), x)
  report = jaxamp.precision_report(model.apply, device_type=device_type)(params, x)
  assert (report.device_type, report.dtype) == (device_type, dtype)
  worst = report.entries[0]
  assert 0 < worst.accumulated_error < 64 * rounding
  for e in report.entries:
    if e.local_error:  # a primitive loses precision only where it runs in 16 bits or casts to it
      assert e.compute_dtype == dtype or e.primitive == "convert_element_type", e
      assert e.local_error <= 4 * rounding, e
  dense = [e for e in report.entries if e.primitive == "dot_general"]
  assert {e.name_stack for e in dense} == {"Mlp/Dense_0", "Mlp/Dense_1"}
  assert all(e.source.startswith(__file__ + ":") for e in dense)  # the model's line, not flax's


def test_the_report_prints_as_a_table_and_converts_to_dicts():
  report = jaxamp.precision_report(layered, device_type="cuda")(X, W, LAYERS)
  lines = str(report).splitlines()
  assert lines[0].startswith("precision_report('cuda', float16): ")
  assert lines[1].split()[:6] == ["path", "primitive", "rule", "dtype", "local", "accumulated"]
  assert len(lines) == 3 + len(report.entries)  # title, header, entries, what an error is
  assert lines[-1].startswith("error = max|autocast - float32| / max|float32|")
  assert "scan" in str(report) and "_report.py:" in str(report)  # a long file name is cut
  assert "test_precision_report.py:" in report.table(full=True)
  assert tuple(report.to_dicts()[0]) == jaxamp.PrecisionEntry._fields
  assert len(str(report.worst(2)).splitlines()) == 5


def test_the_default_table_fits_100_columns():
  report = jaxamp.precision_report(deep_model, device_type="cuda")(X, W)
  assert max(map(len, str(report).splitlines())) <= 100
  assert max(map(len, str(report.where_error_starts()).splitlines())) <= 100


@pytest.mark.slow
def test_the_full_table_adds_name_stacks_runs_and_torch_ops():
  report = jaxamp.precision_report(Mlp().apply, device_type="cuda")(MLP_PARAMS, MLP_X)
  header = report.table(full=True).splitlines()[1].split()
  assert header[-6:] == ["runs", "source", "name", "stack", "torch", "ops"]
  assert "Mlp/Dense_0" in report.table(full=True) and "Mlp/Dense_0" not in str(report)


def fp16_dot_then_float32_ops(x, w):
  # The dot runs in float16 under "cuda" (torch's matmul); exp and log run in float32 (torch's
  # float32 list) on its rounded output: they inherit its error and amplify it.
  return jnp.log(jnp.exp(4.0 * (x @ w)) + 1.0)


def test_the_local_error_view_ranks_a_low_precision_op_above_the_float32_ops_after_it():
  report = jaxamp.precision_report(fp16_dot_then_float32_ops, device_type="cuda")(X, W)
  (exp,) = entries(report, "exp")
  (dot,) = entries(report, "dot_general")
  assert exp.compute_dtype == "float32" and exp.accumulated_error > dot.accumulated_error
  assert report.entries.index(exp) < report.entries.index(dot)  # by accumulated error
  starts = report.where_error_starts()
  assert starts.entries[0] == dot and starts.order == "local"
  assert all(e.compute_dtype != "float32" for e in starts.entries)  # exact in float32: left out
  assert "where the error starts" in str(starts).splitlines()[0]


def rms_norm(h):
  return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def rms_norm_kept(h):
  with jaxamp.autocast_disabled():
    return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def test_autocast_disabled_around_the_worst_op_removes_its_error():
  x = jnp.abs(X) * 100  # unnormalised inputs: h * h overflows float16
  report = jaxamp.precision_report(lambda x, w: rms_norm(x @ w), device_type="cuda")(x, W)
  worst = report.entries[0]
  assert (worst.primitive, worst.compute_dtype) == ("mul", "float16")
  assert math.isinf(worst.local_error) and math.isinf(worst.max_abs)
  fixed = jaxamp.precision_report(lambda x, w: rms_norm_kept(x @ w), device_type="cuda")(x, W)
  (square, scale) = entries(fixed, "mul")
  assert square.rule == "kept" and square.compute_dtype == "float32"
  assert square.local_error == 0.0 and square.max_abs < 65504
  assert scale.accumulated_error < 4 * F16_ROUNDING  # the output: only the dot's rounding left


def test_the_function_is_traced_afresh_on_every_call():
  norm = rms_norm

  def f(x, w):
    return norm(x @ w)

  x = jnp.abs(X) * 100
  assert math.isinf(jaxamp.precision_report(f, device_type="cuda")(x, W).entries[0].local_error)
  norm = rms_norm_kept
  report = jaxamp.precision_report(f, device_type="cuda")(x, W)
  assert all(e.rule == "kept" for e in entries(report, "mul"))


def test_precision_report_rejects_bad_input():
  with pytest.raises(TypeError, match="precision_report takes a callable"):
    jaxamp.precision_report(3)
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.precision_report(chain, device_type="mps")
  with pytest.raises(ValueError, match="`dtype` must be one of"):
    jaxamp.precision_report(chain, device_type="cuda", dtype=jnp.float32)
  with pytest.raises(TypeError, match="concrete arrays"):
    jax.jit(jaxamp.precision_report(chain, device_type="cuda"))(X, W)
  report = jaxamp.precision_report(chain, device_type="cuda")(X, W)
  with pytest.raises(ValueError, match="`n` must be"):
    report.worst(-1)
  with pytest.raises(ValueError, match="`at_least` must be"):
    report.where_error_starts(at_least=-1.0)


def test_the_device_type_may_be_the_second_positional_argument_as_for_autocast():
  def f(x, w):
    return jnp.tanh(x @ w)

  positional = jaxamp.precision_report(f, "cuda")(X, W)
  assert str(positional) == str(jaxamp.precision_report(f, device_type="cuda")(X, W))
