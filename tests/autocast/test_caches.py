"""autocast's caches reuse traces and rewrites, yet keep nothing of the user's alive."""

import collections
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp._src import caches
from jaxamp._src.autocast import higher_order
from jaxamp._src.autocast import transform as autocast_module

W = jnp.ones((8, 8)) * 0.1


@pytest.fixture(autouse=True)
def _fresh_caches():
  jaxamp.clear_caches()
  yield
  jaxamp.clear_caches()


def _batches_alive(refs: list) -> int:
  gc.collect()
  return sum(r() is not None for r in refs)


def _batch(i: int) -> jax.Array:
  return jnp.full((4, 8), float(i + 1))


def _closure_step(batch):
  return jaxamp.autocast(lambda params: jnp.sum(batch @ params), device_type="cpu")(W)


def _jit_closure_step(batch):
  """The closed-over batch lands in a jit body: the rewrite cache sees it too."""
  return jaxamp.autocast(
    lambda params: jnp.sum(jax.jit(lambda q: batch @ q)(params)), device_type="cpu"
  )(W)


def _scan_closure_step(batch):
  def f(params):
    carry, _ = lax.scan(lambda c, row: (c + jnp.sum(row @ params @ batch.T), None), 0.0, batch)
    return carry

  return jaxamp.autocast(f, device_type="cpu")(W)


@pytest.mark.parametrize("step", [_closure_step, _jit_closure_step, _scan_closure_step])
@pytest.mark.slow
def test_an_eager_loop_keeps_no_closed_over_batch_alive(step):
  refs = []
  for i in range(4):
    batch = _batch(i)
    refs.append(weakref.ref(batch))
    out = step(batch)
    assert jnp.isfinite(out)
    del batch
  assert _batches_alive(refs) == 0


@pytest.mark.slow
def test_a_numpy_batch_in_a_closure_is_not_kept_either():
  refs = []
  for i in range(3):
    batch = np.full((4, 8), i + 1.0, np.float32)
    refs.append(weakref.ref(batch))
    _closure_step(batch)
    del batch
  assert _batches_alive(refs) == 0


def test_a_function_called_twice_with_one_signature_is_traced_once():
  # A deque's items are not among what a trace is taken to read (a list's are: a function
  # appending to a list it closes over is traced again once the list changed, test_trace_reuse).
  traces = collections.deque()

  def f(x, w, train=True):
    traces.append(1)
    return jnp.sum(x @ w) if train else jnp.sum(x)

  x = _batch(0)
  for _ in range(3):
    jaxamp.autocast(f, device_type="cpu")(x, W)  # a new autocast wrapper each time
  assert len(traces) == 1
  jaxamp.autocast(f, device_type="cpu")(x.astype(jnp.bfloat16), W)
  jaxamp.autocast(f, device_type="cpu")(x, W, train=False)
  jaxamp.autocast(f, device_type="cuda")(x, W)  # the policy is applied after tracing
  assert len(traces) == 3


def test_a_vmapped_function_is_traced_again_for_another_axis_size():
  # pmean divides by the vmap axis's size, read at trace time: a jaxpr traced for one batch size
  # is wrong for another although the per-example avals are the same.
  def f(x):
    return lax.pmean(x, "batch") + lax.axis_size("batch")

  amp = jaxamp.autocast(f, device_type="cpu")
  for n in (4, 2, 8):
    x = jnp.arange(float(n))
    expected = jax.vmap(f, axis_name="batch")(x)
    np.testing.assert_array_equal(jax.vmap(amp, axis_name="batch")(x), expected)
    np.testing.assert_array_equal(jax.jit(jax.vmap(amp, axis_name="batch"))(x), expected)


def test_a_function_is_traced_again_under_another_context_mesh():
  # A bare PartitionSpec resolves against the context mesh when traced; so does anything reading
  # it. The mesh a trace was made under is part of its signature.
  def f(x):
    return x * len(jax.sharding.get_abstract_mesh().axis_names)

  amp = jaxamp.autocast(f, device_type="cpu")
  x = jnp.ones(2)
  for names in (("data",), ("data", "model")):
    with jax.set_mesh(jax.make_mesh((1,) * len(names), names)):
      np.testing.assert_array_equal(amp(x), f(x))
      np.testing.assert_array_equal(jax.jit(amp)(x), f(x))


def test_static_arguments_of_equal_value_but_different_type_are_traced_apart():
  traces = []

  def f(x, scale):
    traces.append(1)
    return x * scale, scale

  x = jnp.ones(3)
  _, one = jaxamp.autocast(f)(x, 1)
  _, one_float = jaxamp.autocast(f)(x, 1.0)
  assert len(traces) == 2 and type(one) is int and type(one_float) is float


class _Model:
  def __init__(self):
    self.w = jnp.ones((8, 8)) * 0.5
    self.traces = 0

  def apply(self, x):
    self.traces += 1
    return jnp.sum(x @ self.w)


def test_a_bound_method_recreated_per_access_still_hits_the_cache():
  model = _Model()
  x = _batch(0)
  outs = [jaxamp.autocast(model.apply, device_type="cpu")(x) for _ in range(3)]
  assert model.traces == 1
  assert all(out == outs[0] for out in outs)
  other = _Model()
  jaxamp.autocast(other.apply, device_type="cpu")(x)  # another instance: its own trace
  assert other.traces == 1


@pytest.mark.slow
def test_the_cache_does_not_keep_a_bound_methods_instance_alive():
  model = _Model()
  instance, weights = weakref.ref(model), weakref.ref(model.w)
  jaxamp.autocast(model.apply, device_type="cpu")(_batch(0))
  del model
  gc.collect()
  assert instance() is None and weights() is None


class _Tag:
  """Static metadata of a pytree node (as an Equinox module's static fields are)."""


class _Tagged:
  def __init__(self, x, tag):
    self.x, self.tag = x, tag


jax.tree_util.register_pytree_node(
  _Tagged, lambda t: ((t.x,), t.tag), lambda tag, children: _Tagged(children[0], tag)
)


@pytest.mark.slow
def test_the_pytree_metadata_of_arguments_and_outputs_dies_with_the_function():
  tag = _Tag()
  metadata = weakref.ref(tag)

  def step(tree):
    return _Tagged(tree.x @ W, tree.tag)  # the output carries the argument's metadata

  out = jaxamp.autocast(step, device_type="cpu")(_Tagged(_batch(0), tag))
  assert out.tag is tag
  del step, tag, out
  gc.collect()
  assert metadata() is None


@pytest.mark.slow
def test_a_partial_recreated_per_call_hits_the_cache_and_keeps_no_array_alive():
  traces = []

  def f(x, w, scale):
    traces.append(1)
    return jnp.sum(x @ w) * scale

  x = _batch(0)
  for _ in range(3):
    jaxamp.autocast(functools.partial(f, scale=2.0), device_type="cpu")(x, W)
  assert len(traces) == 1  # static partial arguments key the cache like static arguments
  refs = []
  for i in range(3):
    w = W + i
    refs.append(weakref.ref(w))
    out = jaxamp.autocast(functools.partial(f, w=w, scale=2.0), device_type="cpu")(x)
    assert out == jaxamp.autocast(f, device_type="cpu")(x, w, 2.0)
    del w, out
  assert _batches_alive(refs) == 0


class _Unhashable:
  __hash__ = None

  def __init__(self):
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return x @ W


class _NotWeakrefable:
  __slots__ = ("calls",)

  def __init__(self):
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return x @ W


def test_unhashable_and_non_weakrefable_callables_still_work():
  x = _batch(0)
  unhashable = _Unhashable()
  for _ in range(2):
    out = jaxamp.autocast(unhashable, device_type="cpu")(x)
    assert out.dtype == jnp.bfloat16
  assert unhashable.calls == 2  # cannot be cached: traced every call
  slots = _NotWeakrefable()
  for _ in range(2):
    out = jaxamp.autocast(slots, device_type="cpu")(x)
    assert out.dtype == jnp.bfloat16
  assert slots.calls == 1
  out = jaxamp.autocast(lambda x, table: x @ W, device_type="cpu")(x, {"k": [1, 2]})
  assert out.dtype == jnp.bfloat16


def _body_with_jit(x):
  return jnp.sum(jax.jit(lambda y: jnp.exp(y @ W))(x))


def test_clear_caches_empties_every_cache_and_the_next_call_retraces():
  traces = []

  def f(x):
    traces.append(1)
    return _body_with_jit(x)

  x = _batch(0)
  jaxamp.autocast(f, device_type="cpu")(x)
  jaxamp.autocast(f, device_type="cpu")(x)
  assert len(traces) == 1
  assert len(autocast_module._traces) > 0 and len(higher_order._rewrites) > 0
  jaxamp.clear_caches()
  assert len(autocast_module._traces) == 0 and len(higher_order._rewrites) == 0
  jaxamp.autocast(f, device_type="cpu")(x)
  assert len(traces) == 2


def test_jit_of_autocast_works_after_clear_caches():
  f = jax.jit(jaxamp.autocast(_body_with_jit, device_type="cuda"))
  x = _batch(0)
  before = f(x)
  jaxamp.clear_caches()
  after = f(x)  # jit's own cache: autocast's trace is not needed
  again = f(x[:2])  # a new shape: autocast traces afresh
  assert before.dtype == after.dtype == again.dtype == jnp.float32
  assert before == after
  assert jaxpr_has_float16_dot(jax.make_jaxpr(f)(x))


def jaxpr_has_float16_dot(closed) -> bool:
  text = str(closed)
  return "dot_general" in text and "f16" in text


def _call_a_fresh_jit(x, i):
  inner = jax.jit(lambda y: jnp.exp(y @ W) + i)
  return jaxamp.autocast(lambda y: jnp.sum(inner(y)), device_type="cpu")(x)


@pytest.mark.slow
def test_a_cached_rewrite_is_dropped_with_its_jaxpr():
  x = _batch(0)
  for i in range(3):
    _call_a_fresh_jit(x, i)
  gc.collect()
  assert len(higher_order._rewrites) == 0
  assert len(autocast_module._traces) == 0


class _Config:
  """A value-hashed static argument (a frozen dataclass would be one too)."""

  def __init__(self, depth: int):
    self.depth = depth

  def __eq__(self, other):
    return type(other) is _Config and other.depth == self.depth

  def __hash__(self):
    return hash(self.depth)


@pytest.mark.slow
def test_the_weak_lru_cache_evicts_the_oldest_and_drops_entries_of_dead_objects():
  cache = caches.WeakLRUCache(2)
  fns = [_Model() for _ in range(3)]  # hashed by identity
  for i, fn in enumerate(fns):
    cache.put((caches.key_part(fn), i), i)
  assert len(cache) == 2 and cache.get((caches.key_part(fns[0]), 0)) is None
  assert cache.get((caches.key_part(fns[2]), 2)) == 2
  config, equal = _Config(3), _Config(3)
  cache.put((caches.key_part(config),), "config")
  assert cache.get((caches.key_part(equal),)) == "config"  # equal values share an entry
  del fns, fn, config
  gc.collect()
  assert len(cache) == 0
  jaxamp.clear_caches()


def _fill_every_cache(x):
  """A grad through autocast with a jit body, a scan, a registered op and a bias add, also under
  the float8 policy, and through an autocast of it with an override."""
  op = jaxamp.register_op("test_caches_fill_op", category="float32")(jnp.tanh)

  def loss(w, b):
    h = jax.jit(lambda y: y @ w + b)(x)
    with jax.named_scope("head"):
      h, _ = lax.scan(lambda c, row: (c + jnp.sum(row), None), jnp.zeros(()), op(h))
    return h

  f = jaxamp.autocast(loss, device_type="cuda")
  jax.grad(f, argnums=(0, 1))(W, jnp.ones((8,)))
  scaled = jaxamp.autocast(lambda s: jnp.sum((s * (x @ W)).astype(jnp.float32)), device_type="cuda")
  jax.grad(scaled)(jnp.float32(2.0))  # a scalar parameter's broadcast gradient
  overridden = jaxamp.autocast(loss, device_type="cuda", overrides={"head": jnp.bfloat16})
  jax.grad(overridden, argnums=(0, 1))(W, jnp.ones((8,)))
  fp8 = jaxamp.autocast(loss, device_type="cuda", dtype=jnp.float8_e4m3fn)  # float8 matmuls
  jax.grad(fp8, argnums=(0, 1))(W, jnp.ones((8,)))
  return f


@pytest.mark.slow
def test_clear_caches_empties_every_registered_cache():
  f = _fill_every_cache(_batch(0))
  registered = caches.registered()
  assert {"autocast.traces", "higher_order.rewrites", "regions.named_ops"} <= set(registered)
  empty = [name for name, cache in registered.items() if cache.size() == 0]
  assert not empty, f"_fill_every_cache leaves {empty} empty: extend it to use them"
  jaxamp.clear_caches()
  assert {name: cache.size() for name, cache in registered.items()} == dict.fromkeys(registered, 0)
  del f


def _has_float16_dot_now(f, x) -> bool:
  """Whether ``f(x)`` traces a float16 dot, tracing ``f`` afresh: jax.make_jaxpr(f) would find
  jax's own trace of ``f``, not call it."""
  return jaxpr_has_float16_dot(jax.make_jaxpr(lambda y: f(y))(x))


def _scan_of_late_op(op):
  return lambda x: lax.scan(lambda c, row: (c + jnp.sum(op(row, W)), None), 0.0, x)[0]


def _jit_of_late_op(op):
  return lambda x: jnp.sum(jax.jit(lambda y: op(y, W))(x))


@pytest.mark.parametrize("spelling", ["decorator", "library"])
def test_a_category_registered_later_reaches_ops_already_looked_up(spelling):
  name = f"test_caches_late_{spelling}"
  if spelling == "decorator":
    op = jaxamp.register_op(name)(lambda a, b: a @ b)
  else:

    def op(a, b):
      return a @ b

    jaxamp.register_op(op, name=name)
  fs = [
    jaxamp.autocast(wrap(op), device_type="cuda") for wrap in (_scan_of_late_op, _jit_of_late_op)
  ]
  x = _batch(0)
  assert all(_has_float16_dot_now(f, x) for f in fs)  # no category: the dot follows its own rule
  jaxamp.register_op(name, category="float32")
  assert not any(_has_float16_dot_now(f, x) for f in fs)


@pytest.mark.slow
def test_a_cached_nnx_bridge_module_alive_at_exit_prints_nothing():
  # its key holds a linen module, whose hash needs module globals torn down at shutdown
  import subprocess
  import sys

  script = """
import jax.numpy as jnp, jaxamp, flax.linen as nn
from flax import nnx
from flax.nnx import bridge
model = bridge.ToNNX(nn.Dense(8), rngs=nnx.Rngs(0))
bridge.lazy_init(model, jnp.ones((4, 8)))
print(jaxamp.autocast(model, device_type="cpu")(jnp.ones((4, 8))).dtype)
"""
  done = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
  )
  assert done.stdout.strip() == "bfloat16"
  assert "Exception ignored" not in done.stderr
