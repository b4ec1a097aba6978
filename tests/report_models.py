"""Functions the report tests (explain, precision_report) share."""

import jax
from jax import lax


def deep_model(x, w):
  """Long paths (a cond in a scan in a jit), long rules (bias adds, op regions), many torch ops:
  what makes a report's table wide."""

  def step(c, _):
    c = lax.cond(c.sum() > 0, lambda c: jax.nn.log_softmax(c @ w + 1.0), lambda c: c, c)
    return c, None

  h = jax.jit(lambda h: lax.scan(step, h, None, length=2)[0])(x)
  return jax.nn.gelu(h @ w).sum()
