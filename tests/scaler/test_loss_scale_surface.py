"""The rest of torch's GradScaler, functionally: ``unscale``, ``update(..., found_inf=...)``,
``set_scale``, the hyperparameter getters and setters, and scripts of them with
``load_state_dict`` (``jaxamp.scaler``); ``scale_loss`` and ``state_dict`` have modules of their
own (``test_scale_loss.py``, ``test_state_dict.py``).

Where torch defines the behaviour the reference is torch itself: golden files recorded by
``scripts/record_gradscaler_surface_goldens.py`` (``gradscaler_goldens``), and the same runs
made live when torch is installed. Everything runs under ``jax.jit``. Where jaxamp deliberately
differs from torch, a test named after the difference shows both sides (torch live).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from gradscaler_goldens import SURFACE_GOLDENS, assert_bitwise_equal, recorder

import jaxamp

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}


def scaler(inner=None, **kwargs):
  kwargs.setdefault("init_scale", 1024.0)
  return jaxamp.dynamic_loss_scale(inner or optax.sgd(0.1), **kwargs)


def assert_trees_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def f32_from_hex(h):
  return recorder.decode({"dtype": "float32", "shape": [], "data": [h]})


def scale_hex(state):
  return f"0x{int(np.asarray(jaxamp.scaler.get_scale(state)).view(np.uint32)):08x}"


# ------------------------------------------------------------------------------------------------
# unscale: torch's unscale_, returning (unscaled grads, found_inf).


def unscale_id(case):
  poisoned = "finite" if not case["found_inf"] else "non-finite"
  return f"{case['unscaled'][0]['dtype']}-{poisoned}-x{case['init_scale']}"


def unscale_like_torch(case):
  grads = [jnp.asarray(recorder.decode(g)) for g in case["scaled"]]
  state = scaler(init_scale=case["init_scale"]).init(PARAMS)
  assert scale_hex(state) == case["scale_hex"]
  return jax.jit(jaxamp.unscale)(grads, state)


@pytest.mark.parametrize("case", SURFACE_GOLDENS["unscale"], ids=unscale_id)
@pytest.mark.slow_after_first
def test_unscale_returns_torch_unscaled_bits_and_found_inf(case):
  grads, found_inf = unscale_like_torch(case)
  assert found_inf.dtype == jnp.bool_ and found_inf.shape == ()
  assert bool(found_inf) == case["found_inf"]
  for g, expected in zip(grads, case["unscaled"], strict=True):
    assert_bitwise_equal(g, recorder.decode(expected))


def test_unscale_goldens_include_huge_scales_whose_inverse_is_subnormal():
  scales = {c["init_scale"] for c in SURFACE_GOLDENS["unscale"]}
  assert {2.0**127, 3.0e38} <= scales
  assert {c["unscaled"][0]["dtype"] for c in SURFACE_GOLDENS["unscale"]} == {"float32", "bfloat16"}


def test_unscale_matches_live_torch():
  pytest.importorskip("torch")
  for i, scale in enumerate((2.0**16, 30001.7, 2.0**127)):
    for dtype in ("float32", "bfloat16"):
      case = recorder.run_unscale_case(scale, dtype, "nan" if i == 1 else None, 1000 + i)
      grads, found_inf = unscale_like_torch(case)
      assert bool(found_inf) == case["found_inf"]
      for g, expected in zip(grads, case["unscaled"], strict=True):
        assert_bitwise_equal(g, recorder.decode(expected))


MIXED_GRADS = {
  "f32": jnp.array([3.0, -7.5e4, 1e-3]),
  "bf16": jnp.array([3.0, 1e5], jnp.bfloat16),
  "f16": jnp.array([3.0, 6e4], jnp.float16),
  "int": jnp.array([1, 2], jnp.int32),
}


@pytest.mark.slow
def test_unscale_gives_the_same_bits_as_the_update_and_keeps_each_dtype():
  tx = scaler(optax.identity(), init_scale=30001.7)  # identity: updates are the unscaled grads
  state = tx.init(MIXED_GRADS)
  grads, found_inf = jax.jit(jaxamp.unscale)(MIXED_GRADS, state)
  updates, _ = jax.jit(tx.update)(MIXED_GRADS, state)
  assert not found_inf
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, MIXED_GRADS)
  assert_trees_bitwise_equal(grads, updates)


def test_unscale_leaves_the_optimizer_state_unchanged():
  state = scaler().init(PARAMS)
  before = jax.tree.map(np.asarray, state)
  jax.jit(jaxamp.unscale)(PARAMS, state)
  assert_trees_bitwise_equal(state, before)


def test_unscale_of_a_disabled_scaler_returns_the_grads_unmodified_and_false():
  state = scaler(enabled=False).init(PARAMS)
  grads = {"w": jnp.array([1.0, jnp.inf, 2.0]), "b": jnp.array(4.0)}
  unscaled, found_inf = jaxamp.unscale(grads, state)
  assert unscaled is grads and not found_inf


@pytest.mark.slow
def test_unscale_reduces_found_inf_over_the_scalers_axis_name():
  grads = jnp.array([[4.0, 4.0], [4.0, jnp.inf]])  # only the second shard overflows
  shared = scaler(init_scale=4.0, axis_name="data").init(jnp.zeros(2))
  local = scaler(init_scale=4.0).init(jnp.zeros(2))
  unscale = jax.jit(jax.vmap(jaxamp.unscale, in_axes=(0, None), axis_name="data"))
  assert unscale(grads, shared)[1].tolist() == [True, True]
  assert unscale(grads, local)[1].tolist() == [False, True]
  assert unscale(grads, shared)[0][0].tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_unscale_accepts_float16_gradients_which_torch_unscale_refuses():
  # torch's unscale_ raises "Attempting to unscale FP16 gradients." for float16 *parameters*;
  # jaxamp's update has always unscaled float16 gradients in float32, and unscale matches it.
  grads, _ = jaxamp.unscale(
    {"g": jnp.array([6e4], jnp.float16)}, scaler(init_scale=4.0).init(PARAMS)
  )
  assert grads["g"].dtype == jnp.float16 and grads["g"].tolist() == [15000.0]
  torch = pytest.importorskip("torch")
  param = torch.zeros(1, dtype=torch.float16, requires_grad=True)
  param.grad = torch.tensor([6e4], dtype=torch.float16)
  torch_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
  torch_scaler.scale(torch.ones(()))
  with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
    torch_scaler.unscale_(torch.optim.SGD([param], lr=0.1))


# ------------------------------------------------------------------------------------------------
# update(..., found_inf=...): the functional form of step() after unscale_().


@pytest.mark.slow
def test_update_with_found_inf_treats_the_grads_as_already_unscaled():
  tx = scaler(optax.adam(0.1), init_scale=30001.7, growth_interval=1)
  state = tx.init(PARAMS)
  scaled = jax.tree.map(lambda param: param * 30001.7, PARAMS)

  @jax.jit
  def unscale_then_update(scaled, state):
    grads, found_inf = jaxamp.unscale(scaled, state)
    return tx.update(grads, state, PARAMS, found_inf=found_inf)

  assert_trees_bitwise_equal(
    unscale_then_update(scaled, state), jax.jit(tx.update)(scaled, state, PARAMS)
  )


@pytest.mark.slow
def test_clipping_outside_the_wrapper_after_unscale_equals_clipping_inside_it():
  clip = optax.clip_by_global_norm(1.0)
  inside = scaler(optax.chain(clip, optax.sgd(0.1)), init_scale=2.0**16)
  outside = scaler(optax.sgd(0.1), init_scale=2.0**16)
  scaled = jax.tree.map(lambda param: param * 2.0**16, PARAMS)

  @jax.jit
  def clip_outside(scaled, state):
    grads, found_inf = jaxamp.unscale(scaled, state)
    grads, _ = clip.update(grads, clip.init(grads))
    return outside.update(grads, state, PARAMS, found_inf=found_inf)

  updates, state = clip_outside(scaled, outside.init(PARAMS))
  expected_updates, expected_state = jax.jit(inside.update)(scaled, inside.init(PARAMS), PARAMS)
  assert_trees_bitwise_equal(updates, expected_updates)
  assert_trees_bitwise_equal(state.inner_state, expected_state.inner_state[1])
  assert state.scale == expected_state.scale and state.growth_tracker == 1


@pytest.mark.slow
def test_update_skips_exactly_when_found_inf_is_true_as_torch_step_after_unscale():
  tx = scaler(optax.sgd(1.0), init_scale=8.0)
  state = tx.init(PARAMS)
  update = jax.jit(lambda g, s, f: tx.update(g, s, PARAMS, found_inf=f))
  updates, skipped = update(PARAMS, state, jnp.array(True))  # finite grads, reported overflow
  assert all(np.all(u == 0) for u in jax.tree.leaves(updates))
  assert skipped.found_inf and skipped.scale == 4.0 and skipped.skipped_steps == 1
  nan_grads = jax.tree.map(lambda param: param * jnp.nan, PARAMS)  # torch steps with them too
  updates, stepped = update(nan_grads, state, jnp.array(False))
  assert all(np.all(np.isnan(u)) for u in jax.tree.leaves(updates))
  assert not stepped.found_inf and stepped.growth_tracker == 1


@pytest.mark.slow
def test_found_inf_is_consumed_by_the_scaler_and_other_extra_args_reach_the_inner_optimizer():
  seen = {}

  def inner_update(updates, state, params=None, **extra_args):
    seen.update(extra_args)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), inner_update)
  tx = scaler(inner)
  tx.update(PARAMS, tx.init(PARAMS), PARAMS, found_inf=jnp.array(False), value=3.0)
  assert seen == {"value": 3.0}


def test_found_inf_passes_through_optax_chain_to_the_scaler():
  tx = optax.chain(optax.add_decayed_weights(0.0), scaler(optax.sgd(1.0), init_scale=8.0))
  state = tx.init(PARAMS)
  _, state = jax.jit(lambda g, s: tx.update(g, s, PARAMS, found_inf=jnp.array(True)))(PARAMS, state)
  assert jaxamp.scaler.get_scale(state) == 4.0


@pytest.mark.parametrize(
  "found_inf, message",
  [
    (jnp.array([True]), r"got a bool array of shape \(1,\)"),
    (jnp.array(1.0), r"got a float32 array of shape \(\)"),
    (1, r"got int"),
  ],
)
def test_update_rejects_a_found_inf_that_is_not_a_bool_scalar(found_inf, message):
  tx = scaler()
  with pytest.raises(
    TypeError,
    match=r"`found_inf` must be a bool scalar \(the second output of "
    r"`jaxamp.unscale`\), " + message,
  ):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, found_inf=found_inf)


def test_disabled_scaler_update_ignores_found_inf():
  tx = scaler(optax.sgd(1.0), enabled=False)
  updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS, found_inf=jnp.array(True))
  assert_trees_bitwise_equal(updates, jax.tree.map(lambda param: -param, PARAMS))


# The recipe of torch's "Working with unscaled gradients": unscale_, clip_grad_norm_, step, update.


def torch_clip_grad_norm(grads, max_norm):
  """``torch.nn.utils.clip_grad_norm_``'s arithmetic: norm of the per-tensor norms, coef + 1e-6."""
  total = jnp.linalg.norm(jnp.stack([jnp.linalg.norm(g.ravel()) for g in jax.tree.leaves(grads)]))
  coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
  return jax.tree.map(lambda g: g * coef, grads), total


@functools.cache
def clip_recipe(cfg_items):
  cfg = dict(cfg_items)
  tx = jaxamp.dynamic_loss_scale(
    optax.sgd(cfg["lr"], momentum=cfg["momentum"]),
    init_scale=cfg["init_scale"],
    growth_factor=cfg["growth_factor"],
    backoff_factor=cfg["backoff_factor"],
    growth_interval=cfg["growth_interval"],
  )

  @jax.jit
  def step(params, opt_state, scaled_grads):
    grads, found_inf = jaxamp.unscale(scaled_grads, opt_state)
    clipped, total_norm = torch_clip_grad_norm(grads, cfg["max_norm"])
    updates, opt_state = tx.update(clipped, opt_state, params, found_inf=found_inf)
    return optax.apply_updates(params, updates), opt_state, grads, total_norm

  return tx, step


def replay_clip_recipe(recorded):
  cfg = recorded["config"]
  tx, step = clip_recipe(tuple(sorted(cfg.items())))
  params = {k: jnp.asarray(recorder.decode(v)) for k, v in recorded["init_params"].items()}
  opt_state = tx.init(params)
  for i, expected in enumerate(recorded["steps"]):
    scaled = {k: jnp.asarray(recorder.decode(v)) for k, v in expected["scaled"].items()}
    params, opt_state, grads, total_norm = step(params, opt_state, scaled)
    where = f"step {i}"
    for k, v in expected["unscaled"].items():
      assert_bitwise_equal(grads[k], recorder.decode(v), err_msg=where)
    np.testing.assert_allclose(
      total_norm, f32_from_hex(expected["total_norm"]), rtol=1e-6, equal_nan=True, err_msg=where
    )
    assert bool(opt_state.found_inf) == expected["found_inf"], where
    assert scale_hex(opt_state) == expected["scale_hex"], where
    assert int(opt_state.growth_tracker) == expected["growth_tracker"], where
    for k, v in expected["params"].items():
      np.testing.assert_allclose(params[k], recorder.decode(v), rtol=1e-5, atol=1e-6, err_msg=where)
  assert jaxamp.scaler.state_dict(opt_state) == recorded["state_dict"]


@pytest.mark.slow
def test_unscale_clip_update_replays_torch_unscale_clip_grad_norm_step_update():
  replay_clip_recipe(SURFACE_GOLDENS["clip_recipe"])


def test_clip_recipe_golden_clips_some_steps_and_skips_others():
  steps = SURFACE_GOLDENS["clip_recipe"]["steps"]
  norms = [f32_from_hex(s["total_norm"]) for s in steps]
  max_norm = SURFACE_GOLDENS["clip_recipe"]["config"]["max_norm"]
  finite = [float(n) for n in norms if np.isfinite(n)]
  assert any(n > max_norm for n in finite) and any(n < max_norm for n in finite)
  assert 3 <= sum(s["found_inf"] for s in steps) < len(steps) // 2


@pytest.mark.slow
def test_unscale_clip_recipe_trained_end_to_end_matches_live_torch():
  pytest.importorskip("torch")
  cfg = dict(recorder.CLIP_CONFIG, seed=5, steps=12)
  expected = recorder.run_clip_recipe(cfg)
  tx, _ = clip_recipe(tuple(sorted(cfg.items())))

  @jax.jit
  def train_step(params, opt_state, x, y, poison_w, poison_b):
    def loss_fn(params):
      return jaxamp.scale_loss(jnp.mean((x @ params["W"].T + params["b"] - y) ** 2), opt_state)

    scaled = jax.grad(loss_fn)(params)
    scaled = {"W": scaled["W"] + poison_w, "b": scaled["b"] + poison_b}
    grads, found_inf = jaxamp.unscale(scaled, opt_state)
    grads, _ = torch_clip_grad_norm(grads, cfg["max_norm"])
    updates, opt_state = tx.update(grads, opt_state, params, found_inf=found_inf)
    return optax.apply_updates(params, updates), opt_state

  params = {k: jnp.asarray(v) for k, v in recorder.clip_initial_params(cfg["seed"]).items()}
  opt_state = tx.init(params)
  for i, (inject, recorded) in enumerate(
    zip(expected["injections"], expected["steps"], strict=True)
  ):
    poison = {"W": np.zeros(6, np.float32), "b": np.zeros(2, np.float32)}
    if inject is not None:
      poison[inject[0]][inject[1]] = float(inject[2])
    x, y = recorder.clip_batch(cfg["seed"], i)
    params, opt_state = train_step(params, opt_state, x, y, poison["W"].reshape(2, 3), poison["b"])
    assert scale_hex(opt_state) == recorded["scale_hex"], i
    assert bool(opt_state.found_inf) == recorded["found_inf"], i
    for k, v in recorded["params"].items():
      np.testing.assert_allclose(params[k], recorder.decode(v), rtol=2e-5, atol=1e-6, err_msg=i)
  assert sum(s["found_inf"] for s in expected["steps"]) >= 1


# ------------------------------------------------------------------------------------------------
# Scripts: set_scale, the setters and load_state_dict against torch, op by op.


SCRIPT_TX = jaxamp.dynamic_loss_scale(optax.sgd(0.1))


@jax.jit
def script_step(state, grads):
  """``update`` reads every hyperparameter from the state, so one transformation replays every
  script; jit compiles once per set of (static) hyperparameters, shared by the golden and live
  replays."""
  return SCRIPT_TX.update(grads, state, jnp.zeros(2))[1]


@jax.jit
def script_step_new_scale(state, grads, new_scale):
  """torch's ``step(); update(new_scale)``: the update's ``new_scale=``."""
  return SCRIPT_TX.update(grads, state, jnp.zeros(2), new_scale=new_scale)[1]


def script_grads(kind):
  return jnp.array([1.0, jnp.inf if kind == "inf" else 2.0])


@functools.cache
def jitted(op):
  if op == "update_new_scale":  # a Python float, validated at trace time
    return jax.jit(jaxamp.scaler.set_scale, static_argnums=1)
  if op == "update_new_scale_tensor":  # a traced 0-d float32 array
    return jax.jit(jaxamp.scaler.set_scale)
  return jax.jit(getattr(jaxamp.scaler, op), static_argnums=1)


def apply_op(state, op, arg):
  """One golden operation on jaxamp's side, under jit."""
  if op == "step":
    return script_step(state, script_grads(arg))
  if op == "step_new_scale":
    kind, new_scale = arg
    return script_step_new_scale(state, script_grads(kind), jnp.float32(new_scale))
  if op == "update_new_scale_tensor":
    return jitted(op)(state, jnp.float32(arg))
  if op == "load_state_dict":  # a dict is not hashable: close over it
    return jax.jit(lambda s: jaxamp.scaler.load_state_dict(s, arg))(state)
  return jitted(op)(state, arg)


def replay_script(script):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), **script["init"])
  state = tx.init(jnp.zeros(2))
  for (op, arg), expected in zip(script["ops"], script["after"], strict=True):
    state = apply_op(state, op, arg)
    where = f"{script['name']}: after {op}({arg})"
    assert jaxamp.scaler.state_dict(state) == expected["state_dict"], where
    assert scale_hex(state) == expected["scale_hex"], where
    assert float(jaxamp.scaler.get_scale(state)) == expected["get_scale"], where
    assert jaxamp.scaler.get_growth_factor(state) == expected["get_growth_factor"], where
    assert jaxamp.scaler.get_backoff_factor(state) == expected["get_backoff_factor"], where
    assert jaxamp.scaler.get_growth_interval(state) == expected["get_growth_interval"], where
    assert jaxamp.scaler.is_enabled(state) == expected["is_enabled"], where


@pytest.mark.slow
@pytest.mark.parametrize("script", SURFACE_GOLDENS["scripts"], ids=lambda s: s["name"])
def test_script_replays_torch_state_after_every_operation(script):
  replay_script(script)


@pytest.mark.slow
def test_scripts_match_live_torch():
  pytest.importorskip("torch")
  for name in recorder.SCRIPTS:
    replay_script(recorder.run_script(name))


def test_an_updates_new_scale_replaces_the_automatic_scale_update():
  # torch's step(); update(new_scale): the step counts neither towards growth nor as an overflow.
  tx = scaler(init_scale=8.0, growth_interval=3)
  state = tx.init(PARAMS)
  _, state = tx.update(PARAMS, state, PARAMS)
  _, taken = jax.jit(lambda s: tx.update(PARAMS, s, PARAMS, new_scale=100.0))(state)
  assert taken.scale == 100.0 and taken.growth_tracker == 1 and not taken.found_inf
  bad = jax.tree.map(lambda param: param * jnp.inf, PARAMS)
  _, skipped = tx.update(bad, state, PARAMS, new_scale=jnp.float32(50.0))
  assert skipped.scale == 50.0 and skipped.growth_tracker == 1 and skipped.found_inf


@pytest.mark.parametrize("enabled", [True, False])
def test_an_updates_new_scale_is_validated_as_set_scales(enabled):
  tx = scaler(enabled=enabled)
  with pytest.raises(TypeError, match="`new_scale` must be a float or a 1-element float32"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, new_scale=2)


def test_a_disabled_scalers_update_ignores_new_scale():
  tx = scaler(enabled=False)
  _, state = tx.update(PARAMS, tx.init(PARAMS), PARAMS, new_scale=8.0)
  assert state.scale == 1.0


# ------------------------------------------------------------------------------------------------
# set_scale: torch's update(new_scale).


@pytest.mark.slow
def test_set_scale_keeps_tracker_found_inf_skipped_steps_and_inner_state():
  tx = scaler(optax.adam(0.1), init_scale=8.0)
  state = tx.init(PARAMS)
  _, state = tx.update(PARAMS, state, PARAMS)
  _, state = tx.update(jax.tree.map(lambda param: param * jnp.inf, PARAMS), state, PARAMS)
  _, state = tx.update(PARAMS, state, PARAMS)
  new = jax.jit(jaxamp.scaler.set_scale)(state, jnp.float32(3.5))
  assert new.scale == 3.5 and new.scale.dtype == jnp.float32 and new.scale.shape == ()
  assert_trees_bitwise_equal(new._replace(scale=state.scale), state)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_set_scale_accepts_a_one_element_float32_array_of_any_shape(shape):
  # torch documents "a 1-element FloatTensor" but only a 0-d one copies into its 0-d scale.
  state = jax.jit(jaxamp.scaler.set_scale)(scaler().init(PARAMS), jnp.full(shape, 6.0, jnp.float32))
  assert state.scale.shape == () and state.scale == 6.0


def test_set_scale_accepts_numpy_floats():
  state = scaler().init(PARAMS)
  assert jaxamp.scaler.set_scale(state, np.float64(0.1)).scale == np.float32(0.1)
  assert jaxamp.scaler.set_scale(state, np.float32(0.5)).scale == 0.5


@pytest.mark.parametrize(
  "new_scale, error, message",
  [
    (2, TypeError, r"got int: 2"),
    (True, TypeError, r"got bool: True"),
    ("2.0", TypeError, r"got str: '2.0'"),
    (jnp.array([2.0, 3.0]), TypeError, r"got a float32 array of shape \(2,\)"),
    (jnp.array(2.0, jnp.float16), TypeError, r"got a float16 array of shape \(\)"),
    (np.array([2.0]), TypeError, r"got a float64 array of shape \(1,\)"),
    (0.0, ValueError, r"`new_scale` must be > 0 and finite in float32.*got 0.0"),
    (-1.0, ValueError, r"`new_scale` must be > 0 .*got -1.0"),
    (float("inf"), ValueError, r"`new_scale` must be > 0 and finite.*got inf"),
    (float("nan"), ValueError, r"`new_scale` must be > 0 and finite.*got nan"),
    (1e39, ValueError, r"`new_scale` .*finite in float32.*got 1e\+39"),
  ],
)
def test_set_scale_rejects_anything_but_a_positive_float_or_one_element_float32_array(
  new_scale, error, message
):
  if error is TypeError:
    message = (
      r"`new_scale` must be a float or a 1-element float32 array \(as torch's "
      r"`GradScaler.update\(new_scale\)`\), " + message
    )
  with pytest.raises(error, match=message):
    jaxamp.scaler.set_scale(scaler().init(PARAMS), new_scale)


def test_set_scale_of_a_disabled_scaler_is_a_no_op_after_validation():
  state = scaler(enabled=False).init(PARAMS)
  assert jaxamp.scaler.set_scale(state, 8.0) is state
  with pytest.raises(TypeError, match="`new_scale` must be a float"):
    jaxamp.scaler.set_scale(state, 8)


def test_set_scale_rejects_ints_and_negative_scales_that_torch_takes_or_crashes_on():
  torch = pytest.importorskip("torch")
  torch_scaler = torch.amp.GradScaler("cpu")
  torch_scaler.scale(torch.ones(()))
  with pytest.raises(AttributeError):  # torch: 'int' object has no attribute 'device'
    torch_scaler.update(2)
  torch_scaler.update(-1.0)  # torch takes it: every later loss would be negated
  assert torch_scaler.get_scale() == -1.0
  state = scaler().init(PARAMS)
  with pytest.raises(TypeError, match=r"`new_scale` must be a float .*got int: 2"):
    jaxamp.scaler.set_scale(state, 2)
  with pytest.raises(ValueError, match=r"`new_scale` must be > 0"):
    jaxamp.scaler.set_scale(state, -1.0)


# ------------------------------------------------------------------------------------------------
# Getters and setters of the hyperparameters.


def test_getters_return_python_numbers_like_torch():
  state = scaler(growth_factor=1.1, backoff_factor=0.3, growth_interval=7).init(PARAMS)
  values = (
    jaxamp.scaler.get_growth_factor(state),
    jaxamp.scaler.get_backoff_factor(state),
    jaxamp.scaler.get_growth_interval(state),
    jaxamp.scaler.is_enabled(state),
  )
  assert values == (1.1, 0.3, 7, True)
  assert [type(v) for v in values] == [float, float, int, bool]


def test_getters_work_under_jit_as_static_values():
  @jax.jit
  def grow(state):
    return jaxamp.scaler.get_scale(state) * jaxamp.scaler.get_growth_factor(state)

  assert grow(scaler(init_scale=4.0, growth_factor=3.0).init(PARAMS)) == 12.0


@pytest.mark.slow
def test_set_growth_factor_takes_effect_in_the_next_jitted_update():
  tx = scaler(optax.sgd(0.1), init_scale=10.0, growth_interval=1)
  state = jaxamp.scaler.set_growth_factor(tx.init(PARAMS), 1.1)
  _, state = jax.jit(tx.update)(PARAMS, state, PARAMS)
  assert state.scale == np.float32(np.float64(np.float32(10.0)) * 1.1)
  assert state.growth_factor == 1.1


def test_setters_work_under_jit():
  state = scaler().init(PARAMS)
  new = jax.jit(
    lambda s: jaxamp.scaler.set_backoff_factor(jaxamp.scaler.set_growth_factor(s, 1.5), 0.75)
  )(state)
  assert (new.growth_factor, new.backoff_factor) == (1.5, 0.75)


def test_setters_keep_enabled_and_axis_name():
  state = scaler(axis_name="data").init(PARAMS)
  new = jaxamp.scaler.set_growth_interval(state, 5)
  assert new.hyperparams.axis_name == "data" and new.enabled


def test_getters_and_setters_of_a_disabled_scaler_use_the_constructor_arguments():
  # torch's disabled GradScaler never stores its factors: get_growth_factor() raises
  # AttributeError there. jaxamp keeps them, so a disabled state answers like an enabled one.
  state = scaler(enabled=False, growth_factor=3.0).init(PARAMS)
  assert jaxamp.scaler.get_growth_factor(state) == 3.0 and not jaxamp.scaler.is_enabled(state)
  assert jaxamp.scaler.get_growth_factor(jaxamp.scaler.set_growth_factor(state, 5.0)) == 5.0


def test_torch_disabled_scaler_getters_raise_where_jaxamp_answers():
  torch = pytest.importorskip("torch")
  with pytest.raises(AttributeError, match="_growth_factor"):
    torch.amp.GradScaler("cpu", enabled=False).get_growth_factor()


@pytest.mark.parametrize(
  "setter, value, error, message",
  [
    ("set_growth_factor", 1.0, ValueError, r"`growth_factor` must be > 1.0 .*got 1.0"),
    ("set_growth_factor", float("inf"), ValueError, r"`growth_factor` .*finite.*got inf"),
    ("set_growth_factor", "2", TypeError, r"`growth_factor` must be a real number.*'2'"),
    (
      "set_growth_factor",
      jnp.float32(2.0),
      TypeError,
      r"`growth_factor` must be a real number \(hyperparameters are static Python numbers",
    ),
    ("set_backoff_factor", 1.0, ValueError, r"`backoff_factor` must satisfy 0 < .* < 1.*1.0"),
    ("set_backoff_factor", 0.0, ValueError, r"`backoff_factor` must satisfy.*0.0"),
    ("set_backoff_factor", True, TypeError, r"`backoff_factor` must be a real number.*True"),
    ("set_growth_interval", 0, ValueError, r"`growth_interval` must be an int in \[1, .*0"),
    ("set_growth_interval", 2.0, TypeError, r"`growth_interval` must be an int.*2.0"),
    ("set_growth_interval", 2**31, ValueError, r"`growth_interval` .*2147483648"),
  ],
)
def test_setters_validate_like_the_constructor(setter, value, error, message):
  with pytest.raises(error, match=message):
    getattr(jaxamp.scaler, setter)(scaler().init(PARAMS), value)


def test_torch_setters_accept_values_its_constructor_rejects():
  torch = pytest.importorskip("torch")
  torch_scaler = torch.amp.GradScaler("cpu")
  torch_scaler.set_growth_factor(0.5)  # no check in torch; jaxamp raises as its constructor does
  assert torch_scaler.get_growth_factor() == 0.5
  with pytest.raises(AssertionError, match="growth factor must be > 1.0"):
    torch.amp.GradScaler("cpu", growth_factor=0.5)


# ------------------------------------------------------------------------------------------------
# axis_name lives in the state, so that unscale reduces over it too.


def test_axis_name_is_kept_in_the_state_as_a_hashable_static_value():
  assert scaler(axis_name=["data", "model"]).init(PARAMS).hyperparams.axis_name == ("data", "model")
  with pytest.raises(
    TypeError,
    match=r"`axis_name` must be None, an axis name or a tuple of "
    r"axis names, got dict",
  ):
    scaler(axis_name={"data": 1})


# ------------------------------------------------------------------------------------------------
# The public namespace: the accessors live in jaxamp.scaler, the old top-level names point there.

ACCESSORS = [
  "get_scale",
  "set_scale",
  "get_growth_factor",
  "set_growth_factor",
  "get_backoff_factor",
  "set_backoff_factor",
  "get_growth_interval",
  "set_growth_interval",
  "is_enabled",
  "state_dict",
  "load_state_dict",
  "EmptyStateDictError",
]


def test_import_jaxamp_makes_the_scaler_namespace_available_with_every_accessor():
  assert sorted(jaxamp.scaler.__all__) == sorted(ACCESSORS)
  assert all(callable(getattr(jaxamp.scaler, name)) for name in ACCESSORS)
  assert "scaler" in jaxamp.__all__


@pytest.mark.parametrize("name", ACCESSORS)
def test_old_top_level_accessor_raises_an_attribute_error_naming_the_new_spelling(name):
  with pytest.raises(AttributeError, match=rf"^jaxamp\.{name} moved to jaxamp\.scaler\.{name}$"):
    getattr(jaxamp, name)
  assert not hasattr(jaxamp, name) and name not in jaxamp.__all__


def test_unknown_top_level_names_raise_the_usual_attribute_error():
  with pytest.raises(AttributeError, match=r"module 'jaxamp' has no attribute 'no_such_name'"):
    jaxamp.no_such_name  # noqa: B018


@pytest.mark.parametrize("module", [jaxamp, jaxamp.scaler, jaxamp.functional])
def test_public_all_is_sorted_and_names_only_existing_attributes(module):
  assert list(module.__all__) == sorted(module.__all__)
  assert all(hasattr(module, name) for name in module.__all__)
