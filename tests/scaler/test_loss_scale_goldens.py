"""`dynamic_loss_scale(optax.sgd(lr))` follows torch's GradScaler trajectories step by step.

The golden file (``scripts/record_gradscaler_goldens.py``) holds, per step, the scaled gradients a
real ``torch.amp.GradScaler("cpu")`` saw, Inf/NaN included. Replaying them must give the same
scale bit for bit, the same growth tracker and found_inf, and the same parameters up to float32
rounding of the SGD step. When torch is installed the same runs are made live, and a model is
trained end to end in both frameworks.

XLA:CPU flushes subnormal float32 operands to zero, torch on CPU does not. Once torch's *scaled
gradients* are subnormal (scales below ~1e-38) the parameters may part; the scale never does.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import script_modules
from paths import ROOT

import jaxamp

GOLDENS = json.loads((ROOT / "tests" / "goldens" / "gradscaler_trajectories.json").read_text())


recorder = script_modules.load("record_gradscaler_goldens")


@functools.cache
def flushes_subnormals():
  tiny = jnp.float32(1e-40)
  return bool(jax.jit(lambda x, y: x * y)(tiny, jnp.float32(1.0)) == 0)


@functools.cache
def scaler_and_step(lr, growth_factor, backoff_factor, growth_interval):
  """One compiled step per hyperparameter set (the init scale is only a value)."""
  tx = jaxamp.dynamic_loss_scale(
    optax.sgd(lr),
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
  )

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, step


def unpack(tree):
  return {
    "W": jnp.asarray(recorder.from_hex(tree["W"], (2, 3))),
    "b": jnp.asarray(recorder.from_hex(tree["b"], (2,))),
  }


def has_subnormal(tree):
  x = np.concatenate([np.asarray(v).ravel() for v in tree.values()])
  return bool(np.any((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)))


def replay(trajectory):
  """Feeds torch's scaled gradients to jaxamp and compares every step."""
  c = trajectory["config"]
  tx, step = scaler_and_step(c["lr"], c["growth_factor"], c["backoff_factor"], c["growth_interval"])
  params = unpack(trajectory["init_params"])
  state = tx.init(params)._replace(scale=jnp.asarray(c["init_scale"], jnp.float32))
  compare_params = True
  for i, recorded in enumerate(trajectory["steps"]):
    grads = unpack(recorded["grads"])
    if has_subnormal(grads) and flushes_subnormals():
      compare_params = False  # see the module docstring
    params, state = step(params, state, grads)
    where = f"{c} step {i}"
    assert f"0x{int(np.asarray(state.scale).view(np.uint32)):08x}" == recorded["scale_hex"], where
    assert float(state.scale) == recorded["scale"], where
    assert int(state.growth_tracker) == recorded["growth_tracker"], where
    assert bool(state.found_inf) == recorded["found_inf"], where
    if compare_params:
      for name, value in unpack(recorded["params"]).items():
        np.testing.assert_allclose(
          params[name], value, rtol=1e-6, atol=1e-7, equal_nan=True, err_msg=where
        )
  assert jaxamp.scaler.state_dict(state) == trajectory["state_dict"]


@pytest.mark.parametrize("index", range(len(GOLDENS["trajectories"])))
@pytest.mark.slow
def test_golden_trajectory_replays_with_bitwise_equal_scales(index):
  replay(GOLDENS["trajectories"][index])


def test_goldens_cover_huge_tiny_and_non_power_of_two_settings():
  configs = [t["config"] for t in GOLDENS["trajectories"]]
  assert len(configs) >= 30
  scales = {c["init_scale"] for c in configs}
  assert {1e38, 3.4028234e38, 1e-30, 1e-44, 3e-45} <= scales
  assert {c["growth_factor"] for c in configs} == {2.0, 1.1, 16.0}
  assert {c["backoff_factor"] for c in configs} == {0.5, 0.3, 0.25}
  assert {c["growth_interval"] for c in configs} == {1, 2, 3, 4, 5}
  steps = [s for t in GOLDENS["trajectories"] for s in t["steps"]]
  assert 0.1 < np.mean([s["found_inf"] for s in steps]) < 0.6
  kinds = {inj[2] for t in GOLDENS["trajectories"] for inj in t["injections"] if inj}
  assert kinds == {"inf", "-inf", "nan"}


@pytest.mark.slow
def test_live_torch_trajectories_replay_with_bitwise_equal_scales():
  pytest.importorskip("torch")
  for config in recorder.make_configs(per_set=1, seed=7):
    replay(recorder.run_config(config))


@pytest.mark.slow
def test_live_end_to_end_training_matches_torch():
  torch = pytest.importorskip("torch")
  config = dict(
    recorder.HYPERPARAMETER_SETS[4], init_scale=2.0**16, p_inject=0.3, seed=11, steps=24, lr=0.05
  )  # growth 1.1, backoff 0.3, interval 2
  expected = recorder.run_config(config)
  tx, _ = scaler_and_step(
    config["lr"], config["growth_factor"], config["backoff_factor"], config["growth_interval"]
  )

  @jax.jit
  def train_step(params, opt_state, x, y, inject_name_is_w, index, value, inject):
    def loss_fn(params):
      loss = jnp.mean((x @ params["W"].T + params["b"] - y) ** 2)
      return jaxamp.scale_loss(loss, opt_state)

    grads = jax.grad(loss_fn)(params)
    w, b = grads["W"].reshape(-1), grads["b"]
    w = jnp.where(inject & inject_name_is_w, w.at[index % 6].set(value), w)
    b = jnp.where(inject & ~inject_name_is_w, b.at[index % 2].set(value), b)
    grads = {"W": w.reshape(2, 3), "b": b}
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {k: jnp.asarray(v) for k, v in recorder.initial_params(config["seed"]).items()}
  opt_state = tx.init(params)._replace(scale=jnp.float32(config["init_scale"]))
  for i, (inject, recorded) in enumerate(
    zip(expected["injections"], expected["steps"], strict=True)
  ):
    x, y = recorder.batch(config["seed"], i)
    name, index, value = inject or ("W", 0, "0")
    params, opt_state = train_step(
      params, opt_state, x, y, name == "W", index, float(value), inject is not None
    )
    assert f"0x{int(np.asarray(opt_state.scale).view(np.uint32)):08x}" == recorded["scale_hex"]
    assert bool(opt_state.found_inf) == recorded["found_inf"]
    for k, v in unpack(recorded["params"]).items():
      np.testing.assert_allclose(params[k], v, rtol=2e-5, atol=1e-6)
  assert torch.__version__  # the comparison ran against a real torch
