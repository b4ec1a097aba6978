"""NaN/inf storms through ``jaxamp.dynamic_loss_scale(optax.adam(...))``.

A storm is a few hundred jitted updates (one ``lax.scan``) of a tree of float32, bfloat16 and
float16 parameters, fed the gradients of a loss scaled by the current scale (so float16 leaves
overflow by themselves while the scale is large) with inf, -inf and NaN injected at random into
random leaves, alone and in bursts. Whatever the storm:

* params and optimizer state never become non-finite;
* found_inf is exactly "some gradient leaf was non-finite", and a skipped step changes nothing
  but the scaler's counters (params and inner state bit-identical);
* the scale follows torch's update rule bit for bit (float64 product rounded to float32) and
  stays finite and > 0, and Adam only sees the finite steps.

torch's GradScaler has no floor: ~150 consecutive overflows back the scale off to exactly 0 (the
last tests check jaxamp does the same, step for step). Storms therefore stop injecting while the
scale is below 2**-60.

Storms are drawn by hypothesis (deterministic: fixed seed, no database, few examples).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from jax import lax

import jaxamp

STEPS = 300
MAX_BURST = 40
PARAMS = {
  "dense": {
    "w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4),
    "b": jnp.linspace(-0.5, 0.5, 5, dtype=jnp.bfloat16),
  },
  "half": jnp.linspace(0.25, 1.0, 6, dtype=jnp.float16).reshape(2, 3),
  "scalar": jnp.asarray(0.5, jnp.float32),
  "nested": {"bf16": jnp.ones((2, 2), jnp.bfloat16), "f16": jnp.full((4,), -1.0, jnp.float16)},
}
LEAVES, TREEDEF = jax.tree.flatten(PARAMS)
NONE, POS_INF, NEG_INF, NAN = 0, 1, 2, 3


def optimizer():
  # eps must be representable in float16, or Adam divides 0 by 0 on an all-zero float16 leaf.
  return optax.adam(1e-2, eps=1e-3)


@dataclasses.dataclass(frozen=True)
class Storm:
  """A storm's recipe: what is injected where is drawn from ``seed`` with numpy."""

  seed: int
  injection_rate: float  # per step, probability of an isolated injection
  burst_rate: float  # per step, probability that a burst of consecutive injections starts
  init_scale: float
  growth_factor: float
  backoff_factor: float
  growth_interval: int

  def arrays(self):
    """(base gradients [STEPS, *leaf], injection codes [STEPS, *leaf]) per leaf.

    Injections come alone (``injection_rate``) and in bursts of up to ``MAX_BURST`` steps
    (``burst_rate``). The generator follows the scale with torch's rule as it goes (float16
    leaves also overflow by themselves while the scale is large) and injects nothing while the
    scale is below ``2**-60``, so that the storm never backs the scale off to 0, which takes
    ~150 consecutive overflows (see the no-floor tests at the end).
    """
    rng = np.random.default_rng(self.seed)
    base = [
      rng.uniform(0.5, 2.0, (STEPS, *x.shape)) * rng.choice([-1.0, 1.0], (STEPS, *x.shape))
      for x in LEAVES
    ]
    codes = [np.zeros((STEPS, *x.shape), np.int8) for x in LEAVES]
    scale, tracker, burst_left = np.float32(self.init_scale), 0, 0
    for step in range(STEPS):
      if burst_left == 0 and rng.random() < self.burst_rate:
        burst_left = int(rng.integers(2, MAX_BURST + 1))
      inject = (burst_left > 0 or rng.random() < self.injection_rate) and scale > 2.0**-60
      burst_left = max(burst_left - 1, 0)
      if inject:
        for leaf in rng.choice(len(LEAVES), size=int(rng.integers(1, 4))):
          index = tuple(int(rng.integers(0, n)) for n in LEAVES[leaf].shape)
          codes[leaf][(step, *index)] = rng.integers(1, 4)
      with np.errstate(over="ignore"):
        overflow = inject or any(
          not np.all(
            np.isfinite(
              (b[step].astype(np.float32) * scale).astype(_np_dtype(x)).astype(np.float32)
            )
          )
          for b, x in zip(base, LEAVES, strict=True)
        )
      scale, tracker = torch_next_scale(scale, tracker, overflow, self)
    return ([jnp.asarray(b, jnp.float32) for b in base], [jnp.asarray(c) for c in codes])


def _np_dtype(x):
  return ml_dtypes.bfloat16 if x.dtype == jnp.bfloat16 else np.dtype(x.dtype)


def torch_next_scale(scale, tracker, found_inf, storm):
  """torch's ``_amp_update_scale_``: float64 products rounded to float32, no floor."""
  if found_inf:
    return np.float32(np.float64(scale) * storm.backoff_factor), 0
  tracker += 1
  if tracker == storm.growth_interval:
    with np.errstate(over="ignore"):
      grown = np.float32(np.float64(scale) * storm.growth_factor)
    return (grown if np.isfinite(grown) else scale), 0
  return scale, tracker


# (growth_factor, backoff_factor, growth_interval): static in the scaler's state, so each one
# compiles the storm once; torch's defaults, and non-power-of-two factors.
HYPERPARAMETERS = [(2.0, 0.5, 2), (1.1, 0.3, 3), (4.0, 0.25, 1)]

storms = st.builds(
  lambda hyper, **kwargs: Storm(
    **kwargs, growth_factor=hyper[0], backoff_factor=hyper[1], growth_interval=hyper[2]
  ),
  hyper=st.sampled_from(HYPERPARAMETERS),
  seed=st.integers(0, 2**16),
  injection_rate=st.sampled_from([0.0, 0.05, 0.3, 0.8]),
  burst_rate=st.sampled_from([0.0, 0.01, 0.05]),
  init_scale=st.sampled_from([1.0, 2.0**10, 2.0**16, 2.0**24, 3e5]),
)

STORM_SETTINGS = settings(
  max_examples=5,
  deadline=None,
  derandomize=True,
  database=None,
  print_blob=True,
  suppress_health_check=list(HealthCheck),
)
SEED = 6


def scaled_gradients(base, codes, scale, like):
  """``base * scale`` in float32, cast to each leaf's dtype (may overflow), then injected."""
  out = []
  for b, c, leaf in zip(base, codes, like, strict=True):
    g = (b * scale).astype(leaf.dtype)
    g = jnp.where(
      c == POS_INF, jnp.inf, jnp.where(c == NEG_INF, -jnp.inf, jnp.where(c == NAN, jnp.nan, g))
    )
    out.append(g.astype(leaf.dtype))
  return out


def scaler(storm: Storm):
  return jaxamp.dynamic_loss_scale(
    optimizer(),
    init_scale=storm.init_scale,
    growth_factor=storm.growth_factor,
    backoff_factor=storm.backoff_factor,
    growth_interval=storm.growth_interval,
  )


@functools.cache
def trainer(growth_factor: float, backoff_factor: float, growth_interval: int):
  """One jitted storm (a ``lax.scan`` of training steps) per set of static hyperparameters."""
  tx = scaler(Storm(0, 0.0, 0.0, 1.0, growth_factor, backoff_factor, growth_interval))

  @jax.jit
  def train(params, state, base, codes):
    def step(carry, xs):
      params, state = carry
      leaves = jax.tree.leaves(params)
      grads = scaled_gradients(*xs, jaxamp.scaler.get_scale(state), leaves)
      nonfinite = jnp.any(jnp.stack([jnp.any(~jnp.isfinite(g)) for g in grads]))
      updates, state = tx.update(jax.tree.unflatten(TREEDEF, grads), state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), (params, state, nonfinite)

    _, history = lax.scan(step, (params, state), (base, codes))
    return history

  return train


@functools.cache
def run(storm: Storm):
  """The storm's history: params, scaler state and the gradients' non-finiteness per step.

  Index 0 of the params/state histories is the initial value, index t the value after step t.
  """
  state = scaler(storm).init(PARAMS)
  train = trainer(storm.growth_factor, storm.backoff_factor, storm.growth_interval)
  params_h, state_h, nonfinite = jax.device_get(train(PARAMS, state, *storm.arrays()))
  prepend = lambda first, rest: jax.tree.map(
    lambda a, b: np.concatenate([np.asarray(a)[None], b]), first, rest
  )
  return prepend(PARAMS, params_h), prepend(jax.device_get(state), state_h), nonfinite


@jax.jit
def adam_on_finite_steps(base, codes, scales, skipped):
  """Plain Adam on the gradients of the steps not skipped, unscaled as torch does."""
  adam = optimizer()

  def step(carry, xs):
    params, adam_state = carry
    base, codes, scale, skip = xs
    grads = scaled_gradients(base, codes, scale, LEAVES)
    # A float32 division: within an ulp of torch's float64 reciprocal rounded to float32.
    inverse = 1.0 / scale.astype(jnp.float32)
    unscaled = [(g.astype(jnp.float32) * inverse).astype(g.dtype) for g in grads]
    updates, new_state = adam.update(jax.tree.unflatten(TREEDEF, unscaled), adam_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
    return (keep(new_params, params), keep(new_state, adam_state)), None

  (params, _), _ = lax.scan(step, (PARAMS, adam.init(PARAMS)), (base, codes, scales, skipped))
  return params


def at(history, t):
  return jax.tree.map(lambda x: x[t], history)


def bitwise_equal(a, b) -> bool:
  return all(
    x.dtype == y.dtype and x.tobytes() == y.tobytes()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def storm_test(fun):
  """A property of random storms: slow (hypothesis draws many, each compiles its storm)."""
  return pytest.mark.slow(seed(SEED)(STORM_SETTINGS(given(storm=storms)(fun))))


# ------------------------------------------------------------------------------------------------


@storm_test
def test_params_and_optimizer_state_stay_finite_through_a_storm(storm):
  params, state, _ = run(storm)
  for leaf in jax.tree.leaves((params, state.inner_state)):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      assert np.all(np.isfinite(leaf.astype(np.float32)))


@storm_test
def test_found_inf_is_exactly_whether_some_gradient_leaf_was_non_finite(storm):
  _, state, nonfinite = run(storm)
  np.testing.assert_array_equal(state.found_inf[1:], nonfinite)


@storm_test
def test_skipped_steps_counts_every_skipped_step(storm):
  _, state, _ = run(storm)
  np.testing.assert_array_equal(state.skipped_steps[1:], np.cumsum(state.found_inf[1:]))


@pytest.mark.slow
def test_float16_gradients_that_overflow_at_a_large_scale_skip_steps_until_it_fits():
  storm = Storm(
    seed=1,
    injection_rate=0.0,
    burst_rate=0.0,
    init_scale=2.0**24,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2,
  )
  _, state, _ = run(storm)
  # 2**24 .. 2**16 overflow float16 (gradients reach 2.0); 2**15 fits.
  assert state.found_inf[1:10].all() and not state.found_inf[10]
  assert state.scale[9] == 2.0**15


@storm_test
def test_skipped_step_leaves_params_and_inner_state_bit_identical(storm):
  params, state, _ = run(storm)
  for t in np.flatnonzero(state.found_inf[1:]) + 1:
    assert bitwise_equal(at(params, t), at(params, t - 1)), t
    assert bitwise_equal(at(state.inner_state, t), at(state.inner_state, t - 1)), t


@storm_test
def test_skipped_step_changes_only_the_scalers_counters(storm):
  _, state, _ = run(storm)
  for t in np.flatnonzero(state.found_inf[1:]) + 1:
    assert state.growth_tracker[t] == 0
    assert state.skipped_steps[t] == state.skipped_steps[t - 1] + 1
    assert state.scale[t] == np.float32(np.float64(state.scale[t - 1]) * storm.backoff_factor)


@storm_test
def test_finite_step_always_updates_params(storm):
  params, state, _ = run(storm)
  for t in np.flatnonzero(~state.found_inf[1:]) + 1:
    assert not bitwise_equal(at(params, t)["dense"]["w"], at(params, t - 1)["dense"]["w"]), t


@storm_test
def test_scale_follows_torchs_update_rule_bit_for_bit(storm):
  _, state, _ = run(storm)
  scale, tracker = np.float32(storm.init_scale), 0
  for t in range(1, STEPS + 1):
    scale, tracker = torch_next_scale(scale, tracker, state.found_inf[t], storm)
    assert state.scale[t].tobytes() == scale.tobytes(), (t, state.scale[t], scale)
    assert state.growth_tracker[t] == tracker, t


@storm_test
def test_scale_stays_finite_and_positive_through_a_storm(storm):
  _, state, _ = run(storm)
  assert state.scale.dtype == np.float32
  assert np.all(np.isfinite(state.scale)) and np.all(state.scale > 0)


@storm_test
def test_adam_counts_only_the_finite_steps(storm):
  _, state, _ = run(storm)
  adam_count = state.inner_state[0].count
  np.testing.assert_array_equal(adam_count[1:], np.cumsum(~state.found_inf[1:]))


# The reference is one fused kernel: XLA:CPU recomputes a float16 leaf's new moments inside its
# parameter update in float32 (excess precision) instead of reading them rounded to float16 as
# the scaler's step does, so after hundreds of steps float16 parameters differ by a few ulps.
RTOL = {np.dtype(jnp.float16): 4 * float(jnp.finfo(jnp.float16).eps)}


@storm_test
def test_storm_trains_like_adam_on_the_finite_steps_alone(storm):
  params, state, _ = run(storm)
  reference = adam_on_finite_steps(
    *storm.arrays(), jnp.asarray(state.scale[:-1]), jnp.asarray(state.found_inf[1:])
  )
  for ours, theirs in zip(
    jax.tree.leaves(at(params, STEPS)), jax.tree.leaves(reference), strict=True
  ):
    np.testing.assert_allclose(
      ours.astype(np.float32),
      np.asarray(theirs, np.float32),
      rtol=RTOL.get(ours.dtype, 1e-5),
      atol=1e-6,
    )


# ------------------------------------------------------------------------------------------------
# No floor, as in torch: enough consecutive overflows back the scale off to exactly 0.


def _nan_steps(n: int):
  tx = jaxamp.dynamic_loss_scale(optimizer())
  nan_grads = jax.tree.map(lambda param: jnp.full_like(param, jnp.nan), PARAMS)

  @jax.jit
  def steps(params, state):
    def step(carry, _):
      params, state = carry
      updates, state = tx.update(nan_grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), state.scale

    return lax.scan(step, (params, state), None, length=n)

  (params, state), scales = steps(PARAMS, tx.init(PARAMS))
  return tx.init(PARAMS), params, state, np.asarray(scales)


@pytest.mark.slow
def test_scale_backs_off_to_exactly_zero_after_166_consecutive_overflows():
  _, _, _, scales = _nan_steps(200)
  # 2**16 * 0.5**165 == 2**-149 (the smallest float32); 2**-150 rounds to even: 0.
  assert scales[164] == np.float32(2.0**-149) and scales[165] == 0.0
  assert np.all(scales[165:] == 0.0)


def test_params_and_inner_state_stay_unchanged_while_the_scale_backs_off_to_zero():
  initial, params, state, _ = _nan_steps(200)
  assert bitwise_equal(params, PARAMS)
  assert bitwise_equal(state.inner_state, initial.inner_state)
  assert state.skipped_steps == 200


def test_scale_backs_off_to_zero_exactly_as_torch_does():
  torch = pytest.importorskip("torch")
  _, _, _, scales = _nan_steps(200)
  weight = torch.nn.Parameter(torch.ones(3))
  sgd = torch.optim.SGD([weight], lr=0.1)
  scaler = torch.amp.GradScaler("cpu")
  torch_scales = []
  for _ in range(200):
    sgd.zero_grad()
    scaler.scale((weight * float("nan")).sum()).backward()
    scaler.step(sgd)
    scaler.update()
    torch_scales.append(np.float32(scaler.get_scale()))
  assert np.array_equal(scales, np.array(torch_scales, np.float32))
