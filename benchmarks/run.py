"""jaxamp benchmarks: autocast vs hand-written Flax / jmp mixed precision, and the loss scaler.

    python -m benchmarks.run                 # everything, < 10 minutes on a 2-core CPU
    python -m benchmarks.run --quick         # smaller models, fewer repetitions, < 1 minute
    python -m benchmarks.run --only lm       # one section: lm, conv, haiku, scaler, gpu, depth
    python -m benchmarks.run --only depth    # the depth sweep alone (not in the default run)
    python -m benchmarks.run --markdown      # tables as markdown (docs/benchmarks.md)

Sections (all measured side by side in one process, printed as ratios):
  lm, conv   1. trace/lower/compile time  2. residual bytes  3. step time  4. convert counts
  haiku      the same for a Haiku ResNet (hk.BatchNorm) against Haiku's jmp policies, with the
             target autocast converts <= jmp converts in the jaxpr, StableHLO and compiled HLO
  scaler     5. dynamic_loss_scale(adam) vs adam update time on >= 10M parameters, and its
             compile/step time against flax DynamicScale and optax.apply_if_finite on LM
             train steps of about 50 and 500 leaves and on optimizer steps alone
  gpu        6. GPU only: autocast speed-up over float32 and the dtypes of the gemm/conv calls
  depth      7. trace/lower/compile time of the LM at 2, 8, 32, 64 unrolled layers (~5-10 min,
             so only with --only; benchmarks/trace_depth.py runs it alone with more options)
No timings are asserted anywhere: targets are printed as ok / MISSED.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import jax  # noqa: E402

from benchmarks import bench_models, bench_scaler, bench_scaler_peers, common, models, trace_depth

SECTIONS = ("lm", "conv", "haiku", "scaler", "gpu", "depth")
DEFAULT_SECTIONS = ("lm", "conv", "haiku", "scaler", "gpu")  # depth takes longer than the rest


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (< 1 min)")
  p.add_argument(
    "--only", default=None, help=f"comma-separated sections to run, of {', '.join(SECTIONS)}"
  )
  p.add_argument("--markdown", action="store_true", help="print markdown tables")
  p.add_argument("--policies", default="cpu,cuda", help="autocast device types: cpu,cuda")
  lm = p.add_argument_group("transformer LM")
  lm.add_argument("--layers", type=int, default=None)
  lm.add_argument("--d-model", type=int, default=None)
  lm.add_argument("--heads", type=int, default=None)
  lm.add_argument("--seq", type=int, default=None)
  lm.add_argument("--batch", type=int, default=None)
  lm.add_argument("--vocab", type=int, default=None)
  conv = p.add_argument_group("conv net")
  conv.add_argument("--conv-batch", type=int, default=None)
  conv.add_argument("--conv-norm", choices=("batch", "group"), default="batch")
  haiku = p.add_argument_group("Haiku ResNet")
  haiku.add_argument("--haiku-batch", type=int, default=None)
  reps = p.add_argument_group("repetitions")
  reps.add_argument("--compile-reps", type=int, default=None)
  reps.add_argument("--step-rounds", type=int, default=None)
  reps.add_argument(
    "--scaler-params",
    type=float,
    default=None,
    help="millions of parameters in the scaler benchmark (default 10.4, quick 2.6)",
  )
  reps.add_argument(
    "--scaler-leaves",
    type=int,
    default=None,
    help="small parameter pairs (weight + bias) in the scaler tree (default 256)",
  )
  return p.parse_args(argv)


def settings(args) -> dict:
  q = args.quick
  lm = models.lm_sizes(q)
  for k in lm:
    v = getattr(args, k)
    if v is not None:
      lm[k] = v
  conv = dict(
    batch=args.conv_batch or (16 if q else 32),
    norm=args.conv_norm,
    features=(16, 32, 32, 64) if q else (32, 64, 64, 128),
  )
  haiku = dict(
    batch=args.haiku_batch or (4 if q else 16),
    image=16 if q else 32,
    blocks=(1, 1, 1, 1),
    channels=(8, 16, 16, 16) if q else (16, 32, 64, 128),
  )
  scaler_m = args.scaler_params or (2.6 if q else 10.4)
  # 4 big leaves hold ~80% of the parameters, `small` small ones (a weight and an 8-element bias
  # each) the rest.
  big_rows = max(1, int(round(scaler_m * 1e6 * 0.8 / 4 / 1024)))
  small = args.scaler_leaves or (64 if q else 256)
  small_size = max(8, int(scaler_m * 1e6 * 0.2 / small))
  return {
    "lm": lm,
    "conv": conv,
    "haiku": haiku,
    "scaler": dict(
      big=4,
      big_shape=(big_rows, 1024),
      small=small,
      small_size=small_size,
      rounds=5 if q else 7,
      per_round=2 if q else 3,
    ),
    "compile_reps": args.compile_reps or (1 if q else 3),
    "step_rounds": args.step_rounds or (3 if q else 5),
    "step_per_round": 2,
    "train_step": not q,
  }


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def gpu_section(results_by_model: dict, policies, markdown: bool) -> str:
  title = "### 6. GPU" if markdown else "== 6. GPU =="
  backend = jax.default_backend()
  if backend != "gpu":
    return f"{title}\n\nskipped: jax.default_backend() is {backend!r}, not 'gpu'."
  if not results_by_model:
    return (
      f"{title}\n\nskipped: run it together with the lm, conv or haiku section (--only lm,gpu)."
    )
  return "\n".join(
    [title, "", f"device: {jax.devices()[0].device_kind}", gpu_table(results_by_model, markdown)]
  )


def gpu_table(results_by_model: dict, markdown: bool) -> str:
  """Step time and speed-up over float32 of every variant, and the gemm/conv kernels' dtypes."""
  rows = []
  for model, results in results_by_model.items():
    base = results["float32"]["step"]
    for name, res in results.items():
      kinds = ", ".join(
        f"{k[0]} {k[1]}->{k[2]} x{v}" for k, v in sorted(res["step_hlo_matmuls"].items())
      )
      rows.append([model, name, common.ms(res["step"]), f"{base / res['step']:.2f}x", kinds])
  return common.table(
    [
      "model",
      "variant",
      "step ms",
      "speed-up vs f32",
      "gemm/conv calls in the train step (operands->result x count)",
    ],
    rows,
    markdown,
  )


def main(argv=None) -> int:
  args = parse_args(argv)
  only = set(DEFAULT_SECTIONS) if args.only is None else {s.strip() for s in args.only.split(",")}
  unknown = only - set(SECTIONS)
  if unknown:
    raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
  policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
  for p in policies:
    if p not in bench_models.POLICIES:
      raise SystemExit(f"unknown policy {p!r}; choose from {tuple(bench_models.POLICIES)}")
  cfg = settings(args)
  started = time.perf_counter()
  print(
    ("## " if args.markdown else "") + "jaxamp benchmarks" + (" (--quick)" if args.quick else "")
  )
  print(
    f"\njax {jax.__version__}, backend {jax.default_backend()}, "
    f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, python "
    f"{platform.python_version()}; command: python -m benchmarks.run "
    + " ".join(argv if argv is not None else sys.argv[1:])
  )
  summary = []
  by_model = {}

  def model_section(name: str, make, title: str, hand: str = "flax", **summary_options):
    """Runs one model's variants side by side, prints its tables, adds its target rows."""
    by_model[name] = bench_models.run(
      make,
      policies=policies,
      compile_reps=cfg["compile_reps"],
      step_rounds=cfg["step_rounds"],
      step_per_round=cfg["step_per_round"],
      train_step=cfg["train_step"],
      log=log,
      hand=hand,
    )
    print(
      "\n"
      + bench_models.report(
        title, by_model[name], policies, args.markdown, train_step=cfg["train_step"], hand=hand
      ),
      flush=True,
    )
    return bench_models.summary_rows(name, by_model[name], policies, hand=hand, **summary_options)

  if "lm" in only:
    lm = cfg["lm"]
    log(f"lm: {lm}")
    summary += model_section(
      "lm",
      functools.partial(models.lm_task, **lm),
      f"transformer LM: {lm['layers']} layers, d={lm['d_model']}, {lm['heads']} heads, "
      f"seq {lm['seq']}, batch {lm['batch']}, vocab {lm['vocab']}",
    )
  if "conv" in only:
    conv = cfg["conv"]
    log(f"conv: {conv}")
    summary += model_section(
      "conv",
      functools.partial(models.conv_task, **conv),
      f"conv net: 4 conv {conv['features']} + {conv['norm']} norm + dense, 32x32x3, "
      f"batch {conv['batch']}",
    )
  if "haiku" in only:
    from benchmarks import haiku_models  # Haiku and jmp are needed by this section only

    hk_cfg = cfg["haiku"]
    log(f"haiku: {hk_cfg}")
    summary += model_section(
      "haiku",
      functools.partial(haiku_models.resnet_task, **hk_cfg),
      f"Haiku ResNet: hk.nets.ResNet blocks {hk_cfg['blocks']}, channels "
      f"{hk_cfg['channels']}, hk.BatchNorm, {hk_cfg['image']}x{hk_cfg['image']}x3, "
      f"batch {hk_cfg['batch']}; hand-written: jmp policies as in Haiku's ImageNet example",
      hand="jmp",
      jaxpr_converts=True,
    )
  if "scaler" in only:
    log(f"scaler: {cfg['scaler']}")
    res = bench_scaler.run(**cfg["scaler"], log=log)
    print("\n" + bench_scaler.report(res, args.markdown), flush=True)
    summary += bench_scaler.summary_rows(res)
    peers = dict(
      lm=None if args.quick else cfg["lm"],
      # As deep as make about 50 and 500 leaves, unless --layers names the LM (gpu_check's).
      lm_leaves=() if args.layers is not None else (50, 500),
      # On a GPU the LM step is the float16 one (forward and backward under autocast "cuda").
      lm_device_type="cuda" if jax.default_backend() == "gpu" else None,
      leaves=(8,) if args.quick else (50, 500),
      d=16 if args.quick else 128,
      # Five rounds put the compile ratios within ~3% on the 2-core machine; --compile-reps wins.
      compile_reps=args.compile_reps or (1 if args.quick else 5),
      rounds=cfg["scaler"]["rounds"],
      per_round=cfg["scaler"]["per_round"],
    )
    log(f"scaler peers: {peers}")
    res = bench_scaler_peers.run(**peers, log=log)
    print("\n" + bench_scaler_peers.report(res, args.markdown), flush=True)
    summary += bench_scaler_peers.summary_rows(res)
  if "gpu" in only:
    print("\n" + gpu_section(by_model, policies, args.markdown), flush=True)
  if "depth" in only:
    depths = (2, 8) if args.quick else trace_depth.DEFAULT_DEPTHS
    log(f"depth: {depths}")
    res = trace_depth.run(
      depths, policies=policies, reps=1 if args.quick else 3, compile_reps=0 if args.quick else 1
    )
    print("\n" + trace_depth.report(res, policies, args.markdown), flush=True)
    summary += trace_depth.summary_rows(res, policies)
  if summary:
    head = (
      "### targets"
      if args.markdown
      else "== targets (autocast / hand-written: Flax dtype=, Haiku jmp) =="
    )
    print(f"\n{head}\n")
    print(
      common.table(
        ["model", "policy", "metric", "hand-written", "autocast", "ratio", "target", "status"],
        summary,
        args.markdown,
      )
    )
  print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
