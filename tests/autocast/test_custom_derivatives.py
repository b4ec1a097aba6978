"""Custom derivatives as JAX defines them, under autocast: ``custom_jvp`` and ``custom_vjp`` in
the spellings JAX documents, Equinox's helpers built on them, and the libraries that rely on
them (diffrax's adjoints, optimistix's implicit differentiation).

JAX calls a custom_vjp's ``fwd`` telling it which inputs are perturbed, and a custom_jvp's rule
with symbolic zeros for the tangents that are zero; autocast passes the same on, so a rule that
looks (Equinox asserts its non-differentiable inputs are unperturbed) sees what it sees without
autocast. Each test compares with float32 JAX; the custom rules here double the gradient, so
agreeing with JAX also says the rule, not autodiff of the primal, was used.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest
from jax.custom_derivatives import SymbolicZero

import jaxamp

X = jax.random.normal(jax.random.key(0), (4, 8))
W = jax.random.normal(jax.random.key(1), (8, 8)) * 0.3
Y = jax.random.normal(jax.random.key(2), (4, 8))
# Device type -> how far its results may be from float32's, relative to the largest value.
POLICIES = {"cuda": 1e-2, "cpu": 5e-2}


def cuda(fun):
  return jaxamp.autocast(fun, device_type="cuda")


def assert_close(actual, expected, device_type: str = "cuda") -> None:
  """Each leaf of ``actual`` is finite, has the dtype of ``expected``'s (float32 gradients for
  float32 parameters) and agrees with it within the policy's 16-bit rounding."""
  actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected, strict=True):
    assert a.dtype == e.dtype, (a.dtype, e.dtype)
    assert bool(jnp.all(jnp.isfinite(a)))
    scale = float(jnp.max(jnp.abs(e)))
    np.testing.assert_allclose(a, e, rtol=0, atol=POLICIES[device_type] * scale)


def dense(primal, tangent):
  """A tangent or cotangent as an array: zeros for a symbolic zero."""
  return jnp.zeros_like(primal) if isinstance(tangent, SymbolicZero) else tangent


# --- custom_vjp ----------------------------------------------------------------------------------


def doubled_vjp(symbolic_zeros: bool = False, seen: list | None = None):
  """``x * y`` with a custom_vjp whose backward doubles the gradient; a ``symbolic_zeros``
  ``fwd`` records the perturbed flags it is called with in ``seen``."""

  @jax.custom_vjp
  def mul(x, y):
    return x * y

  def mul_fwd(x, y):
    if symbolic_zeros:
      seen.append((x.perturbed, y.perturbed))
      x, y = x.value, y.value
    return x * y, (x, y)

  def mul_bwd(residuals, g):
    x, y = residuals
    return 2 * g * y, 2 * g * x

  mul.defvjp(mul_fwd, mul_bwd, symbolic_zeros=symbolic_zeros)
  return mul


@pytest.mark.slow
def test_custom_vjp_fwd_is_told_the_inputs_jax_perturbs():
  """Under ``grad`` with respect to one input, ``fwd`` sees that one perturbed, as in JAX."""
  seen_jax, seen_autocast = [], []
  loss = lambda mul: lambda w, y: mul(X @ w, y).sum()
  jax.grad(loss(doubled_vjp(True, seen_jax)))(W, Y)
  jax.grad(cuda(loss(doubled_vjp(True, seen_autocast))))(W, Y)
  assert set(seen_autocast) == set(seen_jax) == {(True, False)}


@pytest.mark.parametrize("symbolic_zeros", [False, True])
@pytest.mark.parametrize("argnums", [0, 1], ids=["grad_w", "grad_y"])
def test_custom_vjp_gradient_with_respect_to_one_input(argnums, symbolic_zeros):
  """The backward's gradient, float32, for either input alone."""
  loss = lambda mul: lambda w, y: mul(X @ w, y).sum()
  expected = jax.grad(loss(doubled_vjp(symbolic_zeros, [])), argnums)(W, Y)
  actual = jax.grad(cuda(loss(doubled_vjp(symbolic_zeros, []))), argnums)(W, Y)
  assert_close(actual, expected)


def test_custom_vjp_bwd_gets_the_symbolic_zero_cotangents_jax_gives():
  """With ``symbolic_zeros``, an output nothing depends on has a ``SymbolicZero`` cotangent."""

  def split(seen):
    @jax.custom_vjp
    def halves(x):
      return x * 2, x * 3

    def halves_fwd(x):
      return halves(x.value), x.value

    def halves_bwd(x, cts):
      seen.append(tuple(isinstance(ct, SymbolicZero) for ct in cts))
      first, second = (dense(x, ct) for ct in cts)
      return (2 * (2 * first + 3 * second),)

    halves.defvjp(halves_fwd, halves_bwd, symbolic_zeros=True)
    return halves

  seen_jax, seen_autocast = [], []
  loss = lambda halves: lambda w: halves(X @ w)[0].sum()
  expected = jax.grad(loss(split(seen_jax)))(W)
  actual = jax.grad(cuda(loss(split(seen_autocast))))(W)
  assert seen_autocast == seen_jax == [(False, True)]
  assert_close(actual, expected)


def remat_optimized_matmul():
  """``a @ b`` with a custom_vjp defined with ``optimize_remat=True`` (as tokamax's ops are),
  its backward doubling the gradient."""

  @jax.custom_vjp
  def matmul(a, b):
    return a @ b

  def matmul_fwd(a, b):
    return a @ b, (a, b)

  def matmul_bwd(residuals, g):
    a, b = residuals
    return 2 * g @ b.T, 2 * a.T @ g

  matmul.defvjp(matmul_fwd, matmul_bwd, optimize_remat=True)
  return matmul


def test_a_custom_vjp_with_optimize_remat_runs_its_forward_low_under_vjp():
  fun = cuda(remat_optimized_matmul())
  jaxpr = jax.make_jaxpr(lambda x, w: jax.vjp(fun, x, w)[0])(X, W).jaxpr
  assert jaxpr_utils.matmuls_off_dtype(jaxpr, jnp.float16) == []


def test_a_custom_vjp_with_optimize_remat_gives_its_backwards_gradient():
  loss = lambda matmul: lambda w: (matmul(X, w) * Y).sum()
  expected = jax.grad(loss(remat_optimized_matmul()))(W)
  assert_close(jax.grad(cuda(loss(remat_optimized_matmul())))(W), expected)


def test_a_custom_vjp_with_optimize_remat_whose_residuals_go_unused_runs_its_primal_low():
  # jit drops the unused residuals: JAX runs the primal in place of the forward.
  fun = cuda(remat_optimized_matmul())
  lowered = jax.jit(lambda x, w: jax.vjp(fun, x, w)[0]).lower(X, W).as_text()
  dots = [line for line in lowered.splitlines() if "dot_general" in line]
  assert dots and all("f32" not in line for line in dots)
  out = jax.jit(lambda x, w: jax.vjp(fun, x, w)[0])(X, W)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(out, X @ W, rtol=0, atol=1e-2 * float(jnp.max(jnp.abs(X @ W))))


def test_custom_vjp_nondiff_argnums_keeps_its_rule():
  """A Python value in ``nondiff_argnums`` reaches ``fwd`` and ``bwd``; the gradient is the
  backward's."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def scale(k, x):
    return k * x

  scale.defvjp(lambda k, x: (k * x, None), lambda k, _, g: (2 * k * g,))
  loss = lambda w: scale(3.0, X @ w).sum()
  assert_close(jax.grad(cuda(loss))(W), jax.grad(loss)(W))


@pytest.mark.parametrize("device_type", POLICIES)
def test_custom_vjp_bwd_complex_cotangent_for_a_real_input_passes_through(device_type):
  # netket's expect: the backward of a real-to-complex function returns complex cotangents.
  @jax.custom_vjp
  def amplitude(w, x):
    return jnp.sum((x @ w) * (1.0 + 2.0j))

  def amplitude_bwd(x, g):
    return jnp.outer(jnp.sum(x, 0), jnp.ones(8)) * g * (1 + 2j), None

  amplitude.defvjp(lambda w, x: (amplitude(w, x), x), amplitude_bwd)
  loss = lambda w, x: jnp.real(amplitude(w, x))
  expected = jax.grad(loss)(W, X)
  actual = jax.grad(jaxamp.autocast(loss, device_type=device_type))(W, X)
  assert actual.dtype == expected.dtype == jnp.complex64
  np.testing.assert_allclose(actual, expected, rtol=POLICIES[device_type])


def test_custom_vjp_differentiated_through_a_closed_over_value_raises_as_jax_does():
  """A gradient through a value the primal closes over is JAX's error, not a silent zero."""

  def loss(w):
    project = jax.custom_vjp(lambda x: x @ w)  # closes over w
    project.defvjp(lambda x: (x @ w, None), lambda _, g: (g @ w.T,))
    return project(X).sum()

  with pytest.raises(Exception, match="closed-over value") as from_jax:
    jax.grad(jax.jit(loss))(W)
  with pytest.raises(type(from_jax.value), match="closed-over value"):
    jax.grad(cuda(loss))(W)


# --- custom_jvp ----------------------------------------------------------------------------------


def doubled_jvp(symbolic_zeros: bool = False, seen: list | None = None):
  """``a * s`` with a custom_jvp whose rule doubles the tangent; a ``symbolic_zeros`` rule
  records which of its tangents are symbolic zeros in ``seen``."""

  @jax.custom_jvp
  def mul(a, s):
    return a * s

  def mul_jvp(primals, tangents):
    (a, s), (ta, ts) = primals, tangents
    if symbolic_zeros:
      seen.append(tuple(isinstance(t, SymbolicZero) for t in tangents))
      ta, ts = dense(a, ta), dense(s, ts)
    return a * s, 2 * (ta * s + a * ts)

  mul.defjvp(mul_jvp, symbolic_zeros=symbolic_zeros)
  return mul


@pytest.mark.parametrize("device_type", POLICIES)
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["grad_w", "grad_y", "grad_both"])
@pytest.mark.slow_after_first
def test_custom_jvp_of_a_traced_scalar_argument_gives_the_rule_gradient(argnums, device_type):
  """``mul(x @ w, jnp.max(y))``: the rule's tangent for the rank-0 argument is cast linearly
  (no clip to the 16-bit range, which reverse mode could not transpose)."""
  loss = lambda mul: lambda w, y: mul(X @ w, jnp.max(y)).sum()
  expected = jax.grad(loss(doubled_jvp()), argnums)(W, Y)
  actual = jax.grad(jaxamp.autocast(loss(doubled_jvp()), device_type=device_type), argnums)(W, Y)
  assert_close(actual, expected, device_type)


def test_custom_jvp_rule_is_told_the_tangents_jax_makes_symbolic_zeros():
  """With ``symbolic_zeros``, the rule sees a ``SymbolicZero`` for the input not
  differentiated, as in JAX, and its gradient is the rule's."""
  seen_jax, seen_autocast = [], []
  loss = lambda mul: lambda w, y: mul(X @ w, y).sum()
  expected = jax.grad(loss(doubled_jvp(True, seen_jax)))(W, Y)
  actual = jax.grad(cuda(loss(doubled_jvp(True, seen_autocast))))(W, Y)
  assert set(seen_autocast) == set(seen_jax) == {(False, True)}
  assert_close(actual, expected)


def test_custom_jvp_nondiff_argnums_keeps_its_rule():
  """A Python value in ``nondiff_argnums`` reaches the rule; the gradient is the rule's."""

  @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
  def scale(k, x):
    return k * x

  scale.defjvp(lambda k, primals, t: (k * primals[0], 2 * k * t[0]))
  loss = lambda w: scale(3.0, X @ w).sum()
  assert_close(jax.grad(cuda(loss))(W), jax.grad(loss)(W))


def test_custom_jvp_whose_rule_calls_it_on_tangents():
  """A rule that applies its own function to its tangents (optimistix's ``asarray``) is
  differentiated once, not again and again."""

  @jax.custom_jvp
  def ident(x):
    return x

  ident.defjvp(lambda primals, t: (ident(primals[0]), 2 * ident(t[0])))
  loss = lambda w: jnp.sum(ident(X @ w) ** 2)
  assert_close(jax.grad(cuda(loss))(W), jax.grad(loss)(W))


@pytest.mark.slow
def test_custom_jvp_forward_mode_gives_the_rule_tangent():
  """``jax.jvp`` through the autocast function uses the rule (in the policy's dtype)."""
  fun = lambda mul: lambda w: mul(X @ w, jnp.max(w))
  _, expected = jax.jvp(fun(doubled_jvp()), (W,), (W,))
  _, actual = jax.jvp(cuda(fun(doubled_jvp())), (W,), (W,))
  assert actual.dtype == jnp.float16
  assert_close(actual.astype(jnp.float32), expected)


# --- Equinox -------------------------------------------------------------------------------------


def doubled_filter_vjp():
  """``x * y`` with ``eqx.filter_custom_vjp``: ``x`` differentiable, ``y`` a non-differentiable
  array; the backward doubles the gradient."""

  @eqx.filter_custom_vjp
  def mul(x, y):
    return x * y

  @mul.def_fwd
  def mul_fwd(perturbed, x, y):
    return x * y, None

  @mul.def_bwd
  def mul_bwd(residuals, g, perturbed, x, y):
    return 2 * g * y

  return mul


def test_filter_custom_vjp_with_a_nondifferentiable_array_runs():
  """Its ``fwd`` asserts the non-differentiable array is unperturbed: called without
  differentiation it is not called with everything perturbed."""
  fun = lambda w, y: doubled_filter_vjp()(X @ w, y)
  assert_close(cuda(fun)(W, Y), fun(W, Y))


def test_filter_custom_vjp_with_a_nondifferentiable_array_gives_the_bwd_gradient():
  """Under ``grad``, ``fwd`` is told the non-differentiable array is unperturbed."""
  loss = lambda w, y: doubled_filter_vjp()(X @ w, y).sum()
  assert_close(jax.grad(cuda(loss))(W, Y), jax.grad(loss)(W, Y))


def test_filter_custom_jvp_gives_the_rule_gradient():
  """``y`` is not differentiated: the rule gets ``None`` for its tangent, as without autocast."""

  @eqx.filter_custom_jvp
  def mul(x, y):
    return x * y

  @mul.def_jvp
  def mul_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    assert ty is None
    return x * y, 2 * tx * y

  loss = lambda w, y: mul(X @ w, y).sum()
  assert_close(jax.grad(cuda(loss))(W, Y), jax.grad(loss)(W, Y))


def checkpointed_loop(w, x):
  """Three steps of ``x = tanh(x @ w)`` by ``eqx.internal.while_loop(kind="checkpointed")``, a
  ``filter_custom_vjp`` with non-differentiable arrays; the sum of squares of the result."""
  body = lambda carry: (carry[0] + 1, jnp.tanh(carry[1] @ w))
  steps = eqx.internal.while_loop(
    lambda carry: carry[0] < 3, body, (0, x), max_steps=4, kind="checkpointed"
  )
  return jnp.sum(steps[1] ** 2)


@pytest.mark.slow
def test_checkpointed_while_loop_forward():
  """Without differentiation: the loop body's matmul autocast, the value float32's."""
  dots = jaxpr_utils.float_dtypes_of(
    jaxpr_utils.traced(cuda(checkpointed_loop), W, X), "dot_general"
  )
  assert dots == {jnp.dtype(jnp.float16)}
  assert_close(cuda(checkpointed_loop)(W, X), checkpointed_loop(W, X))


@pytest.mark.slow
def test_checkpointed_while_loop_gradient():
  grad = jax.jit(jax.grad(cuda(checkpointed_loop)))
  assert_close(grad(W, X), jax.jit(jax.grad(checkpointed_loop))(W, X))


def test_checkpointed_while_loop_backward_recomputes_the_body_as_the_forward_ran_it():
  """The backward evaluates the loop body again (a closure-converted jaxpr) to differentiate it:
  in float16, as the forward ran it, as torch.utils.checkpoint recomputes under the forward's
  autocast state. A float32 recomputation would differentiate another function."""
  jaxpr = jaxpr_utils.traced(jax.grad(cuda(checkpointed_loop)), W, X)
  assert jaxpr_utils.float_dtypes_of(jaxpr, "tanh") == {jnp.dtype(jnp.float16)}


def recomputing_checkpoint(fun):
  """``fun`` as a custom_vjp that saves its input and recomputes ``fun`` in the backward, by
  ``jax.closure_convert`` as Equinox's checkpointed loops do."""

  def checkpointed(x):
    converted, consts = jax.closure_convert(fun, x)

    @jax.custom_vjp
    def call(x, consts):
      return converted(x, *consts)

    def call_fwd(x, consts):
      return converted(x, *consts), (x, consts)

    def call_bwd(saved, g):
      _, vjp = jax.vjp(converted, *(saved[0], *saved[1]))
      x_ct, *consts_ct = vjp(g)
      return x_ct, tuple(consts_ct)

    call.defvjp(call_fwd, call_bwd)
    return call(x, tuple(consts))

  return checkpointed


def test_a_backward_recomputing_a_closure_converted_forward_runs_it_autocast():
  def loss(w, x):
    return jnp.sum(recomputing_checkpoint(lambda x: jnp.tanh(x @ w))(x) ** 2)

  jaxpr = jaxpr_utils.traced(jax.grad(cuda(loss)), W, X)
  assert jaxpr_utils.float_dtypes_of(jaxpr, "tanh") == {jnp.dtype(jnp.float16)}
  assert_close(jax.grad(cuda(loss))(W, X), jax.grad(loss)(W, X))


def test_a_backward_of_its_own_still_runs_as_written():
  """Only what repeats the forward is autocast: the rule's own matmuls keep their dtypes."""

  @jax.custom_vjp
  def f(x, w):
    return jnp.tanh(x @ w)

  def f_bwd(saved, g):
    x, w = saved
    return (g @ w.T, x.T @ g)

  f.defvjp(lambda x, w: (f(x, w), (x, w)), f_bwd)
  loss = lambda w, x: jnp.sum(f(x, w).astype(jnp.float32))
  dots = jaxpr_utils.dtypes_of(jaxpr_utils.traced(jax.grad(cuda(loss)), W, X), "dot_general")
  assert [ins for ins, _ in dots].count((jnp.float16, jnp.float16)) == 1  # the forward's


EPS = 0.05


@jax.custom_vjp
def smooth_max(a):
  """z with sum(exp((a * a - z) / EPS)) == 1, by fixed-point steps on a float32 carry."""
  c = a * a
  return jax.lax.fori_loop(0, 3, lambda i, z: z + EPS * jax.nn.logsumexp((c - z) / EPS), 0.0)


def _smooth_max_bwd(saved, g):
  a, z = saved  # implicit differentiation: p sums to one where a * a is the forward's
  return (g * jnp.exp((a * a - z) / EPS) * 2 * a,)


smooth_max.defvjp(lambda a: (smooth_max(a), (a, smooth_max(a))), _smooth_max_bwd)


def implicit_loss(w, x):
  return smooth_max(x @ w)


IMPLICIT_X = jnp.linspace(-1.0, 1.0, 32).reshape(16, 2)
IMPLICIT_W = jnp.array([[1.7, -0.4], [0.9, 2.2]])


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_backward_recomputing_from_residuals_computes_in_the_dtypes_they_were_saved_in(
  device_type,
):
  """torch runs a custom backward on the tensors its forward saved (bfloat16 ``a``), so an
  implicit gradient recomputes ``a * a`` as the forward did. Upcast to float32 residuals, the
  recomputation disagreed with the forward's solution (a 59% error under "cpu")."""
  amp = jaxamp.autocast(implicit_loss, device_type=device_type)
  grad = jax.jit(jax.grad(amp))(IMPLICIT_W, IMPLICIT_X)
  whole = jax.jit(jaxamp.autocast(jax.grad(implicit_loss), device_type=device_type))
  reference = jax.grad(implicit_loss)(IMPLICIT_W, IMPLICIT_X)
  np.testing.assert_allclose(grad, whole(IMPLICIT_W, IMPLICIT_X), rtol=5e-3)
  np.testing.assert_allclose(grad, reference, rtol=1e-2, atol=1e-2)


def test_a_backward_runs_on_its_residuals_as_saved_with_autocast_off():
  """The bwd's own ``a * a`` on the float16 ``a`` the forward saved is float16 (autocast off:
  an op that no list names runs in its inputs' dtype, as torch's does)."""
  jaxpr = jaxpr_utils.traced(jax.grad(cuda(implicit_loss)), IMPLICIT_W, IMPLICIT_X)
  assert jnp.dtype(jnp.float16) in jaxpr_utils.float_dtypes_of(jaxpr, "exp")


BACKWARD_LINALG = {
  "inv": lambda a, g: g * jnp.linalg.inv(a).T,
  "cholesky": lambda a, g: g * jnp.linalg.cholesky(a @ a.T + jnp.eye(a.shape[0])),
  "eigh": lambda a, g: g * jnp.linalg.eigh(a + a.T)[1],
  "rfft": lambda a, g: g * jnp.abs(jnp.fft.irfft(jnp.fft.rfft(a), a.shape[-1])),
}


@pytest.mark.parametrize("op", list(BACKWARD_LINALG))
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_a_backwards_linear_algebra_on_a_16_bit_residual_runs_in_float32(op, device_type):
  """A custom logdet (Gaussian-process code) whose backward inverts the matrix its forward saved:
  linear algebra and FFTs have no 16-bit kernels and run in float32, as in the forward."""

  @jax.custom_vjp
  def logdet(a):
    return jnp.linalg.slogdet(a)[1]

  logdet.defvjp(lambda a: (logdet(a), a), lambda a, g: (BACKWARD_LINALG[op](a, g),))

  def nll(w, x):
    z = x @ w
    return logdet(z @ z.T + 0.1)  # a 16-bit residual: the matmul's output

  w = jax.random.normal(jax.random.key(5), (8, 8)) / 3
  x = jax.random.normal(jax.random.key(6), (6, 8))
  grad = jax.jit(jax.grad(jaxamp.autocast(nll, device_type=device_type)))(w, x)
  assert grad.dtype == jnp.float32
  assert jnp.isfinite(grad).all()


# --- diffrax -------------------------------------------------------------------------------------


ADJOINTS = ["RecursiveCheckpointAdjoint", "BacksolveAdjoint"]


@functools.cache
def ode_problem(adjoint_name: str):
  """``loss(params, y0) = |y(1)|²`` for ``dy/dt = mlp(y)`` solved by Tsit5 with diffrax's
  ``adjoint_name``, the MLP's arrays and y(0); the MLP goes in as ``args``, as
  ``BacksolveAdjoint`` requires of what it differentiates."""
  diffrax = pytest.importorskip("diffrax")
  params, static = eqx.partition(eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(3)), eqx.is_array)
  adjoint = getattr(diffrax, adjoint_name)()
  term = diffrax.ODETerm(lambda t, y, mlp: mlp(y))

  def loss(params, y0):
    args = eqx.combine(params, static)
    solution = diffrax.diffeqsolve(
      term, diffrax.Tsit5(), 0.0, 1.0, 0.25, y0, args=args, adjoint=adjoint, max_steps=8
    )
    return jnp.sum(solution.ys[-1] ** 2)

  return loss, params, jnp.array([0.5, -0.3])


@functools.cache
def float32_ode(adjoint_name: str):
  """The float32 loss and its gradient, computed once per adjoint."""
  loss, params, y0 = ode_problem(adjoint_name)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, y0)


@pytest.mark.slow  # diffrax solves
@pytest.mark.parametrize("device_type", POLICIES)
@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_diffrax_solve_forward(adjoint, device_type):
  """Without differentiation (the adjoint's custom_vjp runs its primal)."""
  loss, params, y0 = ode_problem(adjoint)
  actual = jax.jit(jaxamp.autocast(loss, device_type=device_type))(params, y0)
  assert_close(actual, float32_ode(adjoint)[0], device_type)


@pytest.mark.slow  # diffrax solves
@pytest.mark.parametrize("device_type", POLICIES)
@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_diffrax_solve_gradient(adjoint, device_type):
  """Through the adjoint's custom_vjp: its ``fwd`` told which inputs are perturbed."""
  loss, params, y0 = ode_problem(adjoint)
  grad = jax.jit(jax.grad(jaxamp.autocast(loss, device_type=device_type), argnums=(0, 1)))
  assert_close(grad(params, y0), float32_ode(adjoint)[1], device_type)


@functools.cache
def stiff_linear_ode(adjoint_name: str, solver_name: str):
  """``loss(a, y0) = sum y(1)`` for ``dy/dt = a @ y`` solved by ``solver_name`` with a PID step
  size controller: an adaptive solve, whose accepted steps depend on every rounding."""
  diffrax = pytest.importorskip("diffrax")
  term = diffrax.ODETerm(lambda t, y, a: a @ y)
  controller = diffrax.PIDController(rtol=1e-3, atol=1e-4)

  def loss(a, y0):
    solution = diffrax.diffeqsolve(
      term,
      getattr(diffrax, solver_name)(),
      0.0,
      1.0,
      0.1,
      y0,
      args=a,
      stepsize_controller=controller,
      saveat=diffrax.SaveAt(t1=True),
      adjoint=getattr(diffrax, adjoint_name)(),
      max_steps=1000,
    )
    return jnp.sum(solution.ys)

  return loss


@pytest.mark.slow  # an implicit diffrax solve, differentiated
def test_diffrax_default_adjoint_of_an_implicit_adaptive_solve_gives_the_float16_gradient():
  """diffrax's default adjoint recomputes the solve in its backward: under autocast it must take
  the steps the float16 forward took, and give the gradient the direct adjoint gives."""
  a = jax.random.normal(jax.random.key(5), (4, 4)) * 0.3
  y0 = jnp.array([1.0, -0.5, 0.3, 0.8])
  grad_of = lambda adjoint: jax.jit(
    jax.grad(cuda(stiff_linear_ode(adjoint, "Kvaerno5")), argnums=1)
  )(a, y0)
  np.testing.assert_allclose(
    grad_of("RecursiveCheckpointAdjoint"), grad_of("DirectAdjoint"), rtol=1e-3, atol=1e-4
  )


# --- optimistix ----------------------------------------------------------------------------------

W4 = jax.random.normal(jax.random.key(4), (4, 4)) * 0.3 + 2 * jnp.eye(4)
B4 = jax.random.normal(jax.random.key(5), (4,))


def residual(y, args):
  w, b = args
  return jnp.tanh(w @ y) + y - b


def objective(y, args):
  w, b = args
  return jnp.sum((w @ y - b) ** 2) + 0.1 * jnp.sum(y**2)


def solution(kind: str):
  """The solution y(w, b) of a root find, least squares or minimisation by optimistix, with
  tolerances a 16-bit residual can meet; its gradient is by implicit differentiation."""
  optx = pytest.importorskip("optimistix")
  tol = dict(rtol=1e-2, atol=1e-2)
  solve = {
    "root_find": lambda args: optx.root_find(residual, optx.Newton(**tol), jnp.zeros(4), args),
    "least_squares": lambda args: optx.least_squares(
      residual, optx.GaussNewton(**tol), jnp.zeros(4), args
    ),
    "minimise": lambda args: optx.minimise(objective, optx.BFGS(**tol), jnp.zeros(4), args),
  }[kind]
  return lambda w, b: solve((w, b)).value


# Each solver under one policy: both policies are covered, and the file stays fast.
SOLVERS = [("root_find", "cuda"), ("least_squares", "cpu"), ("minimise", "cuda")]


@pytest.mark.parametrize("kind,device_type", SOLVERS)
@pytest.mark.slow
def test_optimistix_solution(kind, device_type):
  solve = solution(kind)
  actual = jax.jit(jaxamp.autocast(solve, device_type=device_type))(W4, B4)
  assert_close(actual, solve(W4, B4), device_type)


@pytest.mark.slow
@pytest.mark.parametrize("kind,device_type", SOLVERS)
def test_optimistix_implicit_gradient(kind, device_type):
  """The gradient through the solution, by implicit differentiation (optimistix's default
  ``ImplicitAdjoint``, a custom_jvp)."""
  solve = solution(kind)
  loss = lambda w, b: jnp.sum(solve(w, b) ** 2)
  grad = jax.jit(jax.grad(jaxamp.autocast(loss, device_type=device_type), argnums=(0, 1)))
  assert_close(grad(W4, B4), jax.grad(loss, argnums=(0, 1))(W4, B4), device_type)
