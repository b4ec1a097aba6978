"""Under ``grad``, autocast binds each operation through a cached ``jax.jit(inline=True)``, as
``jax.numpy`` does, so JAX linearizes each distinct operation once instead of once per layer
(``compat.staged``). The program it builds is the same, down to each eqn's source line."""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import ad

import jaxamp
from jaxamp._src import compat

prims = compat.primitives


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
    h = nn.Dense(x.shape[-1])(h)
    return x + jax.nn.softmax(h) * h


class Stack(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = Block()(x)
    return x


def _loss_and_params(layers: int, device_type: str = "cuda"):
  model = Stack(layers)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)
  params = model.init(jax.random.key(0), x)

  def loss(params):
    return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

  return jaxamp.autocast(loss, device_type=device_type), params


def _unstaged(monkeypatch):
  monkeypatch.setattr(compat, "linearizing", lambda values: False)


def _jvp_rule_linearizations(fun, params, monkeypatch) -> collections.Counter:
  """Primitive -> how many times JAX linearizes it by tracing its JVP rule in ``grad(fun)``."""
  counts = collections.Counter()
  fallback = ad.fallback_linearize_rule

  def counting(primitive, *args, **kwargs):
    counts[primitive] += 1
    return fallback(primitive, *args, **kwargs)

  jaxamp.clear_caches()
  jax.clear_caches()
  with monkeypatch.context() as patch:
    patch.setattr(ad, "fallback_linearize_rule", counting)
    jax.make_jaxpr(jax.grad(fun))(params)
  return counts


@pytest.mark.slow  # counts linearizations of a deep program
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_grad_linearizes_each_repeated_operation_once(device_type, monkeypatch):
  shallow, deep = (
    _jvp_rule_linearizations(*_loss_and_params(layers, device_type), monkeypatch)
    for layers in (2, 4)
  )
  # A float32-inside softmax or gelu on a 16-bit input is one jax.checkpoint per call (flax
  # names each layer's ops apart, so no two calls are the same program): linearized per call,
  # all else once. Each layer has a gelu, and under "cpu" a softmax too (CUDA's softmax is on
  # its float32 list: float32 out, nothing to recompute).
  checkpoints = shallow.pop(prims.remat_p, 0), deep.pop(prims.remat_p, 0)
  assert shallow == deep
  per_layer = 2 if device_type == "cpu" else 1
  assert checkpoints == (2 * per_layer, 4 * per_layer)


@pytest.mark.slow
def test_unstaged_grad_linearizes_every_operation(monkeypatch):
  """The counts above are a real signal: without staging they grow with the depth."""
  _unstaged(monkeypatch)
  shallow, deep = (
    _jvp_rule_linearizations(*_loss_and_params(layers), monkeypatch) for layers in (2, 4)
  )
  assert deep.total() > shallow.total() + 50  # ~40 per layer


def _lowered_text(fun, params) -> str:
  jaxamp.clear_caches()
  jax.clear_caches()
  lowered = jax.jit(jax.value_and_grad(fun)).lower(params)
  return lowered.as_text(debug_info=True)


@pytest.mark.slow
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_staged_grad_lowers_to_the_same_program_and_source_lines(device_type, monkeypatch):
  fun, params = _loss_and_params(3, device_type)
  texts = []
  for staging in (True, False):
    if not staging:
      _unstaged(monkeypatch)
    texts.append(_lowered_text(fun, params))  # one call site: the same tracebacks
  assert texts[0] == texts[1]
  assert "test_staged_binds.py" in texts[0]  # locations are compared, not absent


@pytest.mark.slow
def test_staging_applies_only_while_linearizing():
  fun, params = _loss_and_params(2)
  jaxamp.clear_caches()
  jax.make_jaxpr(fun)(params)
  jax.make_jaxpr(lambda params: jax.jvp(fun, (params,), (params,)))(params)
  assert not compat._staged_functions
  jax.make_jaxpr(jax.grad(fun))(params)
  assert compat._staged_functions


def test_clear_caches_drops_the_staged_functions():
  fun, params = _loss_and_params(2)
  jax.make_jaxpr(jax.grad(fun))(params)
  assert compat._staged_functions
  jaxamp.clear_caches()
  assert not compat._staged_functions


@pytest.mark.slow
def test_staged_grad_values_equal_unstaged(monkeypatch):
  fun, params = _loss_and_params(2)
  staged = jax.jit(jax.value_and_grad(fun))(params)
  _unstaged(monkeypatch)
  jaxamp.clear_caches()
  jax.clear_caches()
  unstaged = jax.jit(jax.value_and_grad(fun))(params)
  for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(unstaged), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
