"""jaxamp: torch.amp's automatic mixed precision for JAX.

``autocast`` runs a function with each primitive in the dtype torch's autocast uses for that op;
``dynamic_loss_scale`` is torch's GradScaler as an optax transformation, and ``jaxamp.scaler`` has
the rest of GradScaler's methods as functions of the optimizer state.
"""

from jaxamp import functional, scaler
from jaxamp._src.autocast.regions import autocast_disabled, register_op
from jaxamp._src.autocast.transform import autocast, custom_bwd, custom_fwd
from jaxamp._src.caches import clear_caches
from jaxamp._src.integrations.accumulation import multi_steps
from jaxamp._src.integrations.train import make_nnx_train_step, make_train_step
from jaxamp._src.policies.edit import Change, Diff
from jaxamp._src.policies.policy import Policy, get_autocast_dtype, is_autocast_available
from jaxamp._src.policies.policy import builtin_policy as policy
from jaxamp._src.policies.table import Category
from jaxamp._src.reports.explain import Decision, Explanation, explain
from jaxamp._src.reports.nonfinite import LeafStats, NonfiniteReport, nonfinite_report
from jaxamp._src.reports.precision import PrecisionEntry, PrecisionReport, precision_report
from jaxamp._src.scaler.grad_scaler import scale_loss, unscale
from jaxamp._src.scaler.loss_scale import DynamicLossScaleState, dynamic_loss_scale

__version__ = "0.1.0"

__all__ = (
  "Category",
  "Change",
  "Decision",
  "Diff",
  "DynamicLossScaleState",
  "Explanation",
  "LeafStats",
  "NonfiniteReport",
  "Policy",
  "PrecisionEntry",
  "PrecisionReport",
  "autocast",
  "autocast_disabled",
  "clear_caches",
  "custom_bwd",
  "custom_fwd",
  "dynamic_loss_scale",
  "explain",
  "functional",
  "get_autocast_dtype",
  "is_autocast_available",
  "make_nnx_train_step",
  "make_train_step",
  "multi_steps",
  "nonfinite_report",
  "policy",
  "precision_report",
  "register_op",
  "scale_loss",
  "scaler",
  "unscale",
)


def __getattr__(name: str) -> object:
  """Names the JAX spelling of torch's names and the new home of the moved GradScaler accessors."""
  if name in scaler.__all__:
    raise AttributeError(f"jaxamp.{name} moved to jaxamp.scaler.{name}")
  torch_spellings = {  # torch's names, answered with the JAX spelling
    "GradScaler": (
      "jaxamp has no GradScaler class: torch's GradScaler is an optax transformation here, "
      "`tx = jaxamp.dynamic_loss_scale(optax.adamw(...))`, with `jaxamp.scale_loss(loss, "
      "opt_state)` for `scaler.scale(loss)` and its other methods in `jaxamp.scaler` "
      "(`jaxamp.scaler.get_scale(opt_state)`, ...)"
    ),
    "amp": (
      "jaxamp is itself torch.amp: `jaxamp.autocast` is `torch.amp.autocast` and "
      "`jaxamp.dynamic_loss_scale` is `torch.amp.GradScaler`"
    ),
    "is_autocast_enabled": (
      "autocast is a function transformation, not a mode that code can query: a function runs "
      "under autocast by being wrapped in `jaxamp.autocast(f, ...)`, "
      "`jaxamp.explain(f, device_type=...)(*args)` shows the dtype each op gets, and "
      "`jaxamp.autocast_disabled()` is torch's `autocast(enabled=False)`"
    ),
    "cuda": (
      "jaxamp has no cuda module: torch.cuda.amp.autocast() is "
      '`jaxamp.autocast(f, device_type="cuda")` and torch.cuda.amp.GradScaler() is '
      "`jaxamp.dynamic_loss_scale(optax...)`"
    ),
  }
  if name in torch_spellings:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {torch_spellings[name]}.")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
