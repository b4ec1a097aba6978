"""Issue #21's device checks in one call: the test suite and the GPU benchmarks on a CUDA machine.

A session that is lent a GPU has about 15 minutes of device time, machine start included, and
at most 10 minutes a command. This script does the whole check in one command and keeps going
when one step fails or runs out of time. Every step has its own time limit and writes its own
files under ``$OUT``, so the results come back whatever happens.

Here, before the device call (the wheels the GPU image lacks, into the git-ignored wheels/gpu):

    python scripts/gpu_check.py --fetch-wheels

On the device machine (the session's ``run`` tool, with ``carry=["wheels"]``):

    python scripts/gpu_check.py                  # every step, about 9 minutes at most
    python scripts/gpu_check.py --steps tests    # some of: env, install, tests, bench, fp8, scaler

Here, to try the plumbing on the CPU with tiny sizes:

    python scripts/gpu_check.py --dry-run --steps env,tests,bench

Steps:

- ``env``: ``nvidia-smi`` and JAX's version and devices.
- ``install``: the carried wheels and jaxamp itself, both with ``--no-deps``. The image's jax,
  flax, optax, chex, equinox, orbax and torch are kept.
- ``tests``: the fast subset (``-m "not slow"``) on the GPU backend, with a JUnit XML report.
- ``bench``: ``benchmarks.run`` for the LM, the conv net and the GPU section (issue #21.2). The
  LM and conv net are sized so that a float32 step takes tens of milliseconds on an H100.
- ``fp8``: ``benchmarks.fp8``'s GPU section: float8 autocast against bfloat16, the step time
  and the float8 gemm calls in the compiled HLO (issue #27.4).
- ``scaler``: ``benchmarks.run``'s scaler sections (issue #21.3). Last, since the budget may run
  out before it: ``--steps install,scaler`` on the still-warm machine runs it alone.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHEELS = ROOT / "wheels" / "gpu"
# What the tests import that the GPU image does not have (pure-Python wheels, no dependencies
# pulled: the image's jax must stay).
MISSING_ON_IMAGE = ("hypothesis", "sortedcontainers", "attrs", "dm-haiku", "jmp", "tabulate")
IMAGE_PYTHONS = ("3.11", "3.12", "3.13")
STEPS = ("env", "install", "tests", "bench", "fp8", "scaler")
# Seconds each step may take, within a 600 s command limit less start-up and transfers.
LIMITS = {"env": 30, "install": 60, "tests": 150, "bench": 200, "fp8": 60, "scaler": 120}
# An LM whose float32 train step takes tens of milliseconds on an H100 (~130M parameters, 8192
# tokens a step) and a conv net of the same order.
GPU_SIZES = (
  "--layers 8 --d-model 1024 --heads 16 --seq 512 --batch 16 --vocab 32768 --conv-batch 256 "
  "--compile-reps 1 --step-rounds 3"
)
DRY_RUN_SIZES = "--quick"


def commands(out: pathlib.Path, dry_run: bool) -> dict[str, str]:
  """The shell command of each step."""
  py = shlex.quote(sys.executable)
  sizes = DRY_RUN_SIZES if dry_run else GPU_SIZES
  tests = "tests/project/test_compat.py" if dry_run else "tests"
  return {
    "env": f"(nvidia-smi || true) && {py} -c 'import jax; print(jax.__version__, jax.devices())'",
    "install": (
      f"{py} -m pip install --no-deps --no-index --find-links {shlex.quote(str(WHEELS))} "
      f"{' '.join(MISSING_ON_IMAGE)} && {py} -m pip install --no-deps -e {shlex.quote(str(ROOT))}"
    ),
    "tests": (
      f"{py} -m pytest -p no:cacheprovider -o addopts='' -q -m 'not slow' {tests} "
      f"--junitxml={shlex.quote(str(out / 'tests.xml'))}"
    ),
    "bench": (
      f"{py} -m benchmarks.run --only lm,conv,gpu --markdown {sizes} "
      f"> {shlex.quote(str(out / 'bench.md'))}"
    ),
    "fp8": f"{py} -m benchmarks.fp8 --only gpu --markdown > {shlex.quote(str(out / 'fp8.md'))}",
    "scaler": (
      f"{py} -m benchmarks.run --only scaler --markdown {sizes} "
      f"> {shlex.quote(str(out / 'scaler.md'))}"
    ),
  }


def run_step(name: str, command: str, limit: float, out: pathlib.Path) -> int:
  """Runs ``command`` for at most ``limit`` seconds; its output goes to ``out/<name>.log``."""
  with open(out / f"{name}.log", "w") as log:
    log.write(f"$ {command}\n(limit {limit:.0f} s)\n\n")
    log.flush()
    start = time.monotonic()
    # A session of its own, so that a timeout stops the whole step (the shell's children too)
    # and nothing is left holding the GPU.
    proc = subprocess.Popen(
      command, shell=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
      rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      rc = 124
    log.write(f"\n[{name}: exit {rc} after {time.monotonic() - start:.0f} s]\n")
  return rc


def fetch_wheels() -> int:
  """Downloads the wheels the GPU image lacks into wheels/gpu (here, where there is a network),
  for each Python the image may have: hypothesis's wheels are built per version."""
  WHEELS.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(WHEELS)]
  for version in IMAGE_PYTHONS:
    per_version = ["--python-version", version, "--only-binary=:all:"]
    rc = subprocess.run([*command, *per_version, *MISSING_ON_IMAGE]).returncode
    if rc:
      return rc
  return 0


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {STEPS}")
  p.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together")
  p.add_argument("--dry-run", action="store_true", help="tiny sizes and tests, for a CPU")
  p.add_argument("--fetch-wheels", action="store_true", help="download the wheels and stop")
  args = p.parse_args(argv)
  if args.fetch_wheels:
    return fetch_wheels()
  steps = [s.strip() for s in args.steps.split(",") if s.strip()]
  unknown = sorted(set(steps) - set(STEPS))
  if unknown:
    p.error(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
  out = pathlib.Path(os.environ.get("OUT") or ROOT / "out" / "gpu_check")
  out.mkdir(parents=True, exist_ok=True)
  deadline = time.monotonic() + args.budget
  summary = []
  for name, command in commands(out, args.dry_run).items():
    if name not in steps:
      continue
    left = deadline - time.monotonic()
    if left < 10:
      summary.append(f"{name}: not started, {left:.0f} s left of the budget")
      continue
    start = time.monotonic()
    rc = run_step(name, command, min(LIMITS[name], left), out)
    summary.append(f"{name}: exit {rc} in {time.monotonic() - start:.0f} s")
  (out / "summary.txt").write_text("\n".join(summary) + "\n")
  print("\n".join(summary))
  for name in steps:  # the end of each log, so the command's own output shows the gist
    log = out / f"{name}.log"
    if log.exists():
      print(f"\n== {name} ==\n" + "\n".join(log.read_text().splitlines()[-15:]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
