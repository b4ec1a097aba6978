"""Section 5: ``dynamic_loss_scale(optax.adam)`` update against bare ``optax.adam``.

A parameter tree of a few big leaves and many small ones (>= 10M float32 parameters by default).
Each program is ``jit(update + apply_updates)``; the gradients are finite, so the scaler takes its
normal path (finite check, unscale, inner update, scale bookkeeping). Both run round-robin.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from benchmarks import common

TARGET = 1.05


def param_tree(
  big: int = 4, big_shape=(2048, 1024), small: int = 256, small_size: int = 8192, seed: int = 0
) -> dict:
  rng = np.random.default_rng(seed)
  tree = {
    f"big_{i}": jnp.asarray(rng.standard_normal(big_shape, np.float32) * 0.02) for i in range(big)
  }
  tree["small"] = [
    {
      "w": jnp.asarray(rng.standard_normal((small_size,), np.float32) * 0.02),
      "b": jnp.zeros((8,), jnp.float32),
    }
    for _ in range(small)
  ]
  return tree


def _finite_check_adam(learning_rate: float) -> optax.GradientTransformation:
  """Reference, not a scaler: adam plus the one finite check over all leaves that any correct
  skip-on-overflow needs (no unscale, no skip, no scale update), i.e. the cost floor of the check.
  The flag feeds adam's step count through a select so that XLA cannot drop the check."""
  adam = optax.adam(learning_rate)

  def update(grads, state, params=None):
    leaves = jax.tree.leaves(grads)
    found_inf = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
    updates, new_state = adam.update(grads, state, params)
    count = new_state[0].count
    new_state = (
      new_state[0]._replace(count=jnp.where(found_inf, count - 1, count)),
      *new_state[1:],
    )
    return updates, new_state

  return optax.GradientTransformation(adam.init, update)


def _program(tx, params, grads):
  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  jitted = jax.jit(update)
  opt_state = tx.init(params)
  start = time.perf_counter()
  compiled = jitted.lower(params, opt_state, grads).compile()
  return jitted, opt_state, compiled, time.perf_counter() - start


def run(
  *, big=4, big_shape=(2048, 1024), small=256, small_size=8192, rounds=9, per_round=3, log=print
) -> dict[str, Any]:
  params = param_tree(big, big_shape, small, small_size)
  n = sum(x.size for x in jax.tree.leaves(params))
  leaves = len(jax.tree.leaves(params))
  log(f"  {n / 1e6:.2f}M parameters in {leaves} leaves")
  grads = jax.tree.map(lambda p: p * 0.5 + 1e-3, params)
  scaled_grads = jax.tree.map(lambda g: g * 2.0**16, grads)
  programs = {
    "optax.adam": (optax.adam(1e-3), grads),
    "dynamic_loss_scale(adam)": (jaxamp.dynamic_loss_scale(optax.adam(1e-3)), scaled_grads),
    "dynamic_loss_scale(adam, enabled=False)": (
      jaxamp.dynamic_loss_scale(optax.adam(1e-3), enabled=False),
      grads,
    ),
    "reference: adam + finite check only": (_finite_check_adam(1e-3), grads),
  }
  funs, info = {}, {}
  for name, (tx, g) in programs.items():
    jitted, opt_state, compiled, compile_s = _program(tx, params, g)
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    info[name] = {
      "compile": compile_s,
      "temp_bytes": getattr(mem, "temp_size_in_bytes", float("nan")),
      "fusions": sum(1 for i in common.parse_hlo(hlo) if i["op"] == "fusion"),
      "conditionals": hlo.count(" conditional("),
    }
    funs[name] = lambda f=jitted, a=(params, opt_state, g): f(*a)
  medians = common.interleaved_median(funs, rounds=rounds, per_round=per_round)
  for name in programs:
    info[name]["step"] = medians[name]
  return {"params": n, "leaves": leaves, "results": info}


def report(res: dict, markdown: bool = False) -> str:
  base = res["results"]["optax.adam"]["step"]
  base_compile = res["results"]["optax.adam"]["compile"]
  rows = [
    [
      name,
      common.ms(r["step"]),
      common.ratio(r["step"], base),
      common.ms(r["compile"]),
      common.ratio(r["compile"], base_compile),
      r["fusions"],
      r["conditionals"],
      common.mib(r["temp_bytes"]),
    ]
    for name, r in res["results"].items()
  ]
  title = (
    f"5. optimizer update + apply_updates, jitted, {res['params'] / 1e6:.2f}M float32 "
    f"parameters in {res['leaves']} leaves, median ms"
  )
  return "\n".join(
    [
      ("### " if markdown else "== ") + "loss scaler" + ("" if markdown else " =="),
      "",
      title,
      common.table(
        [
          "optimizer",
          "update ms",
          "vs adam",
          "lower+compile ms",
          "vs adam",
          "HLO fusions",
          "conditionals",
          "XLA temp MiB",
        ],
        rows,
        markdown,
      ),
    ]
  )


def summary_rows(res: dict) -> list[list[Any]]:
  base = res["results"]["optax.adam"]["step"]
  scaled = res["results"]["dynamic_loss_scale(adam)"]["step"]
  r = scaled / base
  floor = res["results"]["reference: adam + finite check only"]["step"]
  return [
    [
      "optimizer",
      "-",
      "update ms (adam vs scaler)",
      f"{base * 1e3:.4g}",
      f"{scaled * 1e3:.4g}",
      f"{r:.2f}x",
      f"<= {TARGET:.2f}x",
      common.target_mark(r, TARGET),
    ],
    [
      "optimizer",
      "-",
      "update ms (adam + finite check vs scaler)",
      f"{floor * 1e3:.4g}",
      f"{scaled * 1e3:.4g}",
      f"{scaled / floor:.2f}x",
      "",
      "",
    ],
  ]
