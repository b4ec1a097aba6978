"""Saving and restoring the scaler: ``jaxamp.scaler.state_dict`` and ``load_state_dict``
(torch's ``GradScaler.state_dict``/``load_state_dict``, dicts that round-trip with torch's), and
flax checkpoints of the state. Bad dicts get a ValueError/TypeError naming the key and what is
valid, where torch checks nothing.
"""

import math

import cpu_devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import jaxamp

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
TORCH_KEYS = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]


def scaler(inner=None, **kwargs):
  kwargs.setdefault("init_scale", 1024.0)
  return jaxamp.dynamic_loss_scale(inner or optax.adam(1e-2), **kwargs)


def scaler_state(**kwargs):
  return scaler(**kwargs).init(PARAMS)


# --- state_dict -----------------------------------------------------------------------------------


def test_state_dict_has_torch_keys_and_python_types():
  d = jaxamp.scaler.state_dict(
    scaler_state(growth_factor=1.1, backoff_factor=0.3, growth_interval=7)
  )
  assert d == {
    "scale": 1024.0,
    "growth_factor": 1.1,
    "backoff_factor": 0.3,
    "growth_interval": 7,
    "_growth_tracker": 0,
  }
  assert [type(v) for v in d.values()] == [float, float, float, int, int]


def test_state_dict_of_a_disabled_scaler_is_empty():
  assert jaxamp.scaler.state_dict(scaler_state(enabled=False)) == {}


def test_state_dict_round_trips_with_torch():
  torch = pytest.importorskip("torch")
  torch_scaler = torch.amp.GradScaler(
    "cpu", init_scale=300.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=3
  )
  torch_scaler.scale(torch.ones(()))
  torch_scaler.update(123.5)
  state = jaxamp.scaler.load_state_dict(scaler_state(), torch_scaler.state_dict())
  assert jaxamp.scaler.state_dict(state) == torch_scaler.state_dict()
  back = torch.amp.GradScaler("cpu")
  back.load_state_dict(jaxamp.scaler.state_dict(state))
  assert back.state_dict() == torch_scaler.state_dict()


# --- load_state_dict ------------------------------------------------------------------------------


@pytest.mark.slow
def test_load_state_dict_restores_scale_tracker_and_hyperparameters():
  tx = scaler()
  state = jaxamp.scaler.load_state_dict(
    tx.init(PARAMS),
    {
      "scale": 100.0,
      "growth_factor": 1.1,
      "backoff_factor": 0.3,
      "growth_interval": 2,
      "_growth_tracker": 1,
    },
  )
  assert state.scale.dtype == jnp.float32 and state.growth_tracker.dtype == jnp.int32
  step = jax.jit(lambda g, s: tx.update(g, s, PARAMS))
  _, grown = step(jax.tree.map(jnp.ones_like, PARAMS), state)  # tracker 1 -> 2: grow by 1.1
  assert grown.scale == np.float32(np.float64(np.float32(100.0)) * 1.1)
  _, backed_off = step(jax.tree.map(lambda param: param * jnp.nan, PARAMS), state)
  assert backed_off.scale == np.float32(100.0 * 0.3)


def test_load_state_dict_of_a_torch_dict_restores_the_hyperparameters_to_the_last_bit():
  d = {
    "scale": 3e38,
    "growth_factor": 1.0000000000000002,
    "backoff_factor": 0.1 + 0.2,
    "growth_interval": 2**31 - 1,
    "_growth_tracker": 2**31 - 2,
  }
  state = jax.jit(lambda s: jaxamp.scaler.load_state_dict(s, d))(scaler_state())
  assert jaxamp.scaler.state_dict(state) == dict(d, scale=float(np.float32(3e38)))


def test_load_state_dict_keeps_enabled_and_axis_name():
  state = scaler(axis_name=("data", "model")).init(PARAMS)
  loaded = jaxamp.scaler.load_state_dict(
    state, dict(jaxamp.scaler.state_dict(state), growth_factor=4.0)
  )
  assert loaded.hyperparams.axis_name == ("data", "model") and loaded.enabled


@pytest.mark.slow
def test_load_state_dict_accepts_a_zero_scale_reached_by_backing_off():
  tx = scaler(optax.sgd(0.1), init_scale=1e-45)
  state = tx.init(PARAMS)
  _, state = jax.jit(tx.update)(jax.tree.map(lambda param: param * jnp.nan, PARAMS), state, PARAMS)
  assert state.scale == 0.0
  loaded = jaxamp.scaler.load_state_dict(state, jaxamp.scaler.state_dict(state))
  assert jaxamp.scaler.state_dict(loaded)["scale"] == 0


def test_load_state_dict_into_a_disabled_scaler_is_a_no_op_even_for_an_empty_dict():
  state = scaler_state(enabled=False)
  assert jaxamp.scaler.load_state_dict(state, {}) is state
  assert jax.jit(lambda s: jaxamp.scaler.load_state_dict(s, {"scale": "junk"}))(state).scale == 1.0


def test_load_state_dict_updates_an_nnx_optimizer_in_place():
  optimizer = nnx.Optimizer(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), scaler(), wrt=nnx.Param)
  d = dict(jaxamp.scaler.state_dict(optimizer), scale=32.0, backoff_factor=0.25)
  assert jaxamp.scaler.load_state_dict(optimizer, d) is optimizer
  assert jaxamp.scaler.state_dict(optimizer) == d


STATE_DICT = {
  "scale": 8.0,
  "growth_factor": 2.0,
  "backoff_factor": 0.5,
  "growth_interval": 10,
  "_growth_tracker": 3,
}


def test_load_state_dict_ignores_extra_keys_like_torch():
  loaded = jaxamp.scaler.load_state_dict(scaler_state(), {**STATE_DICT, "extra": 1, "step": 7})
  assert jaxamp.scaler.state_dict(loaded) == STATE_DICT


def test_load_state_dict_accepts_numpy_scalars():
  loaded = jaxamp.scaler.load_state_dict(
    scaler_state(), {**STATE_DICT, "scale": np.float32(8.0), "_growth_tracker": np.int64(3)}
  )
  assert jaxamp.scaler.state_dict(loaded) == STATE_DICT


def test_load_state_dict_accepts_the_array_that_get_scale_returns():
  d = {**STATE_DICT, "scale": jaxamp.scaler.get_scale(scaler_state(init_scale=8.0))}
  assert jaxamp.scaler.state_dict(jaxamp.scaler.load_state_dict(scaler_state(), d)) == STATE_DICT


# --- min_scale, which torch does not have ---------------------------------------------------------


def test_state_dict_adds_min_scale_only_when_set_and_load_state_dict_restores_it():
  floored = scaler_state(min_scale=2.0)
  d = jaxamp.scaler.state_dict(floored)
  assert list(d) == [*TORCH_KEYS, "min_scale"] and d["min_scale"] == 2.0
  assert jaxamp.scaler.load_state_dict(scaler_state(), d).min_scale == 2.0
  assert jaxamp.scaler.load_state_dict(floored, dict(d, min_scale=None)).min_scale is None


def test_load_state_dict_without_min_scale_keeps_the_programs_floor():
  torch_dict = jaxamp.scaler.state_dict(scaler_state())
  assert jaxamp.scaler.load_state_dict(scaler_state(min_scale=2.0), torch_dict).min_scale == 2.0


@pytest.mark.parametrize(
  "min_scale, error", [(0.0, ValueError), (math.inf, ValueError), ("1", TypeError)]
)
def test_load_state_dict_rejects_a_bad_min_scale_naming_the_valid_choices(min_scale, error):
  d = dict(jaxamp.scaler.state_dict(scaler_state()), min_scale=min_scale)
  with pytest.raises(error, match=r"`min_scale` must be None \(no floor, as in torch\) or a real"):
    jaxamp.scaler.load_state_dict(scaler_state(), d)


def test_a_min_scale_state_dict_loads_into_torch_which_ignores_the_floor():
  torch = pytest.importorskip("torch")
  d = jaxamp.scaler.state_dict(scaler_state(min_scale=2.0))
  back = torch.amp.GradScaler("cpu")
  back.load_state_dict(d)
  assert back.state_dict() == {k: d[k] for k in TORCH_KEYS}


# --- bad dicts ------------------------------------------------------------------------------------


TORCH_EMPTY_MESSAGE = (
  "The source state dict is empty, possibly because it was saved from a "
  "disabled instance of GradScaler."
)


def test_load_state_dict_of_an_empty_dict_raises_a_runtime_error_like_torch():
  with pytest.raises(
    RuntimeError,
    match=r"`state_dict` is empty, possibly because it was saved "
    r"from a disabled scaler",
  ) as error:
    jaxamp.scaler.load_state_dict(scaler_state(), {})
  assert isinstance(error.value, ValueError)  # and a ValueError, as jaxamp's other bad values
  assert TORCH_EMPTY_MESSAGE in str(error.value)


def test_load_state_dict_empty_error_quotes_live_torch():
  torch = pytest.importorskip("torch")
  with pytest.raises(RuntimeError) as torch_error:
    torch.amp.GradScaler("cpu").load_state_dict({})
  assert str(torch_error.value) == TORCH_EMPTY_MESSAGE


@pytest.mark.parametrize("missing", sorted(STATE_DICT))
def test_load_state_dict_with_a_missing_key_names_the_expected_keys(missing):
  partial = {k: v for k, v in STATE_DICT.items() if k != missing}
  with pytest.raises(ValueError, match=rf"`state_dict` lacks the keys \['{missing}'\]; expected"):
    jaxamp.scaler.load_state_dict(scaler_state(), partial)


@pytest.mark.parametrize(
  "d, error, message",
  [
    (None, TypeError, r"`state_dict` must be a dict, got NoneType"),
    ([("scale", 1.0)], TypeError, r"`state_dict` must be a dict, got list"),
    ({**STATE_DICT, "scale": "8"}, TypeError, r"`scale` must be a real number"),
    (
      {**STATE_DICT, "scale": -1.0},
      ValueError,
      r"`scale` must be >= 0 and finite in float32.*-1.0",
    ),
    ({**STATE_DICT, "scale": math.nan}, ValueError, r"`scale` must be >= 0 and finite.*nan"),
    (
      {**STATE_DICT, "scale": 1e39},
      ValueError,
      r"`scale` must be >= 0 and finite in float32.*1e\+39",
    ),
    (
      {**STATE_DICT, "_growth_tracker": -1},
      ValueError,
      r"`_growth_tracker` must be an int in \[0, .*-1",
    ),
    ({**STATE_DICT, "_growth_tracker": 0.5}, TypeError, r"`_growth_tracker` must be an int.*0.5"),
    (
      {**STATE_DICT, "growth_interval": 0},
      ValueError,
      r"`growth_interval` must be an int in \[1, .*0",
    ),
    ({**STATE_DICT, "growth_factor": 0.9}, ValueError, r"`growth_factor` must be > 1.0.*got 0.9"),
    ({**STATE_DICT, "backoff_factor": 1.5}, ValueError, r"`backoff_factor` must satisfy.*1.5"),
  ],
)
def test_load_state_dict_rejects_malformed_values_naming_them(d, error, message):
  with pytest.raises(error, match=message):
    jaxamp.scaler.load_state_dict(scaler_state(), d)


def test_a_growth_tracker_past_a_lowered_interval_round_trips():
  # set_growth_interval below the tracker leaves it counting on until the next overflow, as
  # torch's does; the state_dict of that state loads, into jaxamp as into torch.
  state = scaler_state(growth_interval=10)
  step = jax.jit(lambda g, s: scaler(growth_interval=3).update(g, s, PARAMS))
  state = jaxamp.scaler.load_state_dict(
    state, {**jaxamp.scaler.state_dict(state), "_growth_tracker": 5}
  )
  state = jaxamp.scaler.set_growth_interval(state, 3)
  saved = jaxamp.scaler.state_dict(state)
  assert saved["_growth_tracker"] == 5 and saved["growth_interval"] == 3
  assert jaxamp.scaler.state_dict(jaxamp.scaler.load_state_dict(scaler_state(), saved)) == saved
  _, stepped = step(jax.tree.map(jnp.ones_like, PARAMS), state)
  assert int(stepped.growth_tracker) == 6 and float(stepped.scale) == 1024.0


def test_load_state_dict_rejects_a_growth_tracker_past_int32():
  with pytest.raises(ValueError, match=r"`_growth_tracker` must be an int in \[0, 2\*\*31 - 1\]"):
    jaxamp.scaler.load_state_dict(scaler_state(), {**STATE_DICT, "_growth_tracker": 2**31})


def test_state_dict_under_jit_raises_naming_get_scale():
  with pytest.raises(TypeError, match="outside `jit`.*get_scale"):
    jax.jit(lambda s: jaxamp.scaler.state_dict(s)["scale"])(scaler_state())


def test_load_state_dict_of_a_traced_scale_raises_naming_set_scale():
  load = lambda s, scale: jaxamp.scaler.load_state_dict(s, {**STATE_DICT, "scale": scale})
  with pytest.raises(TypeError, match="outside `jit`.*set_scale"):
    jax.jit(load)(scaler_state(), jnp.float32(8.0))


PMAP_REPLICATED = """
import jax, jax.numpy as jnp, optax, jaxamp

params = {"w": jnp.ones(3)}
tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**16)
state = jax.pmap(lambda _: tx.init(params))(jnp.arange(2))  # one copy per device
assert jaxamp.scaler.get_scale(state).shape == (2,)
saved = jaxamp.scaler.state_dict(state)
assert saved["scale"] == 2.0**16 and saved["_growth_tracker"] == 0, saved
state = jaxamp.scaler.set_scale(state, 1024.0)
assert jaxamp.scaler.get_scale(state).tolist() == [1024.0, 1024.0]
state = jaxamp.scaler.load_state_dict(state, saved)
assert jaxamp.scaler.get_scale(state).tolist() == [2.0**16, 2.0**16]
diverged = state._replace(scale=jnp.asarray([1.0, 2.0]))
try:
  jaxamp.scaler.state_dict(diverged)
except ValueError as error:
  assert "axis_name" in str(error), error
else:
  raise AssertionError("state_dict of diverged replicas did not raise")
print("OK")
"""


def test_the_accessors_read_and_write_a_pmap_replicated_state():
  out = cpu_devices.run_script(PMAP_REPLICATED, devices=2)
  assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def test_torch_load_state_dict_checks_nothing_where_jaxamp_validates():
  torch = pytest.importorskip("torch")
  torch_scaler = torch.amp.GradScaler("cpu")
  bad = {
    "scale": -1.0,
    "growth_factor": 0.5,
    "backoff_factor": 3.0,
    "growth_interval": 0,
    "_growth_tracker": 0,
  }
  torch_scaler.load_state_dict(bad)  # accepted by torch
  assert torch_scaler.state_dict() == bad
  with pytest.raises(KeyError):  # torch: a bare KeyError; jaxamp: a ValueError naming every key
    torch_scaler.load_state_dict({"scale": 1.0})
  with pytest.raises(ValueError, match=r"`state_dict` lacks the keys \['growth_factor'"):
    jaxamp.scaler.load_state_dict(scaler_state(), {"scale": 1.0})


# --- flax checkpoints -----------------------------------------------------------------------------


def test_flax_checkpoints_save_and_restore_min_scale():
  saved = serialization.to_bytes(scaler_state(min_scale=2.0))
  assert serialization.from_bytes(scaler_state(), saved).min_scale == 2.0
  unfloored = serialization.to_bytes(scaler_state())
  assert serialization.from_bytes(scaler_state(), unfloored).min_scale is None


def test_flax_checkpoints_leave_axis_name_out_and_restore_the_programs():
  saved = serialization.to_bytes(scaler_state(axis_name="data", growth_factor=3.0))
  target = scaler_state(axis_name="batch")
  restored = serialization.from_bytes(target, saved)
  assert restored.hyperparams.axis_name == "batch" and restored.growth_factor == 3.0


def test_flax_checkpoints_keep_the_programs_enabled_flag():
  """As torch's ``load_state_dict``: a disabled scaler ignores an enabled scaler's checkpoint."""
  saved = serialization.to_bytes(scaler_state(growth_factor=3.0))
  restored = serialization.from_bytes(scaler_state(enabled=False), saved)
  assert not restored.enabled and restored.growth_factor == 2.0
  assert jaxamp.scaler.get_scale(restored) == 1.0


def test_a_flax_checkpoint_of_a_disabled_scaler_is_refused_by_an_enabled_one():
  saved = serialization.to_bytes(scaler_state(enabled=False))
  with pytest.raises(jaxamp.scaler.EmptyStateDictError, match="disabled loss scaler"):
    serialization.from_bytes(scaler_state(), saved)
