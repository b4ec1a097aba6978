"""Data-parallel mixed-precision training on 8 (virtual CPU) devices.

A small Flax linen MLP is trained with ``jaxamp.autocast`` (float16, the cuda policy) and
``jaxamp.dynamic_loss_scale`` three ways: on one device, with ``jax.jit`` and ``NamedSharding``
(batch sharded over a "data" mesh axis, params and optimizer state replicated), and with
``jax.shard_map`` (the scaler reduces its finite check over ``axis_name="data"``). Step 2's batch
holds an inf in one example, which lives on one device only. The three runs must end with the
same params, and the overflow must skip the step on every device: params unchanged and the
scale backed off once, in every device's copy.

The body runs in a subprocess: the device count must be set (``XLA_FLAGS``) before JAX starts.
"""

import textwrap

import cpu_devices
import numpy as np
import pytest

SCRIPT = textwrap.dedent(
  """
    import json
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxamp

    STEPS, OVERFLOW_STEP, BAD_ROW = 5, 2, 37  # row 37 of 64 lives on device 4 (8 rows each)
    mesh = jax.make_mesh((8,), ("data",))

    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))

    model = MLP()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 64), jnp.int32)
    params = model.init(jax.random.key(0), x[:1])
    batches = [x.at[BAD_ROW, 3].set(jnp.inf) if step == OVERFLOW_STEP else x
               for step in range(STEPS)]

    @jaxamp.autocast(device_type="cuda")
    def loss_fn(params, x, y):
      logits = model.apply(params, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make_step(tx, mean_over=None):
      def step(params, opt_state, x, y):
        def scaled_loss(params):
          loss = loss_fn(params, x, y)
          if mean_over is not None:  # shard_map: the mean over all devices' examples
            loss = jax.lax.pmean(loss, mean_over)
          return jaxamp.scale_loss(loss, opt_state), loss
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
      return step

    def scaler(**kwargs):
      return jaxamp.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), init_scale=2.0**12,
                                       growth_interval=2, **kwargs)

    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx, tx_dp = scaler(), scaler(axis_name="data")
    runs = {
        "single": (tx, jax.jit(make_step(tx)), lambda a: a, lambda a: a),
        "named_sharding": (tx, jax.jit(make_step(tx), in_shardings=(replicated, replicated,
                                                                    data, data),
                                       out_shardings=replicated),
                           lambda a: jax.device_put(a, replicated),
                           lambda a: jax.device_put(a, data)),
        "shard_map": (tx_dp, jax.jit(jax.shard_map(
            make_step(tx_dp, mean_over="data"), mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()))),
                      lambda a: jax.device_put(a, replicated),
                      lambda a: jax.device_put(a, data)),
    }

    def copies(tree):
      # Every device's copy of every leaf of a replicated tree, as numpy arrays.
      return [[np.asarray(s.data) for s in leaf.addressable_shards]
              for leaf in jax.tree.leaves(tree)]

    result = {"devices": jax.device_count()}
    for name, (tx, step, place, shard) in runs.items():
      run_params, s = place(params), place(tx.init(params))
      log = []
      for i, batch in enumerate(batches):
        before = copies(run_params)
        run_params, s, loss = step(run_params, s, shard(batch), shard(y))
        after = copies(run_params)
        log.append({
            "loss_finite": bool(np.isfinite(loss)),
            "found_inf": [bool(c) for c in copies(s.found_inf)[0]],
            "scale": [float(c) for c in copies(s.scale)[0]],
            "copies": len(after[0]),
            "unchanged": all(np.array_equal(b, a) for leaf_b, leaf_a in zip(before, after)
                             for b, a in zip(leaf_b, leaf_a)),
            "copies_agree": all(np.array_equal(c, leaf[0]) for leaf in after for c in leaf),
            "low_precision_logits": str(jax.eval_shape(
                jaxamp.autocast(model.apply, device_type="cuda"), run_params, batch).dtype),
        })
      result[name] = {
          "log": log,
          "params": [np.asarray(leaf, np.float32).ravel().tolist()
                     for leaf in jax.tree.leaves(run_params)],
          "param_dtypes": [str(leaf.dtype) for leaf in jax.tree.leaves(run_params)],
          "param_sharding_replicated": all(
              leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(run_params)),
      }
    print(json.dumps(result))
    """
)


TWO_DEVICES = textwrap.dedent(
  """
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxamp

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    model = nn.Dense(4)
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x)
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))
    loss_fn = jaxamp.autocast(lambda p, x: model.apply(p, x).sum(), device_type="cuda")

    @jax.jit
    def step(p, s, x):
      grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, x), s))(p)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s

    data = NamedSharding(mesh, P("data"))
    bad = jax.device_put(x.at[7, 0].set(jnp.inf), data)  # row 7 lives on the second device
    new, state = step(params, tx.init(params), bad)
    assert bool(state.found_inf) and float(state.scale) == 2.0**15, state
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new),
                                                   jax.tree.leaves(params)))
    print("OK")
  """
)


def test_an_inf_on_one_of_two_devices_skips_the_data_parallel_step():
  out = cpu_devices.run_script(TWO_DEVICES, devices=2)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.fixture(scope="module")
def result():
  return cpu_devices.run_json(SCRIPT, devices=8)


PARALLEL = ("named_sharding", "shard_map")
OVERFLOW_STEP = 2


@pytest.mark.slow  # 8 devices, three training runs
def test_runs_on_eight_devices(result):
  assert result["devices"] == 8
  for name in PARALLEL:
    assert all(entry["copies"] == 8 for entry in result[name]["log"]), name


@pytest.mark.slow  # 8 devices, three training runs
def test_model_computes_in_float16(result):
  assert {e["low_precision_logits"] for e in result["single"]["log"]} == {"float16"}


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", PARALLEL)
def test_data_parallel_params_match_the_single_device_run(result, name):
  for ours, single in zip(result[name]["params"], result["single"]["params"], strict=True):
    np.testing.assert_allclose(ours, single, rtol=2e-3, atol=2e-4)


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", PARALLEL)
def test_every_device_holds_the_same_params_after_every_step(result, name):
  assert all(entry["copies_agree"] for entry in result[name]["log"])


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", PARALLEL)
def test_data_parallel_params_stay_float32_and_replicated(result, name):
  assert set(result[name]["param_dtypes"]) == {"float32"}
  assert result[name]["param_sharding_replicated"]


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", ("single", *PARALLEL))
def test_overflow_on_one_device_skips_the_step_on_every_device(result, name):
  entry = result[name]["log"][OVERFLOW_STEP]
  assert not entry["loss_finite"]
  assert entry["found_inf"] == [True] * len(entry["found_inf"])
  assert entry["unchanged"]  # every device's copy of every param is bit-identical


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", ("single", *PARALLEL))
def test_overflow_on_one_device_backs_the_scale_off_once_on_every_device(result, name):
  log = result[name]["log"]
  before, after = log[OVERFLOW_STEP - 1]["scale"], log[OVERFLOW_STEP]["scale"]
  assert len(set(before)) == 1 and after == [before[0] / 2] * len(after)


@pytest.mark.slow  # 8 devices, three training runs
@pytest.mark.parametrize("name", ("single", *PARALLEL))
def test_finite_steps_update_params_and_grow_the_scale_like_the_single_device_run(result, name):
  log = result[name]["log"]
  assert [e["found_inf"][0] for e in log] == [False, False, True, False, False]
  assert [e["scale"][0] for e in log] == [e["scale"][0] for e in result["single"]["log"]]
  assert [e["scale"][0] for e in log] == [2.0**12, 2.0**13, 2.0**12, 2.0**12, 2.0**13]
  assert not any(e["unchanged"] for i, e in enumerate(log) if i != OVERFLOW_STEP)
