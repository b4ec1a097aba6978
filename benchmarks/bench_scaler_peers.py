"""The loss scaler against its peers: compile time and step time, side by side.

``jaxamp.dynamic_loss_scale(adam)`` against flax's ``DynamicScale`` (its ``value_and_grad`` and a
``jnp.where`` select of the new state, as in flax's examples), ``optax.apply_if_finite(adam)``
and bare ``optax.adam``, on (a) transformer LM train steps (``models.lm_task``; float32, or
float16 under ``--lm-autocast cuda``, which ``run.py`` uses on a GPU), as many layers deep as
make about 50 and about 500 parameter leaves (``--lm-leaves``), and (b) a pure optimizer step
(``update`` + ``apply_updates``) on transformer-like parameter trees of 50 and 500 leaves: the
worst case for the step, where nothing but the optimizer runs. Compile time is trace + lower +
XLA compile with cold caches, median of ``compile_reps`` rounds; the programs alternate within
each round, and so do the step timings (median over rounds, and the quartiles of each round's
ratio to adam: the spread on a shared machine; a round calls each program for about half a
second at most, once for a deep LM). ``passes`` is what timings on a loaded machine cannot give:
the bytes the compiled step reads and writes (every kernel's operands and outputs, the taken
branch of a conditional) over the bytes of the parameters, exact and repeatable. Bare adam is 10
(it reads gradient, moments and parameter and writes moments and parameter, its three kernels
reading the new moments again).
Targets: the scaler compiles in at most ``apply_if_finite``'s time and steps in <= 1.02x adam's.

    python -m benchmarks.bench_scaler_peers [--quick] [--markdown] [--lm-leaves 50,500]
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from benchmarks import common, models

STEP_TARGET = 1.02
PEERS = ("optax.adam", "jaxamp", "flax DynamicScale", "optax.apply_if_finite")
FLAX_MAX_LEAVES = 100  # flax's per-leaf selects compile quadratically: 198 s at 500 leaves
ROUND_SECONDS = 0.5  # the most one program's calls take in a round (at least one call)


def layer_tree(leaves: int, d: int = 128, seed: int = 0) -> dict:
  """``leaves`` float32 arrays shaped like a transformer's: blocks of 10 (norms, attention, MLP)."""
  shapes = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
  rng = np.random.default_rng(seed)
  return {
    f"{i // len(shapes):03d}_{i % len(shapes)}": jnp.asarray(
      rng.standard_normal(shapes[i % len(shapes)], np.float32) * 0.02
    )
    for i in range(leaves)
  }


def _adam() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(functools.partial(jnp.where, ok), new, old)


def optimizer_steps(params: Any) -> dict[str, tuple]:
  """``name: (step(params, opt_state, grads), opt_state, grads)``: update + apply_updates."""
  grads = jax.tree.map(lambda p: p * 0.5 + 1e-3, params)
  scaled = jax.tree.map(lambda g: g * 2.0**16, grads)
  out = {}
  for name, tx, g in (
    ("optax.adam", _adam(), grads),
    ("jaxamp", jaxamp.dynamic_loss_scale(_adam()), scaled),
    ("optax.apply_if_finite", optax.apply_if_finite(_adam(), 5), grads),
  ):

    def step(params, opt_state, grads, tx=tx):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    out[name] = (step, tx.init(params), g)
  from flax.training.dynamic_scale import DynamicScale

  adam = _adam()

  def flax_step(params, opt_state, grads):
    ds, adam_state = opt_state
    # DynamicScale computes the gradients itself: of sum(p * g), whose gradient is g.
    loss = lambda p: sum(
      jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(grads), strict=True)
    )
    ds, is_fin, _, g = ds.value_and_grad(loss)(params)
    updates, new_state = adam.update(g, adam_state, params)
    new_params = optax.apply_updates(params, updates)
    return _select(is_fin, new_params, params), (ds, _select(is_fin, new_state, adam_state))

  out["flax DynamicScale"] = (flax_step, (DynamicScale(), adam.init(params)), grads)
  return out


def lm_layers_for(leaves: int, lm: dict) -> int:
  """The number of layers that gives ``models.lm_task`` with ``lm``'s other sizes the number of
  parameter leaves nearest to ``leaves`` (at least one layer)."""
  count = [len(jax.tree.leaves(models.lm_param_shapes(**dict(lm, layers=n)))) for n in (1, 2)]
  per_layer = count[1] - count[0]
  return max(1, round((leaves - (count[0] - per_layer)) / per_layer))


def lm_steps(lm: dict, device_type: str | None = None) -> tuple[dict[str, tuple], Any]:
  """The same for a transformer LM: ``value_and_grad(loss)`` + update; the loss in float32, or
  under ``jaxamp.autocast`` for ``device_type`` (``"cuda"``: the float16 train step)."""
  task = models.lm_task(None, **lm)
  loss_fn = lambda p, batch: task.loss(p, task.state, batch)[0]
  if device_type is not None:
    loss_fn = jaxamp.autocast(loss_fn, device_type=device_type)
  out = {}
  for name, tx in (
    ("optax.adam", _adam()),
    ("jaxamp", jaxamp.dynamic_loss_scale(_adam())),
    ("optax.apply_if_finite", optax.apply_if_finite(_adam(), 5)),
  ):
    scaled = name == "jaxamp"

    def step(params, opt_state, batch, tx=tx, scaled=scaled):
      if scaled:
        grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, batch), opt_state))(params)
      else:
        grads = jax.grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    out[name] = (step, tx.init(task.params), task.batch)
  from flax.training.dynamic_scale import DynamicScale

  adam = _adam()

  def flax_step(params, opt_state, batch):
    ds, adam_state = opt_state
    ds, is_fin, _, grads = ds.value_and_grad(loss_fn)(params, batch)
    updates, new_state = adam.update(grads, adam_state, params)
    new_params = optax.apply_updates(params, updates)
    return _select(is_fin, new_params, params), (ds, _select(is_fin, new_state, adam_state))

  out["flax DynamicScale"] = (flax_step, (DynamicScale(), adam.init(task.params)), task.batch)
  return out, task.params


_ARRAY = re.compile(r"\b(pred|bf16|[suf](?:8|16|32|64))\[([\d,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
_BRANCHES = re.compile(
  r"branch_computations=\{([^}]*)\}|true_computation=(%\S+), false_computation"
)
_CALLED = re.compile(r"(?:body|condition|to_apply)=(%[\w.\-]+)")


def _bytes(type_str: str) -> int:
  """Bytes of the arrays in an HLO type (a tuple's elements summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(type_str):
    size = int(np.prod([int(d) for d in dims.split(",") if d]))
    total += size * ({"pred": 8, "bf16": 16}.get(dtype) or int(dtype[1:])) // 8
  return total


def hlo_traffic(text: str) -> int:
  """Bytes a compiled HLO module reads and writes per run: every kernel's operands and outputs.

  Fusions, copies and unfused ops of the entry computation count once each; a conditional counts
  its costliest branch (the taken one for a finite step), a while or call its body once.
  Parameters, constants, tuples and bitcasts move nothing.
  """
  comps: dict[str, list[str]] = {}
  name = entry = None
  for line in re.sub(r"/\*index=\d+\*/", "", text).splitlines():
    head = re.match(r"^(ENTRY\s+)?(%[\w.\-]+)\s.*\{$", line)
    if head:
      name = head.group(2)
      comps[name] = []
      entry = name if head.group(1) else entry
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)

  def traffic(comp: str) -> int:
    instrs = common.parse_hlo("\n".join(comps[comp]))
    types = {i["name"]: i["type"] for i in instrs}
    total = 0
    for i in instrs:
      if i["op"] in _FREE:
        continue
      if i["op"] == "conditional":
        m = _BRANCHES.search(i["attrs"])
        total += max(map(traffic, re.findall(r"%[\w.\-]+", m.group(1) or i["attrs"])))
      elif i["op"] in ("while", "call"):
        total += sum(map(traffic, _CALLED.findall(i["attrs"])))
      else:
        total += _bytes(i["type"]) + sum(_bytes(types.get(o, "")) for o in i["operands"])
    return total

  return traffic(entry)


def measure(
  steps: dict[str, tuple], params: Any, *, compile_reps: int, rounds: int, calls: int
) -> dict:
  """Compile (cold caches) and step time of every program, the programs interleaved.

  A round calls each program ``calls`` times, or fewer if they would take over ``ROUND_SECONDS``.
  """
  times: dict[str, list[float]] = {name: [] for name in steps}
  compiled = {}
  for r in range(compile_reps):
    order = list(steps) if r % 2 == 0 else list(reversed(steps))
    for name in order:
      step, state, extra = steps[name]
      common.clear_all_caches()
      gc.collect()  # the previous program's garbage is not charged to this one
      start = time.perf_counter()
      compiled[name] = jax.jit(step).trace(params, state, extra).lower().compile()
      times[name].append(time.perf_counter() - start)
  funs = {
    name: functools.partial(compiled[name], params, state, extra)
    for name, (_, state, extra) in steps.items()
  }
  start = time.perf_counter()
  common.block(funs["optax.adam"]())  # its first call: compiled already, so about one step
  calls = max(1, min(calls, int(ROUND_SECONDS / (time.perf_counter() - start))))
  per_round: dict[str, list[float]] = {name: [] for name in steps}
  for r in range(rounds):  # one round at a time, so that each round's ratios can be taken
    once = common.interleaved_median(funs, rounds=1, per_round=calls, warmup=int(r == 0))
    for name, seconds in once.items():
      per_round[name].append(seconds)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  out = {}
  for name in steps:
    ratios = sorted(a / b for a, b in zip(per_round[name], per_round["optax.adam"], strict=True))
    compile_ratios = sorted(
      a / b for a, b in zip(times[name], times["optax.apply_if_finite"], strict=True)
    )
    out[name] = {
      "compile": statistics.median(times[name]),
      "compile_ratio": statistics.median(compile_ratios),
      "compile_ratio_iqr": (_quantile(compile_ratios, 0.25), _quantile(compile_ratios, 0.75)),
      "step": statistics.median(per_round[name]),
      "step_ratio": statistics.median(ratios),
      "step_ratio_iqr": (_quantile(ratios, 0.25), _quantile(ratios, 0.75)),
      "hlo_ops": sum(1 for _ in common.parse_hlo(compiled[name].as_text())),
      "passes": hlo_traffic(compiled[name].as_text()) / param_bytes,
    }
  return out


def _quantile(sorted_values: list[float], q: float) -> float:
  return sorted_values[round(q * (len(sorted_values) - 1))]


def run(
  *,
  lm: dict | None = None,
  lm_leaves=(),
  lm_device_type: str | None = None,
  leaves=(50, 500),
  d: int = 128,
  compile_reps: int = 5,
  rounds: int = 21,
  per_round: int = 3,
  flax_max_leaves: int = FLAX_MAX_LEAVES,
  log=print,
) -> dict[str, Any]:
  cases = {}
  opts = dict(compile_reps=compile_reps, rounds=rounds, calls=per_round)
  if lm is None:
    lms = []
  elif lm_leaves:  # lm's sizes, as deep as the leaf counts ask
    lms = [dict(lm, layers=lm_layers_for(n, lm)) for n in lm_leaves]
  else:
    lms = [lm]
  for sizes in lms:
    steps, params = lm_steps(sizes, lm_device_type)
    n = len(jax.tree.leaves(params))
    if n > flax_max_leaves:
      del steps["flax DynamicScale"]
    what = "LM train step" + (f", autocast {lm_device_type}" if lm_device_type else "")
    log(f"  peers: {what}, {sizes['layers']} layers, {n} leaves")
    cases[f"{what} ({n} leaves)"] = measure(steps, params, **opts)
  for n in leaves:
    params = layer_tree(n, d)
    steps = optimizer_steps(params)
    if n > flax_max_leaves:
      del steps["flax DynamicScale"]
    size = sum(x.size for x in jax.tree.leaves(params)) / 1e6
    log(f"  peers: optimizer step, {n} leaves, {size:.2f}M parameters")
    cases[f"optimizer step ({n} leaves, {size:.2f}M)"] = measure(steps, params, **opts)
  return {"cases": cases, "flax_max_leaves": flax_max_leaves}


def _spread(r: dict, key: str = "step_ratio") -> str:
  low, high = r[f"{key}_iqr"]
  return f"{r[key]:.2f}x [{low:.2f}, {high:.2f}]"


def _status(ok: bool) -> str:
  return "ok" if ok else "MISSED"


def report(res: dict, markdown: bool = False) -> str:
  rows, targets = [], []
  for case, results in res["cases"].items():
    adam, aif = results["optax.adam"], results["optax.apply_if_finite"]
    for name in PEERS:
      if name not in results:
        rows.append([case, name, "skipped", "", "", "", "", "", "", ""])
        continue
      r = results[name]
      rows.append(
        [
          case,
          name,
          common.ms(r["compile"]),
          common.ratio(r["compile"], adam["compile"]),
          common.ratio(r["compile"], aif["compile"]),
          common.ms(r["step"]),
          _spread(r),
          f"{r['passes']:.2f}",
          f"{r['passes'] / adam['passes']:.2f}x",
          r["hlo_ops"],
        ]
      )
    ours = results["jaxamp"]
    c, s = ours["compile_ratio"], ours["step_ratio"]
    targets.append(
      [
        case,
        "compile vs apply_if_finite",
        _spread(ours, "compile_ratio"),
        "<= 1.00x",
        _status(c <= 1),
      ]
    )
    targets.append(
      [case, "step vs adam", _spread(ours), f"<= {STEP_TARGET:.2f}x", _status(s <= STEP_TARGET)]
    )
    p = ours["passes"] / adam["passes"]
    targets.append(
      [case, "passes vs adam", f"{p:.2f}x", f"<= {STEP_TARGET:.2f}x", _status(p <= STEP_TARGET)]
    )
  head = ("### " if markdown else "== ") + "loss scaler vs peers" + ("" if markdown else " ==")
  note = (
    "trace + lower + compile (cold caches) and step, median ms; compile vs apply_if_finite "
    "(targets) and step vs adam: median of the rounds' ratios [quartiles]; passes: bytes the "
    "compiled step reads and writes / parameter "
    f"bytes (exact); flax DynamicScale skipped above {res['flax_max_leaves']} leaves (its "
    "per-leaf selects compile quadratically)"
  )
  return "\n".join(
    [
      head,
      "",
      note,
      common.table(
        [
          "case",
          "scaler",
          "compile ms",
          "vs adam",
          "vs apply_if_finite",
          "step ms",
          "step vs adam",
          "passes",
          "vs adam",
          "HLO ops",
        ],
        rows,
        markdown,
      ),
      "",
      common.table(["case", "jaxamp", "ratio", "target", "status"], targets, markdown),
    ]
  )


def summary_rows(res: dict) -> list[list[Any]]:
  """Rows for ``run.py``'s targets table: jaxamp against apply_if_finite (compile), adam (step)."""
  rows = []
  for case, results in res["cases"].items():
    ours, aif, adam = results["jaxamp"], results["optax.apply_if_finite"], results["optax.adam"]
    for metric, base, target in (
      ("compile ms (apply_if_finite vs scaler)", aif["compile"], 1.0),
      ("step ms (adam vs scaler)", adam["step"], STEP_TARGET),
    ):
      key = "compile" if metric.startswith("compile") else "step"
      r = ours[f"{key}_ratio"]
      rows.append(
        [
          "optimizer",
          "-",
          f"{case}: {metric}",
          f"{base * 1e3:.4g}",
          f"{ours[key] * 1e3:.4g}",
          f"{r:.2f}x",
          f"<= {target:.2f}x",
          common.target_mark(r, target),
        ]
      )
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--markdown", action="store_true")
  p.add_argument("--leaves", default="50,500")
  p.add_argument("--no-lm", action="store_true")
  p.add_argument(
    "--lm-leaves",
    default=None,
    help="LMs as deep as give about these numbers of leaves (default 50,500; --quick and '': "
    "the LM of models.lm_sizes)",
  )
  p.add_argument(
    "--lm-autocast", default=None, help="the LM's loss under autocast for this device type"
  )
  args = p.parse_args(argv)
  q = args.quick
  lm = None if args.no_lm else models.lm_sizes(q)
  lm_leaves = args.lm_leaves if args.lm_leaves is not None else ("" if q else "50,500")
  res = run(
    lm=lm,
    lm_leaves=tuple(int(n) for n in lm_leaves.split(",") if n),
    lm_device_type=args.lm_autocast,
    leaves=tuple(int(n) for n in args.leaves.split(",") if n),
    d=64 if q else 128,
    compile_reps=1 if q else 5,
    rounds=5 if q else 21,
    log=lambda m: print(m, file=sys.stderr, flush=True),
  )
  print(report(res, args.markdown))
  return 0


if __name__ == "__main__":
  sys.exit(main())
