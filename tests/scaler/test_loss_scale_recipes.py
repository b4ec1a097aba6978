"""The recipes of ``docs/loss_scaling.md`` (torch's "Gradient Scaling Examples"), one test each.

Clipping unscaled gradients, gradient accumulation with ``optax.MultiSteps`` around and inside the
scaler, several losses, gradient penalty, checkpoints (orbax and ``state_dict``) and data
parallelism over several devices.
"""

import json
import textwrap

import chex
import cpu_devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp

RNG = np.random.default_rng(0)
PARAMS = {"w": jnp.asarray(RNG.standard_normal(3), jnp.float32), "b": jnp.float32(0.1)}
X = jnp.asarray(RNG.standard_normal((8, 3)), jnp.float32)
Y = jnp.asarray(RNG.standard_normal(8), jnp.float32)


def loss_fn(params, x=X, y=Y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def make_train_step(tx, loss=loss_fn):
  @jax.jit
  def train_step(params, opt_state, *batch):
    grads = jax.grad(lambda params: jaxamp.scale_loss(loss(params, *batch), opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return train_step


def poisoned(x):
  return x.at[0, 0].set(jnp.inf)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------------------------------
# Clipping: the clip inside the wrapped optimizer sees unscaled gradients.


@pytest.mark.slow  # trains a model for several steps
def test_recipe_clip_unscaled_gradients_inside_the_wrapped_optimizer():
  tx = jaxamp.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(0.2), optax.sgd(1.0)), init_scale=2.0**16
  )
  opt_state = tx.init(PARAMS)
  params, _ = make_train_step(tx)(PARAMS, opt_state)
  grads = jax.grad(loss_fn)(PARAMS)
  norm = optax.tree.norm(grads)
  assert norm > 0.2  # the clip is active, and it clipped the unscaled norm to 0.2
  step = jax.tree.map(lambda a, b: b - a, PARAMS, params)
  np.testing.assert_allclose(optax.tree.norm(step), 0.2, rtol=1e-5)
  for name in PARAMS:
    np.testing.assert_allclose(step[name], -grads[name] * 0.2 / norm, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Gradient accumulation.


def micro_batches(n, bad=()):
  """n micro-batches of 2 examples; those in ``bad`` contain an Inf."""
  xs = [X[2 * (i % 4) : 2 * (i % 4) + 2] for i in range(n)]
  ys = [Y[2 * (i % 4) : 2 * (i % 4) + 2] for i in range(n)]
  return [(poisoned(x) if i in bad else x, y) for i, (x, y) in enumerate(zip(xs, ys, strict=True))]


@pytest.mark.slow
def test_recipe_multisteps_around_the_scaler_skips_the_whole_accumulated_step_like_torch():
  tx = jaxamp.multi_steps(jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0), 4)
  train_step = make_train_step(tx)
  params, opt_state = PARAMS, tx.init(PARAMS)
  scales = []
  for x, y in micro_batches(12, bad={1}):  # three windows of 4; the first one overflows
    params, opt_state = train_step(params, opt_state, x, y)
    scales.append(float(jaxamp.scaler.get_scale(opt_state)))
  assert scales == [8.0] * 3 + [4.0] * 8 + [4.0]  # one back-off, at the end of window 1
  assert int(opt_state.inner_opt_state.skipped_steps) == 1
  # Windows 2 and 3 stepped with the mean gradient of their 4 micro-batches.
  expected = PARAMS
  for _ in range(2):
    mean = jax.tree.map(
      lambda *g: sum(g) / 4, *[jax.grad(loss_fn)(expected, x, y) for x, y in micro_batches(4)]
    )
    expected = jax.tree.map(lambda param, g: param - 0.1 * g, expected, mean)
  for name in PARAMS:
    np.testing.assert_allclose(params[name], expected[name], rtol=1e-5)


@pytest.mark.slow
def test_multi_steps_micro_steps_leave_negative_zero_params_bit_identical():
  params = {
    "w": jnp.array([-0.0, 0.0, 2.0]),
    "z": jax.lax.complex(jnp.array([-0.0, 1.0]), jnp.array([-0.0, -0.0])),
  }
  tx = jaxamp.multi_steps(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  stepped = optax.apply_updates(params, updates)
  for name in params:
    assert np.asarray(stepped[name]).tobytes() == np.asarray(params[name]).tobytes(), name


@pytest.mark.slow
def test_plain_optax_multisteps_keeps_a_nan_accumulator_after_an_overflow():
  # Why the recipe wraps MultiSteps: without the reset every later window is skipped too.
  tx = optax.MultiSteps(jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0), 2)
  train_step = make_train_step(tx)
  params, opt_state = PARAMS, tx.init(PARAMS)
  for x, y in micro_batches(6, bad={1}):
    params, opt_state = train_step(params, opt_state, x, y)
  assert int(opt_state.inner_opt_state.skipped_steps) == 3
  assert np.isnan(np.asarray(opt_state.acc_grads["w"])).all()


@pytest.mark.slow
def test_recipe_multisteps_inside_the_scaler_drops_only_the_bad_micro_batch():
  inner = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4).gradient_transformation()
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=8.0)
  train_step = make_train_step(tx)
  params, opt_state = PARAMS, tx.init(PARAMS)
  batches = micro_batches(5, bad={1})
  for x, y in batches[:2]:
    params, opt_state = train_step(params, opt_state, x, y)
  assert float(jaxamp.scaler.get_scale(opt_state)) == 4.0  # backed off at once, mid-window
  assert int(opt_state.inner_state.mini_step) == 1  # the bad micro-batch was not counted
  for x, y in batches[2:]:
    params, opt_state = train_step(params, opt_state, x, y)
  good = [b for i, b in enumerate(batches) if i != 1]
  mean = jax.tree.map(lambda *g: sum(g) / 4, *[jax.grad(loss_fn)(PARAMS, x, y) for x, y in good])
  for name in PARAMS:
    np.testing.assert_allclose(params[name], PARAMS[name] - 0.1 * mean[name], rtol=1e-5)


@pytest.mark.slow
def test_multisteps_around_the_scaler_matches_torch_gradient_accumulation():
  torch = pytest.importorskip("torch")
  batches = micro_batches(12, bad={5})
  k, lr = 4, 0.1
  # torch's recipe: scaler.scale(loss / k).backward() per micro-batch, step + update per window.
  w = torch.tensor(np.asarray(PARAMS["w"]), requires_grad=True)
  b = torch.tensor(np.asarray(PARAMS["b"]), requires_grad=True)
  opt = torch.optim.SGD([w, b], lr=lr)
  scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=1.1, growth_interval=1)
  torch_scales = []
  for i, (x, y) in enumerate(batches):
    x, y = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y))
    scaler.scale(((x @ w + b - y) ** 2).mean() / k).backward()
    if (i + 1) % k == 0:
      scaler.step(opt)
      scaler.update()
      opt.zero_grad()
      torch_scales.append(scaler.get_scale())
  scaler = jaxamp.dynamic_loss_scale(
    optax.sgd(lr), init_scale=8.0, growth_factor=1.1, growth_interval=1
  )
  tx = jaxamp.multi_steps(scaler, k)
  train_step = make_train_step(tx)
  params, opt_state = PARAMS, tx.init(PARAMS)
  scales = []
  for i, (x, y) in enumerate(batches):
    params, opt_state = train_step(params, opt_state, x, y)
    if (i + 1) % k == 0:
      scales.append(float(jaxamp.scaler.get_scale(opt_state)))
  assert scales == torch_scales  # [8.8, 4.4, 4.84]: grow, skip and back off, grow
  np.testing.assert_allclose(params["w"], w.detach().numpy(), rtol=1e-5)
  np.testing.assert_allclose(params["b"], b.detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize("k", [0, -1])
def test_multi_steps_non_positive_k_is_a_value_error(k):
  with pytest.raises(ValueError, match="every_k_schedule"):
    jaxamp.multi_steps(optax.sgd(0.1), k)


@pytest.mark.parametrize("k", [2.5, "a"])
def test_multi_steps_non_integer_k_is_a_type_error(k):
  with pytest.raises(TypeError, match="every_k_schedule"):
    jaxamp.multi_steps(optax.sgd(0.1), k)


@pytest.mark.parametrize("inner", [None, lambda g: g])
def test_multi_steps_inner_must_be_a_gradient_transformation(inner):
  with pytest.raises(TypeError, match="`inner` must be an optax GradientTransformation"):
    jaxamp.multi_steps(inner, 2)


def applies_every_second_step(k) -> bool:
  params = {"w": jnp.ones(3)}
  tx = jaxamp.multi_steps(optax.sgd(1.0), k)
  state, update = tx.init(params), jax.jit(tx.update)
  first, state = update(params, state, params)
  second, state = update(params, state, params)
  return bool(np.all(first["w"] == 0) and np.all(second["w"] == -1.0))


@pytest.mark.parametrize("k", [2, lambda step: 2], ids=["int", "schedule"])
def test_multi_steps_accepts_an_int_or_a_schedule(k):
  assert applies_every_second_step(k)


def test_multi_steps_accepts_a_numpy_integer():
  assert applies_every_second_step(np.int64(2))


# ------------------------------------------------------------------------------------------------
# Several losses, gradient penalty.


@pytest.mark.slow
def test_recipe_several_losses_are_scaled_by_the_same_scale_and_summed():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)
  opt_state = tx.init(PARAMS)
  loss0 = lambda params: loss_fn(params)
  loss1 = lambda params: jnp.sum(params["w"] ** 2)

  def scaled_total(params):  # torch: scaler.scale(loss0).backward(); scaler.scale(loss1).backward()
    scaled = jaxamp.scale_loss((loss0(params), loss1(params)), opt_state)
    return scaled[0] + scaled[1]

  updates, _ = jax.jit(tx.update)(jax.grad(scaled_total)(PARAMS), opt_state, PARAMS)
  expected = jax.grad(lambda params: loss0(params) + loss1(params))(PARAMS)
  for name in PARAMS:
    np.testing.assert_allclose(updates[name], -expected[name], rtol=1e-5)


@pytest.mark.slow  # trains a model for several steps
def test_recipe_gradient_penalty_unscales_the_inner_gradients_by_dividing_by_the_scale():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)
  opt_state = tx.init(PARAMS)

  @jax.jit
  def penalized_grads(params, opt_state):
    def total(params):
      scaled_grads = jax.grad(lambda q: jaxamp.scale_loss(loss_fn(q), opt_state))(params)
      grads = jax.tree.map(lambda g: g / jaxamp.scaler.get_scale(opt_state), scaled_grads)
      penalty = optax.tree.norm(grads)
      return jaxamp.scale_loss(loss_fn(params) + penalty, opt_state)

    return jax.grad(total)(params)

  updates, _ = jax.jit(tx.update)(penalized_grads(PARAMS, opt_state), opt_state, PARAMS)
  expected = jax.grad(lambda params: loss_fn(params) + optax.tree.norm(jax.grad(loss_fn)(params)))(
    PARAMS
  )
  for name in PARAMS:
    np.testing.assert_allclose(updates[name], -expected[name], rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Checkpoints.


def train_a_few_steps(tx, n=4):
  train_step = make_train_step(tx)
  params, opt_state = PARAMS, tx.init(PARAMS)
  for i in range(n):
    params, opt_state = train_step(params, opt_state, poisoned(X) if i == 1 else X, Y)
  return train_step, params, opt_state


@pytest.mark.slow
def test_recipe_checkpoint_round_trip_with_orbax(tmp_path):
  tx = jaxamp.dynamic_loss_scale(
    optax.adam(1e-2), init_scale=1024.0, growth_factor=1.1, growth_interval=2
  )
  train_step, params, opt_state = train_a_few_steps(tx)
  assert jaxamp.scaler.state_dict(opt_state)["scale"] != 1024.0
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step_4", {"params": params, "opt_state": opt_state})
    checkpointer.wait_until_finished()
    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = checkpointer.restore(tmp_path / "step_4", abstract)
  assert_trees_equal(restored, {"params": params, "opt_state": opt_state})
  continued = train_step(params, opt_state, X, Y)
  resumed = train_step(restored["params"], restored["opt_state"], X, Y)
  assert_trees_equal(resumed, continued)


@pytest.mark.slow
def test_recipe_checkpoint_round_trip_with_state_dict():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0, growth_interval=3)
  train_step, params, opt_state = train_a_few_steps(tx)
  saved = json.dumps(jaxamp.scaler.state_dict(opt_state))  # e.g. next to a torch checkpoint
  fresh = tx.init(params)._replace(inner_state=opt_state.inner_state)
  restored = jaxamp.scaler.load_state_dict(fresh, json.loads(saved))
  assert jaxamp.scaler.state_dict(restored) == jaxamp.scaler.state_dict(opt_state)
  for _ in range(3):
    p1, opt_state = train_step(params, opt_state, X, Y)
    p2, restored = train_step(params, restored, X, Y)
    assert_trees_equal(p1, p2)
    params = p1
  assert jaxamp.scaler.state_dict(restored) == jaxamp.scaler.state_dict(opt_state)


@pytest.mark.slow
def test_recipe_checkpoint_round_trip_with_flax_serialization():
  from flax import serialization
  from flax.training import train_state

  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=1024.0, growth_factor=1.1)
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
  state = state.replace(opt_state=train_a_few_steps(tx)[2])
  data = serialization.to_bytes(state)  # msgpack, hyperparameters included
  target = train_state.TrainState.create(
    apply_fn=None, params=PARAMS, tx=jaxamp.dynamic_loss_scale(optax.adam(1e-2))
  )
  restored = serialization.from_bytes(target, data)
  assert jaxamp.scaler.state_dict(restored) == jaxamp.scaler.state_dict(state)
  assert_trees_equal(restored.opt_state, state.opt_state)


# ------------------------------------------------------------------------------------------------
# Data parallelism.

_DATA_PARALLEL_SCRIPT = textwrap.dedent(
  """
    import json, jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxamp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal(16), jnp.float32)
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0, growth_interval=2,
                                   axis_name="data")

    def loss_fn(params, x, y):
      return jnp.mean((x @ params["w"] - y) ** 2)

    def train_step(params, opt_state, x, y):  # per device: its 4 examples
      # The loss is the mean over all devices; the gradient of the replicated params is then
      # the global one on every device (shard_map's psum of the per-device contributions).
      global_loss = lambda params: jax.lax.pmean(loss_fn(params, x, y), "data")
      grads = jax.grad(lambda params: jaxamp.scale_loss(global_loss(params), opt_state))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    dp_step = jax.jit(jax.shard_map(
        train_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P())))
    single_tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0, growth_interval=2)

    @jax.jit
    def single_step(params, opt_state, x, y):
      grads = jax.grad(lambda params: jaxamp.scale_loss(loss_fn(params, x, y), opt_state))(params)
      updates, opt_state = single_tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    p1, s1 = params, tx.init(params)
    p2, s2 = params, single_tx.init(params)
    log = []
    for i in range(4):
      xi = x.at[13, 1].set(jnp.inf) if i == 1 else x  # device 3's shard overflows at step 1
      p1, s1 = dp_step(p1, s1, xi, y)
      p2, s2 = single_step(p2, s2, xi, y)
      log.append([float(s1.scale), bool(s1.found_inf), float(s2.scale)])
    print(json.dumps({
        "devices": len(jax.devices()), "log": log,
        "dp": np.asarray(p1["w"]).tolist(), "single": np.asarray(p2["w"]).tolist(),
    }))
    """
)


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_recipe_exported_train_step_serializes_and_reproduces_the_jitted_step():
  # docs/loss_scaling.md, "Exporting a train step": the one check to disable on XLA:CPU.
  params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), "b": jnp.zeros(4)}
  x = jnp.linspace(0.0, 1.0, 16).reshape(2, 8)
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))

  def train_step(params, opt_state):
    loss = lambda p: jaxamp.scale_loss(jnp.mean((x @ p["w"] + p["b"]) ** 2), opt_state)
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  leaves, treedef = jax.tree.flatten((params, tx.init(params)))
  flat_step = lambda leaves: jax.tree.leaves(train_step(*jax.tree.unflatten(treedef, leaves)))
  exported = jax.export.export(
    jax.jit(flat_step),
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("LayoutConstraint")],
  )(leaves)
  restored = jax.export.deserialize(exported.serialize())
  chex.assert_trees_all_equal(restored.call(leaves), jax.jit(flat_step)(leaves))


def test_recipe_data_parallel_training_with_shard_map_and_axis_name():
  result = cpu_devices.run_json(_DATA_PARALLEL_SCRIPT, devices=4)
  assert result["devices"] == 4
  assert result["log"] == [
    [1024.0, False, 1024.0],
    [512.0, True, 512.0],
    [512.0, False, 512.0],
    [1024.0, False, 1024.0],
  ]
  np.testing.assert_allclose(result["dp"], result["single"], rtol=1e-5)


def _lbfgs_objective(p):
  return jnp.sum((p["w"] - 1.0) ** 2) + 3.0 * jnp.sum(p["b"] ** 2)


LBFGS_PARAMS = {"w": jnp.arange(8.0).reshape(2, 4), "b": jnp.ones(3)}


def test_a_line_search_closure_through_the_scaler_is_a_value_error():
  # optax's L-BFGS idiom on a scaled loss: the stored value and gradient of one scale would be
  # compared with the next scale's; torch's GradScaler.step refuses a closure too.
  tx = jaxamp.dynamic_loss_scale(optax.lbfgs(), init_scale=16.0)
  state = tx.init(LBFGS_PARAMS)
  fn = lambda q: jaxamp.scale_loss(_lbfgs_objective(q), state)
  value, grad = optax.value_and_grad_from_state(fn)(LBFGS_PARAMS, state=state)
  with pytest.raises(ValueError, match="line-search optimizer.*jaxamp.unscale"):
    tx.update(grad, state, LBFGS_PARAMS, value=value, grad=grad, value_fn=fn)


def test_recipe_line_search_on_unscaled_gradients_matches_plain_lbfgs_while_the_scale_grows():
  def run(tx, scaled):
    params, state = LBFGS_PARAMS, tx.init(LBFGS_PARAMS)

    @jax.jit
    def step(params, state):
      value = _lbfgs_objective(params)
      if scaled:
        grads = jax.grad(lambda q: jaxamp.scale_loss(_lbfgs_objective(q), state))(params)
        grads, found_inf = jaxamp.unscale(grads, state)
        extra = {"found_inf": found_inf}
      else:
        grads, extra = jax.grad(_lbfgs_objective)(params), {}
      updates, state = tx.update(
        grads, state, params, value=value, grad=grads, value_fn=_lbfgs_objective, **extra
      )
      return optax.apply_updates(params, updates), state

    for _ in range(5):
      params, state = step(params, state)
    return params, state

  plain, _ = run(optax.lbfgs(), scaled=False)
  scaled, state = run(
    jaxamp.dynamic_loss_scale(optax.lbfgs(), init_scale=16.0, growth_interval=1), True
  )
  assert jaxamp.scaler.get_scale(state) == 16.0 * 2**5
  # Not bit for bit under jit: XLA:CPU fuses the two programs differently (an FMA in one only).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), scaled, plain)


# --- inner optimizers handed the objective itself (sam's grad_fn, sophia's obj_fn) ---------------


def _sam(opaque_mode):
  return optax.contrib.sam(
    optax.sgd(0.1), optax.chain(optax.contrib.normalize(), optax.sgd(0.05)), opaque_mode=opaque_mode
  )


def test_sams_opaque_grad_fn_through_the_scaler_is_a_value_error():
  tx = jaxamp.dynamic_loss_scale(_sam(opaque_mode=True), init_scale=16.0)
  state = tx.init(PARAMS)
  grad_fn = lambda p, _: jax.grad(lambda q: jaxamp.scale_loss(loss_fn(q), state))(p)
  with pytest.raises(ValueError, match=r"`grad_fn`.*sam\(opaque_mode=True\).*opaque_mode=False"):
    tx.update(grad_fn(PARAMS, 0), state, PARAMS, grad_fn=grad_fn)


def test_sophias_obj_fn_through_the_scaler_is_a_value_error():
  tx = jaxamp.dynamic_loss_scale(optax.contrib.sophia(0.01), init_scale=16.0)
  state = tx.init(PARAMS)
  obj_fn = lambda q: jaxamp.scale_loss(loss_fn(q), state)
  with pytest.raises(ValueError, match="`obj_fn`.*sophia.*jaxamp.unscale"):
    tx.update(jax.grad(obj_fn)(PARAMS), state, PARAMS, obj_fn=obj_fn)


def _steps(tx, scaled, steps=4, **objective):
  """``steps`` jitted steps of ``tx`` on ``loss_fn``; ``scaled``: through the loss scale, with
  ``jaxamp.unscale``'s ``found_inf=`` when an objective function is passed."""

  @jax.jit
  def step(params, state):
    if not scaled:
      grads, extra = jax.grad(loss_fn)(params), {}
    else:
      grads = jax.grad(lambda q: jaxamp.scale_loss(loss_fn(q), state))(params)
      extra = {}
      if objective:
        grads, extra["found_inf"] = jaxamp.unscale(grads, state)
    updates, state = tx.update(grads, state, params, **objective, **extra)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, tx.init(PARAMS)
  for _ in range(steps):
    params, state = step(params, state)
  return params


def test_recipe_sam_in_its_default_mode_through_the_scaler_matches_plain_sam():
  # every gradient, the adversarial steps' too, arrives as `updates`: unscaled and checked
  plain = _steps(_sam(opaque_mode=False), scaled=False)
  scaled = _steps(jaxamp.dynamic_loss_scale(_sam(opaque_mode=False), init_scale=2.0**10), True)
  jax.tree.map(np.testing.assert_array_equal, scaled, plain)


def test_recipe_sophia_on_unscaled_gradients_with_an_unscaled_obj_fn_matches_plain_sophia():
  sophia = lambda: optax.contrib.sophia(0.01, update_interval=1)
  plain = _steps(sophia(), scaled=False, obj_fn=loss_fn)
  scaled = _steps(jaxamp.dynamic_loss_scale(sophia(), init_scale=2.0**10), True, obj_fn=loss_fn)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), scaled, plain)
