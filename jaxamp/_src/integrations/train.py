"""Ready-made mixed-precision train steps for flax: linen ``TrainState`` and ``nnx.Optimizer``.

Each helper turns a loss function into a train step that autocasts the forward pass, scales the
loss when the optimizer contains ``jaxamp.dynamic_loss_scale`` (and does not when it does not),
differentiates, updates, and returns metrics. The steps are plain functions: wrap them in
``jax.jit`` (linen) or ``nnx.jit`` (nnx). Gradient accumulation works by putting
``jaxamp.multi_steps`` around the scaler in the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._src.autocast import transform as autocast_lib
from jaxamp._src.integrations import state_tree
from jaxamp._src.reports import nonfinite
from jaxamp._src.scaler import grad_scaler, loss_scale

Metrics = dict[str, Any]


def _scaler_state(opt_state: Any) -> loss_scale.DynamicLossScaleState | None:
  """The one scaler state inside ``opt_state``, or None when the optimizer has no scaler."""
  found = state_tree.tree_find_nodes(opt_state, loss_scale.DynamicLossScaleState)
  if len(found) > 1:
    raise ValueError(
      f"the optimizer state holds {len(found)} `dynamic_loss_scale` states; the train step "
      "helpers support one scaler per optimizer."
    )
  return found[0] if found else None


def _plain(tree: Any) -> Any:
  """``tree`` with every ``nnx.Variable`` replaced by the array it holds."""
  return jax.tree.map(state_tree.tree_unwrap, tree, is_leaf=state_tree.is_variable)


def _split_loss(out: Any) -> tuple[jax.Array, Any, bool]:
  """``(loss, aux, has_aux)`` from what a loss function returned: ``loss`` or ``(loss, aux)``."""
  if isinstance(out, tuple | list):
    if len(out) != 2:
      raise ValueError(
        f"the loss function must return a scalar loss or a pair (loss, aux); got a "
        f"{type(out).__name__} of length {len(out)}."
      )
    loss, aux = out
    has_aux = True
  else:
    loss, aux, has_aux = out, None, False
  if jnp.ndim(loss) != 0 or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise ValueError(
      "the loss must be a floating-point scalar; got shape "
      f"{jnp.shape(loss)} and dtype {jnp.result_type(loss)}."
    )
  return jnp.asarray(loss).astype(jnp.float32), aux, has_aux


def _forward(loss_fn: Callable, enabled: bool, **options: Any) -> Callable:
  return autocast_lib.autocast(loss_fn, enabled=enabled, **options)


def _metrics(loss: jax.Array, aux: Any, has_aux: bool, opt_state: Any) -> Metrics:
  """loss, and the scaler's scale, found_inf and skipped_steps after the update (or neutral)."""
  scaler = _scaler_state(opt_state)
  if scaler is None or not scaler.enabled:
    metrics = {
      "loss": loss,
      "scale": jnp.ones([], jnp.float32),
      "found_inf": jnp.array(False),
      "skipped_steps": jnp.zeros([], jnp.int32),
    }
  else:
    unwrap = state_tree.tree_unwrap
    metrics = {
      "loss": loss,
      "scale": grad_scaler.get_scale(scaler),
      "found_inf": jnp.asarray(unwrap(scaler.found_inf)),
      "skipped_steps": jnp.asarray(unwrap(scaler.skipped_steps)),
    }
  if has_aux:
    metrics["aux"] = aux
  return metrics


def make_train_step(
  loss_fn: Callable[..., Any],
  *,
  device_type: str | None = None,
  dtype: Any = None,
  enabled: bool = True,
  nonfinite_report: bool = False,
  policy: Any = None,
  overrides: Any = None,
) -> Callable[..., tuple[Any, Metrics]]:
  """A mixed-precision train step for a flax ``TrainState`` (or any state with its interface).

  ``loss_fn(params, batch, *args, **kwargs)`` returns a scalar loss or ``(loss, aux)``. The
  returned ``step(state, batch, *args, **kwargs) -> (state, metrics)``:

  1. runs ``loss_fn`` under ``jaxamp.autocast(device_type=..., dtype=...)`` (not at all when
     ``enabled=False``: the float32 baseline);
  2. multiplies the loss by the loss scale if ``state.opt_state`` holds a
     ``jaxamp.dynamic_loss_scale`` state (an optimizer without one is used as it is: bfloat16
     needs no scaling), and takes the gradients with respect to ``params``;
  3. calls ``state.apply_gradients(grads=grads)``, which unscales, skips non-finite steps and
     updates the scale inside the optimizer.

  ``metrics`` is a dict of arrays: ``loss`` (float32, unscaled), ``scale`` (the loss scale after
  the update, 1.0 without a scaler), ``found_inf`` (whether the scaler's last update was skipped),
  ``skipped_steps`` (skipped updates so far) and ``aux`` when ``loss_fn`` returned one. With
  ``jaxamp.multi_steps`` around the scaler, ``found_inf`` and ``scale`` change only when an
  accumulated step is applied.

  ``nonfinite_report=True`` adds ``metrics["nonfinite_report"]``, the ``jaxamp.NonfiniteReport``
  of the gradients as the scaler checks them: of the scaled loss, before unscaling (plain
  gradients without a scaler). Its non-finite leaves are exactly the ones that set ``found_inf``,
  and ``print(metrics["nonfinite_report"])`` names them, worst first: the layer where the float16
  backward pass overflowed. Unscaling would not change the counts (a finite factor keeps Inf and
  NaN), but the scaled ``max_finite`` shows the headroom left below float16's 65504; divide it by
  the scale the step used (the previous step's ``scale``) for the gradient's own magnitude.

  Example::

    model = MLP()
    tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
    state = TrainState.create(apply_fn=model.apply, params=model.init(key, x)["params"], tx=tx)

    def loss_fn(params, batch):
      logits = model.apply({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = jax.jit(jaxamp.make_train_step(loss_fn, device_type="cuda"))  # float16
    state, metrics = step(state, batch)

  Extra arguments of ``step`` go to ``loss_fn`` (a dropout key, BatchNorm statistics: return the
  new ``batch_stats`` as ``aux`` and ``state.replace(batch_stats=metrics["aux"])``).

  Args:
    loss_fn: ``(params, batch, *args, **kwargs) -> loss`` or ``(loss, aux)``.
    device_type: the autocast policy, "cuda" (float16), "cpu" (bfloat16) or "xpu"; None: the
      default backend's, as for ``jaxamp.autocast``.
    dtype: the low-precision dtype; None: the device type's default.
    enabled: False trains in the dtypes the model was written in (no autocast).
    nonfinite_report: add the gradients' ``jaxamp.NonfiniteReport`` to the metrics (one fused
      pass over the gradients, about the cost of the scaler's finite check).
    policy: a ``jaxamp.Policy`` instead of ``device_type`` and ``dtype``, as for ``autocast``.
    overrides: parts of the model run under another dtype or policy, or with autocast off, as
      for ``autocast``.

  Returns:
    ``step(state, batch, *args, **kwargs) -> (new_state, metrics)``, jit-compatible.
  """
  forward = _forward(
    loss_fn, enabled, device_type=device_type, dtype=dtype, policy=policy, overrides=overrides
  )

  def step(state: Any, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, Metrics]:
    scaled = _scaler_state(state.opt_state) is not None
    has_aux_box: list[bool] = []

    def objective(params: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
      loss, aux, has_aux = _split_loss(forward(params, batch, *args, **kwargs))
      has_aux_box.append(has_aux)
      objective_value = grad_scaler.scale_loss(loss, state.opt_state) if scaled else loss
      return objective_value, (loss, aux)

    grads, (loss, aux) = jax.grad(objective, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    metrics = _metrics(loss, aux, has_aux_box[0], state.opt_state)
    if nonfinite_report:
      metrics["nonfinite_report"] = nonfinite.nonfinite_report(grads)
    return state, metrics

  return step


def make_nnx_train_step(
  loss_fn: Callable[..., Any],
  *,
  device_type: str | None = None,
  dtype: Any = None,
  enabled: bool = True,
  nonfinite_report: bool = False,
  policy: Any = None,
  overrides: Any = None,
) -> Callable[..., Metrics]:
  """A mixed-precision train step for an nnx model and its ``nnx.Optimizer``.

  ``loss_fn(model, batch, *args, **kwargs)`` returns a scalar loss or ``(loss, aux)``. The
  returned ``step(model, optimizer, batch, *args, **kwargs) -> metrics`` updates ``model`` and
  ``optimizer`` in place:

  1. runs ``loss_fn`` under ``jaxamp.autocast`` (the model is passed straight in, so its state
     updates, e.g. BatchNorm running statistics and RNG counters, are kept, in float32);
  2. scales the loss if ``optimizer`` holds a ``jaxamp.dynamic_loss_scale`` state (otherwise
     trains unscaled) and takes the gradients of the ``nnx.Param`` variables with
     ``nnx.value_and_grad``;
  3. calls ``optimizer.update(model, grads)``: unscale, skip non-finite steps, update the scale.

  ``metrics`` is the dict described in ``make_train_step``. The optimizer must be created with
  ``wrt=nnx.Param``.

  Example::

    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.dynamic_loss_scale(optax.adam(1e-3)), wrt=nnx.Param)

    def loss_fn(model, batch):
      logits = model(batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = nnx.jit(jaxamp.make_nnx_train_step(loss_fn, device_type="cuda"))
    metrics = step(model, optimizer, batch)

  Args:
    loss_fn: ``(model, batch, *args, **kwargs) -> loss`` or ``(loss, aux)``.
    device_type: the autocast policy, as for ``make_train_step``.
    dtype: the low-precision dtype; None: the device type's default.
    enabled: False trains in the dtypes the model was written in (no autocast).
    nonfinite_report: add the gradients' ``jaxamp.NonfiniteReport`` (paths as in the gradient
      ``nnx.State``) to the metrics, as for ``make_train_step``.
    policy: a ``jaxamp.Policy`` instead of ``device_type`` and ``dtype``, as for ``autocast``.
    overrides: by place, as for ``autocast`` (nnx submodules by attribute path or class).

  Returns:
    ``step(model, optimizer, batch, *args, **kwargs) -> metrics``; use it under ``nnx.jit``.
  """
  from flax import nnx

  forward = _forward(
    loss_fn, enabled, device_type=device_type, dtype=dtype, policy=policy, overrides=overrides
  )

  def step(model: Any, optimizer: Any, batch: Any, *args: Any, **kwargs: Any) -> Metrics:
    scaler = _scaler_state(optimizer.opt_state)
    scaler = None if scaler is None else _plain(scaler)  # arrays, not the optimizer's Variables
    has_aux_box: list[bool] = []

    # The extra arguments go through value_and_grad, not a closure: nnx objects among them (an
    # nnx.Rngs for dropout) may then update their state inside the gradient's trace.
    def objective(
      model: Any, batch: Any, args: tuple, kwargs: dict
    ) -> tuple[jax.Array, tuple[jax.Array, Any]]:
      loss, aux, has_aux = _split_loss(forward(model, batch, *args, **kwargs))
      has_aux_box.append(has_aux)
      objective_value = loss if scaler is None else grad_scaler.scale_loss(loss, scaler)
      return objective_value, (loss, aux)

    grad_fn = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
    (_, (loss, aux)), grads = grad_fn(model, batch, args, kwargs)
    optimizer.update(model, grads)
    metrics = _metrics(loss, aux, has_aux_box[0], optimizer.opt_state)
    if nonfinite_report:
      metrics["nonfinite_report"] = nonfinite.nonfinite_report(grads)
    return metrics

  return step
