"""Gradient accumulation that survives a non-finite micro-batch, for use around the scaler."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.scaler import loss_scale


def multi_steps(
  inner: optax.GradientTransformation, every_k_schedule
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps`` whose accumulator restarts from zero after every emitted step.

  Put it around ``dynamic_loss_scale`` to get torch's accumulation behaviour: the scaler sees the
  accumulated gradients once per ``every_k_schedule`` micro-batches, and one non-finite
  micro-batch skips the whole accumulated step. optax's own ``MultiSteps`` resets its
  accumulator by multiplying it with 0, which keeps a NaN: every later step would be skipped.

  Args:
    inner: the transformation to apply every k micro-batches (usually the scaler).
    every_k_schedule: k, or a schedule of k, as for ``optax.MultiSteps``.

  Returns:
    A transformation whose state is an ``optax.MultiStepsState``.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"`inner` must be an optax GradientTransformation, got {type(inner).__name__}: {inner!r}."
    )
  if isinstance(every_k_schedule, numbers.Integral) and not isinstance(every_k_schedule, bool):
    if every_k_schedule < 1:
      raise ValueError(
        f"`every_k_schedule` must be an int >= 1 or a schedule, got {every_k_schedule!r}."
      )
    every_k_schedule = int(every_k_schedule)
  elif not callable(every_k_schedule):
    raise TypeError(
      f"`every_k_schedule` must be an int >= 1 or a schedule (a callable of the "
      f"step), got {type(every_k_schedule).__name__}: {every_k_schedule!r}."
    )
  accumulate = optax.MultiSteps(inner, every_k_schedule)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = accumulate.update(updates, state, params, **extra_args)
    restart = state.mini_step == 0
    acc_grads = jax.tree.map(lambda a: jnp.where(restart, jnp.zeros_like(a), a), state.acc_grads)
    return jax.tree.map(lambda u: _unless_emitted(restart, u), updates), state._replace(
      acc_grads=acc_grads
    )

  return optax.GradientTransformationExtraArgs(accumulate.init, update_fn)


def _unless_emitted(emitted: jax.Array, update: jax.Array) -> jax.Array:
  """-0.0 on micro-steps, where MultiSteps gives +0.0: ``param + -0.0`` is ``param`` bit for bit."""
  if not jnp.issubdtype(update.dtype, jnp.inexact):
    return update
  return jnp.where(emitted, update, loss_scale.no_op_fill(update.dtype))
