"""A data-parallel train step with float32 gradient reductions
(``jaxamp._src.autocast.weight_grads``) against the old 16-bit ones, side by side.

    python -m benchmarks.bench_gradient_reductions             # ~2-3 min on a 2-core CPU
    python -m benchmarks.bench_gradient_reductions --quick     # smaller models, fewer repetitions
    python -m benchmarks.bench_gradient_reductions --models mlp,lm --policies cuda --devices 8

The step is ``jax.jit`` of ``value_and_grad`` + SGD, the batch sharded over a "data" mesh axis of
``--devices`` virtual CPU devices (set before JAX starts), params replicated. For each model
(``mlp``: 4 flax Dense layers; ``lm`` and ``conv``: the models of ``benchmarks/models.py``) and
policy, "old" runs under ``weight_grads.disabled()`` (a cast-down parameter's gradient comes out
of a 16-bit matmul, reduced in 16 bits) and "new" as jaxamp runs now. Measured, variants
interleaved in alternating order:

* compile: trace + lower + XLA compile from cold caches (JAX's and jaxamp's), median of
  ``--compile-reps``;
* step: the compiled step on the same inputs, median over ``--rounds`` of the mean of
  ``--per-round`` calls;
* the dtypes of the all-reduce / reduce-scatter ops in the compiled HLO.

Prints new/old ratios. No timing is asserted anywhere. On CPU, XLA runs every 16-bit dot in
float32 anyway, so the step times compare the programs' extra work (converts, wider
all-reduces), not tensor-core throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="small models, few repetitions")
  p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (data axis)")
  p.add_argument("--models", default="mlp,lm,conv", help="of mlp, lm, conv")
  p.add_argument("--policies", default="cuda,cpu", help="autocast device types")
  p.add_argument("--compile-reps", type=int, default=None)
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--per-round", type=int, default=3)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  flag = f"--xla_force_host_platform_device_count={args.devices}"
  if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  compile_reps = args.compile_reps or (1 if args.quick else 3)
  rounds = args.rounds or (3 if args.quick else 7)
  policies = [p.strip() for p in args.policies.split(",") if p.strip()]
  names = [m.strip() for m in args.models.split(",") if m.strip()]
  print(
    f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
    f"{os.cpu_count()} CPUs; command: python -m benchmarks.bench_gradient_reductions "
    + " ".join(sys.argv[1:] if argv is None else argv)
  )
  header = (
    f"{'model':<6} {'policy':<6} {'compile old ms':>14} {'new ms':>8} {'ratio':>6} "
    f"{'step old ms':>11} {'new ms':>8} {'ratio':>6}  all-reduce dtypes old -> new"
  )
  print(header)
  for name in names:
    for policy in policies:
      row = compare(MODELS[name](args.quick), policy, compile_reps, rounds, args.per_round)
      compile_, step_ = row["compile"], row["step"]
      print(
        f"{name:<6} {policy:<6} {compile_['old'] * 1e3:>14.1f} {compile_['new'] * 1e3:>8.1f} "
        f"{compile_['new'] / compile_['old']:>5.2f}x {step_['old'] * 1e3:>11.2f} "
        f"{step_['new'] * 1e3:>8.2f} {step_['new'] / step_['old']:>5.2f}x  "
        f"{','.join(row['dtypes']['old'])} -> {','.join(row['dtypes']['new'])}",
        flush=True,
      )
  return 0


# --- models: (params, state, batch, loss(params, state, batch) -> (loss, state)) -----------------


def mlp(quick: bool):
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  width, batch = (128, 64) if quick else (512, 256)

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(3):
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(10)(x)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
  model = MLP()
  params = model.init(jax.random.key(0), x[:1])

  def loss(params, state, batch):
    x, y = batch
    logits = model.apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state

  return params, {}, (x, y), loss


def lm(quick: bool):
  from benchmarks import models

  size = dict(layers=1, d_model=64, heads=2, seq=32, batch=16, vocab=256) if quick else {}
  task = models.lm_task(None, **{**dict(batch=16), **size})
  return task.params, task.state, task.batch, task.loss


def conv(quick: bool):
  from benchmarks import models

  task = models.conv_task(None, batch=16, features=(8, 16, 16, 32) if quick else (32, 64, 64, 128))
  return task.params, task.state, task.batch, task.loss


MODELS = {"mlp": mlp, "lm": lm, "conv": conv}


# --- measuring -----------------------------------------------------------------------------------

COLLECTIVE = re.compile(
  r"^\s*(?:ROOT )?%\S+ = (.*) (all-reduce|all-reduce-start|reduce-scatter)\(", re.MULTILINE
)


def reduced_dtypes(hlo: str) -> list[str]:
  """The element types of the all-reduce / reduce-scatter results in compiled HLO text."""
  return sorted(
    {d for shapes, _ in COLLECTIVE.findall(hlo) for d in re.findall(r"\b([a-z]+[0-9]+)\[", shapes)}
  )


def compare(model, policy: str, compile_reps: int, rounds: int, per_round: int) -> dict:
  """Compile time, step time and reduction dtypes of the step, old and new, interleaved."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxamp
  from benchmarks import common
  from jaxamp._src.autocast import weight_grads

  params, state, batch, loss = model
  auto = (jax.sharding.AxisType.Auto,)  # XLA places the collectives, as in a plain jit
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params, state = jax.device_put((params, state), replicated)
  batch = jax.device_put(batch, data)
  tx = optax.sgd(1e-3)
  opt_state = jax.device_put(tx.init(params), replicated)
  autocast_loss = jaxamp.autocast(loss, device_type=policy)

  def step(params, state, opt_state, batch):
    (value, state), grads = jax.value_and_grad(autocast_loss, has_aux=True)(params, state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, value

  def mode(name: str):
    return weight_grads.disabled() if name == "old" else contextlib.nullcontext()

  def build(name: str):
    common.clear_all_caches()
    jaxamp.clear_caches()
    with mode(name):
      start = time.perf_counter()
      jitted = jax.jit(
        step,
        in_shardings=(replicated, replicated, replicated, data),
        out_shardings=(replicated, replicated, replicated, replicated),
      )
      compiled = jitted.lower(params, state, opt_state, batch).compile()
      return time.perf_counter() - start, compiled

  compile_times = {"old": [], "new": []}
  compiled = {}
  for rep in range(compile_reps):
    for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
      seconds, compiled[name] = build(name)
      compile_times[name].append(seconds)
  steps = {name: (lambda c=c: c(params, state, opt_state, batch)) for name, c in compiled.items()}
  step_times = common.interleaved_median(steps, rounds=rounds, per_round=per_round)
  return {
    "compile": {name: statistics.median(t) for name, t in compile_times.items()},
    "step": step_times,
    "dtypes": {name: reduced_dtypes(c.as_text()) for name, c in compiled.items()},
  }


if __name__ == "__main__":
  sys.exit(main())
