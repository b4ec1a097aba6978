"""The gradients of float32 values autocast casts down are reduced in float32.

autocast runs ``dot(x16, convert(W, float16))``. Before ``weight_grads``, JAX transposed that in
float16: the weight gradient came out of a float16 matmul and, in a data-parallel step, XLA
all-reduced the per-device partial sums in float16, before the convert to float32 (a float16 bias
gradient too). torch's DDP reduces the float32 ``param.grad``. These tests check the compiled
data-parallel step on 8 virtual CPU devices (a subprocess: the device count is set before JAX
starts), the numbers of a step whose float16 sum over the devices overflows, and that the
forward pass, forward mode, vmap, second derivatives, remat policies and scan are unchanged.
``weight_grads.disabled()`` gives the old behaviour, for the checks that these tests catch it.
"""

import re
import textwrap

import cpu_devices
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import sub_jaxprs, walk

import jaxamp
from jaxamp._src.autocast import weight_grads

LOW = {"cuda": jnp.dtype(jnp.float16), "cpu": jnp.dtype(jnp.bfloat16)}

SCRIPT = textwrap.dedent(
  """
    import json, re
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxamp
    from jaxamp._src.autocast import weight_grads

    mesh = jax.make_mesh((8,), ("data",))
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    COLLECTIVE = re.compile(
        r"^\\s*(?:ROOT )?%\\S+ = (.*) (all-reduce|all-reduce-start|reduce-scatter)\\(", re.M)

    class Net(nn.Module):
      # A conv, an einsum with a batch dimension shared with its weight (per-head projections),
      # attention between activations, and Dense layers.
      @nn.compact
      def __call__(self, x):
        h = nn.relu(nn.Conv(8, (3, 3))(x)).reshape(x.shape[0], 4, 16, 8)
        w = self.param("heads", nn.initializers.lecun_normal(), (4, 8, 8))
        q = jnp.einsum("bhtd,hde->bhte", h, w)
        att = jax.nn.softmax(jnp.einsum("bhte,bhse->bhts", q, q) / 8.0)
        h = jnp.einsum("bhts,bhse->bhte", att, q).reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.relu(nn.Dense(32)(h)))

    rng = np.random.default_rng(0)
    net = Net()
    images = jnp.asarray(rng.standard_normal((16, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, 16), jnp.int32)
    net_params = net.init(jax.random.key(0), images[:1])

    def reduced_dtypes(policy):
      def loss(params, x, y):
        logits = jaxamp.autocast(net.apply, device_type=policy)(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      step = jax.jit(jax.grad(loss), in_shardings=(replicated, data, data),
                     out_shardings=replicated)
      hlo = step.lower(net_params, images, labels).compile().as_text()
      return sorted({d for shapes, _ in COLLECTIVE.findall(hlo)
                     for d in re.findall(r"\\b([a-z]+[0-9]+)\\[", shapes)})

    # Overflow: dL/dy = 2**16 / 64 = 1024 per element, x ~ 1, 64 rows: a per-device dW of about
    # 8 * 1024 = 8192 fits in float16, the sum over the 8 devices (about 65536) does not.
    dense = nn.Dense(16)
    x = jnp.asarray(rng.uniform(0.9, 1.1, (64, 16)), jnp.float16)  # a 16-bit activation
    dense_params = dense.init(jax.random.key(1), x[:1].astype(jnp.float32))
    SCALE = 2.0 ** 16

    def scaled_loss(apply):
      def loss(params, x):
        return jnp.mean(jnp.sum(apply(params, x).astype(jnp.float32), -1)) * SCALE
      return loss

    def overflow_step():
      loss = scaled_loss(jaxamp.autocast(dense.apply, device_type="cuda"))
      step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)),
                     in_shardings=(replicated, data), out_shardings=replicated)
      (value, (grads, dx)) = step(dense_params, x)
      grads = jax.tree.map(lambda g: np.asarray(g, np.float64) / SCALE, grads)
      return value, grads, np.asarray(dx, np.float32)

    def clear():
      jax.clear_caches()
      jaxamp.clear_caches()

    result = {"dtypes": {}}
    for policy in ("cuda", "cpu"):
      result["dtypes"][policy] = {"new": reduced_dtypes(policy)}
      clear()
      with weight_grads.disabled():
        result["dtypes"][policy]["old"] = reduced_dtypes(policy)
      clear()

    reference = jax.grad(scaled_loss(dense.apply))(
        dense_params, x.astype(jnp.float32))
    reference = jax.tree.map(lambda g: np.asarray(g, np.float64) / SCALE, reference)
    new_value, new_grads, new_dx = overflow_step()
    clear()
    with weight_grads.disabled():
      old_value, old_grads, old_dx = overflow_step()
    clear()
    leaves = lambda tree: [np.asarray(g).ravel().tolist() for g in jax.tree.leaves(tree)]
    result["overflow"] = {
        "reference": leaves(reference), "new": leaves(new_grads), "old": leaves(old_grads),
        "loss_bit_identical": bool(np.asarray(new_value) == np.asarray(old_value)),
        "dx_bit_identical": bool(np.array_equal(new_dx, old_dx)),
        "largest_reference": float(max(np.abs(g).max() for g in jax.tree.leaves(reference))),
    }
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def eight_devices():
  return cpu_devices.run_json(SCRIPT, devices=8)


@pytest.mark.slow  # a subprocess on several virtual CPU devices
@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_data_parallel_step_all_reduces_gradients_in_float32(eight_devices, policy):
  assert eight_devices["dtypes"][policy]["new"] == ["f32"]


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_without_weight_grads_the_data_parallel_step_all_reduces_in_float16(eight_devices):
  # What the test above catches (XLA:CPU widens bfloat16 reductions itself, so only float16).
  assert "f16" in eight_devices["dtypes"]["cuda"]["old"]


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_gradients_whose_sum_over_devices_overflows_float16_stay_finite_and_exact(eight_devices):
  run = eight_devices["overflow"]
  assert run["largest_reference"] * 2.0**16 > 65504  # the float16 sum would overflow
  for ours, reference in zip(run["new"], run["reference"], strict=True):
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
  assert not all(np.isfinite(np.concatenate([np.asarray(g) for g in run["old"]])))


@pytest.mark.slow  # a subprocess on several virtual CPU devices
def test_forward_values_and_activation_gradients_are_bit_identical(eight_devices):
  assert eight_devices["overflow"]["loss_bit_identical"]
  assert eight_devices["overflow"]["dx_bit_identical"]


# --- single device: which matmuls compute the gradients -------------------------------------------


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(6, (3, 3))(x)).reshape(x.shape[0], 5, 24)  # (B, 5, 4 * 6 features)
    w = self.param("heads", nn.initializers.lecun_normal(), (5, 24, 7))
    h = jnp.einsum("bhd,hde->bhe", h, w).reshape(x.shape[0], 35)
    return nn.Dense(3)(nn.relu(nn.Dense(11)(h)))


NET = Net()
X = jnp.asarray(np.random.default_rng(0).standard_normal((9, 5, 4, 2)), jnp.float32)
PARAMS = NET.init(jax.random.key(0), X[:1])
SHAPES = [leaf.shape for leaf in jax.tree.leaves(PARAMS)]


def loss_of(policy, model=NET):
  apply = jaxamp.autocast(model.apply, device_type=policy)
  return lambda params, x=X: jnp.mean(apply(params, x).astype(jnp.float32) ** 2)


# Matmuls: a bfloat16 weight gradient's dot is a cpu_result_dot_p (a dot lowered per platform).
MATMUL_NAMES = ("dot_general", "conv_general_dilated", weight_grads.cpu_result_dot_p.name)


def param_gradient_dtypes(jaxpr, shapes) -> set:
  """Output dtypes of the matmuls and sums that produce a parameter's gradient (an output of
  one of the parameter ``shapes``, up to a transpose), as run on GPU and TPU: a
  ``cpu_result_dot_p`` with its float32 result (16-bit on CPU only, see weight_grads)."""
  shapes = {tuple(sorted(shape)) for shape in shapes}
  return {
    eqn.outvars[0].aval.dtype
    for eqn in eqns_off_cpu(jaxpr)
    if eqn.primitive.name in (*MATMUL_NAMES, "reduce_sum")
    and tuple(sorted(eqn.outvars[0].aval.shape)) in shapes
  }


def eqns_off_cpu(jaxpr):
  """Every eqn of ``jaxpr`` and its sub-jaxprs but those of a cond's CPU-only branches."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    platforms = eqn.params.get("branches_platforms") or ()
    for label, sub in sub_jaxprs(eqn):
      index = int(label[label.index("[") + 1 : -1]) if label.startswith("branches[") else None
      if index is None or "cpu" not in (platforms[index] or ()):
        yield from eqns_off_cpu(sub)


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_parameter_gradients_come_out_of_float32_matmuls_and_sums(policy):
  jaxpr = jax.make_jaxpr(jax.grad(loss_of(policy)))(PARAMS)
  assert param_gradient_dtypes(jaxpr, SHAPES) == {jnp.dtype(jnp.float32)}
  jaxamp.clear_caches()
  with weight_grads.disabled():
    old = jax.make_jaxpr(jax.grad(loss_of(policy)))(PARAMS)
  jaxamp.clear_caches()
  assert LOW[policy] in param_gradient_dtypes(old, SHAPES)  # what the check catches


def test_a_bias_the_add_broadcasts_is_broadcast_in_float32_before_its_cast():
  """flax's Dense adds a (1, F) bias: broadcast to the output in float32 and then cast, JAX
  sums its cotangent in float32 itself, with no custom_jvp around the add."""
  dense = nn.Dense(3)
  x = jnp.ones((4, 5))
  params = dense.init(jax.random.key(0), x)
  apply = jaxamp.autocast(dense.apply, device_type="cuda")
  loss = lambda params: apply(params, x).astype(jnp.float32).sum()
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr
  names = [eqn.primitive.name for _, eqn in walk(jaxpr)]
  assert "custom_jvp_call" not in names
  made_by = {eqn.outvars[0]: eqn for eqn in jaxpr.eqns}
  (add,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "add"]
  cast = next(made_by[a] for a in add.invars if made_by[a].primitive.name != "dot_general")
  assert cast.primitive.name == "jaxamp_saturating_convert"
  broadcast = made_by[cast.invars[0]]
  assert broadcast.primitive.name == "broadcast_in_dim"
  assert broadcast.outvars[0].aval.dtype == jnp.float32
  assert broadcast.outvars[0].aval.shape == (4, 3)
  bias_grad = jax.grad(loss)(params)["params"]["bias"]
  np.testing.assert_array_equal(bias_grad, np.full(3, 4.0, np.float32))


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_weight_gradient_matmuls_keep_16_bit_operands_off_cpu(policy):
  """The float32 gradient is a float32 *result* of the 16-bit operands (tensor cores)."""
  jaxpr = jax.make_jaxpr(jax.grad(loss_of(policy)))(PARAMS)
  for eqn in eqns_off_cpu(jaxpr):
    if eqn.primitive.name in MATMUL_NAMES:
      assert {a.aval.dtype for a in eqn.invars} == {LOW[policy]}, eqn


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_weight_gradient_matmuls_keep_their_output_transposes_unfolded_on_cpu(policy):
  """XLA:CPU folds a transpose of a dot's output into the dot, which then misses its fast
  kernel: the dot's output passes through ``unfolded_p``, an optimization barrier on CPU only."""
  step = jax.jit(jax.grad(loss_of(policy)))
  jaxpr = jax.make_jaxpr(step)(PARAMS)
  eqns = [eqn for _, eqn in walk(jaxpr)]
  producers = {out: eqn.primitive for eqn in eqns for out in eqn.outvars}
  transposed = [producers.get(e.invars[0]) for e in eqns if e.primitive.name == "transpose"]
  assert weight_grads.unfolded_p in transposed
  assert weight_grads.unfolded_p.name not in step.lower(PARAMS).as_text()
  assert "optimization_barrier" in step.lower(PARAMS).as_text()


@pytest.mark.parametrize(("platform", "result"), [("cpu", "bf16"), ("cuda", "f32")])
def test_bfloat16_weight_gradient_dots_have_16_bit_results_only_when_lowered_for_cpu(
  platform, result
):
  """XLA:CPU cannot run every bfloat16 x bfloat16 -> float32 dot: lowered for it, a bfloat16
  weight gradient is a bfloat16-result dot converted to float32; lowered for GPU, a float32-result
  dot. One jaxpr for both (``cpu_result_dot_p``), with no ``cond`` per weight."""
  traced = jax.jit(jax.grad(loss_of("cpu", Stack()))).trace(STACK_PARAMS, STACK_X)
  assert "cond" not in {eqn.primitive.name for _, eqn in walk(traced.jaxpr)}
  text = traced.lower(lowering_platforms=(platform,)).as_text()
  dots = re.findall(r"stablehlo\.dot_general .*-> tensor<([0-9x]+)x(\w+)>", text)
  weight_gradients = [dtype for shape, dtype in dots if shape == "16x16"]  # the two kernels
  assert weight_gradients == [result, result], dots
  assert {dtype for shape, dtype in dots if shape != "16x16"} == {"bf16"}, dots


def test_bfloat16_weight_gradients_computed_on_cpu_are_the_16_bit_results():
  """XLA:CPU drops a float32 -> bfloat16 -> float32 round trip: the optimization barrier in
  ``cpu_result_dot_p``'s CPU lowering keeps the 16-bit result the gradient is made of."""
  grads = jax.jit(jax.grad(loss_of("cpu", Stack())))(STACK_PARAMS, STACK_X)
  for kernel in (layer["kernel"] for layer in grads["params"].values()):
    assert kernel.dtype == jnp.float32
    rounded = np.asarray(kernel.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(kernel), rounded)


@pytest.mark.slow  # compiles many transforms
@pytest.mark.parametrize("policy", ["cuda"])  # bfloat16 keeps its 16-bit result on XLA:CPU
def test_weight_gradients_are_the_float32_sums_of_the_16_bit_products(policy):
  """Not rounded to 16 bits: the float32 sums of the products of the 16-bit operands."""
  grads = jax.grad(loss_of(policy))(PARAMS)
  jaxamp.clear_caches()
  with weight_grads.disabled():
    old = jax.grad(loss_of(policy))(PARAMS)
  jaxamp.clear_caches()
  kernel, old_kernel = (g["params"]["Dense_1"]["kernel"] for g in (grads, old))
  assert kernel.dtype == jnp.float32
  # bfloat16 / float16 rounding of the old gradient: a relative error of 2**-9 / 2**-12.
  np.testing.assert_allclose(kernel, old_kernel, rtol=2.0**-7)
  assert not np.array_equal(kernel, old_kernel)
  representable = np.asarray(kernel.astype(LOW[policy]).astype(jnp.float32))
  assert not np.array_equal(np.asarray(kernel), representable)  # more than 16 bits


# --- the rest of JAX keeps working --------------------------------------------------------------


@pytest.mark.slow
def test_forward_pass_is_bit_identical_and_adds_no_compiled_ops():
  apply = jax.jit(jaxamp.autocast(NET.apply, device_type="cuda"))
  new, new_hlo = apply(PARAMS, X), apply.lower(PARAMS, X).compile().as_text()
  jax.clear_caches()
  jaxamp.clear_caches()
  with weight_grads.disabled():
    old, old_hlo = apply(PARAMS, X), apply.lower(PARAMS, X).compile().as_text()
  jax.clear_caches()
  jaxamp.clear_caches()
  np.testing.assert_array_equal(new, old)
  count = lambda hlo: sum(" = " in line for line in hlo.splitlines())
  assert count(new_hlo) == count(old_hlo)


@pytest.mark.slow  # compiles many transforms
def test_forward_mode_works_and_agrees_with_the_old_tangents():
  """jvp runs the custom rule: the same tangent terms, a bias's summed in float32."""
  tangent = jax.tree.map(jnp.ones_like, PARAMS)
  new = jax.jvp(loss_of("cuda"), (PARAMS,), (tangent,))
  jaxamp.clear_caches()
  with weight_grads.disabled():
    old = jax.jvp(loss_of("cuda"), (PARAMS,), (tangent,))
  jaxamp.clear_caches()
  np.testing.assert_array_equal(new[0], old[0])
  np.testing.assert_allclose(new[1], old[1], rtol=1e-3)


@pytest.mark.slow  # compiles many transforms
def test_vmap_inside_and_outside_grad():
  loss = loss_of("cuda")
  per_example = jax.vmap(jax.grad(lambda params, x: loss(params, x[None])), in_axes=(None, 0))(
    PARAMS, X
  )
  vmapped = lambda params: jnp.mean(jax.vmap(lambda x: loss(params, x[None]))(X))
  of_vmapped = jax.grad(vmapped)(PARAMS)
  mean = jax.tree.map(lambda g: g.mean(0), per_example)
  for ours, theirs in zip(jax.tree.leaves(of_vmapped), jax.tree.leaves(mean), strict=True):
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, theirs, rtol=2e-2, atol=1e-4)
  # vmap inside grad batches the float32-gradient matmuls themselves (16-bit operands).
  jaxpr = jax.make_jaxpr(jax.grad(vmapped))(PARAMS)
  assert param_gradient_dtypes(jaxpr, SHAPES) == {jnp.dtype(jnp.float32)}
  for eqn in eqns_off_cpu(jaxpr):
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      assert {a.aval.dtype for a in eqn.invars} == {jnp.dtype(jnp.float16)}, eqn


@pytest.mark.slow  # compiles many transforms
def test_hessian_vector_products_and_grad_of_grad():
  loss = loss_of("cuda")
  tangent = jax.tree.map(jnp.ones_like, PARAMS)
  forward_over_reverse = jax.jvp(jax.grad(loss), (PARAMS,), (tangent,))[1]
  reverse_over_reverse = jax.grad(
    lambda params: jnp.vdot(_flat(jax.grad(loss)(params)), _flat(tangent))
  )(PARAMS)
  for a, b in zip(
    jax.tree.leaves(forward_over_reverse), jax.tree.leaves(reverse_over_reverse), strict=True
  ):
    assert a.dtype == jnp.float32 and np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def _flat(tree):
  return jnp.concatenate([leaf.ravel() for leaf in jax.tree.leaves(tree)])


class Stack(nn.Module):
  remat_policy: object = None

  @nn.compact
  def __call__(self, x):
    dense = nn.remat(nn.Dense, policy=self.remat_policy) if self.remat_policy else nn.Dense
    for i in range(2):
      x = jnp.tanh(dense(16, name=f"layer{i}")(x))
    return x


REMAT_POLICIES = {
  "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "save_only_these_names": jax.checkpoint_policies.save_only_these_names("none"),
}
STACK_X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)
STACK_PARAMS = Stack().init(jax.random.key(0), STACK_X)


@pytest.mark.parametrize("name", sorted(REMAT_POLICIES))
def test_remat_policies_still_see_the_dots(name):
  """``jax.checkpoint`` around autocast saves what its policy says: the two dots' outputs."""
  loss = jax.checkpoint(loss_of("cuda", Stack()), policy=REMAT_POLICIES[name])
  saved = _saved_residuals(loss, STACK_PARAMS, STACK_X)
  dots = [(8, 16, jnp.dtype(jnp.float16))] * 2
  assert saved == ([] if name == "save_only_these_names" else dots)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REMAT_POLICIES))
def test_remat_inside_autocast_gives_the_same_gradients(name):
  plain = jax.grad(loss_of("cuda", Stack()))(STACK_PARAMS, STACK_X)
  rematted = jax.grad(loss_of("cuda", Stack(REMAT_POLICIES[name])))(STACK_PARAMS, STACK_X)
  for a, b in zip(jax.tree.leaves(rematted), jax.tree.leaves(plain), strict=True):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)


def _saved_residuals(loss, params, x) -> list:
  """(shape..., dtype) of the values ``jax.vjp`` keeps that are not its inputs, sorted."""

  def residuals(params):
    return jax.tree.leaves(jax.vjp(lambda params: loss(params, x), params)[1])

  jaxpr = jax.make_jaxpr(residuals)(params).jaxpr
  inputs = {*jaxpr.invars, *jaxpr.constvars}
  kept = {v for v in jaxpr.outvars if type(v).__name__ != "Literal" and v not in inputs}
  return sorted((*v.aval.shape, v.aval.dtype) for v in kept)


@pytest.mark.slow
def test_scan_over_layers_gets_float32_weight_gradients():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jnp.tanh(nn.Dense(16)(x)), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      return scan()(x, None)[0]

  x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 16)), jnp.float32)
  params = Scanned().init(jax.random.key(0), x)
  loss = loss_of("cuda", Scanned())
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
  layer_shapes = [leaf.shape[1:] for leaf in jax.tree.leaves(params)]  # one layer's, in the body
  assert param_gradient_dtypes(jaxpr, layer_shapes) == {jnp.dtype(jnp.float32)}
  grads = jax.grad(loss)(params, x)
  assert all(np.all(np.isfinite(g)) and g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


# --- a 16-bit parameter broadcast to a larger shape: its gradient is a float32 sum ----------------

SUM_X = jnp.ones((256, 64)) / 8
SUM_W = jnp.ones((64, 256)) / 16  # SUM_X @ SUM_W is 0.5 everywhere: sums of 65536 halves


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_a_scalar_parameters_gradient_is_summed_in_float32_as_torchs_sum_to(policy):
  # torch CPU autocast: d/ds sum(s * (x @ w)) is exactly 32768 (a bfloat16 sum gave 8192)
  loss = lambda s, x, w: jnp.sum((s * (x @ w)).astype(jnp.float32))
  grad = jax.grad(jaxamp.autocast(loss, device_type=policy))(jnp.float32(2.0), SUM_X, SUM_W)
  assert grad.dtype == jnp.float32 and float(grad) == 32768.0


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
@pytest.mark.parametrize("computed", ["exp", "tanh"])
def test_a_computed_scalars_gradient_is_summed_in_float32(policy, computed):
  # CLIP's exp(logit_scale) times the similarity matrix, a tanh gate: one element broadcast over
  # the whole product, whose gradient torch's sum_to accumulates in float32
  fun = getattr(jnp, computed)
  loss = lambda s, x, w: jnp.sum((fun(s) * (x @ w)).astype(jnp.float32))
  s = jnp.float32(0.5)
  grad = jax.grad(jaxamp.autocast(loss, device_type=policy))(s, SUM_X, SUM_W)
  np.testing.assert_allclose(grad, jax.grad(loss)(s, SUM_X, SUM_W), rtol=2**-7)


@pytest.mark.parametrize("keepdims_axis,summed", [(None, True), (1, False)])
def test_a_computed_value_gets_the_float32_sum_only_when_it_has_one_element(keepdims_axis, summed):
  # h - mean(h): the global mean is broadcast over all of h; a keepdims mean (a norm's statistic)
  # is an activation summed along one dim, whose broadcast stays a plain one
  def loss(x, w):
    h = x @ w
    return jnp.sum((h - jnp.mean(h, axis=keepdims_axis, keepdims=True)).astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jaxamp.autocast(loss, device_type="cpu"))(SUM_X, SUM_W)
  assert ("name=summed_in_float32" in str(jaxpr)) == summed


def test_a_prelu_slopes_gradient_is_summed_in_float32():
  x = jax.random.normal(jax.random.key(0), (32, 8, 32, 32))
  loss = lambda a, x: jnp.mean(jaxamp.functional.prelu(x, a) ** 2)
  slope = jnp.full((1,), 0.25)
  grad = jax.grad(jaxamp.autocast(loss, device_type="cpu"))(slope, x)
  np.testing.assert_allclose(grad, jax.grad(loss)(slope, x), rtol=5e-3)


def test_an_equinox_per_channel_prelus_gradient_under_vmap_is_summed_in_float32():
  import equinox as eqx  # noqa: PLC0415

  prelu = eqx.nn.PReLU(init_alpha=jnp.full((32,), 0.25))
  x = jax.random.normal(jax.random.key(1), (16, 8, 8, 32))
  loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
  grad = eqx.filter_grad(jaxamp.autocast(loss, device_type="cpu"))(prelu, x).negative_slope
  expected = eqx.filter_grad(loss)(prelu, x).negative_slope
  np.testing.assert_allclose(grad, expected, rtol=2e-2, atol=1e-5)


def test_without_weight_grads_a_scalar_parameters_gradient_is_a_16_bit_sum():
  # what the tests above catch; checked in the jaxpr, since some XLA:CPU versions widen a bfloat16
  # reduce_sum's accumulator and give 32768 anyway
  loss = lambda s, x, w: jnp.sum((s * (x @ w)).astype(jnp.float32))
  jaxamp.clear_caches()
  with weight_grads.disabled():
    grad = jax.grad(jaxamp.autocast(loss, device_type="cpu"))
    jaxpr = jax.make_jaxpr(grad)(jnp.float32(2.0), SUM_X, SUM_W).jaxpr
  jaxamp.clear_caches()
  producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
  eqn = producers[jaxpr.outvars[0]]
  while eqn.primitive.name == "convert_element_type":
    eqn = producers[eqn.invars[0]]
  assert eqn.primitive.name == "reduce_sum" and eqn.outvars[0].aval.dtype == jnp.bfloat16
