"""Sections 1-4 and 6: jaxamp.autocast against hand-written Flax mixed precision.

For one model (the transformer LM or the conv net) and each policy ("cpu": bfloat16,
"cuda": float16) three programs are compared in one process:

* ``float32``: the float32 model;
* ``flax <dtype>``: the same model written with ``dtype=<dtype>`` on every layer (params float32);
  for the Haiku ResNet, ``jmp <dtype>``: Haiku's jmp policies (``haiku_models.jmp_policies``);
* ``autocast <device>``: ``jaxamp.autocast(loss_of_the_float32_model, device_type=<device>)``.

Measured: trace/lower/compile time of ``jax.jit(jax.value_and_grad(loss))`` (cold caches, median),
residual bytes kept for the backward pass, XLA's temp buffer size, the step time of a jitted
train step (value_and_grad + adam), and the ``convert`` ops in StableHLO and in the compiled HLO.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import common, models

POLICIES = {"cpu": jnp.bfloat16, "cuda": jnp.float16}
TARGETS = {"compile": 1.10, "residual": 1.00, "step": 1.05}


def _autocast_loss(loss, device_type: str):
  wrapped = jaxamp.autocast(loss, device_type=device_type)

  def autocast_loss(params, state, batch):
    value, new_state = wrapped(params, state, batch)
    return value.astype(jnp.float32), new_state

  return autocast_loss


def variants(make_task, policies, hand: str = "flax") -> dict[str, models.Task]:
  """name -> Task, float32 first, then per policy the hand-written and the autocast version.

  ``hand`` names the hand-written mixed precision: "flax" (``dtype=``) or "jmp" (Haiku)."""
  base = make_task(None)
  out = {"float32": base}
  for device in policies:
    dtype = POLICIES[device]
    out[f"{hand} {jnp.dtype(dtype).name}"] = make_task(dtype)
    out[f"autocast {device}"] = models.Task(
      base.name, _autocast_loss(base.loss, device), base.params, base.state, base.batch
    )
  return out


def pairs(policies, hand: str = "flax") -> list[tuple[str, str, str]]:
  """(policy, hand-written variant, autocast variant)."""
  return [(d, f"{hand} {jnp.dtype(POLICIES[d]).name}", f"autocast {d}") for d in policies]


def _compile_once(task: models.Task) -> dict[str, Any]:
  """Cold trace, lower and compile of jit(value_and_grad(loss)): wall and process CPU seconds."""
  common.clear_all_caches()
  fun = jax.jit(jax.value_and_grad(task.loss, has_aux=True))
  args = (task.params, task.state, task.batch)
  c0, t0 = time.process_time(), time.perf_counter()
  traced = fun.trace(*args)
  jaxpr = traced.jaxpr
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  compiled = lowered.compile()
  t3, c3 = time.perf_counter(), time.process_time()
  return {
    "trace": t1 - t0,
    "lower": t2 - t1,
    "compile": t3 - t2,
    "total": t3 - t0,
    "cpu": c3 - c0,
    "lowered": lowered,
    "compiled": compiled,
    "jaxpr": jaxpr,
  }


def _analyse(res: dict, lowered, compiled, jaxpr=None) -> None:
  if jaxpr is not None:
    res["jaxpr_converts"] = common.jaxpr_count(jaxpr, "convert_element_type")
  res["shlo_converts"] = common.stablehlo_converts(lowered.as_text(debug_info=True))
  hlo = compiled.as_text()
  res["hlo_converts"] = common.hlo_converts(hlo)
  res["matmuls"] = common.hlo_matmul_dtypes(hlo)
  mem = compiled.memory_analysis()
  res["temp_bytes"] = getattr(mem, "temp_size_in_bytes", float("nan")) if mem else float("nan")


def run(
  make_task,
  *,
  policies=("cpu", "cuda"),
  compile_reps=3,
  step_rounds=7,
  step_per_round=3,
  train_step=True,
  log=print,
  hand: str = "flax",
) -> dict[str, Any]:
  start = time.perf_counter()
  tasks = variants(make_task, policies, hand)
  results: dict[str, dict[str, Any]] = {name: {} for name in tasks}
  params = next(iter(tasks.values())).params
  log(f"  {len(tasks)} variants, {models.param_count(params) / 1e6:.2f}M parameters")

  # 1 + 4: compile times. Warm-up first (backend start, imports, flax's first traces) with a
  # trace of every variant, so that no variant pays it; the programs of the first timed
  # repetition are the ones analysed below.
  jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(())))
  for task in tasks.values():
    jax.jit(jax.value_and_grad(task.loss, has_aux=True)).trace(task.params, task.state, task.batch)
  compiled_grad = {}
  for name in tasks:
    results[name]["times"] = {k: [] for k in ("trace", "lower", "compile", "total", "cpu")}
  for rep in range(max(1, compile_reps)):
    for name, task in tasks.items():
      out = _compile_once(task)
      res = results[name]
      for k in ("trace", "lower", "compile", "total", "cpu"):
        res["times"][k].append(out[k])
      if rep == 0:
        _analyse(res, out["lowered"], out["compiled"], out["jaxpr"])
        compiled_grad[name] = out["compiled"]
    log(
      f"  compile rep {rep + 1}/{max(1, compile_reps)} done ({time.perf_counter() - start:.0f} s)"
    )
  for res in results.values():
    res["compile_median"] = {k: statistics.median(v) for k, v in res["times"].items()}

  # 2: residuals kept for the backward pass.
  for name, task in tasks.items():
    stats = common.residual_stats(
      lambda p, t=task: t.loss(p, t.state, t.batch), [task.params], has_aux=True
    )
    results[name]["residuals"] = stats
    out_state = jax.eval_shape(task.loss, task.params, task.state, task.batch)[1]
    results[name]["state_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(out_state)})

  # 3: step time of the jitted train step (value_and_grad + adam; with train_step=False, of the
  # value_and_grad compiled above, which saves one compilation per variant), round-robin.
  tx = optax.adam(1e-3)
  steps = {}
  for name, task in tasks.items():
    if not train_step:
      args = (task.params, task.state, task.batch)
      results[name]["step_hlo_matmuls"] = results[name]["matmuls"]
      steps[name] = lambda f=compiled_grad[name], a=args: f(*a)
      continue

    def step(params, opt_state, state, batch, loss=task.loss):
      (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params, state, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, new_state, value

    opt_state = tx.init(task.params)
    args = (task.params, opt_state, task.state, task.batch)
    compiled = jax.jit(step).lower(*args).compile()  # called directly: compiled once
    results[name]["step_hlo_matmuls"] = common.hlo_matmul_dtypes(compiled.as_text())
    steps[name] = lambda f=compiled, a=args: f(*a)
  medians, cpu = common.interleaved_median(
    steps, rounds=step_rounds, per_round=step_per_round, cpu_time=True
  )
  for name, seconds in medians.items():
    results[name]["step"] = seconds
    results[name]["step_cpu"] = cpu[name]
  log(f"  step timing done ({time.perf_counter() - start:.0f} s)")
  return results


# --- reporting -----------------------------------------------------------------------------------


def report(
  title: str,
  results: dict,
  policies,
  markdown: bool = False,
  examples: int = 6,
  train_step: bool = True,
  hand: str = "flax",
) -> str:
  out = [f"### {title}" if markdown else f"== {title} =="]
  base = results["float32"]
  hand_of = {ac: h for _, h, ac in pairs(policies, hand)}
  vs = f"vs {hand}"

  def vs_hand(name, value_of):
    hand = hand_of.get(name)
    return common.ratio(value_of(results[name]), value_of(results[hand])) if hand else ""

  rows = []
  for name, res in results.items():
    t = res["compile_median"]
    rows.append(
      [
        name,
        common.ms(t["trace"]),
        common.ms(t["lower"]),
        common.ms(t["compile"]),
        common.ms(t["total"]),
        common.ratio(t["total"], base["compile_median"]["total"]),
        vs_hand(name, lambda r: r["compile_median"]["total"]),
        common.ms(t["cpu"]),
        vs_hand(name, lambda r: r["compile_median"]["cpu"]),
      ]
    )
  out += [
    "",
    "1. trace + lower + compile of jit(value_and_grad(loss)), cold caches, median ms "
    f"of {len(base['times']['total'])} (wall; last two columns: process CPU time)",
    common.table(
      ["variant", "trace", "lower", "compile", "total", "vs f32", vs, "CPU total", f"CPU {vs}"],
      rows,
      markdown,
    ),
  ]

  rows = []
  for name, res in results.items():
    r = res["residuals"]
    dtypes = ", ".join(f"{d} {common.mib(b)}" for d, b in sorted(r["by_dtype"].items()))
    rows.append(
      [
        name,
        common.mib(r["bytes"]),
        r["count"],
        common.mib(r["arg_bytes"]),
        common.mib(res["temp_bytes"]),
        common.ratio(r["bytes"], base["residuals"]["bytes"]),
        vs_hand(name, lambda x: x["residuals"]["bytes"]),
        dtypes,
      ]
    )
  out += [
    "",
    "2. residuals kept for the backward pass (MiB; jax.vjp residuals that are not inputs)"
    " and XLA temp buffers of the compiled value_and_grad",
    common.table(
      [
        "variant",
        "residual MiB",
        "#",
        "inputs kept MiB",
        "XLA temp MiB",
        "vs f32",
        vs,
        "residual MiB by dtype",
      ],
      rows,
      markdown,
    ),
  ]

  rows = []
  for name, res in results.items():
    rows.append(
      [
        name,
        common.ms(res["step"]),
        common.ratio(res["step"], base["step"]),
        vs_hand(name, lambda r: r["step"]),
        common.ms(res["step_cpu"]),
        vs_hand(name, lambda r: r["step_cpu"]),
      ]
    )
  what = "train step (value_and_grad + adam)" if train_step else "value_and_grad (--quick)"
  out += [
    "",
    f"3. jitted {what}, median ms",
    common.table(["variant", "step ms", "vs f32", vs, "CPU ms", f"CPU {vs}"], rows, markdown),
  ]

  rows = []
  for name, res in results.items():
    pairs_ = common.convert_pairs(res["shlo_converts"])
    rows.append(
      [
        name,
        res["jaxpr_converts"],
        len(res["shlo_converts"]),
        len(res["hlo_converts"]),
        vs_hand(name, lambda r: r["jaxpr_converts"] or 1),
        vs_hand(name, lambda r: len(r["shlo_converts"]) or 1),
        vs_hand(name, lambda r: len(r["hlo_converts"]) or 1),
        ", ".join(f"{k} {v}" for k, v in pairs_.most_common(4)),
      ]
    )
  out += [
    "",
    "4. convert ops (jaxpr convert_element_type incl. sub-jaxprs, StableHLO of lowered, "
    "compiled HLO incl. fusion bodies)",
    common.table(
      [
        "variant",
        "jaxpr",
        "StableHLO",
        "HLO",
        f"jaxpr {vs}",
        f"SHLO {vs}",
        f"HLO {vs}",
        "StableHLO src->dst",
      ],
      rows,
      markdown,
    ),
  ]
  rows = []
  for name, res in results.items():
    rows.append(
      [name, ", ".join(f"{k[0]} {k[1]}->{k[2]} x{v}" for k, v in sorted(res["matmuls"].items()))]
    )
  out += [
    "",
    "   dot/conv dtypes in the compiled HLO (operands->result)",
    common.table(["variant", "kind operands->result x count"], rows, markdown),
  ]
  notes = [
    f"{name}: updated state dtypes {res['state_dtypes']}"
    for name, res in results.items()
    if res["state_dtypes"] and res["state_dtypes"] != ["float32"]
  ]
  if notes:
    out += ["", "   note: " + "; ".join(notes)]

  for _, h, ac in pairs(policies, hand):
    extra = common.extra_converts(
      results[ac]["shlo_converts"], results[h]["shlo_converts"], limit=0
    )
    if not extra:
      continue
    counts = common.convert_pairs(extra)
    out += [
      "",
      f"   {len(extra)} StableHLO converts of `{ac}` without a same-typed counterpart "
      f"in `{h}` ({', '.join(f'{k} {v}' for k, v in counts.most_common())}); examples:",
    ]
    for conv in _diverse(extra, examples):
      consumers = ", ".join(sorted(set(conv["consumers"]))[:3])
      out.append(
        f"   - {conv['src']}->{conv['dst']} [{conv['shape']}] of {conv['producer']}"
        f" -> used by {consumers or '(output)'}"
      )
  return "\n".join(out)


def _diverse(extra: list[dict], limit: int) -> list[dict]:
  """Examples with distinct (src, dst, producer op) first."""
  seen, first, rest = set(), [], []
  for conv in extra:
    key = (
      conv["src"],
      conv["dst"],
      conv["producer"].split("@")[0],
      tuple(sorted({c.split("@")[0] for c in conv["consumers"]})),
    )
    (rest if key in seen else first).append(conv)
    seen.add(key)
  return (first + rest)[:limit]


def summary_rows(
  model: str, results: dict, policies, hand: str = "flax", jaxpr_converts: bool = False
) -> list[list[Any]]:
  """Rows of the targets table: model, policy, metric, hand-written, autocast, ratio, target,
  status. ``jaxpr_converts`` adds a row for the jaxpr's convert_element_type eqns."""
  rows = []
  for device, hand_name, ac in pairs(policies, hand):
    h, a = results[hand_name], results[ac]
    metrics = [
      (
        "compile ms",
        h["compile_median"]["total"] * 1e3,
        a["compile_median"]["total"] * 1e3,
        TARGETS["compile"],
      ),
      (
        "residual MiB",
        h["residuals"]["bytes"] / 2**20,
        a["residuals"]["bytes"] / 2**20,
        TARGETS["residual"] if device == "cpu" else None,
      ),
      ("step ms", h["step"] * 1e3, a["step"] * 1e3, TARGETS["step"]),
      ("StableHLO converts", len(h["shlo_converts"]), len(a["shlo_converts"]), 1.0),
      ("HLO converts", len(h["hlo_converts"]), len(a["hlo_converts"]), 1.0),
    ]
    if jaxpr_converts:
      metrics.insert(3, ("jaxpr converts", h["jaxpr_converts"], a["jaxpr_converts"], 1.0))
    for metric, hv, av, target in metrics:
      r = av / hv if hv else float("inf")
      status = "" if target is None else common.target_mark(r, target)
      rows.append(
        [
          model,
          device,
          metric,
          f"{hv:.4g}",
          f"{av:.4g}",
          f"{r:.2f}x",
          "" if target is None else f"<= {target:.2f}x",
          status,
        ]
      )
  return rows
