"""The scaler under ``jax.shard_map`` with sharded (FSDP-style) gradients, on 8 virtual CPU devices.

Parameters and gradients are split over the mesh axis "d" (``in_specs=P("d")``, the default
``check_vma=True``), a small bias is replicated, and ``dynamic_loss_scale(..., axis_name="d")``
must take one skip decision for all shards. Each case runs the same steps twice: sharded, and
unsharded under plain ``jit``. Step 2's gradient holds an inf in one row of the weight, which lives
on one device only. The cases: sgd with momentum, adam, clip_by_global_norm + adamw, ``unscale``
then ``update(found_inf=...)``, ``jaxamp.multi_steps`` around the scaler, and an FSDP training
step that gathers the weight with ``all_gather`` (the example of ``docs/loss_scaling.md``).

The body runs in a subprocess: the device count must be set (``XLA_FLAGS``) before JAX starts.
Each case catches its own error, so that one broken case fails only its own tests.
"""

import textwrap

import cpu_devices
import numpy as np
import pytest

TWO_SHARDS = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import PartitionSpec as P
    import jaxamp

    mesh = jax.make_mesh((2,), ("d",))
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1), init_scale=8.0, axis_name="d")
    params = jnp.ones((4, 3))
    grads = params.at[3, 0].set(jnp.inf)  # row 3 lives on the second shard only

    def step(p, g, s):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s.found_inf, s.scale

    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P("d"), P()),
                                    out_specs=(P("d"), P(), P())))
    state = tx.init(params)
    on_shards = jax.sharding.NamedSharding(mesh, P("d"))
    params, grads = jax.device_put(params, on_shards), jax.device_put(grads, on_shards)
    new, found_inf, scale = sharded(params, grads, state)
    assert bool(found_inf) and float(scale) == 4.0, (found_inf, scale)
    assert np.array_equal(new, params), new  # the finite shard skipped its step too
    print("OK")
  """
)

# Parameters typed as sharded (an Explicit mesh, ``jax.make_mesh``'s default axis type): a skipped
# step's -0.0 updates and its copies of the moments carry the shardings of the taken step's.
EXPLICIT_MESH = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import AxisType, PartitionSpec as P
    import jaxamp

    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
      rng = np.random.default_rng(0)
      # w is big enough for the skipped branch to compute its copy of the moments.
      params = {"w": jax.device_put(jnp.asarray(rng.standard_normal((64, 128)), jnp.float32),
                                    P("model", None)),
                "b": jax.device_put(jnp.ones(128), P(None))}
      grads = jax.tree.map(lambda p: 0.5 * p, params)
      for tx in (jaxamp.dynamic_loss_scale(optax.adamw(1e-3), init_scale=1.0),
                 jaxamp.multi_steps(jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=1.0),
                                    every_k_schedule=1)):
        step = jax.jit(lambda g, s, p: tx.update(g, s, p))
        state = jax.jit(tx.init)(params)
        updates, taken = step(grads, state, params)
        assert updates["w"].sharding.spec == P("model", None), updates["w"].sharding
        bad = {"w": grads["w"] * jnp.inf, "b": grads["b"]}
        updates, skipped = step(bad, taken, params)
        assert all(np.array_equal(u, -np.zeros_like(u)) for u in jax.tree.leaves(updates))
        assert updates["w"].sharding.spec == P("model", None), updates["w"].sharding
        assert float(jaxamp.scaler.get_scale(skipped)) == 0.5  # backed off: the step was skipped
        for old, new in zip(jax.tree.leaves(taken), jax.tree.leaves(skipped)):
          if old.ndim == 2:  # the moments of w
            assert np.array_equal(old, new) and new.sharding.spec == P("model", None)
    print("OK")
  """
)

SCRIPT = textwrap.dedent(
  """
    import json, traceback
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, PartitionSpec as P
    import jaxamp

    STEPS, OVERFLOW_STEP, BAD_ROW = 6, 2, 11  # row 11 of 16 lives on device 5 (2 rows each)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(0)
    # A -0.0 weight: a skipped step must keep it -0.0 (the skip's updates are -0.0).
    params = {"w": jnp.asarray(rng.standard_normal((16, 3)), jnp.float32).at[0, 0].set(-0.0),
              "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    # Gradients of the scaled loss: w's are sharded like w, b's are replicated (already reduced).
    grads = [{"w": jnp.asarray(rng.standard_normal((16, 3)) * 300, jnp.float32),
              "b": jnp.asarray(rng.standard_normal(3) * 300, jnp.float32)} for _ in range(STEPS)]
    grads[OVERFLOW_STEP]["w"] = grads[OVERFLOW_STEP]["w"].at[BAD_ROW, 1].set(jnp.inf)

    def specs(tree):  # FSDP: every weight-shaped leaf (params, grads, moments) split over "d"
      return jax.tree.map(lambda x: P("d") if jnp.ndim(x) == 2 else P(), tree)

    def scaler(inner, axis_name):
      return jaxamp.dynamic_loss_scale(inner, init_scale=2.0**10, growth_interval=2,
                                       axis_name=axis_name)

    def plain(tx):
      def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
      return step

    def with_unscale(tx):  # torch's unscale_ before step
      def step(params, state, grads):
        grads, found_inf = jaxamp.unscale(grads, state)
        updates, state = tx.update(grads, state, params, found_inf=found_inf)
        return optax.apply_updates(params, updates), state
      return step

    CASES = {
        "sgd": (lambda a: scaler(optax.sgd(0.1, momentum=0.9), a), plain),
        "adam": (lambda a: scaler(optax.adam(0.01), a), plain),
        # optax's clip_by_global_norm inside shard_map sees this shard's gradients only: the norm
        # is per shard (optax's behaviour), so this case is not compared with the unsharded run,
        # and it has no replicated bias (its update would differ from device to device).
        "clip_adamw": (lambda a: scaler(optax.chain(optax.clip_by_global_norm(1.0),
                                                    optax.adamw(0.01)), a), plain),
        "adam_unscale": (lambda a: scaler(optax.adam(0.01), a), with_unscale),
        "multi_steps": (lambda a: jaxamp.multi_steps(scaler(optax.adam(0.01), a), 2), plain),
    }

    def scaler_state(state):
      return state.inner_opt_state if isinstance(state, optax.MultiStepsState) else state

    def bits(tree):
      return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]

    def copies(x):  # every device's copy of a replicated scalar
      return [np.asarray(s.data).item() for s in x.addressable_shards]

    def replicas_agree(tree):  # every device holds the same bits of every replicated leaf
      return all(len({np.asarray(s.data).tobytes() for s in x.addressable_shards}) == 1
                 for x in jax.tree.leaves(tree) if x.sharding.is_fully_replicated)

    def max_diff(a, b):
      return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    def run(make_tx, make_step, batches, params=params):
      tx, tx_d = make_tx(None), make_tx("d")
      state = tx_d.init(params)
      unsharded = jax.jit(make_step(tx))
      sharded = jax.jit(jax.shard_map(
          make_step(tx_d), mesh=mesh, in_specs=(specs(params), specs(state), specs(params)),
          out_specs=(specs(params), specs(state))))
      plain_params, s, sharded_params, s_d = params, tx.init(params), params, state
      log = []
      for g in batches:
        before_p, before_inner = bits(sharded_params), bits(scaler_state(s_d).inner_state)
        plain_params, s = unsharded(plain_params, s, g)
        sharded_params, s_d = sharded(sharded_params, s_d, g)
        sc, sc_d = scaler_state(s), scaler_state(s_d)
        log.append({
            "params_unchanged": bits(sharded_params) == before_p,
            "inner_state_unchanged": bits(sc_d.inner_state) == before_inner,
            "params_bitwise_unsharded": bits(sharded_params) == bits(plain_params),
            "state_bitwise_unsharded": bits(s_d) == bits(s),
            "params_max_diff": max_diff(sharded_params, plain_params),
            "state_max_diff": max_diff(s_d, s),
            "replicas_agree": replicas_agree((sharded_params, s_d)),
            "w_is_sharded": not sharded_params["w"].sharding.is_fully_replicated,
            "scale": copies(sc_d.scale), "found_inf": copies(sc_d.found_inf),
            "growth_tracker": copies(sc_d.growth_tracker),
            "skipped_steps": copies(sc_d.skipped_steps),
            "unsharded": [float(sc.scale), bool(sc.found_inf), int(sc.growth_tracker)],
        })
      return log

    def fsdp():
      # The docs' FSDP step: each device holds 2 rows of w, gathers the whole w for its batch
      # shard; the gradient of w comes back as this device's rows (psum_scatter, by autodiff).
      x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
      y = jnp.asarray(rng.standard_normal((64, 3)), jnp.float32)
      batches = [(x.at[37, 3].set(jnp.inf) if i == OVERFLOW_STEP else x, y) for i in range(4)]

      def loss_fn(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

      tx = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2)
      tx_d = jaxamp.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2,
                                       axis_name="d")

      @jax.jit
      def step(params, opt_state, x, y):
        scaled_loss = lambda params: jaxamp.scale_loss(loss_fn(params, x, y), opt_state)
        grads = jax.grad(scaled_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      def train_step(params, opt_state, x, y):  # params: this device's rows of w, and b
        def global_loss(params):
          full = dict(params, w=jax.lax.all_gather(params["w"], "d", tiled=True))
          return jax.lax.pmean(loss_fn(full, x, y), "d")
        grads = jax.grad(lambda params: jaxamp.scale_loss(global_loss(params), opt_state))(params)
        updates, opt_state = tx_d.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      state = tx_d.init(params)
      fsdp_step = jax.jit(jax.shard_map(
          train_step, mesh=mesh, in_specs=(specs(params), specs(state), P("d"), P("d")),
          out_specs=(specs(params), specs(state))))
      plain_params, s, sharded_params, s_d = params, tx.init(params), params, state
      log = []
      for xb, yb in batches:
        before = bits(sharded_params)
        plain_params, s = step(plain_params, s, xb, yb)
        sharded_params, s_d = fsdp_step(sharded_params, s_d, xb, yb)
        log.append({
            "params_unchanged": bits(sharded_params) == before,
            "scale": copies(s_d.scale),
            "unsharded_scale": float(s.scale),
            "params_max_diff": max_diff(sharded_params, plain_params),
            "params_scale": max(float(np.max(np.abs(x))) for x in jax.tree.leaves(plain_params)),
        })
      return log

    def statistic_state():
      # An inner state leaf that the step makes vary over "d": this shard's squared gradient
      # norm, replicated on input and sharded on output. A skipped step keeps the old value in a
      # state of the taken step's type.
      def init(params):
        return jnp.zeros(1)

      def update(updates, state, params=None):
        return updates, jnp.sum(updates["w"] ** 2)[None]

      tx = jaxamp.dynamic_loss_scale(optax.GradientTransformation(init, update), init_scale=1.0,
                                     axis_name="d")
      state = tx.init(params)
      step = jax.jit(jax.shard_map(
          plain(tx), mesh=mesh, in_specs=(specs(params), specs(state), specs(params)),
          out_specs=(specs(params), specs(state)._replace(inner_state=P("d")))))
      finite = step(params, state, grads[0])[1]
      skipped = step(params, state, grads[OVERFLOW_STEP])[1]
      expected = [float(np.sum(np.asarray(grads[0]["w"])[2 * i:2 * i + 2] ** 2))
                  for i in range(8)]
      return {"finite": np.asarray(finite.inner_state).tolist(), "expected": expected,
              "skipped": np.asarray(skipped.inner_state).tolist(),
              "skipped_found_inf": bool(skipped.found_inf)}

    result = {"devices": jax.device_count()}
    jobs = {name: (lambda c=case: run(*c, grads)) for name, case in CASES.items()}
    jobs["clip_adamw"] = lambda: run(*CASES["clip_adamw"], [{"w": g["w"]} for g in grads],
                                     params={"w": params["w"]})
    jobs.update(fsdp=fsdp, statistic_state=statistic_state)
    for name, job in jobs.items():
      try:
        result[name] = job()
      except Exception as e:
        result[name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def result():
  return cpu_devices.run_json(SCRIPT, devices=8, timeout=600)


def case(result, name):
  value = result[name]
  assert not (isinstance(value, dict) and "error" in value), value.get("error")
  return value


OVERFLOW_STEP = 2
ALL = ("sgd", "adam", "clip_adamw", "adam_unscale", "multi_steps")
UPDATE_EVERY_STEP = ("sgd", "adam", "clip_adamw", "adam_unscale")
# multi_steps(k=2) emits at steps 1, 3, 5: the overflow of micro-step 2 skips the step of 3.
MULTI_STEPS_SKIPPED = 3


def test_an_inf_in_one_of_two_shards_skips_both_shards_step():
  out = cpu_devices.run_script(TWO_SHARDS, devices=2)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_params_sharded_on_an_explicit_mesh_take_and_skip_steps_keeping_their_sharding():
  out = cpu_devices.run_script(EXPLICIT_MESH, devices=2)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow  # 8 devices, every case
def test_runs_on_eight_devices_with_the_weight_sharded(result):
  assert result["devices"] == 8
  for name in ALL:
    assert all(entry["w_is_sharded"] for entry in case(result, name)), name


@pytest.mark.slow  # 8 devices, every case
@pytest.mark.parametrize("name", ("sgd", "adam", "adam_unscale", "multi_steps"))
def test_sharded_steps_give_the_unsharded_params_and_state_bit_for_bit(result, name):
  log = case(result, name)
  diffs = [(e["params_max_diff"], e["state_max_diff"]) for e in log]
  assert all(e["params_bitwise_unsharded"] for e in log), diffs
  assert all(e["state_bitwise_unsharded"] for e in log), diffs


@pytest.mark.slow  # 8 devices, every case
def test_clip_by_global_norm_chain_runs_sharded_with_a_per_shard_norm(result):
  # optax's clip_by_global_norm under shard_map clips by this shard's norm, not the global one:
  # only the scaler's part (no crash, one skip decision, the scale) is compared here.
  log = case(result, "clip_adamw")
  assert [e["found_inf"][0] for e in log] == [False, False, True, False, False, False]
  assert [e["unsharded"][0] for e in log] == [e["scale"][0] for e in log]
  assert not any(e["params_unchanged"] for i, e in enumerate(log) if i != OVERFLOW_STEP)


@pytest.mark.slow  # 8 devices, every case
@pytest.mark.parametrize("name", UPDATE_EVERY_STEP)
def test_overflow_on_one_shard_skips_every_shards_step_bit_for_bit(result, name):
  entry = case(result, name)[OVERFLOW_STEP]
  assert entry["found_inf"] == [True] * 8
  assert entry["params_unchanged"]  # the -0.0 weight too: skipped updates are -0.0
  assert entry["inner_state_unchanged"]  # moments and counts of every shard
  assert entry["skipped_steps"] == [1] * 8 and entry["growth_tracker"] == [0] * 8


@pytest.mark.slow  # 8 devices, every case
def test_overflow_in_one_shards_micro_batch_skips_the_accumulated_step_everywhere(result):
  log = case(result, "multi_steps")
  assert [e["found_inf"][0] for e in log] == [False, False, False, True, True, False]
  entry = log[MULTI_STEPS_SKIPPED]
  assert entry["params_unchanged"] and entry["inner_state_unchanged"]
  assert entry["found_inf"] == [True] * 8 and entry["skipped_steps"] == [1] * 8
  assert not log[MULTI_STEPS_SKIPPED + 2]["params_unchanged"]  # the next emitted step steps


@pytest.mark.slow  # 8 devices, every case
@pytest.mark.parametrize("name", UPDATE_EVERY_STEP)
def test_overflow_on_one_shard_backs_the_scale_off_identically_on_every_device(result, name):
  log = case(result, name)
  before, after = log[OVERFLOW_STEP - 1]["scale"], log[OVERFLOW_STEP]["scale"]
  assert before == [2.0**11] * 8 and after == [2.0**10] * 8
  assert after[0] == log[OVERFLOW_STEP]["unsharded"][0]


@pytest.mark.slow  # 8 devices, every case
@pytest.mark.parametrize("name", UPDATE_EVERY_STEP)
def test_the_scale_grows_after_growth_interval_finite_steps_on_every_device(result, name):
  log = case(result, name)
  assert [e["scale"] for e in log] == [
    [s] * 8 for s in (2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11, 2.0**11)
  ]
  assert [e["growth_tracker"] for e in log] == [[t] * 8 for t in (1, 0, 0, 1, 0, 1)]
  assert [e["scale"][0] for e in log] == [e["unsharded"][0] for e in log]


@pytest.mark.slow  # 8 devices, every case
def test_multi_steps_scale_follows_the_emitted_steps_like_the_unsharded_run(result):
  log = case(result, "multi_steps")
  assert [e["scale"] for e in log] == [
    [s] * 8 for s in (2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9)
  ]
  assert [e["scale"][0] for e in log] == [e["unsharded"][0] for e in log]


@pytest.mark.slow  # 8 devices, every case
@pytest.mark.parametrize("name", ALL)
def test_every_device_holds_the_same_replicated_values(result, name):
  assert all(entry["replicas_agree"] for entry in case(result, name))


@pytest.mark.slow  # 8 devices, every case
def test_fsdp_training_step_with_all_gather_matches_the_unsharded_run(result):
  log = case(result, "fsdp")
  assert [e["scale"] for e in log] == [[s] * 8 for s in (2.0**10, 2.0**11, 2.0**10, 2.0**10)]
  assert [e["scale"][0] for e in log] == [e["unsharded_scale"] for e in log]
  assert [e["params_unchanged"] for e in log] == [False, False, True, False]
  for e in log:  # the sums are split differently: equal up to rounding
    assert e["params_max_diff"] <= 1e-5 * max(1.0, e["params_scale"]), e


@pytest.mark.slow  # 8 devices, every case
def test_an_inner_state_leaf_that_becomes_sharded_is_kept_on_a_skipped_step(result):
  out = case(result, "statistic_state")
  np.testing.assert_allclose(out["finite"], out["expected"], rtol=1e-6)
  assert out["skipped_found_inf"] and out["skipped"] == [0.0] * 8
