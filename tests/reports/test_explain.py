"""jaxamp.explain reports what autocast does to every primitive, inside sub-jaxprs too."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import lax
from report_models import deep_model

import jaxamp

X = jnp.ones((4, 8))
W = jnp.ones((8, 8)) * 0.1


def model(x, w):
  h = jax.jit(lambda a: jnp.tanh(a @ w))(x)
  h = lax.scan(lambda c, _: (c @ w, None), h, None, length=2)[0]
  return jax.nn.softmax(h).sum()


def test_every_primitive_gets_a_decision_including_sub_jaxprs():
  explanation = jaxamp.explain(model, device_type="cuda")(X, W)
  paths = {d.path for d in explanation.decisions}
  assert {"", "jit(<lambda>)", "scan"} <= paths
  dots = [d for d in explanation.decisions if d.primitive == "dot_general"]
  assert len(dots) == 2 and all(d.inputs == ("float16", "float16") for d in dots)
  assert all(d.traced == ("float32", "float32") for d in dots)


def test_decisions_name_the_rule_and_the_torch_ops():
  explanation = jaxamp.explain(model, device_type="cuda")(X, W)
  dot = next(d for d in explanation.decisions if d.primitive == "dot_general")
  assert dot.rule == "lower" and "matmul" in dot.torch_ops
  softmax = [d for d in explanation.decisions if d.rule == "op softmax: float32"]
  assert softmax and all(d.torch_ops == ("softmax",) for d in softmax)


def attention_like(x, w):
  return jax.nn.softmax(x @ w)  # a softmax of a bfloat16 value under "cpu"


def test_softmax_recomputed_in_the_backward_pass_sits_in_a_checkpoint():
  explanation = jaxamp.explain(attention_like, device_type="cpu")(X, W)
  softmax = [d for d in explanation.decisions if d.rule == "op softmax: float32_inside"]
  assert softmax and all(d.path == "checkpoint" for d in softmax)


def test_casts_inserted_are_counted_once_per_value():
  explanation = jaxamp.explain(lambda x, w: (x @ w, x @ w), device_type="cuda")(X, W)
  assert [d.casts for d in explanation.decisions] == [2, 0]


@pytest.mark.parametrize("device_type,exp_rule", [("cuda", "float32"), ("cpu", "native")])
def test_the_policy_decides_the_rule(device_type, exp_rule):
  explanation = jaxamp.explain(lambda x, w: jnp.exp(x @ w), device_type=device_type)(X, W)
  assert explanation.decisions[-1].rule == exp_rule


def test_explanation_prints_as_a_table_and_summarises():
  explanation = jaxamp.explain(model, device_type="cpu")(X, W)
  text = str(explanation)
  assert text.splitlines()[0].startswith("autocast('cpu', bfloat16)")
  assert "dot_general" in text and "f32->bf16" in text
  assert explanation.summary()["lower"] == 2
  assert tuple(explanation.to_dicts()[0]) == jaxamp.Decision._fields


def test_the_default_table_fits_100_columns():
  lines = str(jaxamp.explain(deep_model, device_type="cuda")(X, W)).splitlines()
  assert max(map(len, lines)) <= 100
  assert "jit(<lambda>)/scan/cond.branch1" in jaxamp.explain(deep_model)(X, W).table(full=True)


def test_the_default_table_lists_each_rules_torch_ops_once():
  text = str(jaxamp.explain(model, device_type="cuda")(X, W))
  rows_with_dots = [line for line in text.splitlines() if " dot_general " in line]
  assert len(rows_with_dots) == 2 and not any("matmul" in line for line in rows_with_dots)
  assert text.count("__matmul__") == 1  # in the torch ops under the table


def test_the_full_table_has_the_torch_ops_on_every_row():
  text = jaxamp.explain(model, device_type="cuda")(X, W).table(full=True)
  rows_with_dots = [line for line in text.splitlines() if " dot_general " in line]
  assert len(rows_with_dots) == 2 and all("__matmul__" in line for line in rows_with_dots)
  assert "traced -> inputs" in text and "(float32, float32) -> (float16, float16)" in text


def test_explain_does_not_run_the_computation_or_pollute_caches():
  first = jaxamp.explain(model, device_type="cuda")(X, W)
  again = jaxamp.explain(model, device_type="cuda")(X, W)
  assert first.decisions == again.decisions  # rewrite caches are bypassed while recording


def test_explain_rejects_bad_input():
  with pytest.raises(TypeError, match="explain takes a callable"):
    jaxamp.explain(3)
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.explain(model, device_type="mps")


@pytest.mark.slow
def test_explain_takes_the_non_array_leaves_autocast_takes():
  class Layer(eqx.Module):
    linear: eqx.nn.Linear
    axis_name: str = "batch"  # a static string leaf, as equinox's BatchNorm has

  layer = Layer(eqx.nn.Linear(3, 2, key=jax.random.key(0)))
  fun = lambda m, x: m.linear(x).sum()
  explanation = jaxamp.explain(fun, device_type="cpu")(layer, jnp.ones(3))
  assert any(d.primitive == "dot_general" for d in explanation.decisions)


@pytest.mark.parametrize(
  "tool, records",
  [(jaxamp.explain, "decisions"), (jaxamp.precision_report, "entries")],
  ids=["explain", "precision_report"],
)
def test_an_nnx_module_as_the_function_is_reported_like_its_autocast(tool, records):
  """``explain(model)(x)``, as ``autocast(model)(x)``: a BatchNorm in training writes its
  statistics, which a closed-over module could not; the model itself is left as it was."""
  model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0)))
  mean = model.layers[1].mean.get_value()
  result = tool(model, device_type="cuda")(jnp.ones((4, 8)))
  assert any(entry.primitive == "dot_general" for entry in getattr(result, records))
  assert model.layers[1].mean.get_value() is mean


def test_the_device_type_may_be_the_second_positional_argument_as_for_autocast():
  positional = jaxamp.explain(model, "cuda")(X, W)
  assert positional.decisions == jaxamp.explain(model, device_type="cuda")(X, W).decisions
