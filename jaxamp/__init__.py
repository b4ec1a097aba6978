"""jaxamp: torch.amp's automatic mixed precision for JAX.

``autocast`` runs a function with each primitive in the dtype torch's autocast uses for that op;
``dynamic_loss_scale`` is torch's GradScaler as an optax transformation.
"""

from jaxamp import functional
from jaxamp._src.accumulation import multi_steps
from jaxamp._src.autocast import autocast, custom_bwd, custom_fwd
from jaxamp._src.caches import clear_caches
from jaxamp._src.explain import Decision, Explanation, explain
from jaxamp._src.loss_scale import (
    DynamicLossScaleState,
    EmptyStateDictError,
    dynamic_loss_scale,
    get_backoff_factor,
    get_growth_factor,
    get_growth_interval,
    get_scale,
    is_enabled,
    load_state_dict,
    scale_loss,
    set_backoff_factor,
    set_growth_factor,
    set_growth_interval,
    set_scale,
    state_dict,
    unscale,
)
from jaxamp._src.policy import Category, get_autocast_dtype, is_autocast_available
from jaxamp._src.regions import autocast_disabled, register_op
from jaxamp._src.train import make_nnx_train_step, make_train_step

__version__ = "0.1.0"

__all__ = (
    "Category",
    "Decision",
    "Explanation",
    "DynamicLossScaleState",
    "EmptyStateDictError",
    "dynamic_loss_scale",
    "explain",
    "get_backoff_factor",
    "get_growth_factor",
    "get_growth_interval",
    "get_scale",
    "load_state_dict",
    "make_nnx_train_step",
    "make_train_step",
    "multi_steps",
    "scale_loss",
    "set_backoff_factor",
    "set_growth_factor",
    "set_growth_interval",
    "set_scale",
    "state_dict",
    "unscale",
    "functional",
    "autocast",
    "autocast_disabled",
    "clear_caches",
    "custom_bwd",
    "custom_fwd",
    "get_autocast_dtype",
    "is_autocast_available",
    "is_enabled",
    "register_op",
)
