"""``jaxamp.nonfinite_report`` against the plain finite check, on ~10M parameters of gradients.

    python -m benchmarks.bench_nonfinite             # 10.4M float32 gradients, 9 rounds
    python -m benchmarks.bench_nonfinite --quick     # 2.6M, 5 rounds (seconds)
    python -m benchmarks.bench_nonfinite --dtype float16 --markdown

The gradient tree is the scaler benchmark's (``bench_scaler.param_tree``: 4 big leaves and 256
weight/bias pairs). Both programs are jitted and run round-robin (``common.interleaved_median``):
``finite check`` is ``jnp.all(jnp.isfinite(g))`` over every leaf, the scaler's found-inf check;
``nonfinite_report`` counts NaN/+Inf/-Inf and the largest finite magnitude of every leaf. The
ratio of the medians is printed, for finite gradients and for gradients with Inf and NaN in a few
leaves. No target: the report is a debugging aid, off by default in the train steps.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks import bench_scaler, common


def finite_check(grads: Any) -> jax.Array:
  """Whether any leaf holds an Inf or NaN: one fused reduction per leaf, as the scaler does."""
  leaves = jax.tree.leaves(grads)
  return ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))


def poisoned(grads: dict) -> dict:
  """``grads`` with Inf, -Inf and NaN written into a big leaf and two small ones."""
  grads = dict(grads, small=list(grads["small"]))
  big = grads["big_0"]
  grads["big_0"] = big.at[0, :3].set(jnp.array([jnp.inf, -jnp.inf, jnp.nan], big.dtype))
  for i in (3, 7):
    w = grads["small"][i]["w"]
    grads["small"][i] = dict(grads["small"][i], w=w.at[i].set(jnp.array(jnp.nan, w.dtype)))
  return grads


def run(
  *,
  big=4,
  big_shape=(2048, 1024),
  small=256,
  small_size=8192,
  dtype="float32",
  rounds=9,
  per_round=3,
  log=print,
) -> dict[str, Any]:
  params = bench_scaler.param_tree(big, big_shape, small, small_size)
  grads = jax.tree.map(lambda p: (p * 0.5 + 1e-3).astype(dtype), params)
  n = sum(x.size for x in jax.tree.leaves(grads))
  leaves = len(jax.tree.leaves(grads))
  log(f"  {n / 1e6:.2f}M {dtype} gradients in {leaves} leaves")
  programs = {
    "finite check": jax.jit(finite_check),
    "nonfinite_report": jax.jit(jaxamp.nonfinite_report),
  }
  results = {}
  for case, tree in (("finite", grads), ("with inf/nan", poisoned(grads))):
    funs = {name: (lambda f=f, t=tree: f(t)) for name, f in programs.items()}
    results[case] = common.interleaved_median(funs, rounds=rounds, per_round=per_round)
  report = jax.jit(jaxamp.nonfinite_report)(poisoned(grads))
  return {
    "params": n,
    "leaves": leaves,
    "dtype": dtype,
    "results": results,
    "example": report.format(limit=3),
  }


def report(res: dict, markdown: bool = False) -> str:
  rows = [
    [
      case,
      common.ms(r["finite check"]),
      common.ms(r["nonfinite_report"]),
      common.ratio(r["nonfinite_report"], r["finite check"]),
    ]
    for case, r in res["results"].items()
  ]
  title = (
    f"jitted, {res['params'] / 1e6:.2f}M {res['dtype']} gradients in {res['leaves']} "
    f"leaves, median ms"
  )
  return "\n".join(
    [
      ("### " if markdown else "== ") + "nonfinite_report" + ("" if markdown else " =="),
      "",
      title,
      common.table(
        ["gradients", "finite check ms", "nonfinite_report ms", "report / check"], rows, markdown
      ),
      "",
      "report of the gradients with inf/nan:",
      res["example"],
    ]
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="2.6M parameters, 5 rounds")
  p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = p.parse_args(argv)
  big_shape, small_size = ((1024, 512), 2048) if args.quick else ((2048, 1024), 8192)
  rounds = args.rounds or (5 if args.quick else 9)
  print(f"jax {jax.__version__} on {jax.default_backend()}")
  res = run(big_shape=big_shape, small_size=small_size, dtype=args.dtype, rounds=rounds)
  print(report(res, args.markdown))
  return 0


if __name__ == "__main__":
  sys.exit(main())
