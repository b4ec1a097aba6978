"""Every floating-point primitive JAX exports runs under every autocast policy on 16-bit inputs.

The primitives are discovered, not listed: every ``Primitive`` in ``jax.extend.core.primitives``,
``jax.lax`` and ``jax.lax.linalg``. Each needs a recipe (how to call it, in ``RECIPES``) or a
reasoned exclusion (``EXCLUDED``), so a primitive a new JAX release adds fails here by name until
someone decides how autocast treats it. Each recipe runs inside ``jax.jit`` under "cuda", "cpu",
"tpu" and "xpu" with float16 and bfloat16 inputs, and its outputs are compared with a float32
run on the same (rounded) values. Linear algebra, which JAX has no 16-bit kernels for, must run in
float32 under every policy; ragged_dot, a grouped matmul, in the low dtype like dot_general.

To stay fast on two cores, each recipe is traced under every policy, and the distinct rewritten
programs of one dtype are compiled together, once (policies that rewrite a recipe identically
share its program).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxpr_utils
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.lax import linalg as lax_linalg
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import Category
from jaxamp._src.policies import policy

DEVICE_TYPES = ("cuda", "cpu", "tpu", "xpu")
CONFIGS = [
  (device_type, dtype) for device_type in DEVICE_TYPES for dtype in (jnp.float16, jnp.bfloat16)
]
CONFIG_IDS = [f"{device_type}-{jnp.dtype(dtype).name}" for device_type, dtype in CONFIGS]
F32 = jnp.dtype(jnp.float32)

# Primitives JAX binds but does not export, by the public function that binds them.
TRACED_ONLY = {"ragged_dot_general": "jax.lax.ragged_dot"}


def _exported(module) -> set[str]:
  return {value.name for value in vars(module).values() if isinstance(value, jex_core.Primitive)}


LINALG = _exported(lax_linalg)
DISCOVERED = _exported(jex_primitives) | _exported(lax) | LINALG | set(TRACED_ONLY)

_INTEGER = "takes integer or bool operands only; autocast never casts those"
_KEYS = "PRNG keys and raw random bits: no floating operand"
_NO_OPERANDS = "has no operands, so autocast has nothing to cast"
EXCLUDED = {
  **dict.fromkeys(
    [
      "and",
      "or",
      "not",
      "xor",
      "shift_left",
      "shift_right_arithmetic",
      "shift_right_logical",
      "clz",
      "population_count",
      "mulhi",
      "reduce_and",
      "reduce_or",
      "reduce_xor",
      "lu_pivots_to_permutation",
    ],
    _INTEGER,
  ),
  **dict.fromkeys(
    [
      "random_bits",
      "random_fold_in",
      "random_seed",
      "random_split",
      "threefry2x32",
      "rng_bit_generator",
    ],
    _KEYS,
  ),
  **dict.fromkeys(["iota", "axis_index", "empty2", "create_token"], _NO_OPERANDS),
  "after_all": "joins effect tokens; no floating operand",
  "stage": "EvalTrace's eager staging of a value; under tracing lax.stage binds nothing",
  "custom_lin": "exists only to be transposed: evaluating it raises in JAX itself (forward-mode "
  "of a custom_vjp), with or without autocast",
  "select_and_scatter": "bound only by select_and_scatter_add's lowering rule, never in a traced "
  "jaxpr (select_and_scatter_add has a recipe)",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How to call one primitive: a function and its arguments.

  float32 numpy arrays among ``args`` become the 16-bit inputs; anything else (integer indices,
  PRNG keys) passes as it is. ``check`` is "close" (close to a float32 run on the same values),
  "finite" (outputs finite; results that legitimately differ, like random draws) or "lowers"
  (rewritten and lowered to StableHLO only: XLA:CPU cannot run it).
  ``axis`` runs the function under ``shard_map`` over a one-device mesh axis named "i".
  ``low_inputs=False`` passes float32 inputs, for primitives JAX cannot even trace on 16-bit
  values: the recipe makes its 16-bit values with a matmul, which autocast lowers.
  """

  primitive: str
  fn: Callable
  args: tuple
  check: str = "close"
  name: str | None = None
  axis: bool = False
  low_inputs: bool = True
  check_vma: bool = False  # shard_map's check_vma=True turns psum into psum_invariant

  @property
  def id(self) -> str:
    return self.name or self.primitive


_rng = np.random.default_rng(0)


def u(*shape, lo=-1.0, hi=1.0):
  return _rng.uniform(lo, hi, shape).astype(np.float32)


def spd(n=4):
  a = u(n, n)
  return (a @ a.T + n * np.eye(n)).astype(np.float32)


def dominant(n=4):
  """A diagonally dominant matrix with distinct real eigenvalues (no pivoting, no complex pairs)."""
  return (np.diag(np.arange(1.0, n + 1.0) * 2) + 0.1 * u(n, n)).astype(np.float32)


def upper(n=4):
  return np.linalg.cholesky(spd(n)).T.astype(np.float32)


def _scalar_like(x, value):
  return jnp.full((), value, x.dtype)


def _bitcast_roundtrip(x):
  bits = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits), x.dtype)


def _custom_jvp():
  @jax.custom_jvp
  def f(x):
    return jnp.exp(x) * x

  f.defjvp(lambda primals, tangents: (f(primals[0]), tangents[0] * jnp.exp(primals[0])))
  return f


def _custom_vjp():
  @jax.custom_vjp
  def f(x):
    return jnp.exp(x) * x

  f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.exp(x),))
  return f


def _call(primitive):
  """Binds a call primitive as interpreters do (``get_bind_params``), on an exp's jaxpr."""

  def call(x):
    closed = jax.make_jaxpr(lambda v: jnp.exp(v) * 2)(x)
    jaxpr = closed if primitive is jex_primitives.closed_call_p else closed.jaxpr
    return primitive.bind(x, **primitive.get_bind_params({"call_jaxpr": jaxpr}))

  return call


def _new_ref(x, y):
  ref = jax.new_ref(x)
  ref[...] += jnp.exp(y)
  return ref[...]


def _ragged_all_to_all(x, out):
  # One device: send every row to itself.
  n = jnp.array([0], jnp.int32)
  size = jnp.array([x.shape[0]], jnp.int32)
  return lax.ragged_all_to_all(x, out, n, size, n, size, axis_name="i")


X, Y = u(4, 4), u(4, 4)
POS = u(4, 4, lo=0.5, hi=2.0)
UNIT = u(4, 4, lo=-0.9, hi=0.9)
IDX = np.array([[0], [2]], np.int32)
SCATTER = lax.ScatterDimensionNumbers(
  update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
WINDOW = dict(window_dimensions=(2, 2), window_strides=(1, 1), padding="VALID")


def _unary(prim, fn, x=X, **kw):
  return Recipe(prim, fn, (x,), **kw)


def _binary(prim, fn, x=X, y=Y, **kw):
  return Recipe(prim, fn, (x, y), **kw)


def _cumulative(prim, fn):
  return Recipe(prim, lambda x: fn(x, axis=0), (u(4, 4, lo=0.5, hi=1.5),))


def _reduce_window(prim, init, op):
  return Recipe(prim, lambda x: lax.reduce_window(x, init, op, **WINDOW), (X,))


def _pool3d(prim, init, op):
  x = u(1, 4, 4, 4, 2)
  window = dict(window_dimensions=(1, 2, 2, 2, 1), window_strides=(1, 2, 2, 2, 1), padding="VALID")
  return Recipe(prim, lambda x: lax.reduce_window(x, init, op, **window), (x,), name=f"{prim}[3d]")


def _max_pool(x):
  return lax.reduce_window(x, -jnp.inf, lax.max, **WINDOW)


def _collective(prim, fn, x=X, **kw):
  return Recipe(prim, fn, (x,), axis=True, **kw)


_ALL_RECIPES: tuple[Recipe, ...] = (
  # --- elementwise --------------------------------------------------------------------------
  *(
    _unary(primitive, getattr(lax, f))
    for primitive, f in [
      ("abs", "abs"),
      ("asinh", "asinh"),
      ("atan", "atan"),
      ("bessel_i0e", "bessel_i0e"),
      ("bessel_i1e", "bessel_i1e"),
      ("cbrt", "cbrt"),
      ("ceil", "ceil"),
      ("cos", "cos"),
      ("cosh", "cosh"),
      ("erf", "erf"),
      ("erfc", "erfc"),
      ("exp", "exp"),
      ("exp2", "exp2"),
      ("expm1", "expm1"),
      ("floor", "floor"),
      ("is_finite", "is_finite"),
      ("logistic", "logistic"),
      ("neg", "neg"),
      ("round", "round"),
      ("sign", "sign"),
      ("sin", "sin"),
      ("sinh", "sinh"),
      ("square", "square"),
      ("tan", "tan"),
      ("tanh", "tanh"),
      ("stop_gradient", "stop_gradient"),
    ]
  ),
  *(
    _unary(primitive, getattr(lax, f), UNIT)
    for primitive, f in [
      ("acos", "acos"),
      ("asin", "asin"),
      ("atanh", "atanh"),
      ("erf_inv", "erf_inv"),
    ]
  ),
  *(
    _unary(primitive, getattr(lax, f), POS)
    for primitive, f in [
      ("digamma", "digamma"),
      ("lgamma", "lgamma"),
      ("log", "log"),
      ("log1p", "log1p"),
      ("rsqrt", "rsqrt"),
      ("sqrt", "sqrt"),
    ]
  ),
  _unary("acosh", lax.acosh, POS + 1),
  _unary("integer_pow", lambda x: lax.integer_pow(x, 3)),
  _unary("reduce_precision", lambda x: lax.reduce_precision(x, exponent_bits=5, mantissa_bits=7)),
  _unary(
    "convert_element_type",
    lambda x: (lax.convert_element_type(x * 4, jnp.int32), x.astype(jnp.float32)),
  ),
  _unary("bitcast_convert_type", _bitcast_roundtrip),
  _unary("copy", lambda x: jex_primitives.copy_p.bind(x)),
  _unary("optimization_barrier", lambda x: lax.optimization_barrier((x, x * 2))),
  _unary("name", lambda x: checkpoint_name(jnp.exp(x), "h")),
  _unary("device_put", lambda x: jax.device_put(jnp.exp(x))),
  _unary(
    "sharding_constraint",
    lambda x: lax.with_sharding_constraint(
      jnp.exp(x), NamedSharding(Mesh(jax.devices()[:1], ("i",)), P())
    ),
  ),
  _unary("dce_sink", lambda x: (lax.dce_sink(jnp.exp(x)), x * 2)[1]),
  *(
    _binary(primitive, getattr(lax, f))
    for primitive, f in [
      ("add", "add"),
      ("sub", "sub"),
      ("mul", "mul"),
      ("max", "max"),
      ("min", "min"),
      ("atan2", "atan2"),
      ("nextafter", "nextafter"),
      ("eq", "eq"),
      ("ne", "ne"),
      ("lt", "lt"),
      ("le", "le"),
      ("gt", "gt"),
      ("ge", "ge"),
    ]
  ),
  *(
    _binary(primitive, getattr(jex_primitives, f"{primitive}_p").bind)
    for primitive in ("eq_to", "le_to", "lt_to")
  ),
  _binary("add_any", jex_primitives.add_jaxvals_p.bind),
  _binary("div", lax.div, y=POS),
  Recipe("div", lambda x: 1.0 / x, (POS,), name="div[rdiv]"),
  _binary("rem", lax.rem, x=u(4, 4, lo=-3, hi=3), y=POS),
  _binary("pow", lax.pow, x=POS),
  # lax.complex rejects 16-bit parts even untraced: its parts come from a lowered matmul.
  _binary("complex", lambda x, y: lax.complex(x @ y, y), low_inputs=False),
  _binary("real", lambda x, y: lax.real(lax.complex(x @ y, y)), low_inputs=False),
  _binary("imag", lambda x, y: lax.imag(lax.complex(x @ y, y)), low_inputs=False),
  _binary("conj", lambda x, y: lax.conj(lax.complex(x @ y, y)), low_inputs=False),
  _binary("igamma", lax.igamma, x=POS, y=POS),
  _binary("igammac", lax.igammac, x=POS, y=POS),
  _binary("igamma_grad_a", lax.igamma_grad_a, x=POS, y=POS),
  _binary("polygamma", lax.polygamma, x=np.ones((4, 4), np.float32), y=POS),
  _binary("zeta", lax.zeta, x=POS + 2, y=POS),
  Recipe("regularized_incomplete_beta", lax.betainc, (POS, POS, u(4, 4, lo=0.1, hi=0.9))),
  Recipe("clamp", lax.clamp, (np.float32(-0.5), X, np.float32(0.5))),
  Recipe("select_n", lax.select_n, (X > 0, X, Y)),
  # --- reductions, scans, sorting -----------------------------------------------------------
  _unary("reduce_sum", lambda x: lax.reduce_sum(x, (0,))),
  _unary("reduce_max", lambda x: lax.reduce_max(x, (0,))),
  _unary("reduce_min", lambda x: lax.reduce_min(x, (0,))),
  _unary("reduce_prod", lambda x: lax.reduce_prod(x, (0,)), u(4, 4, lo=0.8, hi=1.2)),
  _unary("argmax", lambda x: lax.argmax(x, 0, jnp.int32)),
  _unary("argmin", lambda x: lax.argmin(x, 0, jnp.int32)),
  _binary(
    "reduce",
    lambda x, y: lax.reduce(
      (x, y),
      (_scalar_like(x, 0), _scalar_like(y, 0)),
      lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
      (0,),
    ),
  ),
  _cumulative("cumsum", lax.cumsum),
  _cumulative("cumprod", lax.cumprod),
  _cumulative("cummax", lax.cummax),
  _cumulative("cummin", lax.cummin),
  _cumulative("cumlogsumexp", lax.cumlogsumexp),
  _reduce_window("reduce_window_sum", 0.0, lax.add),
  _reduce_window("reduce_window_max", -np.inf, lax.max),
  _reduce_window("reduce_window_min", np.inf, lax.min),
  _pool3d("reduce_window_sum", 0.0, lax.add),
  _pool3d("reduce_window_max", -np.inf, lax.max),
  _binary(
    "reduce_window",
    lambda x, y: lax.reduce_window(
      (x, y),
      (_scalar_like(x, 0), _scalar_like(y, 0)),
      lambda a, b: (a[0] + b[0], a[1] + b[1]),
      **WINDOW,
    ),
  ),
  _unary("select_and_scatter_add", lambda x: jax.grad(lambda v: _max_pool(v).sum())(x)),
  _binary("select_and_gather_add", lambda x, t: jax.jvp(_max_pool, (x,), (t,))),
  _binary("sort", lambda x, y: lax.sort((x, y), num_keys=1)),
  _unary("top_k", lambda x: lax.top_k(x, 2)),
  _unary("approx_top_k", lambda x: lax.approx_max_k(x, 2)),
  # --- shapes, indexing -----------------------------------------------------------------------
  _unary("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (2, 4, 4), (1, 2))),
  _unary("reshape", lambda x: lax.reshape(x, (16,))),
  _unary("squeeze", lambda x: lax.squeeze(x[None], (0,))),
  _unary("transpose", lambda x: lax.transpose(x, (1, 0))),
  _unary("rev", lambda x: lax.rev(x, (0,))),
  _unary("slice", lambda x: lax.slice(x, (1, 0), (3, 4))),
  _unary("dynamic_slice", lambda x: lax.dynamic_slice(x, (jnp.int32(1), jnp.int32(0)), (2, 4))),
  _binary(
    "dynamic_update_slice",
    lambda x, y: lax.dynamic_update_slice(x, y[:2], (jnp.int32(1), jnp.int32(0))),
  ),
  _unary("gather", lambda x: x[jnp.array([2, 0])]),
  _binary("concatenate", lambda x, y: lax.concatenate([x, y], 0)),
  _unary("split", lambda x: lax.split(x, (1, 3))),
  _binary("stack", lambda x, y: lax.stack([x, y])),
  _unary("unstack", lambda x: lax.unstack(x)),  # lax.stack & co: from jax 0.10.1
  _unary("tile", lambda x: lax.tile(x, (2, 1))),
  Recipe("pad", lambda x, v: lax.pad(x, v, [(1, 1, 0), (0, 2, 1)]), (X, np.float32(0.5))),
  _binary("scatter", lambda x, y: x.at[jnp.array([0, 2])].set(y[:2])),
  _binary("scatter-add", lambda x, y: x.at[jnp.array([0, 2])].add(y[:2])),
  _binary("scatter-mul", lambda x, y: x.at[jnp.array([0, 2])].multiply(y[:2])),
  _binary("scatter-min", lambda x, y: x.at[jnp.array([0, 2])].min(y[:2])),
  _binary("scatter-max", lambda x, y: x.at[jnp.array([0, 2])].max(y[:2])),
  _binary("scatter-sub", lambda x, y: lax.scatter_sub(x, IDX, y[:2], SCATTER)),
  # --- matmuls and convolutions ---------------------------------------------------------------
  _binary("dot_general", lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())))),
  _binary(
    "conv_general_dilated",
    lambda x, k: lax.conv_general_dilated(x[None, None], k[None, None, :3, :3], (1, 1), "SAME"),
  ),
  Recipe("ragged_dot_general", lax.ragged_dot, (u(6, 4), u(2, 4, 3), np.array([2, 4], np.int32))),
  # --- linear algebra and FFT: float32 under every policy --------------------------------------
  Recipe("cholesky", lax_linalg.cholesky, (spd(),)),
  Recipe("cholesky_update", lax_linalg.cholesky_update, (upper(), u(4))),
  Recipe(
    "eig",
    lambda a: lax_linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False),
    (dominant(),),
  ),
  Recipe("eigh", lambda a: lax_linalg.eigh(a)[1], (spd(),)),
  Recipe("hessenberg", lax_linalg.hessenberg, (dominant(),)),
  Recipe("householder_product", lax_linalg.householder_product, (u(4, 3), u(3, lo=1.0, hi=1.5))),
  Recipe("lu", lax_linalg.lu, (dominant(),)),
  Recipe("ormqr", lax_linalg.ormqr, (u(4, 3), u(3, lo=1.0, hi=1.5), u(4, 2))),
  Recipe("qr", lax_linalg.qr, (dominant(),)),
  Recipe("schur", lax_linalg.schur, (dominant(),)),
  Recipe("svd", lambda a: lax_linalg.svd(a, full_matrices=False), (dominant(),)),
  Recipe(
    "svd", lambda a: jnp.linalg.norm(a, ord=2), (dominant(),), name="svd (jnp.linalg.norm ord=2)"
  ),
  Recipe(
    "svd",
    lambda a: jnp.linalg.norm(a, ord="nuc"),
    (dominant(),),
    name="svd (jnp.linalg.norm ord=nuc)",
  ),
  Recipe(
    "svd",
    lambda a: jnp.linalg.matrix_norm(a, ord=2),
    (dominant(),),
    name="svd (jnp.linalg.matrix_norm ord=2)",
  ),
  Recipe(
    "symmetric_product",
    lambda a, c: lax_linalg.symmetric_product(a, c, alpha=1.0, beta=0.5),
    (u(4, 3), spd()),
  ),
  Recipe(
    "triangular_solve",
    lambda a, b: lax_linalg.triangular_solve(a, b, left_side=True, lower=False),
    (upper(), u(4, 2)),
  ),
  Recipe("tridiagonal", lax_linalg.tridiagonal, (spd(),)),
  Recipe(
    "tridiagonal_solve",
    lax_linalg.tridiagonal_solve,
    (
      np.r_[0, u(3)].astype(np.float32),
      u(4, lo=3, hi=4),
      np.r_[u(3), 0].astype(np.float32),
      u(4, 2),
    ),
  ),
  _binary("fft", lambda x, y: lax.fft(x @ y, lax.FftType.RFFT, (4,)), low_inputs=False),
  Recipe(
    "custom_linear_solve",
    lambda a, b: lax.custom_linear_solve(lambda v: a @ v, b, lambda _, r: r / jnp.diag(a)),
    (dominant(), u(4)),
  ),
  # --- randomness -----------------------------------------------------------------------------
  Recipe(
    "random_gamma",
    lambda key, a: jax.random.gamma(key, a),
    (jax.random.key(0), POS),
    check="finite",
  ),
  Recipe(
    "rng_uniform",
    lambda a, b: lax.rng_uniform(a, b, (3,)),
    (np.float32(0.5), np.float32(1.5)),
    check="finite",
  ),
  # --- higher-order ---------------------------------------------------------------------------
  _unary("jit", jax.jit(lambda x: jnp.exp(x) + x)),
  _unary("closed_call", _call(jex_primitives.closed_call_p)),
  _unary("call", _call(jex_primitives.call_p)),
  _unary("remat2", jax.checkpoint(lambda x: jnp.exp(x) * x)),
  _unary("custom_jvp_call", _custom_jvp()),
  _unary("custom_vjp_call", _custom_vjp()),
  _unary("cond", lambda x: lax.cond(x[0, 0] > 0, jnp.exp, jnp.sin, x)),
  _unary("scan", lambda x: lax.scan(lambda c, r: (c + jnp.exp(r), c * 2), x[0], x)),
  _unary("while", lambda x: lax.while_loop(lambda c: c[0, 0] < 3, lambda c: c + jnp.exp(c), x)),
  _binary("get", _new_ref),
  _binary("swap", _new_ref),
  # --- collectives (a one-device mesh axis) ---------------------------------------------------
  _collective("psum", lambda x: lax.psum(x, "i")),
  _collective("psum_invariant", lambda x: lax.psum(x, "i") * 2, check_vma=True),
  _collective("pmax", lambda x: lax.pmax(x, "i")),
  _collective("pmin", lambda x: lax.pmin(x, "i")),
  _collective("ppermute", lambda x: lax.ppermute(x, "i", [(0, 0)])),
  _collective("all_gather", lambda x: lax.all_gather(x, "i", tiled=True)),
  _collective("all_to_all", lambda x: lax.all_to_all(x, "i", 0, 0, tiled=True)),
  Recipe(
    "ragged_all_to_all",
    _ragged_all_to_all,
    (X, np.zeros((4, 4), np.float32)),
    axis=True,
    check="lowers",
  ),
)
# Primitives newer than the oldest JAX jaxamp supports (0.10.0): absent there.
ADDED_AFTER_OLDEST_JAX = frozenset({"mulhi", "stage", "split", "stack", "unstack", "tile"})
# The recipes of the primitives this JAX has (newer ones are added by later releases).
RECIPES = tuple(recipe for recipe in _ALL_RECIPES if recipe.primitive in DISCOVERED)


def _cast(args, source, target) -> tuple:
  """``args`` with their ``source``-dtype arrays cast to ``target``."""
  return tuple(jnp.asarray(a, target) if getattr(a, "dtype", None) == source else a for a in args)


def _inputs(recipe: Recipe, dtype) -> tuple:
  return _cast(recipe.args, F32, dtype) if recipe.low_inputs else recipe.args


def _reference_inputs(recipe: Recipe, dtype) -> tuple:
  """The recipe's inputs as float32 values the 16-bit dtype can represent exactly."""
  return _cast(_inputs(recipe, dtype), dtype, F32) if recipe.low_inputs else recipe.args


def _wrap(recipe: Recipe, device_type: str | None = None, dtype=None) -> Callable:
  """The recipe's function, autocast when ``device_type`` is given, under shard_map if a
  collective."""
  fn = recipe.fn
  if device_type is not None:
    fn = jaxamp.autocast(fn, device_type=device_type, dtype=dtype)
  if recipe.axis:
    mesh = Mesh(jax.devices()[:1], ("i",))
    fn = jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=recipe.check_vma)
  return fn


def _batch(fns) -> Callable:
  """One function calling each of ``fns`` on its own arguments: one compile instead of many."""
  return lambda all_args: [fn(*args) for fn, args in zip(fns, all_args, strict=True)]


TOLERANCE = 8  # relative and absolute, in units of the 16-bit dtype's eps
# XLA:CPU's backend optimisations take most of the compile time and change no result here.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
COMPARED = tuple(recipe for recipe in RECIPES if recipe.check == "close")
# The compared recipes in float32, compiled once: the two 16-bit dtypes only change the values.
REFERENCE = jax.jit(_batch([_wrap(recipe) for recipe in COMPARED]), compiler_options=FAST_COMPILE)

# Primitives whose floating inputs autocast must give a fixed dtype under every policy.
FLOAT32_INPUTS = LINALG | {"fft"}
LOW_INPUTS = {"dot_general", "conv_general_dilated", "ragged_dot_general"}


def _compare(recipe: Recipe, outs, reference, dtype) -> list[str]:
  problems = []
  for out, ref in zip(
    map(np.asarray, jax.tree.leaves(outs)), map(np.asarray, jax.tree.leaves(reference)), strict=True
  ):
    if jnp.issubdtype(out.dtype, jnp.inexact) and not np.all(np.isfinite(out)):
      problems.append(f"non-finite {out.dtype} output")
    if recipe.check != "close":
      continue
    tol = TOLERANCE * float(jnp.finfo(dtype).eps)
    if jnp.issubdtype(ref.dtype, jnp.inexact):
      if not np.allclose(out.astype(np.complex128), ref, rtol=tol, atol=tol):
        error = np.max(np.abs(out.astype(np.complex128) - ref))
        problems.append(f"{out.dtype} output off float32's by up to {error:.3g} (tol {tol:.3g})")
    elif out.dtype != ref.dtype or not np.array_equal(out, ref):
      problems.append(f"{out.dtype} output differs from float32's {ref.dtype} output")
  return problems


def _input_problems(recipe: Recipe, jaxpr, dtype) -> list[str]:
  """Linear algebra must see float32 inputs, matmuls the low dtype, whatever the policy."""
  expected = (
    F32
    if recipe.primitive in FLOAT32_INPUTS
    else jnp.dtype(dtype)
    if recipe.primitive in LOW_INPUTS
    else None
  )
  if expected is None:
    return []
  found = {
    d
    for ins, _ in jaxpr_utils.dtypes_of(jaxpr, recipe.primitive)
    for d in ins
    if jnp.issubdtype(d, jnp.floating)
  }
  return (
    []
    if found == {expected}
    else [f"{recipe.primitive} got {sorted(map(str, found))} inputs, not {expected}"]
  )


def _first_line(error: Exception) -> str:
  return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def _programs(dtype, problems) -> dict:
  """Each recipe autocast under each policy, traced: {(recipe id, jaxpr text): (recipe, device
  types)}. Policies that rewrite a recipe identically share one program: it runs once."""
  programs = {}
  for device_type in DEVICE_TYPES:
    for recipe in RECIPES:
      try:
        closed = jax.make_jaxpr(_wrap(recipe, device_type, dtype))(*_inputs(recipe, dtype))
        jex_core.check_jaxpr(closed.jaxpr)
      except Exception as error:  # noqa: BLE001  (every failure is reported, by recipe)
        problems[recipe.id, device_type] = [_first_line(error)]
        continue
      if found := _input_problems(recipe, closed, dtype):
        problems[recipe.id, device_type] = found
      key = (recipe.id, str(closed))
      programs.setdefault(key, (recipe, []))[1].append(device_type)
  return programs


def _failing(items: list, attempt: Callable) -> dict[int, Exception]:
  """The items ``attempt`` raises on, by index, found by halving the list: one failing program
  costs a few small compiles, not one compile per program."""
  try:
    attempt(items)
    return {}
  except Exception as error:  # noqa: BLE001  (narrowed down, then reported with its culprit)
    if len(items) == 1:
      return {0: error}
  half = len(items) // 2
  found = _failing(items[:half], attempt)
  found.update({half + i: e for i, e in _failing(items[half:], attempt).items()})
  return found


def _execute(pairs, dtype) -> list:
  """Outputs of each (recipe, device type) program, or the error it raised: all programs in one
  jit, compiled and run once. Recipes XLA:CPU cannot run are lowered only."""

  def jitted(items):
    fns = [_wrap(recipe, device_type, dtype) for recipe, device_type in items]
    inputs = [_inputs(recipe, dtype) for recipe, _ in items]
    return jax.jit(_batch(fns), compiler_options=FAST_COMPILE), inputs

  def lower(items):
    batch, inputs = jitted(items)
    return batch.lower(inputs)

  def run(items):
    batch, inputs = jitted([item for item in items if item[0].check != "lowers"])
    return batch(inputs)

  results: list = [None] * len(pairs)
  failed = _failing(pairs, lower)  # lowering is cheap, and where missing kernels show
  rest = [i for i in range(len(pairs)) if i not in failed]
  ran = [i for i in rest if pairs[i][0].check != "lowers"]
  try:
    outputs = run([pairs[i] for i in ran])
  except Exception:  # noqa: BLE001  (an XLA error: find the programs that raise it)
    failed.update({ran[i]: e for i, e in _failing([pairs[i] for i in ran], run).items()})
    ran = [i for i in ran if i not in failed]
    outputs = run([pairs[i] for i in ran])
  for i, out in zip(ran, outputs, strict=True):
    results[i] = out
  for i, error in failed.items():
    results[i] = error
  return results


def test_every_discovered_primitive_has_a_recipe_or_a_reasoned_exclusion():
  covered = {recipe.primitive for recipe in RECIPES}
  missing = sorted(DISCOVERED - covered - set(EXCLUDED))
  assert not missing, (
    f"primitives with no recipe in RECIPES and no reasoned exclusion in "
    f"EXCLUDED (decide how autocast treats them): {missing}"
  )
  assert not covered & set(EXCLUDED), sorted(covered & set(EXCLUDED))
  stale = sorted(set(EXCLUDED) - DISCOVERED - ADDED_AFTER_OLDEST_JAX)
  assert not stale, f"exclusions for primitives JAX no longer exports: {stale}"


@pytest.mark.slow
def test_every_recipe_binds_its_primitive():
  wrong = [
    recipe.id
    for recipe in RECIPES
    if recipe.primitive
    not in jaxpr_utils.primitive_names(
      jax.make_jaxpr(_wrap(recipe))(*_inputs(recipe, jnp.bfloat16))
    )
  ]
  assert not wrong, f"recipes that do not bind their primitive: {wrong}"


def test_linear_algebra_runs_in_float32_and_ragged_dot_low_in_every_table():
  for device_type in DEVICE_TYPES:
    categories = {
      str(key): category
      for key, category in policy.get_table(device_type).primitive_categories.items()
    }
    for name in FLOAT32_INPUTS - set(EXCLUDED):
      assert categories.get(name) is Category.FLOAT32, (device_type, name)
    assert categories["ragged_dot_general"] is Category.LOWER


@pytest.mark.slow  # compiles every primitive under every policy
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_every_primitive_runs_under_every_policy_on_16_bit_inputs_inside_jit(dtype):
  problems: dict[tuple[str, str], list[str]] = {}
  programs = list(_programs(dtype, problems).values())
  results = _execute([(recipe, device_types[0]) for recipe, device_types in programs], dtype)
  reference = dict(
    zip(
      (r.id for r in COMPARED),
      REFERENCE([_reference_inputs(r, dtype) for r in COMPARED]),
      strict=True,
    )
  )
  for (recipe, device_types), outs in zip(programs, results, strict=True):
    if isinstance(outs, Exception):
      found = [_first_line(outs)]
    elif recipe.check == "lowers":
      continue
    else:
      found = _compare(recipe, outs, reference.get(recipe.id, outs), dtype)
    for device_type in device_types:
      if found:
        problems.setdefault((recipe.id, device_type), []).extend(found)
  assert not problems, "\n".join(
    f"{name} under {device_type}/{jnp.dtype(dtype).name}: {'; '.join(found)}"
    for (name, device_type), found in problems.items()
  )


def _ragged_inputs(dtype):
  x, w = u(6, 4), u(2, 4, 3)
  if dtype is not None:
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  return x, w, jnp.array([2, 4], jnp.int32)


@pytest.mark.parametrize("device_type,dtype", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
  "inputs,preferred",
  [
    ("float32", None),
    ("float32", "dtype"),
    ("float32", "scalar type"),
    ("low", None),
    ("low", "dtype"),
    ("low", "scalar type"),
  ],
)
@pytest.mark.slow_after_first
def test_ragged_dot_runs_in_the_low_dtype_like_dot_general(device_type, dtype, inputs, preferred):
  """Operands in the low dtype, as dot_general's; the result too, unless the caller gave a
  preferred_element_type. ragged_dot records one only when given, so a float32 result of float32
  operands is kept; jnp's dots record the inputs' dtype by default, so dot_general keeps only a
  float32 result of 16-bit inputs."""
  low = jnp.dtype(dtype)
  preferred_type = {None: None, "dtype": F32, "scalar type": jnp.float32}[preferred]
  x, w, sizes = _ragged_inputs(None if inputs == "float32" else dtype)
  ragged = lambda x, w, s: lax.ragged_dot(x, w, s, preferred_element_type=preferred_type)
  dot = lambda x, w, s: lax.dot_general(
    x, w[0], (((1,), (0,)), ((), ())), preferred_element_type=preferred_type
  )
  cast = lambda f: jaxamp.autocast(f, device_type=device_type, dtype=dtype)
  ((ins, outs),) = jaxpr_utils.dtypes_of(
    jax.make_jaxpr(cast(ragged))(x, w, sizes), "ragged_dot_general"
  )
  ((_, dot_outs),) = jaxpr_utils.dtypes_of(jax.make_jaxpr(cast(dot))(x, w, sizes), "dot_general")
  assert ins == (low, low, jnp.dtype(jnp.int32))
  assert outs == ((F32,) if preferred is not None else (low,))
  assert dot_outs == ((F32,) if inputs == "low" and preferred is not None else (low,))
  if inputs == "float32" and preferred is None:  # one compile per policy is enough
    out = jax.jit(cast(ragged))(x, w, sizes)
    assert out.dtype == low
    np.testing.assert_allclose(
      np.asarray(out, np.float32), ragged(x, w, sizes), rtol=0.05, atol=0.05
    )


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
@pytest.mark.slow
def test_bias_add_after_ragged_dot_stays_in_the_low_dtype(device_type):
  """An expert layer's bias add belongs to its grouped matmul, as a Dense layer's to its dot."""
  x, w, sizes = _ragged_inputs(None)
  layer = lambda x, w, b, s: lax.ragged_dot(x, w, s) + b
  out = jaxamp.autocast(layer, device_type=device_type)(x, w, u(3), sizes)
  assert out.dtype == policy.get_table(device_type).default_dtype
