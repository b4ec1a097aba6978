"""Records torch's answer for a 16-bit tensor combined with a Python scalar, as golden values.

Regenerate (needs torch; the committed goldens were made with torch 2.13.0, CPU build):

  python scripts/record_scalar_opmath_goldens.py   # -> tests/goldens/torch_scalar_opmath.json

torch's kernels compute a 16-bit tensor and a Python scalar in float32 ("opmath") and round
the result to the tensor's dtype, so a scalar too large (or too small) for 16 bits still gives
the right product, or an infinity where the product overflows. Each case records:

* ``opmath``: that computation written out, ``op(x.float(), s).to(x.dtype)`` — the answer of
  torch's CUDA kernels for every op here, and jaxamp's;
* ``torch_cpu``: what torch's CPU kernel returns, or ``None`` where it refuses the scalar
  (``clamp``, ``pow``: "value cannot be converted ... without overflow"). The CPU kernels of
  ``*`` and ``/`` use opmath; those of ``+``, ``-`` and the comparisons first convert the scalar
  to the tensor's dtype (an infinity where it overflows), and ``s / x`` is ``reciprocal(x) * s``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "goldens" / "torch_scalar_opmath.json"
# Exactly representable in float16 and bfloat16 (bfloat16 rounds 60000 to 59904, kept as such).
VALUES = [1e-3, 0.5, 0.6875, 2.0, -3.0, 0.0, 300.0, 60000.0, -60000.0]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# name -> torch expression of the tensor ``x`` and the scalar ``s``.
OPS = {
  "mul": "x * s",
  "div": "x / s",
  "rdiv": "s / x",
  "add": "x + s",
  "sub": "x - s",
  "rsub": "s - x",
  "pow": "x ** s",
  "clamp": "torch.clamp(x, -s, s)",
  "maximum": "torch.clamp_min(x, -s)",
  "lt": "x < s",
}
# Per dtype: scalars that fit it and scalars that do not (too large, or flushed to zero).
SCALARS = {
  "float16": {"fits": [0.5, 3.0, -1.5, 2.0], "does_not_fit": [1e5, -7e4, 1e-8]},
  # bfloat16 has float32's exponent range: only the largest float32 values do not fit it.
  "bfloat16": {"fits": [0.5, 3.0, -1.5, 2.0], "does_not_fit": [3.4e38, -3.4e38]},
}
CPU_OPMATH = ("mul", "div")  # the ops whose torch CPU kernels compute in opmath
# Negative bases: NaN either way. x / 3.4e38: XLA turns a division by a constant into a product
# with its reciprocal, a float32 subnormal that XLA:CPU flushes to zero (plain JAX does too).
SKIP = {("pow", -1.5), ("pow", 1e5), ("pow", -7e4), ("div", 3.4e38), ("div", -3.4e38)}


def opmath(expr: str, x: torch.Tensor, s: float) -> torch.Tensor:
  """``expr`` computed in float32 and rounded to ``x``'s dtype."""
  out = eval(expr, {"torch": torch, "x": x.float(), "s": s})
  return out if out.dtype == torch.bool else out.to(x.dtype)


def torch_cpu(expr: str, x: torch.Tensor, s: float) -> torch.Tensor | None:
  """What torch's CPU kernel returns, or None where it refuses the scalar."""
  try:
    return eval(expr, {"torch": torch, "x": x, "s": s})
  except RuntimeError:
    return None


def encode(out: torch.Tensor | None) -> dict | None:
  if out is None:
    return None
  return dict(dtype=str(out.dtype).removeprefix("torch."), values=out.float().tolist())


def record() -> dict:
  cases = []
  for dtype_name, dtype in DTYPES.items():
    x = torch.tensor(VALUES, dtype=torch.float32).to(dtype)
    for fit, scalars in SCALARS[dtype_name].items():
      for s in scalars:
        for op, expr in OPS.items():
          if (op, s) in SKIP:
            continue
          cases.append(
            dict(
              op=op,
              expr=expr,
              dtype=dtype_name,
              scalar=s,
              fits=fit == "fits",
              inputs=x.float().tolist(),
              opmath=encode(opmath(expr, x, s)),
              torch_cpu=encode(torch_cpu(expr, x, s)),
            )
          )
  return {"torch": torch.__version__, "cases": cases}


def main() -> None:
  OUT.write_text(json.dumps(record(), indent=1, allow_nan=True) + "\n")
  print(f"wrote {OUT}")


if __name__ == "__main__":
  np.seterr(all="ignore")
  main()
