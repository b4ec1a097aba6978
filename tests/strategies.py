"""Hypothesis strategies shared by the property tests.

``programs()`` draws small random JAX programs: a list of layers applied to a ``(4, 8)`` float32
activation, built from dots, convolutions, elementwise ops, reductions, softmax / log_softmax /
layer-norm composites (``jax.nn``, flax and hand-written), ``lax.scan``, ``lax.cond``,
``lax.while_loop``, ``jax.checkpoint``, nested ``jax.jit`` and ``custom_jvp`` / ``custom_vjp``
functions whose rules equal autodiff (so gradients can be compared with the float32 run).

A drawn ``Program`` knows how to make its float32 parameters (``init``) and how to run
(``apply(params, x, flag)``); ``flag`` is an int32 scalar that picks ``lax.cond`` branches and
``lax.while_loop`` trip counts, so control flow never depends on rounding.

Numerics are kept well conditioned on purpose, so that the float32 run is a fair reference for
a float16 / bfloat16 run: weights are scaled by ``1 / sqrt(fan_in)``, layer norms use a large
epsilon (a layer norm of an almost constant row amplifies rounding errors without bound), and
``smooth=True`` programs avoid the kinks where one rounding flips a gradient: ``|h|`` becomes
``sqrt(h*h + 1)`` and the row maximum subtracted from ``h`` is a ``stop_gradient`` (as in every
stable softmax).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

B, D = 4, 8  # batch, features
LN_EPSILON = 0.1

LEAF_KINDS = (
  "dense",
  "conv",
  "add",
  "mul",
  "tanh",
  "exp_abs",
  "log1p_abs",
  "sum",
  "max",
  "mean",
  "softmax",
  "softmax_hand",
  "log_softmax",
  "log_softmax_hand",
  "standardize",
  "layer_norm_flax",
  "layer_norm_hand",
)
# The leaf kinds that are library composites autocast recognises as one torch op.
LIBRARY_COMPOSITES = ("softmax", "log_softmax", "layer_norm_flax")
HIGHER_KINDS = ("scan", "cond", "while", "checkpoint", "jit", "custom_jvp", "custom_vjp")


@dataclasses.dataclass(frozen=True)
class Node:
  """One layer: a leaf op, or a higher-order op around sub-programs (``bodies``)."""

  kind: str
  index: int
  bodies: tuple[tuple[Node, ...], ...] = ()

  def __repr__(self) -> str:
    if not self.bodies:
      return self.kind
    return f"{self.kind}({', '.join('[' + ', '.join(map(repr, b)) + ']' for b in self.bodies)})"


@dataclasses.dataclass(frozen=True)
class Program:
  """A drawn program: ``layers`` applied in order; ``seed`` fixes its parameters and inputs."""

  layers: tuple[Node, ...]
  seed: int
  smooth: bool

  def __repr__(self) -> str:
    return f"Program([{', '.join(map(repr, self.layers))}], seed={self.seed}, smooth={self.smooth})"

  def nodes(self):
    def visit(layers):
      for node in layers:
        yield node
        for body in node.bodies:
          yield from visit(body)

    return list(visit(self.layers))

  def kinds(self) -> set[str]:
    return {node.kind for node in self.nodes()}

  def init(self) -> dict:
    """Float32 parameters, keyed by node index."""
    rng = np.random.default_rng(self.seed)
    params = {}
    for node in self.nodes():
      node_params = _init_node(node.kind, rng)
      if node_params:
        params[f"n{node.index}"] = node_params
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)

  def inputs(self):
    """``(x, cotangent, flag)``: the activation, a fixed output cotangent and the cond flag."""
    rng = np.random.default_rng(self.seed + 1)
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    flag = jnp.asarray(self.seed % 3, jnp.int32)
    return x, ct, flag

  def apply(self, params, x, flag):
    return _run(self.layers, params, x, flag, self.smooth)

  def layer_outputs(self, params, x, flag) -> list:
    """The output of every top-level layer, in order (the last one is ``apply``'s)."""
    outs = []
    for node in self.layers:
      x = _apply_node(node, params, x, flag, self.smooth)
      outs.append(x)
    return outs

  def loss(self, params, x, ct, flag):
    """A scalar of the output, for gradients: the output's inner product with ``ct``."""
    return jnp.sum(self.apply(params, x, flag) * ct)


def _init_node(kind: str, rng) -> dict:
  normal = rng.standard_normal
  if kind == "dense":
    return {"w": normal((D, D)) / np.sqrt(D), "b": 0.1 * normal(D)}
  if kind == "conv":
    return {"k": normal((3, 1, 1)) / np.sqrt(3), "b": 0.1 * normal(1)}
  if kind == "add":
    return {"p": 0.5 * normal(D)}
  if kind == "mul":
    return {"p": 1.0 + 0.25 * normal(D)}
  if kind in ("layer_norm_flax", "layer_norm_hand"):
    return {"scale": 1.0 + 0.1 * normal(D), "bias": 0.1 * normal(D)}
  if kind == "scan":
    return {"xs": 0.1 * normal((2, D))}
  return {}


def _abs(h, smooth):
  return jnp.sqrt(h * h + 1.0) if smooth else jnp.abs(h)


def _row_max(h, smooth):
  m = jnp.max(h, axis=-1, keepdims=True)
  return lax.stop_gradient(m) if smooth else m


def _leaf(kind, node_params, h, smooth):
  if kind == "dense":
    return h @ node_params["w"] + node_params["b"]
  if kind == "conv":
    out = lax.conv_general_dilated(
      h[:, :, None], node_params["k"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    return (out + node_params["b"])[:, :, 0]
  if kind == "add":
    return h + node_params["p"]
  if kind == "mul":
    return h * node_params["p"]
  if kind == "tanh":
    return jnp.tanh(h)
  if kind == "exp_abs":
    return jnp.exp(-_abs(h, smooth))
  if kind == "log1p_abs":
    return jnp.log1p(_abs(h, smooth))
  if kind == "sum":
    return h + 0.1 * jnp.sum(h, axis=-1, keepdims=True)
  if kind == "max":
    return h - _row_max(h, smooth)
  if kind == "mean":
    return h - jnp.mean(h, axis=-1, keepdims=True)
  if kind == "softmax":
    return jax.nn.softmax(h, axis=-1)
  if kind == "softmax_hand":  # flax-style hand-written
    e = jnp.exp(h - lax.stop_gradient(jnp.max(h, axis=-1, keepdims=True)))
    return e / jnp.sum(e, axis=-1, keepdims=True)
  if kind == "log_softmax":
    return jax.nn.log_softmax(h, axis=-1)
  if kind == "log_softmax_hand":
    shifted = h - lax.stop_gradient(jnp.max(h, axis=-1, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  if kind == "standardize":
    return jax.nn.standardize(h, axis=-1, epsilon=LN_EPSILON)
  if kind == "layer_norm_flax":
    return nn.LayerNorm(epsilon=LN_EPSILON).apply({"params": node_params}, h)
  if kind == "layer_norm_hand":
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * lax.rsqrt(var + LN_EPSILON) * node_params["scale"] + node_params["bias"]
  raise ValueError(kind)


def _run(layers, params, h, flag, smooth):
  for node in layers:
    h = _apply_node(node, params, h, flag, smooth)
  return h


def _apply_node(node: Node, params, h, flag, smooth):
  kind = node.kind
  node_params = params.get(f"n{node.index}", {})
  if not node.bodies:
    return _leaf(kind, node_params, h, smooth)
  run = functools.partial(_run, smooth=smooth)
  body = node.bodies[0]
  if kind == "scan":

    def step(carry, x_t):
      out = run(body, params, carry, flag) + x_t
      return out, jnp.tanh(out)

    carry, ys = lax.scan(step, h, node_params["xs"])
    return 0.5 * (carry + jnp.mean(ys, axis=0))
  if kind == "cond":
    return lax.cond(
      flag > 0,
      lambda a: run(body, params, a, flag),
      lambda a: run(node.bodies[1], params, a, flag),
      h,
    )
  if kind == "while":

    def cond_fun(state):
      return state[0] < flag + 1

    def body_fun(state):
      return state[0] + 1, run(body, params, state[1], flag)

    return lax.while_loop(cond_fun, body_fun, (jnp.int32(0), h))[1]
  if kind == "checkpoint":
    return jax.checkpoint(lambda ps, a: run(body, ps, a, flag))(params, h)
  if kind == "jit":
    return jax.jit(lambda ps, a, f: run(body, ps, a, f))(params, h, flag)
  if kind == "custom_jvp":
    f = lambda ps, a, fl: run(body, ps, a, fl)
    fun = jax.custom_jvp(f)

    @fun.defjvp
    def fun_jvp(primals, tangents):  # equal to autodiff
      return jax.jvp(f, primals, tangents)

    return fun(params, h, flag)
  if kind == "custom_vjp":
    f = lambda ps, a, fl: run(body, ps, a, fl)
    fun = jax.custom_vjp(f)

    def fwd(ps, a, fl):
      return f(ps, a, fl), (ps, a, fl)

    def bwd(residuals, g):  # equal to autodiff
      return jax.vjp(f, *residuals)[1](g)

    fun.defvjp(fwd, bwd)
    return fun(params, h, flag)
  raise ValueError(kind)


# ------------------------------------------------------------------------------------------------
# Strategies.


def _layers(
  depth: int,
  min_size: int,
  max_size: int,
  allow_while: bool,
  nested_custom_vjp: bool,
  exclude: frozenset,
  top: bool = True,
):
  leaf = st.builds(lambda k: (k, ()), st.sampled_from([k for k in LEAF_KINDS if k not in exclude]))
  if depth == 0:
    node = leaf
  else:
    higher = tuple(
      k
      for k in HIGHER_KINDS
      if (allow_while or k != "while") and (top or nested_custom_vjp or k != "custom_vjp")
    )
    sub = _layers(depth - 1, 1, 2, allow_while, nested_custom_vjp, exclude, top=False)
    compound = st.tuples(st.sampled_from(higher), st.tuples(sub, sub)).map(
      lambda t: (t[0], t[1] if t[0] == "cond" else t[1][:1])
    )
    node = st.one_of(leaf, compound)
  return st.lists(node, min_size=min_size, max_size=max_size)


def _number(raw, counter):
  """Raw ``(kind, bodies)`` tuples to ``Node`` objects with unique parameter indices."""
  layers = []
  for kind, bodies in raw:
    index = next(counter)
    layers.append(Node(kind, index, tuple(_number(b, counter) for b in bodies)))
  return tuple(layers)


@st.composite
def programs(
  draw,
  *,
  max_layers: int = 5,
  depth: int = 2,
  allow_while: bool = True,
  smooth: bool = False,
  nested_custom_vjp: bool = True,
  force_nested_custom_vjp: bool = False,
  exclude=(),
) -> Program:
  """A random program, starting with a dense layer.

  Args:
    max_layers: at most this many top-level layers.
    depth: how deep higher-order ops nest.
    allow_while: include ``lax.while_loop`` (it has no reverse-mode derivative).
    smooth: no kinks (see the module docstring), for gradient comparisons.
    nested_custom_vjp: allow ``custom_vjp`` inside other higher-order ops (not only at the top).
    force_nested_custom_vjp: end with a ``custom_vjp`` inside a jit, scan, cond or checkpoint.
    exclude: leaf kinds not to use.
  """
  raw = draw(_layers(depth, 1, max_layers - 1, allow_while, nested_custom_vjp, frozenset(exclude)))
  if force_nested_custom_vjp:
    outer = draw(st.sampled_from(("jit", "scan", "cond", "checkpoint")))
    leaf = draw(st.sampled_from(LEAF_KINDS))
    inner = (("custom_vjp", (((leaf, ()),),)),)  # a body holding one custom_vjp of one leaf
    raw = [*raw, (outer, (inner, (("tanh", ()),)) if outer == "cond" else (inner,))]
  seed = draw(st.integers(0, 2**16))
  # The first layer is a dense layer, as in a model's input projection, so that low-precision
  # values flow through the whole program.
  return Program(_number([("dense", ())] + raw, itertools.count()), seed, smooth)


def program_with_every_kind(
  *, allow_while: bool = True, smooth: bool = False, seed: int = 7, exclude=()
) -> Program:
  """One program using every layer kind once, each higher-order kind around two leaves.

  Property tests run it as an explicit example, so every kind is covered whatever is drawn.
  """
  leaves = iter([k for k in LEAF_KINDS[1:] if k not in exclude])  # it starts with "dense"
  raw = [("dense", ())]
  for kind in HIGHER_KINDS:
    if kind == "while" and not allow_while:
      continue
    body = tuple((next(leaves, "tanh"), ()) for _ in range(2))
    bodies = (body, ((next(leaves, "tanh"), ()),)) if kind == "cond" else (body,)
    raw.append((kind, bodies))
  raw.extend((kind, ()) for kind in leaves)
  return Program(_number(raw, itertools.count()), seed, smooth)
