"""``custom_fwd``/``custom_bwd`` on a ``jax.custom_vjp``, in torch's spelling and in JAX's.

torch decorates an ``autograd.Function``'s one forward: ``custom_fwd(cast_inputs=torch.float32)``
casts its floating inputs and runs it with autocast off, and ``custom_bwd`` then runs the
backward with autocast off too. A custom_vjp has two forwards, the primal and the ``fwd`` rule;
decorating either (torch users decorate ``fwd``) makes the whole custom_vjp that region.
"""

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
TO_FLOAT32 = jaxamp.custom_fwd(cast_inputs=jnp.float32)


def torch_spelling(decorate_fwd=TO_FLOAT32, seen=None):
  """``mm`` with its ``fwd`` rule decorated, as torch decorates ``forward``; the backward
  records the dtypes it sees in ``seen``."""

  @jax.custom_vjp
  def mm(a, b):
    return a @ b

  @decorate_fwd
  def mm_fwd(a, b):
    return a @ b, (a, b)

  @jaxamp.custom_bwd
  def mm_bwd(residuals, g):
    a, b = residuals
    ga, gb = g @ b.T, a.T @ g
    if seen is not None:
      seen.update(residuals=(a.dtype, b.dtype), cotangent=g.dtype, products=(ga.dtype, gb.dtype))
    return ga, gb

  mm.defvjp(mm_fwd, mm_bwd)
  return mm


def jax_spelling():
  """``mm`` with its primal decorated and a ``fwd`` rule that calls it."""

  @jax.custom_vjp
  @jaxamp.custom_fwd(cast_inputs=jnp.float32)
  def mm(a, b):
    return a @ b

  @jaxamp.custom_bwd
  def mm_bwd(residuals, g):
    a, b = residuals
    return g @ b.T, a.T @ g

  mm.defvjp(lambda a, b: (mm(a, b), (a, b)), mm_bwd)
  return mm


def cuda(fun):
  return jaxamp.autocast(fun, device_type="cuda")


def dot_dtypes(fun, *args) -> list:
  """The output dtype of every dot_general in ``fun``'s jaxpr, in order."""
  return [
    outs[0] for _, outs in jaxpr_utils.dtypes_of(jaxpr_utils.traced(fun, *args), "dot_general")
  ]


def float32_grads(x, w):
  return jax.grad(lambda x, w: (x @ w).sum(), argnums=(0, 1))(x, w)


def test_torch_spelling_call_runs_in_float32_with_autocast_off_inside():
  mm = torch_spelling()
  fun = cuda(lambda x, w: mm(x @ w, w))  # nothing differentiated: the primal runs
  assert fun(X, W).dtype == jnp.float32
  assert dot_dtypes(fun, X, W) == [jnp.float16, jnp.float32]  # x @ w autocast, mm float32


def test_torch_spelling_forward_under_vjp_is_the_float32_primal():
  mm = torch_spelling()
  fun = cuda(lambda x, w: mm(x @ w, w))
  y, _ = jax.vjp(fun, X, W)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(y, fun(X, W))  # the fwd rule and the primal agree


@pytest.mark.parametrize("inner_jit", [False, True], ids=["jit(grad)", "grad(jit)"])
def test_torch_spelling_gradients_match_float32(inner_jit):
  mm = torch_spelling()
  loss = (lambda x, w: mm(x, w).sum()) if not inner_jit else jax.jit(lambda x, w: mm(x, w).sum())
  gx, gw = jax.jit(jax.grad(cuda(loss), argnums=(0, 1)))(X, W)
  assert gx.dtype == gw.dtype == jnp.float32
  rx, rw = float32_grads(X, W)  # forward and backward in float32: no float16 rounding
  np.testing.assert_allclose(gx, rx, rtol=1e-6)
  np.testing.assert_allclose(gw, rw, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_torch_spelling_backward_runs_with_autocast_off_on_the_saved_inputs(dtype):
  seen = {}
  mm = torch_spelling(seen=seen)
  x, w = X.astype(dtype), W.astype(dtype)
  grad = jax.grad(cuda(lambda x, w: mm(x, w).sum()), argnums=(0, 1))
  gx, gw = grad(x, w)
  f32 = jnp.float32
  assert seen == dict(residuals=(f32, f32), cotangent=f32, products=(f32, f32))
  assert dot_dtypes(grad, x, w) == [f32] * 3  # the forward's product and the backward's two
  assert gx.dtype == gw.dtype == dtype  # cotangents come back in the inputs' dtypes


@pytest.mark.slow
def test_torch_spelling_matches_torch_dtypes():
  torch = pytest.importorskip("torch")
  torch_seen, jax_seen = {}, {}

  class MM(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
      ctx.save_for_backward(a, b)
      return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
      a, b = ctx.saved_tensors
      ga, gb = g @ b.T, a.T @ g
      torch_seen.update(
        residuals=(a.dtype, b.dtype), cotangent=g.dtype, products=(ga.dtype, gb.dtype)
      )
      return ga, gb

  a = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
  b = torch.ones(8, 8, dtype=torch.bfloat16, requires_grad=True)
  with torch.autocast("cpu"):
    y = MM.apply(a @ b, b)
  y.sum().backward()

  mm = torch_spelling(seen=jax_seen)
  fun = jaxamp.autocast(lambda a, b: mm(a @ b, b), device_type="cpu")
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16)
  out, vjp = jax.vjp(fun, x, w)
  gx, gw = vjp(jnp.ones_like(out))
  name = lambda d: str(d).removeprefix("torch.")
  as_names = lambda seen: {
    k: tuple(map(name, v)) if isinstance(v, tuple) else name(v) for k, v in seen.items()
  }
  assert as_names(jax_seen) == as_names(torch_seen)
  assert (name(out.dtype), name(gx.dtype), name(gw.dtype)) == (
    name(y.dtype),
    name(a.grad.dtype),
    name(b.grad.dtype),
  )


def test_jax_spelling_still_runs_in_float32():
  mm = jax_spelling()
  fun = cuda(lambda x, w: mm(x @ w, w))
  y, _ = jax.vjp(fun, X, W)
  assert fun(X, W).dtype == y.dtype == jnp.float32
  gx, gw = jax.grad(cuda(lambda x, w: mm(x, w).sum()), argnums=(0, 1))(X, W)
  rx, rw = float32_grads(X, W)
  np.testing.assert_allclose(gx, rx, rtol=1e-6)
  np.testing.assert_allclose(gw, rw, rtol=1e-6)


def test_an_input_a_custom_fwd_function_returns_comes_back_cast():
  passed_on = jaxamp.custom_fwd(cast_inputs=jnp.float32)(lambda a, b: (a, b * 2))
  outs = cuda(lambda x, w: passed_on(x @ w, x @ w))(X, W)
  assert [out.dtype for out in outs] == [jnp.float32, jnp.float32]


@pytest.mark.parametrize(
  "decorate_fwd",
  [lambda f: f, jaxamp.custom_fwd(cast_inputs=None)],
  ids=["undecorated", "cast_inputs=None"],
)
def test_without_cast_inputs_the_custom_vjp_is_autocast_as_before(decorate_fwd):
  mm = torch_spelling(decorate_fwd)
  fun = cuda(lambda x, w: mm(x, w))
  assert fun(X, W).dtype == jnp.float16
  loss = lambda x, w: fun(x, w).astype(jnp.float32).sum()
  # The fwd rule's product and, custom_bwd running under the forward's policy, the backward's two.
  assert dot_dtypes(jax.grad(loss, argnums=(0, 1)), X, W) == [jnp.float16] * 3


@pytest.mark.parametrize("spelling", ["cuda", "gpu"])
def test_a_device_types_custom_fwd_casts_only_under_that_device_types_policy(spelling):
  # torch's custom_fwd(device_type="cuda", cast_inputs=float32) casts only while CUDA autocast
  # is on; under CPU autocast the forward is ordinary autocast code.
  mm = torch_spelling(jaxamp.custom_fwd(device_type=spelling, cast_inputs=jnp.float32))
  fun = lambda a, b: mm(a @ b, b)
  assert dot_dtypes(jaxamp.autocast(fun, device_type="cuda"), X, W) == [jnp.float16, jnp.float32]
  assert dot_dtypes(jaxamp.autocast(fun, device_type="cpu"), X, W) == [jnp.bfloat16] * 2
  grads = jax.grad(lambda a: jaxamp.autocast(fun, device_type="cpu")(a, W).sum())(X)
  assert grads.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(grads)))


def test_outside_autocast_custom_fwd_changes_nothing():
  mm = torch_spelling()
  x, w = X.astype(jnp.float16), W.astype(jnp.float16)
  y, vjp = jax.vjp(mm, x, w)
  assert y.dtype == jnp.float16
  assert all(g.dtype == jnp.float16 for g in vjp(jnp.ones_like(y)))
