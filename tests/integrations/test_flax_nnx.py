"""Flax nnx modules under autocast: low-dtype layers, float32 state, state updates kept.

nnx modules are mutable Python objects, so the autocast function takes their state as an argument
and returns the new one: ``graphdef, state = nnx.split(model)``; inside,
``m = nnx.merge(graphdef, state); return m(x), nnx.state(m)``; outside, ``nnx.update(model, new)``.
"""

import functools

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest
from flax import nnx

import jaxamp

POLICIES = [
  pytest.param("cuda", jnp.float16, id="cuda"),
  pytest.param("xpu", jnp.float16, id="xpu"),
  pytest.param("cpu", jnp.bfloat16, id="cpu"),
]
MODES = ["eager", "nnx_jit"]
F32 = jnp.dtype(jnp.float32)
VALUE_RTOL = 3e-2  # relative to the largest float32 value
GRAD_RTOL = 5e-2  # relative to the largest float32 gradient
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6, 6, 3), np.float32))


class Net(nnx.Module):
  """Every nnx layer autocast must handle; returns each layer's output by name."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)  # BatchNorm follows
    self.batch_norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.linear = nnx.Linear(8, 16, rngs=rngs)
    self.layer_norm = nnx.LayerNorm(16, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    out = {}
    out["conv"] = h = self.conv(x)
    out["batch_norm"] = h = self.batch_norm(h)
    out["linear"] = h = self.linear(h.mean(axis=(1, 2)))
    out["layer_norm"] = h = self.layer_norm(h)
    out["dropout"] = h = self.dropout(h)
    out["head"] = self.head(h)
    return out


@functools.cache
def _template() -> Net:
  return Net(nnx.Rngs(params=0, dropout=1))


def new_net() -> Net:
  """A fresh copy of one initialised Net: same parameters, statistics and RNG state."""
  return nnx.clone(_template())


def autocast_call(model, x, device_type):
  """``model(x)`` under autocast; the model's new state (statistics, RNG counts) is kept."""
  graphdef, state = nnx.split(model)

  def forward(state, x):
    m = nnx.merge(graphdef, state)
    return m(x), nnx.state(m)

  out, new_state = jaxamp.autocast(forward, device_type=device_type)(state, x)
  nnx.update(model, new_state)
  return out


jit_autocast_call = nnx.jit(autocast_call, static_argnames="device_type")


def call(mode, model, x, device_type):
  return (autocast_call if mode == "eager" else jit_autocast_call)(model, x, device_type)


def snapshot(model) -> dict:
  """The model's parameters, BatchNorm statistics and dropout RNG count, as plain arrays."""
  return {
    "params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    "mean": model.batch_norm.mean[...],
    "var": model.batch_norm.var[...],
    "count": int(model.dropout.rngs.count[...]),
  }


@functools.cache
def run(mode, device_type):
  """(outputs, snapshot before, snapshot after) of one autocast call on a fresh Net."""
  model = new_net()
  before = snapshot(model)
  out = call(mode, model, X, device_type)
  return out, before, snapshot(model)


@functools.cache
def float32_run():
  model = new_net()
  out = nnx.jit(lambda m, x: m(x))(model, X)
  return out, snapshot(model)


def assert_close(actual, expected, rtol):
  """Elementwise closeness, tolerance scaled by the largest magnitude in ``expected``."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def batch_stats(snap):
  return snap["mean"], snap["var"]


# --- outputs -------------------------------------------------------------------------------------


@pytest.mark.slow  # compiles under every spelling
@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_linear_and_conv_outputs_are_low_dtype(mode, device_type, low):
  out, _, _ = run(mode, device_type)
  assert {k: out[k].dtype for k in ("conv", "linear", "head")} == dict.fromkeys(
    ("conv", "linear", "head"), jnp.dtype(low)
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "device_type,low,expected",
  [
    pytest.param("cuda", jnp.float16, F32, id="cuda"),  # layer_norm is on CUDA's float32 list
    pytest.param("cpu", jnp.bfloat16, jnp.bfloat16, id="cpu"),
  ],
)
def test_layer_norm_output_has_torch_dtype(device_type, low, expected):
  out, _, _ = run("nnx_jit", device_type)
  assert out["layer_norm"].dtype == expected


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_batch_norm_output_keeps_the_low_dtype_of_its_input(device_type, low):
  out, _, _ = run("nnx_jit", device_type)
  assert out["batch_norm"].dtype == low


@pytest.mark.slow
@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_close_to_float32(mode, device_type, low):
  out, _, _ = run(mode, device_type)
  expected, _ = float32_run()
  for name in expected:
    assert_close(out[name], expected[name], VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_every_dot_and_conv_runs_in_the_low_dtype(device_type, low):
  graphdef, state = nnx.split(new_net())

  def forward(state, x):
    return nnx.merge(graphdef, state)(x)

  jaxpr = jaxpr_utils.traced(jaxamp.autocast(forward, device_type=device_type), state, X)
  found = jaxpr_utils.dtypes_of(jaxpr, "dot_general") + jaxpr_utils.dtypes_of(
    jaxpr, "conv_general_dilated"
  )
  assert len(found) == 3  # conv, linear, head
  assert all(ins == (low, low) and outs == (low,) for ins, outs in found), found


# --- state ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_batch_norm_running_statistics_are_updated(mode, device_type, low):
  _, before, after = run(mode, device_type)
  for old, new in zip(batch_stats(before), batch_stats(after), strict=True):
    assert not np.allclose(new, old)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_batch_norm_running_statistics_stay_float32(mode, device_type, low):
  _, _, after = run(mode, device_type)
  assert [s.dtype for s in batch_stats(after)] == [F32, F32]


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow
def test_batch_norm_running_statistics_are_close_to_float32(device_type, low):
  _, _, after = run("nnx_jit", device_type)
  _, expected = float32_run()
  for found, want in zip(batch_stats(after), batch_stats(expected), strict=True):
    assert_close(found, want, VALUE_RTOL)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_params_stay_float32_and_unchanged(mode, device_type, low):
  _, before, after = run(mode, device_type)
  assert {leaf.dtype for leaf in jax.tree.leaves(after["params"])} == {F32}
  jax.tree.map(np.testing.assert_array_equal, after["params"], before["params"])


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_dropout_rng_counter_advances(mode, device_type, low):
  _, before, after = run(mode, device_type)
  assert after["count"] == before["count"] + 1


@pytest.mark.parametrize("device_type,low", POLICIES)
def test_consecutive_calls_draw_new_dropout_masks(device_type, low):
  model = new_net()
  first = jit_autocast_call(model, X, device_type)["dropout"]
  second = jit_autocast_call(model, X, device_type)["dropout"]
  assert not np.array_equal(first == 0, second == 0)


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.slow_after_first
def test_eval_mode_uses_running_statistics_and_no_dropout(device_type, low):
  model = new_net()
  model.eval()
  before = snapshot(model)
  first = jit_autocast_call(model, X, device_type)
  second = jit_autocast_call(model, X, device_type)
  np.testing.assert_array_equal(first["head"], second["head"])
  np.testing.assert_array_equal(first["dropout"], first["layer_norm"])
  for old, new in zip(batch_stats(before), batch_stats(snapshot(model)), strict=True):
    np.testing.assert_array_equal(new, old)


# --- gradients -----------------------------------------------------------------------------------


def probe_loss(model, x, device_type=None):
  out = autocast_call(model, x, device_type) if device_type else model(x)
  probe = jnp.linspace(-1.0, 1.0, out["head"].size).reshape(out["head"].shape)
  return jnp.sum(out["head"].astype(jnp.float32) * probe)


@pytest.mark.slow  # compiles under every spelling
@pytest.mark.parametrize("device_type,low", POLICIES)
def test_param_gradients_are_float32_and_close_to_float32(device_type, low):
  grads = nnx.jit(nnx.grad(functools.partial(probe_loss, device_type=device_type)))(new_net(), X)
  expected = nnx.jit(nnx.grad(probe_loss))(new_net(), X)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}
  scale = max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(expected))
  for found, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(found, want, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale)


# --- a module passed straight in -----------------------------------------------------------------


@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_module_passed_directly_keeps_batch_norm_statistics(mode, device_type, low):
  model = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
  x = X.reshape(-1, 3) + 1.0
  forward = jaxamp.autocast(lambda m, x: m(x), device_type=device_type)
  if mode == "nnx_jit":
    forward = nnx.jit(forward)
  forward(model, x)
  assert not np.allclose(model.mean[...], 0.0)


@pytest.mark.slow  # compiles under every spelling
@pytest.mark.parametrize("device_type,low", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_module_passed_directly_advances_its_rng_counter(mode, device_type, low):
  model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
  forward = jaxamp.autocast(lambda m, x: m(x), device_type=device_type)
  if mode == "nnx_jit":
    forward = nnx.jit(forward)
  forward(model, X)
  assert int(model.rngs.count[...]) == 1


# --- Variables kept as Refs or hijax types (nnx.var_defaults) ------------------------------------


def _kept_as(storage: str, make):
  """``make()`` with its Variables kept as ``storage`` ("ref" or "hijax")."""
  if not hasattr(nnx, "var_defaults"):
    pytest.skip("nnx.var_defaults is newer than this flax")
  with nnx.var_defaults(**{storage: True}):
    return make()


ROWS = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8), np.float32))


@pytest.mark.parametrize("storage", ["ref", "hijax"])
def test_a_layer_norm_with_variables_kept_as_refs_or_hijax_types_runs(storage):
  norm = _kept_as(storage, lambda: nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
  # CPU's layer_norm computes in float32 and follows its input's dtype out.
  out = jaxamp.autocast(lambda m, x: m(x), device_type="cpu")(norm, ROWS)
  np.testing.assert_allclose(out, norm(ROWS), atol=1e-5)


def test_batch_norm_statistics_kept_as_refs_update_under_nnx_jit():
  """A Ref is written in place: the trace returns no Ref, and the statistics still move."""
  make = lambda: nnx.BatchNorm(8, rngs=nnx.Rngs(0))
  amp, plain = _kept_as("ref", make), _kept_as("ref", make)
  nnx.jit(jaxamp.autocast(lambda m, x: m(x), device_type="cpu"))(amp, ROWS)
  nnx.jit(lambda m, x: m(x))(plain, ROWS)
  assert amp.mean.get_value().dtype == F32
  np.testing.assert_allclose(amp.mean.get_value(), plain.mean.get_value(), rtol=1e-6)


def test_a_linear_kept_as_hijax_types_runs_under_jax_jit():
  linear = _kept_as("hijax", lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  out = jax.jit(jaxamp.autocast(lambda m, x: m(x), device_type="cpu"))(linear, ROWS)
  assert out.dtype == jnp.bfloat16


class SowingBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    h = self.linear(x)
    self.sow(nnx.Intermediate, "hidden", h)
    return jax.nn.relu(h)


def test_an_autocast_submodule_sows_its_intermediates_as_in_nnx():
  # a sown Variable holds a tuple: not an array, nor a Ref
  model = nnx.Sequential(SowingBlock(nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  model.layers[0] = jaxamp.autocast(model.layers[0], device_type="cpu")
  if hasattr(nnx, "capture"):  # newer flax; sow outside it is deprecated there
    out, sown = nnx.capture(model, nnx.Intermediate)(ROWS)
  else:
    out = model(ROWS)
    sown = nnx.pop(model, nnx.Intermediate)
  (hidden,) = jax.tree.leaves(sown)
  assert out.dtype == F32 and hidden.dtype == jnp.bfloat16 and hidden.shape == (4, 8)


def test_a_module_with_a_dict_valued_variable_runs():
  linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  linear.meta = nnx.Variable({"scale": jnp.ones(2)})
  out = jaxamp.autocast(linear, device_type="cpu")(ROWS)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out, linear(ROWS), rtol=2e-2, atol=2e-2)
