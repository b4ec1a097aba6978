"""Checks the scaler's exact float64 arithmetic against NumPy's on every float32 scale.

Run from the repository root:  python scripts/check_exact_f64.py  (~2 minutes on 2 cores)

For every non-negative float32 bit pattern (zero, subnormals, normals, inf and NaNs; a negative
scale differs only in the sign bit) it compares ``exact_f64.unscale_factors``' inverse with
``np.float32(1 / np.float64(scale))``, torch's ``scale.double().reciprocal().float()``, and checks
that ``a * b`` is that inverse exactly with ``a`` a normal float32. The tests sample the same
ranges; this covers all 2**31 of them, the ground for ``exact_f64``'s 26-bit reciprocal. Exits
1 and prints the first mismatches if any. ``--first``/``--count`` check a slice of chunks.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.scaler import exact_f64

CHUNK = 2**24  # bit patterns per compiled call
CHUNKS = 2**31 // CHUNK

_factors = jax.jit(exact_f64.unscale_factors)


def mismatches(first_bits: int, count: int) -> np.ndarray:
  """The scales among ``count`` bit patterns from ``first_bits`` whose factors are wrong."""
  x = np.arange(first_bits, first_bits + count, dtype=np.uint64).astype(np.uint32).view(np.float32)
  a, b, inverse = (np.asarray(v) for v in _factors(jnp.asarray(x)))
  with np.errstate(all="ignore"):
    want = (1.0 / x.astype(np.float64)).astype(np.float32)
  same = (inverse.view(np.uint32) == want.view(np.uint32)) | (np.isnan(inverse) & np.isnan(want))
  finite = np.isfinite(want) & (want != 0)
  with np.errstate(all="ignore"):
    exact = a.astype(np.float64) * b.astype(np.float64) == want.astype(np.float64)
  normal = np.abs(a) >= np.finfo(np.float32).tiny
  return x[~same | (finite & ~(exact & normal))]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--first", type=int, default=0, help=f"first chunk of {CHUNK} patterns")
  p.add_argument("--count", type=int, default=CHUNKS, help=f"chunks to check (all: {CHUNKS})")
  p.add_argument("--chunk", type=int, default=CHUNK, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  chunks = range(args.first, min(args.first + args.count, 2**31 // args.chunk))
  bad = []
  for c in chunks:
    bad.extend(mismatches(c * args.chunk, args.chunk)[:5])
  checked = len(chunks) * args.chunk
  if bad:
    print(f"{len(bad)}+ mismatches among {checked} scales, e.g. {bad[:5]}")
    return 1
  print(f"all {checked} scales match")
  return 0


if __name__ == "__main__":
  sys.exit(main())
