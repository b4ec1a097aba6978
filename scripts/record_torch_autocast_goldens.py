"""Records what torch's CPU autocast does with the cases of ``tests/torch_autocast_cases.py``.

Regenerate (needs torch; the committed goldens were made with torch 2.13.0, CPU build):

  . .venv/bin/activate
  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  python scripts/record_torch_autocast_goldens.py   # -> tests/goldens/torch_cpu_autocast.json

Each case (its inputs drawn by ``with_inputs``) is run three ways: ``bfloat16`` inside
``torch.autocast("cpu", dtype=torch.bfloat16)``, ``float16`` likewise, and ``none`` without
autocast, float32 (the reference values for ``jaxamp.functional``). Each result stores its dtype,
shape and values (complex results: ``values`` and ``imag``), or the error torch raised. The tests
replay the cases with ``run_case`` and ``torch_inputs`` when torch is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "goldens" / "torch_cpu_autocast.json"
_TORCH_DTYPES = {
  "float32": torch.float32,
  "float64": torch.float64,
  "int64": torch.int64,
  "bool": torch.bool,
  "bfloat16": torch.bfloat16,
  "float16": torch.float16,
}


def _load_cases():
  """``tests/torch_autocast_cases.py``, the case data the tests replay."""
  path = ROOT / "tests" / "torch_autocast_cases.py"
  spec = importlib.util.spec_from_file_location("torch_autocast_cases", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


CASES = _load_cases()
MODES, SEED = CASES.MODES, CASES.SEED


# --- running torch -----------------------------------------------------------------------------


def disabled(thunk: Callable[[], Any]) -> Any:
  """Runs ``thunk`` under ``torch.autocast("cpu", enabled=False)``."""
  with torch.autocast("cpu", enabled=False):
    return thunk()


def torch_inputs(inputs: dict[str, Any], mode: str) -> dict[str, torch.Tensor]:
  """The stored inputs of a case as torch tensors for ``mode`` ("bfloat16", "float16", "none")."""
  out = {}
  for name, spec in inputs.items():
    dtype = spec["dtype"]
    if dtype == "low":
      dtype = "float32" if mode == "none" else mode
    values = np.asarray(spec["values"]).reshape(spec["shape"])
    out[name] = torch.from_numpy(values).to(_TORCH_DTYPES[dtype])
  return out


def run_case(expr: str, inputs: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
  """Evaluates ``expr`` over ``inputs`` under ``mode``'s autocast (none: no autocast)."""
  scope = {"torch": torch, "F": F, "disabled": disabled, **inputs}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if mode == "none":
      return eval(expr, scope)  # noqa: S307 - our own expressions
    with torch.autocast("cpu", dtype=_TORCH_DTYPES[mode]):
      return eval(expr, scope)  # noqa: S307


def encode(result: torch.Tensor) -> dict[str, Any]:
  """A result's dtype, shape and values (complex: real ``values`` and ``imag``)."""
  t = result.detach()
  entry: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
  if t.is_complex():
    entry["values"] = t.real.double().reshape(-1).tolist()
    entry["imag"] = t.imag.double().reshape(-1).tolist()
  elif t.dtype.is_floating_point:
    entry["values"] = t.double().reshape(-1).tolist()
  else:
    entry["values"] = t.long().reshape(-1).tolist()
  return entry


def has_autocast_kernel(op: str, key: str) -> bool:
  """Whether torch registers an autocast kernel for some overload of ``aten::op`` under ``key``."""
  names = [n for n in torch._C._dispatch_get_all_op_names() if n.split(".")[0] == f"aten::{op}"]
  return any(torch._C._dispatch_has_kernel_for_dispatch_key(n, key) for n in names)


def record(seed: int = SEED) -> dict[str, Any]:
  """Runs every case under every mode; the golden file's content."""
  cases = CASES.with_inputs(seed)
  for c in cases:
    c["autocast_kernel"] = {
      key: has_autocast_kernel(c["torch_op"], key) for key in ("AutocastCPU", "AutocastCUDA")
    }
    c["results"] = {}
    for mode in MODES:
      try:
        c["results"][mode] = encode(run_case(c["expr"], torch_inputs(c["inputs"], mode), mode))
      except Exception as e:  # noqa: BLE001 - torch's error is the golden result
        c["results"][mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
  return {
    "generator": "scripts/record_torch_autocast_goldens.py",
    "torch_version": torch.__version__,
    "seed": seed,
    "modes": list(MODES),
    "cases": cases,
  }


def appended(recorded: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
  """``recorded`` with the cases of ``fresh`` it lacks added at the end (the inputs of a case
  depend only on the cases before it, so the recorded ones are unchanged)."""
  if recorded["seed"] != fresh["seed"]:
    raise ValueError(f"the recorded seed is {recorded['seed']}, not {fresh['seed']}")
  names = [c["name"] for c in recorded["cases"]]
  if names != [c["name"] for c in fresh["cases"][: len(names)]]:
    raise ValueError("the recorded cases are not the first cases of tests/torch_autocast_cases.py")
  return dict(recorded, cases=recorded["cases"] + fresh["cases"][len(names) :])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument("--seed", type=int, default=SEED)
  parser.add_argument(
    "--append-new",
    action="store_true",
    help="record only the cases --out does not hold yet and keep its recorded ones (kernels "
    "differ between CPUs in the last bits: a conv recorded on AVX-512 is not re-recorded here)",
  )
  args = parser.parse_args()
  golden = record(args.seed)
  if args.append_new:
    golden = appended(json.loads(args.out.read_text()), golden)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
  errors = [
    (c["name"], m, r["error"])
    for c in golden["cases"]
    for m, r in c["results"].items()
    if "error" in r
  ]
  print(f"wrote {len(golden['cases'])} cases to {args.out} ({args.out.stat().st_size} bytes)")
  for name, mode, error in errors:
    print(f"  {name} [{mode}]: {error}")


if __name__ == "__main__":
  main()
