"""Autocasting a submodule keeps its weights trainable.

``eqx.tree_at(lambda m: m.mlp, model, jaxamp.autocast(model.mlp))`` is how an Equinox user
autocasts one layer. ``autocast`` of a module that is a pytree holding arrays returns a pytree
holding the module, so its arrays stay leaves of the model: gradients, optimizers and
``eqx.filter`` see them, and the call passes them to the autocast function as inputs. nnx modules
become a subclass of their class sharing their attributes; functions, bound methods, partials and
jitted functions are wrapped as before.
"""

import functools
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
X = jnp.asarray(np.random.default_rng(0).standard_normal((5, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).standard_normal((5, 2)), jnp.float32)


class Model(eqx.Module):
  """An MLP (the submodule to autocast) and a float32 head."""

  mlp: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key: jax.Array):
    mlp_key, head_key = jax.random.split(key)
    self.mlp = eqx.nn.MLP(4, 8, width_size=16, depth=2, key=mlp_key)
    self.head = eqx.nn.Linear(8, 2, key=head_key)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.head(self.mlp(x).astype(jnp.float32))


def new_model() -> Model:
  return Model(jax.random.key(0))


def with_autocast_mlp(model: Model) -> Model:
  return eqx.tree_at(lambda m: m.mlp, model, jaxamp.autocast(model.mlp, device_type="cuda"))


def loss(model: Model, x: jax.Array = X) -> jax.Array:
  return jnp.mean((jax.vmap(model)(x) - Y) ** 2)


def arrays(tree) -> list:
  return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


# --- the model keeps the submodule's arrays ------------------------------------------------------


@pytest.mark.slow
def test_the_model_keeps_as_many_arrays():
  model = new_model()
  assert len(arrays(with_autocast_mlp(model))) == len(arrays(model)) == 8


@pytest.mark.slow
def test_the_submodule_arrays_are_the_same_leaves():
  model = new_model()
  for old, new in zip(arrays(model), arrays(with_autocast_mlp(model)), strict=True):
    assert new is old


def test_the_model_keeps_its_key_paths():
  # torch's autocast leaves state_dict keys alone; orbax names leaves by these paths
  paths = lambda tree: [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)
  ]
  model = new_model()
  assert paths(with_autocast_mlp(model)) == paths(model)


@pytest.mark.slow
def test_submodule_fields_are_read_through_the_wrapper():
  model = new_model()
  assert with_autocast_mlp(model).mlp.layers[0].weight is model.mlp.layers[0].weight


@pytest.mark.slow
def test_tree_map_rebuilds_a_callable_wrapper_around_new_leaves():
  model = with_autocast_mlp(new_model())
  zeroed = jax.tree.map(lambda x: jnp.zeros_like(x) if eqx.is_array(x) else x, model)
  assert type(zeroed.mlp) is type(model.mlp)
  assert len(arrays(zeroed.mlp)) == 6
  assert all(not leaf.any() for leaf in arrays(zeroed.mlp.layers))
  np.testing.assert_array_equal(jax.vmap(zeroed.mlp)(X), 0.0)


# --- training ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_weight_gets_a_nonzero_float32_gradient():
  grads = eqx.filter_grad(loss)(with_autocast_mlp(new_model()))
  leaves = arrays(grads)
  assert len(leaves) == 8 and {g.dtype for g in leaves} == {F32}
  assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


@pytest.mark.slow
def test_gradients_are_close_to_float32():
  grads = eqx.filter_grad(loss)(with_autocast_mlp(new_model()))
  expected = eqx.filter_grad(loss)(new_model())
  for found, want in zip(arrays(grads), arrays(expected), strict=True):
    np.testing.assert_allclose(found, want, rtol=5e-2, atol=5e-2 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_adam_steps_change_every_weight():
  model = with_autocast_mlp(new_model())
  tx = optax.adam(1e-2)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def step(model, opt_state):
    grads = eqx.filter_grad(loss)(model)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state

  trained = model
  for _ in range(3):
    trained, opt_state = step(trained, opt_state)
  assert type(trained.mlp) is type(model.mlp) and len(arrays(trained)) == 8
  for old, new in zip(arrays(model), arrays(trained), strict=True):
    assert not np.allclose(old, new)


# --- the forward ---------------------------------------------------------------------------------


def test_submodule_matmuls_run_in_float16_and_the_head_in_float32():
  jaxpr = jaxpr_utils.traced(jax.vmap(with_autocast_mlp(new_model())), X)
  assert [ins for ins, _ in jaxpr_utils.dtypes_of(jaxpr, "dot_general")] == [(F16, F16)] * 3 + [
    (F32, F32)
  ]


@pytest.mark.slow
def test_filter_jit_runs_it_once_per_signature_with_the_eager_result():
  model = with_autocast_mlp(new_model())
  traces = []

  @eqx.filter_jit
  def forward(model, x):
    traces.append(None)
    return jax.vmap(model)(x)

  first = forward(model, X)
  np.testing.assert_array_equal(forward(model, X + 0.0), first)
  np.testing.assert_allclose(first, jax.vmap(model)(X), rtol=1e-6)
  assert len(traces) == 1


def test_disabled_autocast_of_a_module_runs_as_written():
  model = new_model()
  wrapped = jaxamp.autocast(model, device_type="cuda", enabled=False)
  assert len(arrays(wrapped)) == 8
  np.testing.assert_array_equal(jax.vmap(wrapped)(X), jax.vmap(model)(X))


# --- nnx ------------------------------------------------------------------------------------------


class NnxModel(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.mlp = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs))
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.head(self.mlp(x).astype(jnp.float32))


def nnx_model_with_autocast_mlp() -> NnxModel:
  model = NnxModel(nnx.Rngs(0))
  model.mlp = jaxamp.autocast(model.mlp, device_type="cuda")
  return model


@pytest.mark.slow
def test_nnx_submodule_params_stay_in_the_model_state():
  assert len(jax.tree.leaves(nnx.state(nnx_model_with_autocast_mlp(), nnx.Param))) == 6


@pytest.mark.slow
def test_an_nnx_module_can_make_an_autocast_submodule_in_init():
  class Wrapper(nnx.Module):
    def __init__(self):
      self.linear = jaxamp.autocast(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), device_type="cuda")

  model = Wrapper()
  assert len(jax.tree.leaves(nnx.state(model, nnx.Param))) == 2
  assert nnx.jit(lambda m, x: m.linear(x))(model, X).dtype == F16


@pytest.mark.slow
def test_nnx_submodule_params_get_float32_gradients_and_statistics_update():
  model = nnx_model_with_autocast_mlp()
  grads = nnx.jit(nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2)))(model)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == 6 and {g.dtype for g in leaves} == {F32}
  assert float(jnp.abs(model.mlp.layers[1].mean[...]).max()) > 0


def test_an_nnx_autocast_submodule_keeps_the_models_state_paths():
  # torch's autocast leaves state_dict keys alone
  paths = lambda model: [path for path, _ in nnx.to_flat_state(nnx.state(model))]
  assert paths(nnx_model_with_autocast_mlp()) == paths(NnxModel(nnx.Rngs(0)))


def test_a_float32_checkpoint_loads_into_a_model_with_an_nnx_autocast_submodule():
  checkpoint = nnx.state(NnxModel(nnx.Rngs(1)))
  model = nnx_model_with_autocast_mlp()
  nnx.update(model, checkpoint)
  for (_, new), (_, saved) in zip(
    nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(checkpoint), strict=True
  ):
    np.testing.assert_array_equal(new.get_value(), saved.get_value())


def test_an_nnx_autocast_module_is_a_module_of_its_class_and_runs_in_float16():
  linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  amp = jaxamp.autocast(linear, device_type="cuda")
  assert isinstance(amp, nnx.Linear)
  assert amp(X).dtype == F16 and linear(X).dtype == F32


def test_model_eval_reaches_an_nnx_autocast_dropout():
  model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
  model.layers[1] = jaxamp.autocast(model.layers[1], device_type="cuda")
  model.eval()
  assert model.layers[1].deterministic
  np.testing.assert_array_equal(model(X), model.layers[0](X))


class LazyScale(nnx.Module):
  """A Variable made in ``__call__`` in place of a placeholder."""

  def __init__(self):
    self.scale = nnx.data(None)

  def __call__(self, x):
    if self.scale is None:
      self.scale = nnx.Param(jnp.full(x.shape[-1], 2.0))
    return x * self.scale


class LazyNorm(nnx.Module):
  """A submodule made in ``__call__`` on first use."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    if not hasattr(self, "norm"):
      self.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
    return self.norm(self.linear(x))


LAZY = {"variable_for_a_placeholder": LazyScale, "submodule": lambda: LazyNorm(nnx.Rngs(0))}


@pytest.mark.parametrize("under", ["eager", "nnx.jit"])
@pytest.mark.parametrize("made", list(LAZY))
def test_what_an_nnx_module_makes_in_its_call_is_added_to_it(made, under):
  model, reference = LAZY[made](), LAZY[made]()
  amp = jaxamp.autocast(lambda m, x: m(x), device_type="cpu")
  run = amp if under == "eager" else nnx.jit(amp)
  out = run(model, X)
  np.testing.assert_allclose(out.astype(F32), reference(X), rtol=2e-2, atol=2e-2)
  paths = lambda m: [path for path, _ in nnx.to_flat_state(nnx.state(m))]
  assert paths(model) == paths(reference)
  np.testing.assert_array_equal(run(model, X), out)  # the second call finds what the first made


def test_what_an_nnx_autocast_module_makes_in_its_call_is_added_to_its_module():
  module = LazyNorm(nnx.Rngs(0))
  jaxamp.autocast(module, device_type="cpu")(X)
  assert isinstance(module.norm, nnx.LayerNorm)


# --- other callables are wrapped as before -------------------------------------------------------

W = jnp.ones((4, 3))


def matmul(w, x):
  return x @ w


class Holder:
  w = W

  def forward(self, x):
    return x @ self.w


@pytest.mark.parametrize(
  "fun",
  [
    pytest.param(lambda x: x @ W, id="function"),
    pytest.param(Holder().forward, id="bound_method"),
    pytest.param(functools.partial(matmul, W), id="partial"),
    pytest.param(jax.jit(functools.partial(matmul, W)), id="jit"),
  ],
)
def test_other_callables_become_functions_that_run_in_float16(fun):
  wrapped = jaxamp.autocast(fun, device_type="cuda")
  assert isinstance(wrapped, types.FunctionType) and wrapped.__wrapped__ is fun
  assert wrapped(X).dtype == F16


class DropoutNet(eqx.Module):
  linear: eqx.nn.Linear
  dropout: eqx.nn.Dropout

  def __call__(self, x, key=None):
    return self.dropout(self.linear(x), key=key)


def test_a_module_without_arrays_keeps_its_leaves_in_the_model():
  # Dropout holds only its rate and inference flag: eqx.nn.inference_mode must still reach them.
  net = DropoutNet(eqx.nn.Linear(8, 8, key=jax.random.key(0)), eqx.nn.Dropout(0.5))
  amp = eqx.tree_at(lambda m: m.dropout, net, jaxamp.autocast(net.dropout, device_type="cuda"))
  assert jax.tree.leaves(amp)[2:] == jax.tree.leaves(net)[2:] == [0.5, False]
  evaluating = eqx.nn.inference_mode(amp)
  assert evaluating.dropout.inference
  x = jnp.ones(8)
  np.testing.assert_array_equal(evaluating(x), evaluating.linear(x))  # no dropout: no key needed
