"""Trace + lower time of a policy with rules and overrides against the built-in policy.

    python -m benchmarks.bench_overrides                 # depths 8,32, 5 repetitions: ~40 s
    python -m benchmarks.bench_overrides --depths 2 --reps 1  # a smoke test: ~15 s
    python -m benchmarks.bench_overrides --markdown      # the table in docs/benchmarks.md

The transformer LM of ``benchmarks/models.py`` (unrolled blocks ``Block_0``, ``Block_1``, ...),
``jax.jit(jax.value_and_grad(loss))`` traced and lowered from cold caches, variants interleaved
in alternating order (``trace_depth.time_once``), median of ``--reps``:

* ``built-in``: ``jaxamp.autocast(loss, device_type="cuda")``;
* ``same program``: ``autocast(loss, policy=jaxamp.policy("cuda").with_rules(SAME_RULES),
  overrides=SAME_OVERRIDES)``: a derived policy (a row the model does not use changed) and
  overrides that match every eqn of the model with the policy it has anyway, so the program is
  the built-in one and the difference is what rules and overrides cost: each eqn's place
  matched, each overridden eqn evaluated under its override's policy;
* ``router-style``: softmax in float16, the LM head in float32, the first block with autocast
  off, attention in bfloat16 (``RULES``, ``OVERRIDES``): another program (converts at the
  boundaries of the bfloat16 and float32 parts, fewer float32 softmaxes), shown for context.

Target: ``same program`` trace + lower <= 1.10x the built-in's (printed as ok / MISSED, never
asserted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax.numpy as jnp

import jaxamp
from benchmarks import common, models, trace_depth

TARGET = 1.10
SAME_RULES = {"cumsum": jaxamp.Category.LOWER}  # the LM computes no cumsum
SAME_OVERRIDES = {"Block_*": jnp.float16, "TransformerLM/Dense_0": jnp.float16}
RULES = {"softmax": jaxamp.Category.LOWER}
OVERRIDES = {
  "TransformerLM/Dense_0": jnp.float32,  # the LM head (the blocks' are Block_i/Dense_0)
  "Block_0": None,
  "MultiHeadDotProductAttention_*": jnp.bfloat16,
}
VARIANTS = ("built-in", "same program", "router-style")


def variants(depth: int, model: dict) -> dict[str, models.Task]:
  base = models.lm_task(None, layers=depth, **model)
  same = jaxamp.policy("cuda").with_rules(SAME_RULES)
  other = jaxamp.policy("cuda").with_rules(RULES)
  return {
    "built-in": _task(base, jaxamp.autocast(base.loss, device_type="cuda")),
    "same program": _task(base, jaxamp.autocast(base.loss, policy=same, overrides=SAME_OVERRIDES)),
    "router-style": _task(base, jaxamp.autocast(base.loss, policy=other, overrides=OVERRIDES)),
  }


def _task(base: models.Task, wrapped) -> models.Task:
  def loss(params, state, batch):
    value, new_state = wrapped(params, state, batch)
    return value.astype(jnp.float32), new_state

  return models.Task(base.name, loss, base.params, base.state, base.batch)


def run(depths, reps: int, model: dict) -> dict[int, dict[str, float]]:
  """depth -> variant -> median trace + lower seconds."""
  results = {}
  for i, depth in enumerate(depths):
    tasks = variants(depth, model)
    if i == 0:  # warm-up: imports and first traces
      for task in tasks.values():
        trace_depth.time_once(task, compile_=False)
    times = {name: [] for name in tasks}
    for rep in range(reps):
      for name in list(tasks) if rep % 2 == 0 else list(reversed(tasks)):
        t = trace_depth.time_once(tasks[name], compile_=False)
        times[name].append(t["trace"] + t["lower"])
    results[depth] = {name: statistics.median(v) for name, v in times.items()}
  return results


def report(results: dict, markdown: bool = False) -> str:
  title = "trace + lower: policies with rules and overrides against the built-in (lm, cuda)"
  rows = []
  for depth, by_name in results.items():
    base, same, other = (by_name[name] for name in VARIANTS)
    rows.append(
      [
        depth,
        common.ms(base),
        common.ms(same),
        f"{same / base:.2f}x",
        f"<= {TARGET:.2f}x",
        common.target_mark(same / base, TARGET),
        common.ms(other),
        f"{other / base:.2f}x",
      ]
    )
  header = ["layers", "built-in", "same program", "ratio", "target", "status"]
  header += ["router-style", "ratio"]
  heading = f"### {title}" if markdown else f"== {title} =="
  note = "median ms (wall) of cold jit(value_and_grad(loss)).trace().lower()"
  return "\n".join([heading, "", note, common.table(header, rows, markdown)])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--depths", default="8,32", help="comma-separated numbers of layers")
  p.add_argument("--reps", type=int, default=5, help="cold trace+lower repetitions (median)")
  p.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = p.parse_args(argv)
  started = time.perf_counter()
  depths = [int(d) for d in args.depths.split(",") if d.strip()]
  results = run(depths, max(1, args.reps), dict(trace_depth.MODEL))
  print(report(results, args.markdown))
  print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
