"""Inside every higher-order primitive, dots, convs, exp and reductions get the policy's dtype."""

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxamp

X = jnp.ones((4, 8)) * 0.1
W = jnp.ones((8, 8)) * 0.1
KERNEL = jnp.ones((3, 3, 8, 8)) * 0.1

# (device_type, dot/conv dtype, dtype exp runs in when fed by a dot)
POLICIES = [
  ("cuda", jnp.float16, jnp.float32),
  ("xpu", jnp.float16, jnp.float32),
  ("cpu", jnp.bfloat16, jnp.bfloat16),
]


def block(x, w):
  """A dot, a conv, an exp and a reduction."""
  h = x @ w
  image = h.reshape(1, 4, 8, 1).repeat(8, axis=3)
  c = lax.conv_general_dilated(
    image, KERNEL, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return jnp.exp(h) + jnp.sum(h) + jnp.sum(c)


def _custom_jvp_block():
  f = jax.custom_jvp(block)
  f.defjvp(lambda primals, t: (block(*primals), jnp.zeros_like(primals[0])))
  return f


def _custom_vjp_block():
  f = jax.custom_vjp(block)
  f.defvjp(lambda x, w: (block(x, w), (x, w)), lambda r, g: (g, r[1]))
  return f


def _custom_vmap_block():
  f = jax.custom_batching.custom_vmap(block)
  f.def_vmap(
    lambda size, batched, x, w: (jax.vmap(block, [0 if b else None for b in batched])(x, w), True)
  )
  return f


def _shard_map(fun):
  mesh = jax.make_mesh((1,), ("d",))
  return jax.shard_map(fun, mesh=mesh, in_specs=(P(), P()), out_specs=P())


def _closed_call(fun):
  """A closed_call eqn (no public API makes one; jax.extend exposes the primitive)."""

  def call(*args):
    closed = jax.make_jaxpr(fun)(*args)
    prim = jax.extend.core.primitives.closed_call_p
    return prim.bind(*args, **prim.get_bind_params({"call_jaxpr": closed}))[0]

  return call


HIGHER_ORDER = {
  "jit": lambda x, w: jax.jit(block)(x, w),
  "closed_call": lambda x, w: _closed_call(block)(x, w),
  "scan": lambda x, w: lax.scan(lambda c, _: (c, block(c, w)), x, None, length=2)[1].sum(0),
  "while": lambda x, w: lax.while_loop(
    lambda s: s[0] < 2, lambda s: (s[0] + 1, block(s[1], w) * 0 + s[1]), (0, x)
  )[1],
  "cond": lambda x, w: lax.cond(x.sum() > 0, block, lambda a, b: a, x, w),
  "switch": lambda x, w: lax.switch(1, [lambda a, b: a, block], x, w),
  "remat": lambda x, w: jax.checkpoint(block)(x, w),
  "custom_jvp": lambda x, w: _custom_jvp_block()(x, w),
  "custom_vjp": lambda x, w: _custom_vjp_block()(x, w),
  "custom_vmap": lambda x, w: _custom_vmap_block()(x, w),
  "sequential_vmap": lambda x, w: jax.custom_batching.sequential_vmap(block)(x, w),
  "shard_map": lambda x, w: _shard_map(block)(x, w),
}


@pytest.mark.parametrize("device_type,low,exp_dtype", POLICIES)
@pytest.mark.parametrize("name", sorted(HIGHER_ORDER))
def test_dtypes_inside_higher_order_primitive(name, device_type, low, exp_dtype):
  fun = jaxamp.autocast(HIGHER_ORDER[name], device_type=device_type)
  jaxpr = jax.make_jaxpr(fun)(X, W)
  jax.extend.core.check_jaxpr(jaxpr.jaxpr)
  for primitive in ("dot_general", "conv_general_dilated"):
    found = jaxpr_utils.dtypes_of(jaxpr, primitive)
    assert found, primitive
    assert all(ins == (low, low) for ins, _ in found), (primitive, found)
  exps = [ins for ins, _ in jaxpr_utils.dtypes_of(jaxpr, "exp")]
  assert exps and all(ins == (exp_dtype,) for ins in exps), exps
  sums = [ins for ins, _ in jaxpr_utils.dtypes_of(jaxpr, "reduce_sum")]
  # jnp.sum accumulates in float32 everywhere (on cpu it returns bfloat16, as torch's sum)
  assert sums and all(ins == (jnp.float32,) for ins in sums), sums


# JAX has no reverse mode for a while loop, nor for a custom_vmap that no vmap has replaced
@pytest.mark.parametrize(
  "name", sorted(set(HIGHER_ORDER) - {"while", "custom_vmap", "sequential_vmap"})
)
@pytest.mark.slow
def test_gradients_through_higher_order_primitive_are_float32(name):
  fun = jaxamp.autocast(HIGHER_ORDER[name], device_type="cuda")
  g = jax.jit(jax.grad(lambda w: fun(X, w).astype(jnp.float32).sum()))(W)
  assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))


def test_reverse_mode_through_a_while_loop_raises_jaxs_own_error():
  def grad_of(fun):
    return jax.jit(jax.grad(lambda w: fun(X, w).astype(jnp.float32).sum()))

  with pytest.raises(ValueError, match="Reverse-mode differentiation does not work") as plain:
    grad_of(HIGHER_ORDER["while"])(W)
  with pytest.raises(ValueError) as autocast:
    grad_of(jaxamp.autocast(HIGHER_ORDER["while"], device_type="cuda"))(W)
  assert str(autocast.value) == str(plain.value)


def test_loop_carries_keep_their_declared_dtypes():
  def fun(x, w):
    return lax.scan(lambda c, _: (c @ w, None), x, None, length=3)[0]

  out = jaxamp.autocast(fun, device_type="cuda")(X, W)
  assert out.dtype == jnp.float32


def _split_in_a_loop(loop):
  """``x`` plus noise drawn from a typed PRNG key that ``loop`` carries and splits."""

  def draw(x, key):
    key, sub = jax.random.split(key)
    return x + jax.random.normal(sub, x.shape), key

  loops = {
    "scan": lambda x, key: lax.scan(lambda c, _: (draw(*c), None), (x, key), None, length=3)[0],
    "fori_loop": lambda x, key: lax.fori_loop(0, 3, lambda i, c: draw(*c), (x, key)),
    "while_loop": lambda x, key: lax.while_loop(
      lambda c: c[0] < 3, lambda c: (c[0] + 1, *draw(*c[1:])), (0, x, key)
    )[1:],
    "cond": lambda x, key: lax.cond(x[0, 0] > 0, draw, lambda x, key: (x, key), x, key),
  }
  return loops[loop]


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.slow_after_first
@pytest.mark.parametrize("loop", ["scan", "fori_loop", "while_loop", "cond"])
def test_a_typed_prng_key_carried_through_a_loop_or_cond_draws_what_plain_jax_draws(
  loop, device_type
):
  fun = _split_in_a_loop(loop)
  (x, key), (plain_x, plain_key) = (
    jax.jit(jaxamp.autocast(fun, device_type=device_type))(X, jax.random.key(0)),
    jax.jit(fun)(X, jax.random.key(0)),
  )
  assert key.dtype == plain_key.dtype and x.dtype == jnp.float32
  assert (jax.random.key_data(key) == jax.random.key_data(plain_key)).all()
  assert (x == plain_x).all()


def _diagonal_solve(a, b):
  """A custom_linear_solve whose matvec and solve are written by hand."""
  return lax.custom_linear_solve(lambda v: a[:, None] * v, b, lambda _, r: r / a[:, None])


LINEAR_SOLVES = {
  "jnp.linalg.solve": lambda a, b: jnp.linalg.solve(a, b),
  "jax.scipy.linalg.solve(assume_a='pos')": lambda a, b: jax.scipy.linalg.solve(
    a @ a.T, b, assume_a="pos"
  ),
  "custom_linear_solve": lambda a, b: _diagonal_solve(jnp.diag(a), b),
}


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("solve", sorted(LINEAR_SOLVES))
def test_a_linear_solves_result_keeps_its_declared_dtype_when_its_right_hand_side_was_lowered(
  solve, device_type
):
  a = jnp.eye(8) * 4 + W
  fun = lambda a, w, x: LINEAR_SOLVES[solve](a, w @ x)  # b: the product, 16-bit under autocast
  out = jaxamp.autocast(fun, device_type=device_type)(a, W, X.T)
  assert out.dtype == jnp.float32


@pytest.mark.parametrize("solve", sorted(LINEAR_SOLVES))
def test_a_linear_solve_of_16_bit_operands_stays_16_bit(solve):
  a = (jnp.eye(8) * 4 + W).astype(jnp.float16)
  b = jnp.ones((8, 4), jnp.float16)
  out = jaxamp.autocast(LINEAR_SOLVES[solve], device_type="cuda")(a, b)
  assert out.dtype == jax.eval_shape(LINEAR_SOLVES[solve], a, b).dtype


def test_cond_branch_outputs_keep_their_declared_dtypes():
  fun = lambda x, w: lax.cond(True, lambda a: a @ w, lambda a: a, x)
  assert jaxamp.autocast(fun, device_type="cuda")(X, W).dtype == jnp.float32


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("device_type,low", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_a_platform_dependent_cond_gives_the_dtype_of_the_branch_this_platform_takes(
  jit, device_type, low
):
  """``lax.platform_dependent``'s branches are one op's implementations, not data-dependent
  paths: its output is what the branch taken computes (here 16-bit, as the matmul's output)."""
  fun = lambda x, w: lax.platform_dependent(
    x @ w, tpu=lambda h: jnp.sum(h, 0), default=lambda h: h[0]
  )
  autocast = jaxamp.autocast(fun, device_type=device_type)
  out = (jax.jit(autocast) if jit else autocast)(X, W)
  assert out.dtype == low
  assert jnp.allclose(out.astype(jnp.float32), fun(X, W), rtol=1e-2)


@pytest.mark.parametrize("device_type,low", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_the_diagonal_of_a_16_bit_square_matrix_is_16_bit(device_type, low):
  """``jnp.diagonal`` of a square matrix is a platform-dependent cond (a gather, or on Mosaic a
  masked sum, which under "cuda" runs in float32); torch's ``diagonal`` keeps its input dtype."""
  fun = lambda x, w: jnp.diagonal(x.T @ w)
  assert jax.jit(jaxamp.autocast(fun, device_type=device_type))(W, W).dtype == low


def test_unknown_primitives_get_their_traced_dtypes_back():
  def fun(x, w):
    h = x @ w
    return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(h.shape, h.dtype), h)

  out = jax.jit(jaxamp.autocast(fun, device_type="cuda"))(X, W)
  assert out.dtype == jnp.float32


def _library_tag():
  """A primitive a library defines, as K-FAC's loss and layer tags are: ``x * weight``, the
  weight a Python scalar it reads back from the jaxpr as given."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  tag = Primitive("library_tag")
  tag.def_impl(lambda x, weight: x * weight)
  tag.def_abstract_eval(lambda x, weight: x)
  mlir.register_lowering(tag, mlir.lower_fun(lambda x, weight: x * weight, False))
  return tag


LIBRARY_TAG = _library_tag()


@pytest.mark.parametrize("device_type,low", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
def test_a_librarys_primitive_runs_on_its_inputs_as_they_come(device_type, low):
  # torch runs an op its autocast lists do not name on what it is given (a fallthrough).
  fun = lambda x, w: LIBRARY_TAG.bind(x @ w, 1.0)
  assert jax.jit(jaxamp.autocast(fun, device_type=device_type))(X, W).dtype == low


def test_a_librarys_primitive_keeps_the_python_scalars_it_was_given():
  fun = lambda x, w: LIBRARY_TAG.bind(x @ w, 1.0)
  jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, device_type="cuda"))(X, W).jaxpr
  (tag,) = [e for e in jaxpr.eqns if e.primitive is LIBRARY_TAG]
  weight = tag.invars[1]
  assert isinstance(weight.val, float) and weight.aval.weak_type


def test_jitted_layer_is_rewritten_once():
  layer = jax.jit(lambda x, w: jnp.tanh(x @ w))

  def fun(x, w):
    return layer(layer(layer(x, w), w), w)

  jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, device_type="cuda"))(X, W)
  bodies = {id(e.params["jaxpr"]) for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"}
  assert len(bodies) <= 2  # the first call sees float32 inputs, the next ones float16


# --- sharding regions: the casts made for an eqn are typed in its mesh ---------------------------


@pytest.mark.parametrize("device_type,low", [("cuda", jnp.float16), ("cpu", jnp.bfloat16)])
@pytest.mark.parametrize("region", ["auto_axes", "explicit_axes"])
def test_a_matmul_in_a_sharding_region_of_another_axis_type_runs_low(region, device_type, low):
  from jax.sharding import AxisType, NamedSharding, auto_axes, explicit_axes

  outer = AxisType.Explicit if region == "auto_axes" else AxisType.Auto
  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(outer, outer))
  if region == "auto_axes":
    matmul = auto_axes(lambda a, b: a @ b, out_sharding=P("data", None))
  else:
    matmul = explicit_axes(lambda a, b: a @ b, in_sharding=(P("data", None), P(None, "model")))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model")))
    out = jax.jit(jaxamp.autocast(matmul, device_type=device_type))(x, w)
  assert out.dtype == low
  np.testing.assert_array_equal(out.astype(jnp.float32), jnp.full((8, 8), 8.0))


# --- jax.custom_batching: the function and its vmap rule, whichever transform comes first ------

VMAPPED_X = jnp.stack([X, 2 * X, 3 * X])


def _counted_custom_vmap():
  """``tanh(x @ w)`` as a custom_vmap whose rule counts its calls."""
  calls = []

  @jax.custom_batching.custom_vmap
  def f(x, w):
    return jnp.tanh(x @ w)

  @f.def_vmap
  def rule(size, batched, x, w):
    calls.append(size)
    return jnp.tanh(jnp.einsum("bij,jk->bik", x, w)), batched[0]

  return f, calls


@pytest.mark.parametrize("device_type,low,_", POLICIES)
@pytest.mark.parametrize("order", ["vmap_outside", "vmap_inside", "vmap_of_jit"])
def test_a_custom_vmaps_rule_runs_autocast_whichever_transform_comes_first(
  device_type, low, _, order
):
  f, calls = _counted_custom_vmap()
  autocast = lambda g: jaxamp.autocast(g, device_type=device_type)
  vmap = lambda g: jax.vmap(g, in_axes=(0, None))
  fun = {
    "vmap_outside": vmap(autocast(f)),
    "vmap_inside": autocast(vmap(f)),
    "vmap_of_jit": vmap(jax.jit(autocast(f))),
  }[order]
  out = fun(VMAPPED_X, W)
  assert calls == [3] and out.dtype == low
  expected = autocast(lambda x, w: jnp.tanh(jnp.einsum("bij,jk->bik", x, w)))(VMAPPED_X, W)
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("device_type,low,_", POLICIES)
def test_a_sequential_vmap_under_vmap_runs_each_call_autocast(device_type, low, _):
  f = jax.custom_batching.sequential_vmap(lambda x, w: jnp.tanh(x @ w))
  outside = jax.vmap(jaxamp.autocast(f, device_type=device_type), in_axes=(0, None))
  inside = jaxamp.autocast(jax.vmap(f, in_axes=(0, None)), device_type=device_type)
  assert outside(VMAPPED_X, W).dtype == inside(VMAPPED_X, W).dtype == low
  np.testing.assert_array_equal(outside(VMAPPED_X, W), inside(VMAPPED_X, W))


def test_gradients_through_a_vmapped_custom_vmap_are_float32():
  f, _ = _counted_custom_vmap()
  fun = jax.vmap(jaxamp.autocast(f, device_type="cuda"), in_axes=(0, None))
  grad = jax.grad(lambda w: fun(VMAPPED_X, w).astype(jnp.float32).sum())(W)
  expected = jax.grad(lambda w: jax.vmap(f, in_axes=(0, None))(VMAPPED_X, w).sum())(W)
  assert grad.dtype == jnp.float32
  np.testing.assert_allclose(grad, expected, rtol=2e-2, atol=1e-3)


def test_a_jet_inside_autocast_runs_its_taylor_series_matmuls_low():
  from jax.experimental import jet

  f = lambda x: jnp.sin(x @ W)
  taylor = lambda x: jet.jet(f, (x,), ((jnp.ones_like(x),),))
  (primal, (series,)), (plain_primal, (plain_series,)) = (
    jaxamp.autocast(taylor, device_type="cuda")(X),
    taylor(X),
  )
  jaxpr = jax.make_jaxpr(jaxamp.autocast(taylor, device_type="cuda"))(X)
  dots = jaxpr_utils.dtypes_of(jaxpr, "dot_general")
  assert dots and all(ins == (jnp.float16, jnp.float16) for ins, _ in dots), dots
  np.testing.assert_allclose(primal, plain_primal, rtol=1e-2)
  np.testing.assert_allclose(series, plain_series, rtol=1e-2, atol=1e-2)
