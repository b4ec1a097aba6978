"""torch's ``GradScaler`` methods as functions of the optimizer state.

Each takes the optimizer state of a ``jaxamp.dynamic_loss_scale`` transform, or any tree holding
it (an ``optax.chain`` / ``MultiSteps`` / ``inject_hyperparams`` state, a flax ``TrainState``, an
``nnx.Optimizer``); the setters and ``load_state_dict`` return the new state.

=====================================  ===================================================
torch                                  jaxamp
=====================================  ===================================================
``scaler.get_scale()``                 ``jaxamp.scaler.get_scale(opt_state)``
``scaler.update(new_scale)``           ``jaxamp.scaler.set_scale(opt_state, new_scale)``
``scaler.get_growth_factor()``         ``jaxamp.scaler.get_growth_factor(opt_state)``
``scaler.set_growth_factor(f)``        ``jaxamp.scaler.set_growth_factor(opt_state, f)``
``scaler.get_backoff_factor()``        ``jaxamp.scaler.get_backoff_factor(opt_state)``
``scaler.set_backoff_factor(f)``       ``jaxamp.scaler.set_backoff_factor(opt_state, f)``
``scaler.get_growth_interval()``       ``jaxamp.scaler.get_growth_interval(opt_state)``
``scaler.set_growth_interval(n)``      ``jaxamp.scaler.set_growth_interval(opt_state, n)``
``scaler.is_enabled()``                ``jaxamp.scaler.is_enabled(opt_state)``
``scaler.state_dict()``                ``jaxamp.scaler.state_dict(opt_state)``
``scaler.load_state_dict(d)``          ``jaxamp.scaler.load_state_dict(opt_state, d)``
=====================================  ===================================================

``EmptyStateDictError`` is what ``load_state_dict`` raises for an empty dict (torch's
``RuntimeError``). ``scale``, ``unscale_`` and ``step``/``update`` are ``jaxamp.scale_loss``,
``jaxamp.unscale`` and the transform's ``update``.
"""

from jaxamp._src.scaler.grad_scaler import (
  EmptyStateDictError,
  get_backoff_factor,
  get_growth_factor,
  get_growth_interval,
  get_scale,
  is_enabled,
  load_state_dict,
  set_backoff_factor,
  set_growth_factor,
  set_growth_interval,
  set_scale,
  state_dict,
)

__all__ = [
  "EmptyStateDictError",
  "get_backoff_factor",
  "get_growth_factor",
  "get_growth_interval",
  "get_scale",
  "is_enabled",
  "load_state_dict",
  "set_backoff_factor",
  "set_growth_factor",
  "set_growth_interval",
  "set_scale",
  "state_dict",
]
