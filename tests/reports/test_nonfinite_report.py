"""``jaxamp.nonfinite_report``: per-leaf NaN / +Inf / -Inf counts and the largest finite magnitude.

The report is plain ``jnp`` code returning a pytree: it runs under ``jit`` and ``vmap``, is
returned from jitted steps, and prints on the host as the non-finite leaves' paths, worst first.
The model tests force one float16 layer to overflow under ``autocast`` + ``dynamic_loss_scale``
and check that the report names that layer, also from the train-step helpers' metrics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jaxamp
from jaxamp._src.reports import nonfinite
from jaxamp._src.reports.nonfinite import LeafStats, NonfiniteReport, nonfinite_report

NAN, INF = float("nan"), float("inf")
F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def counts(stats: LeafStats) -> tuple[int, int, int, float, int]:
  """``(nan, posinf, neginf, max_finite, size)`` of one leaf's stats as Python numbers."""
  return (
    int(stats.nan),
    int(stats.posinf),
    int(stats.neginf),
    float(stats.max_finite),
    int(stats.size),
  )


def by_path(report: NonfiniteReport) -> dict[str, tuple]:
  return {path: counts(stats) for path, stats in report.items()}


MIXED = {
  "nan": jnp.array([1.0, NAN, NAN, -4.0]),
  "posinf": jnp.array([[INF, 2.0], [INF, INF]]),
  "neginf": jnp.array([-INF, -3.0, 0.5]),
  "mixed": jnp.array([NAN, INF, -INF, -INF, 7.0, -9.0]),
  "finite": jnp.array([[1.5, -2.5], [0.0, 3.0]]),
}


# --- counts --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_counts_nan_posinf_neginf_and_max_finite_per_leaf():
  assert by_path(nonfinite_report(MIXED)) == {
    "nan": (2, 0, 0, 4.0, 4),
    "posinf": (0, 3, 0, 2.0, 4),
    "neginf": (0, 0, 1, 3.0, 3),
    "mixed": (1, 1, 2, 9.0, 6),
    "finite": (0, 0, 0, 3.0, 4),
  }


@pytest.mark.slow
def test_leaf_stats_sum_inf_and_nonfinite():
  stats = nonfinite_report(MIXED).leaves["mixed"]
  assert (int(stats.inf), int(stats.nonfinite)) == (3, 4)


@pytest.mark.slow
def test_all_finite_leaf_has_zero_counts_and_its_largest_magnitude():
  stats = nonfinite_report(jnp.array([-65504.0, 3.0, 0.0], jnp.float16)).leaves
  assert counts(stats) == (0, 0, 0, 65504.0, 3)


@pytest.mark.slow
def test_max_finite_is_zero_when_no_value_is_finite():
  stats = nonfinite_report(jnp.array([NAN, INF, -INF])).leaves
  assert counts(stats) == (1, 1, 1, 0.0, 3)


@pytest.mark.parametrize(
  "leaf",
  [jnp.arange(5, dtype=jnp.int32), jnp.array([True, False]), jnp.arange(3, dtype=jnp.uint8), 7],
  ids=["int32", "bool", "uint8", "python_int"],
)
def test_integer_and_bool_leaves_are_finite_with_zero_counts(leaf):
  stats = nonfinite_report(leaf).leaves
  assert counts(stats)[:4] == (0, 0, 0, 0.0) and stats.max_finite.dtype == F32


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=str)
@pytest.mark.slow
def test_low_precision_leaves_report_max_finite_exactly_in_float32(dtype):
  top = float(jnp.finfo(dtype).max)
  leaf = jnp.array([NAN, INF, -INF, -top, 1.0], dtype)
  stats = nonfinite_report({"g": leaf}).leaves["g"]
  assert counts(stats) == (1, 1, 1, top, 5) and stats.max_finite.dtype == F32


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=str)
def test_float8_leaves_are_counted_with_max_finite_in_float32(dtype):
  """float8 values (float8 autocast's operands) have no implicit promotion to float32."""
  top = float(jnp.finfo(dtype).max)
  leaf = jnp.array([NAN, -top, 1.0], dtype)
  stats = nonfinite_report({"w": leaf}).leaves["w"]
  assert counts(stats) == (1, 0, 0, top, 3) and stats.max_finite.dtype == F32


@pytest.mark.slow
def test_float64_leaves_report_max_finite_in_float64():
  with jax.enable_x64(True):
    leaf = jnp.array([1e300, -INF], jnp.float64)
    report = nonfinite_report({"g": leaf, "h": jnp.ones(2, jnp.float32)})
    assert report.leaves["g"].max_finite.dtype == jnp.float64
    assert (float(report.leaves["g"].max_finite), float(report.max_finite)) == (1e300, 1e300)


@pytest.mark.slow
def test_float0_gradients_and_prng_keys_count_as_finite():
  tree = {"f0": np.zeros((3,), jax.dtypes.float0), "key": jax.random.key(0)}
  assert by_path(nonfinite_report(tree)) == {"f0": (0, 0, 0, 0.0, 3), "key": (0, 0, 0, 0.0, 1)}


@pytest.mark.slow
def test_complex_leaves_count_real_and_imaginary_parts():
  leaf = jnp.array([complex(INF, NAN), complex(-3.0, 4.0)], jnp.complex64)
  assert counts(nonfinite_report(leaf).leaves)[:4] == (1, 1, 0, 4.0)


def test_empty_leaves_have_zero_counts():
  tree = {"empty": jnp.zeros((0, 3), jnp.float16), "none": None}
  report = nonfinite_report(tree)
  assert by_path(report) == {"empty": (0, 0, 0, 0.0, 0)} and report.leaves["none"] is None


@pytest.mark.slow
def test_empty_tree_reports_zero_leaves_all_finite():
  for tree in ({}, None, [], ()):
    report = nonfinite_report(tree)
    assert report.num_leaves == 0 and not bool(report.any_nonfinite)
    assert (int(report.nonfinite), float(report.max_finite)) == (0, 0.0)


@pytest.mark.slow
def test_non_array_leaves_are_left_out():
  model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))  # holds jax.nn.relu and an identity
  report = nonfinite_report(model)
  assert report.num_leaves == len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))


# --- totals --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_totals_sum_counts_over_leaves_and_take_the_largest_finite_magnitude():
  report = nonfinite_report(MIXED)
  assert (
    int(report.nan),
    int(report.posinf),
    int(report.neginf),
    int(report.inf),
    int(report.nonfinite),
    int(report.nonfinite_leaves),
    float(report.max_finite),
  ) == (3, 4, 3, 7, 10, 4, 9.0)
  assert bool(report.any_nonfinite)


@pytest.mark.slow
def test_any_nonfinite_is_false_for_a_finite_tree():
  assert not bool(nonfinite_report({"a": jnp.ones(3), "b": [jnp.zeros(2)]}).any_nonfinite)


def test_totals_saturate_at_int32_max_instead_of_wrapping():
  top = np.iinfo(np.int32).max
  assert int(nonfinite._saturating_sum(jnp.array([top - 2, 2, 5], jnp.int32))) == top
  assert int(nonfinite._saturating_add(2**30, 2**30)) == top
  assert int(nonfinite._saturating_add(2**30, 2**30 - 1)) == top


@pytest.mark.slow
def test_leaves_beyond_the_int32_range_are_counted_in_chunks(monkeypatch):
  monkeypatch.setattr(nonfinite, "_MAX_EXACT", 5)  # as if 2**31 - 1
  monkeypatch.setattr(nonfinite, "_CHUNK", 4)  # as if 2**30
  leaf = jnp.array([INF] * 7 + [NAN, -3.0, -INF, 5.0, NAN, INF])
  assert counts(nonfinite_report(leaf).leaves) == (2, 8, 1, 5.0, 13)
  assert counts(jax.jit(nonfinite_report)(leaf).leaves) == (2, 8, 1, 5.0, 13)


# --- transformations -----------------------------------------------------------------------------


@pytest.mark.slow
def test_report_is_returned_from_jit_with_the_eager_values():
  eager, jitted = nonfinite_report(MIXED), jax.jit(nonfinite_report)(MIXED)
  assert isinstance(jitted, NonfiniteReport) and isinstance(jitted.leaves["mixed"], LeafStats)
  assert by_path(jitted) == by_path(eager) and str(jitted) == str(eager)


@pytest.mark.slow  # trains or compiles a model
def test_report_is_ten_arrays_however_many_leaves():
  small, large = nonfinite_report([jnp.ones(2)]), nonfinite_report([jnp.ones(2)] * 300)
  assert len(jax.tree.leaves(small)) == len(jax.tree.leaves(large)) == 10
  assert large.per_leaf.nan.shape == (300,) and len(large.paths) == 300


def test_per_leaf_vectors_follow_the_paths():
  report = nonfinite_report(MIXED)
  assert report.paths == ("finite", "mixed", "nan", "neginf", "posinf")
  assert report.per_leaf.nan.tolist() == [0, 1, 2, 0, 0]
  assert report.per_leaf.max_finite.tolist() == [3.0, 9.0, 4.0, 3.0, 2.0]


def test_report_is_returned_from_a_jitted_step_with_other_metrics():
  @jax.jit
  def step(x):
    y = x / jnp.array([1.0, 0.0, 2.0])
    return y, {"loss": jnp.sum(x), "report": nonfinite_report({"y": y})}

  _, metrics = step(jnp.array([1.0, 1.0, 1.0]))
  assert metrics["report"].nonfinite_paths() == ("y",)


def test_any_nonfinite_drives_a_jnp_where_inside_jit():
  @jax.jit
  def guarded(x):
    return jnp.where(nonfinite_report(x).any_nonfinite, jnp.zeros_like(x), x)

  assert float(jnp.sum(guarded(jnp.array([1.0, INF])))) == 0.0
  assert float(jnp.sum(guarded(jnp.array([1.0, 2.0])))) == 3.0


def test_a_batched_report_says_how_to_format_one_example():
  report = jax.vmap(nonfinite_report)({"x": jnp.array([[1.0, INF], [NAN, 2.0]])})
  with pytest.raises(TypeError, match=r"batched .*x\[i\]"):
    str(report)
  assert "1 nan" in str(jax.tree.map(lambda leaf: leaf[1], report))


@pytest.mark.slow  # trains or compiles a model
def test_report_works_under_vmap_per_example():
  x = jnp.array([[1.0, INF, -INF], [NAN, 2.0, 3.0]])
  report = jax.vmap(nonfinite_report)({"x": x})
  stats = report.leaves["x"]
  assert (
    stats.nan.tolist(),
    stats.posinf.tolist(),
    stats.neginf.tolist(),
    stats.max_finite.tolist(),
    report.nonfinite_leaves.tolist(),
  ) == ([0, 1], [1, 0], [1, 0], [1.0, 3.0], [1, 1])


def test_report_of_activations_can_be_the_aux_of_a_gradient():
  def loss(w):
    h = jnp.log(w)  # log(0) = -inf, log(-1) = nan
    return jnp.sum(w), nonfinite_report({"h": h})

  _, report = jax.jit(jax.grad(loss, has_aux=True))(jnp.array([0.0, -1.0, 2.0]))
  assert counts(report.leaves["h"])[:3] == (1, 0, 1)


# --- paths and host printout ---------------------------------------------------------------------


class Pair(NamedTuple):
  first: jax.Array
  second: jax.Array


@pytest.mark.slow  # trains or compiles a model
def test_paths_join_dict_keys_attribute_names_and_sequence_indices():
  tree = {
    "params": {"Dense_0": {"kernel": jnp.ones(2)}},
    "layers": [jnp.ones(1), jnp.ones(1)],
    "pair": Pair(jnp.ones(1), jnp.ones(1)),
    "by_id": {3: jnp.ones(1)},
  }
  assert [path for path, _ in nonfinite_report(tree).items()] == [
    "by_id/3",
    "layers/0",
    "layers/1",
    "pair/first",
    "pair/second",
    "params/Dense_0/kernel",
  ]


@pytest.mark.slow
def test_a_single_array_has_the_root_path():
  assert nonfinite_report(jnp.array([NAN])).nonfinite_paths() == (".",)


@pytest.mark.slow
def test_nnx_variables_count_as_their_arrays():
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  assert {path for path, _ in nonfinite_report(state).items()} == {"bias", "kernel"}


@pytest.mark.slow
def test_equinox_paths_name_the_module_fields():
  model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
  paths = {path for path, _ in nonfinite_report(eqx.filter(model, eqx.is_array)).items()}
  assert paths == {"layers/0/weight", "layers/0/bias", "layers/1/weight", "layers/1/bias"}


def test_printout_lists_nonfinite_leaves_worst_first_ties_by_path():
  tree = {
    "b": jnp.array([NAN, 1.0]),
    "a": jnp.array([INF, 2.0]),
    "worst": jnp.array([INF, -INF, NAN, 61000.0]),
    "fine": jnp.ones(3),
  }
  report = nonfinite_report(tree)
  assert report.nonfinite_paths() == ("worst", "a", "b")
  assert str(report).splitlines() == [
    "3 of 4 leaves non-finite: 3 inf (+inf 2, -inf 1), 2 nan; max finite 6.1e4",
    "worst: 2 inf, 1 nan, max finite 6.1e4 (+inf 1, -inf 1; 4 values)",
    "a: 1 inf, 0 nan, max finite 2 (+inf 1, -inf 0; 2 values)",
    "b: 0 inf, 1 nan, max finite 1 (+inf 0, -inf 0; 2 values)",
  ]


@pytest.mark.slow
def test_printout_of_a_finite_tree_is_one_line_with_the_leaf_count():
  report = nonfinite_report({"a": jnp.array([1.0, -250.0]), "b": [jnp.zeros(2), jnp.int32(3)]})
  assert str(report) == "all 3 leaves finite, max finite 250"


def test_printout_limit_caps_the_leaf_lines():
  tree = {f"leaf_{i}": jnp.array([NAN] * (i + 1)) for i in range(5)}
  lines = nonfinite_report(tree).format(limit=2).splitlines()
  assert lines[1:] == [
    "leaf_4: 0 inf, 5 nan, max finite 0 (+inf 0, -inf 0; 5 values)",
    "leaf_3: 0 inf, 4 nan, max finite 0 (+inf 0, -inf 0; 4 values)",
    "... and 3 more non-finite leaves",
  ]


def test_printout_inside_jit_raises_and_points_to_debug_print():
  with pytest.raises(TypeError, match="debug_print"):
    jax.jit(lambda x: str(nonfinite_report(x)))(jnp.ones(2))


def test_debug_print_prints_the_report_from_inside_jit(capsys):
  jax.jit(lambda x: nonfinite_report({"x": x}).debug_print())(jnp.array([INF, 1.0]))
  jax.effects_barrier()
  assert capsys.readouterr().out.splitlines()[1] == (
    "x: 1 inf, 0 nan, max finite 1 (+inf 1, -inf 0; 2 values)"
  )


# --- a float16 layer that overflows --------------------------------------------------------------
# `big_in`'s output is scaled up 1000x after a 1000x smaller kernel: its activations are like
# `small_in`'s, but the gradient of its output, a float16 activation gradient, is ~1000x larger.
# A loss scale of 2**12 overflows that one and keeps every other gradient finite; it reaches only
# `big_in`'s kernel (no bias), whose gradient is a float32 matmul result (weight_grads).

X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 6)), jnp.float32)
Y = jnp.arange(16, dtype=jnp.int32) % 3
OVERFLOW_SCALE = 2.0**12


class TwoInputs(nn.Module):
  @nn.compact
  def __call__(self, x):
    small = nn.Dense(8, name="small_in")(x)
    init = nn.initializers.normal(1e-3)
    big = nn.Dense(8, name="big_in", use_bias=False, kernel_init=init)(x) * 1000.0
    return nn.Dense(3, name="head")(nn.relu(small + big))


@functools.cache
def linen_params():
  return TwoInputs().init(jax.random.key(0), X)["params"]


def linen_loss(params, batch):
  logits = TwoInputs().apply({"params": params}, batch[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


@pytest.mark.slow  # trains or compiles a model
def test_linen_float16_overflow_is_pinned_to_the_layer():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=OVERFLOW_SCALE)
  params, opt_state = linen_params(), tx.init(linen_params())

  @jax.jit
  def step(params, opt_state):
    loss_fn = jaxamp.autocast(linen_loss, device_type="cuda")
    grads = jax.grad(lambda params: jaxamp.scale_loss(loss_fn(params, (X, Y)), opt_state))(params)
    _, opt_state = tx.update(grads, opt_state, params)
    return opt_state, nonfinite_report({"params": grads})

  opt_state, report = step(params, opt_state)
  assert bool(opt_state.found_inf) and report.nonfinite_paths() == ("params/big_in/kernel",)
  assert str(report).splitlines()[1].startswith("params/big_in/kernel: ")


@pytest.mark.slow
def test_train_step_metrics_have_no_report_by_default():
  state = TrainState.create(apply_fn=None, params=linen_params(), tx=optax.sgd(0.1))
  _, metrics = jax.jit(jaxamp.make_train_step(linen_loss, device_type="cuda"))(state, (X, Y))
  assert "nonfinite_report" not in metrics


@pytest.mark.slow  # trains or compiles a model
def test_linen_train_step_reports_the_overflowing_layer_until_the_scale_fits():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=OVERFLOW_SCALE)
  state = TrainState.create(apply_fn=None, params=linen_params(), tx=tx)
  step = jax.jit(jaxamp.make_train_step(linen_loss, device_type="cuda", nonfinite_report=True))
  skipped = []
  for _ in range(8):  # the scale backs off from 2**12 until big_in's gradient fits float16
    state, metrics = step(state, (X, Y))
    report = metrics["nonfinite_report"]
    assert bool(report.any_nonfinite) == bool(metrics["found_inf"])
    if not metrics["found_inf"]:
      break
    skipped.append(report.nonfinite_paths())
  # How many halvings it takes depends on the drawn weights; each names the same layer.
  assert skipped and skipped == [("big_in/kernel",)] * len(skipped)
  assert float(metrics["scale"]) == OVERFLOW_SCALE / 2 ** len(skipped)
  max_finite = nonfinite._fmt(float(report.max_finite))
  assert str(report) == f"all 5 leaves finite, max finite {max_finite}"


class NnxTwoInputs(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.small_in = nnx.Linear(6, 8, rngs=rngs)
    init = nnx.initializers.normal(1e-3)
    self.big_in = nnx.Linear(6, 8, use_bias=False, kernel_init=init, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.small_in(x) + self.big_in(x) * 1000.0))


def nnx_loss(model, batch):
  return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()


@pytest.mark.slow  # trains or compiles a model
def test_nnx_train_step_reports_the_overflowing_layer():
  model = NnxTwoInputs(nnx.Rngs(0))
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=OVERFLOW_SCALE)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = nnx.jit(jaxamp.make_nnx_train_step(nnx_loss, device_type="cuda", nonfinite_report=True))
  metrics = step(model, optimizer, (X, Y))
  assert bool(metrics["found_inf"])
  assert metrics["nonfinite_report"].nonfinite_paths() == ("big_in/kernel",)


@pytest.mark.slow  # trains or compiles a model
def test_equinox_float16_overflow_is_pinned_to_the_layer():
  class Model(eqx.Module):
    small_in: eqx.nn.Linear
    big_in: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
      return self.head(jax.nn.relu(self.small_in(x) + self.big_in(x) * 1000.0))

  keys = jax.random.split(jax.random.key(0), 3)
  big = eqx.nn.Linear(6, 8, use_bias=False, key=keys[1])
  big = eqx.tree_at(lambda m: m.weight, big, big.weight * 1e-3)
  model = Model(eqx.nn.Linear(6, 8, key=keys[0]), big, eqx.nn.Linear(8, 3, key=keys[2]))

  def loss(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * OVERFLOW_SCALE

  grads = eqx.filter_jit(eqx.filter_grad(jaxamp.autocast(loss, device_type="cuda")))(model, X, Y)
  report = eqx.filter_jit(nonfinite_report)(grads)
  assert report.nonfinite_paths() == ("big_in/weight",)


@pytest.mark.slow  # trains or compiles a model
def test_benchmark_script_runs_and_prints_the_ratio_and_an_example_report():
  from benchmarks import bench_nonfinite

  res = bench_nonfinite.run(
    big=1, big_shape=(8, 4), small=8, small_size=16, rounds=1, per_round=1, log=lambda *args: None
  )
  text = bench_nonfinite.report(res)
  assert "report / check" in text and "big_0: 2 inf, 1 nan, max finite" in text
