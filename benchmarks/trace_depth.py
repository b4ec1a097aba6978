"""Trace / lower / XLA compile time of the transformer LM against its depth.

    python -m benchmarks.trace_depth                        # depths 2,8,32,64: ~4-5 min
    python -m benchmarks.trace_depth --depths 2,8 --reps 1  # a smoke test: ~40 s
    python -m benchmarks.trace_depth --no-compile           # trace and lower only: ~2 min
    python -m benchmarks.trace_depth --markdown             # the table in docs/benchmarks.md

For each depth (unrolled layers: a Python loop of blocks, not ``nn.scan``) and each policy, the
hand-written Flax model (``dtype=jnp.bfloat16`` / ``jnp.float16`` on every layer) is compared
with ``jaxamp.autocast`` of the float32 model (``device_type="cpu"`` / ``"cuda"``):
``jax.jit(jax.value_and_grad(loss, has_aux=True))``, then ``.trace()``, ``.lower()`` and
``.compile()`` timed separately from cold caches (``jax.clear_caches()`` and
``jaxamp.clear_caches()`` before every measurement), variants interleaved in alternating order.
Trace and lower: median of ``--reps`` (3); XLA compile, which takes ~4x as long as tracing and
does not depend on jaxamp's Python, in the first ``--compile-reps`` (1) of them. Process CPU
time is recorded beside wall time: tracing is single-threaded Python, so its CPU time is a check
against load from other processes on a shared machine. Trace time hardly depends on the array
sizes, so the model is small (d=64, seq 16, batch 2): the numbers measure Python-side tracing,
which grows with the depth.

Target: autocast's trace + lower <= 1.2x the hand-written model's, at every depth (printed as
ok / MISSED, never asserted). XLA's compile is shown beside it: it compiles different programs
(autocast follows torch's op lists), so its ratio is context, not the target.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import platform
import statistics
import sys
import time
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks import common, models

POLICIES = {"cpu": jnp.bfloat16, "cuda": jnp.float16}
TARGET = 1.20  # autocast trace + lower / hand-written trace + lower
DEFAULT_DEPTHS = (2, 8, 32, 64)
MODEL = dict(d_model=64, heads=2, seq=16, batch=2, vocab=128)
STAGES = ("trace", "lower", "compile", "cpu trace+lower")


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def clear_caches() -> None:
  """JAX's caches and jaxamp's: the next trace of anything is cold."""
  jax.clear_caches()
  jaxamp.clear_caches()


def variants(depth: int, policies, model: dict) -> dict[str, models.Task]:
  """name -> Task: per policy, ``flax <dtype>`` then ``autocast <device>``."""
  make = functools.partial(models.lm_task, layers=depth, **model)
  base = make(None)
  out = {}
  for device in policies:
    dtype = POLICIES[device]
    out[f"flax {jnp.dtype(dtype).name}"] = make(dtype)
    wrapped = jaxamp.autocast(base.loss, device_type=device)

    def autocast_loss(params, state, batch, wrapped=wrapped):
      value, new_state = wrapped(params, state, batch)
      return value.astype(jnp.float32), new_state

    out[f"autocast {device}"] = models.Task(
      base.name, autocast_loss, base.params, base.state, base.batch
    )
  return out


def pairs(policies) -> list[tuple[str, str, str]]:
  """(policy, hand-written variant, autocast variant)."""
  return [(d, f"flax {jnp.dtype(POLICIES[d]).name}", f"autocast {d}") for d in policies]


def time_once(task: models.Task, compile_: bool = True) -> dict[str, float]:
  """Cold trace, lower and (with ``compile_``) XLA compile of jit(value_and_grad(loss))."""
  clear_caches()
  gc.collect()  # the previous variant's garbage is not charged to this one
  fun = jax.jit(jax.value_and_grad(task.loss, has_aux=True))
  c0, t0 = time.process_time(), time.perf_counter()
  traced = fun.trace(task.params, task.state, task.batch)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2, c2 = time.perf_counter(), time.process_time()
  if compile_:
    lowered.compile()
  t3 = time.perf_counter()
  return {
    "trace": t1 - t0,
    "lower": t2 - t1,
    "compile": t3 - t2 if compile_ else None,
    "cpu trace+lower": c2 - c0,
  }


def run(
  depths=DEFAULT_DEPTHS,
  *,
  policies=("cpu", "cuda"),
  reps: int = 3,
  compile_reps: int = 1,
  model=None,
  log=log,
) -> dict[int, dict[str, dict[str, Any]]]:
  """depth -> variant -> {"times": stage -> [seconds], "median": stage -> seconds}.

  ``total`` is the median trace+lower plus the median compile (nan with ``compile_reps=0``)."""
  model = dict(MODEL, **(model or {}))
  start = time.perf_counter()
  results = {}
  for i, depth in enumerate(depths):
    tasks = variants(depth, policies, model)
    if i == 0:  # warm-up: imports, flax's and jaxamp's first traces, the backend
      for task in tasks.values():
        time_once(task, compile_=False)
    times = {name: {k: [] for k in STAGES} for name in tasks}
    for rep in range(max(1, reps, compile_reps)):
      order = list(tasks) if rep % 2 == 0 else list(reversed(tasks))
      for name in order:
        for k, v in time_once(tasks[name], compile_=rep < compile_reps).items():
          if v is not None:
            times[name][k].append(v)
    results[depth] = {}
    for name, stages in times.items():
      median = {k: statistics.median(v) if v else float("nan") for k, v in stages.items()}
      median["trace+lower"] = statistics.median(
        [t + lo for t, lo in zip(stages["trace"], stages["lower"], strict=True)]
      )
      median["total"] = median["trace+lower"] + median["compile"]
      results[depth][name] = {"times": stages, "median": median}
    log(f"  depth {depth} done ({time.perf_counter() - start:.0f} s)")
  return results


def report(results: dict, policies, markdown: bool = False) -> str:
  """Per depth and variant: trace, lower, compile, total (median ms); per policy the ratios."""
  title = "trace / lower / compile time against depth (transformer LM, unrolled layers)"
  times = next(iter(next(iter(results.values())).values()))["times"]
  reps, compile_reps = len(times["trace"]), len(times["compile"])
  out = [
    f"### {title}" if markdown else f"== {title} ==",
    "",
    f"jit(value_and_grad(loss)).trace / .lower / .compile, cold caches, median ms (wall) of "
    f"{reps} (compile: {compile_reps}); CPU: process CPU time of trace+lower",
  ]
  rows = []
  for depth, by_name in results.items():
    for name, res in by_name.items():
      m = res["median"]
      rows.append(
        [
          depth,
          name,
          common.ms(m["trace"]),
          common.ms(m["lower"]),
          common.ms(m["trace+lower"]),
          common.ms(m["cpu trace+lower"]),
          _ms(m["compile"]),
          _ms(m["total"]),
        ]
      )
  out.append(
    common.table(
      ["layers", "variant", "trace", "lower", "trace+lower", "CPU", "XLA compile", "total"],
      rows,
      markdown,
    )
  )
  out += ["", f"autocast / hand-written (target: trace+lower <= {TARGET:.2f}x, wall)"]
  out.append(
    common.table(
      [
        "layers",
        "policy",
        "trace+lower",
        "CPU trace+lower",
        "XLA compile",
        "total",
        "target",
        "status",
      ],
      summary_rows(results, policies, ratios_only=True),
      markdown,
    )
  )
  return "\n".join(out)


def _ms(seconds: float) -> str:
  return "-" if math.isnan(seconds) else common.ms(seconds)


def _ratio(ratio: float) -> str:
  return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def summary_rows(results: dict, policies, ratios_only: bool = False) -> list[list[Any]]:
  """Per depth and policy: the trace+lower, compile and total ratios and the target's status.

  With ``ratios_only=False``, rows for run.py's targets table instead: model, policy, metric,
  hand-written ms, autocast ms, ratio, target, status."""
  rows = []
  for depth, by_name in results.items():
    for device, hand, ac in pairs(policies):
      h, a = by_name[hand]["median"], by_name[ac]["median"]
      r = {
        k: a[k] / h[k] if h[k] else float("inf")
        for k in ("trace+lower", "cpu trace+lower", "compile", "total")
      }
      status = common.target_mark(r["trace+lower"], TARGET)
      if ratios_only:
        rows.append(
          [
            depth,
            device,
            _ratio(r["trace+lower"]),
            _ratio(r["cpu trace+lower"]),
            _ratio(r["compile"]),
            _ratio(r["total"]),
            f"<= {TARGET:.2f}x",
            status,
          ]
        )
      else:
        rows.append(
          [
            f"lm {depth} layers",
            device,
            "trace+lower ms",
            f"{h['trace+lower'] * 1e3:.4g}",
            f"{a['trace+lower'] * 1e3:.4g}",
            f"{r['trace+lower']:.2f}x",
            f"<= {TARGET:.2f}x",
            status,
          ]
        )
  return rows


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument(
    "--depths", default=",".join(map(str, DEFAULT_DEPTHS)), help="comma-separated numbers of layers"
  )
  p.add_argument(
    "--reps", type=int, default=3, help="cold trace+lower repetitions per variant (median)"
  )
  p.add_argument(
    "--compile-reps", type=int, default=1, help="how many of them also compile (median)"
  )
  p.add_argument("--policies", default="cpu,cuda", help="autocast device types: cpu,cuda")
  p.add_argument("--no-compile", action="store_true", help="time trace and lower only")
  p.add_argument("--markdown", action="store_true", help="print markdown tables")
  for k, v in MODEL.items():
    p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  depths = [int(d) for d in args.depths.split(",") if d.strip()]
  policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
  for p in policies:
    if p not in POLICIES:
      raise SystemExit(f"unknown policy {p!r}; choose from {tuple(POLICIES)}")
  model = {k: getattr(args, k) for k in MODEL}
  started = time.perf_counter()
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, "
    f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, python "
    f"{platform.python_version()}; model {model}; command: python -m benchmarks.trace_depth "
    + " ".join(argv if argv is not None else sys.argv[1:])
  )
  results = run(
    depths,
    policies=policies,
    reps=args.reps,
    model=model,
    compile_reps=0 if args.no_compile else args.compile_reps,
  )
  print("\n" + report(results, policies, args.markdown))
  print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
