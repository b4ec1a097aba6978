"""Shared benchmark helpers: cache clearing, timing, residual bytes, HLO parsing, tables."""

from __future__ import annotations

import collections
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import jaxamp

# --- caches --------------------------------------------------------------------------------------


def clear_all_caches() -> None:
  """JAX's caches and jaxamp's own: the next trace of anything is cold."""
  jax.clear_caches()
  jaxamp.clear_caches()


# --- timing --------------------------------------------------------------------------------------


def block(tree) -> None:
  jax.block_until_ready(tree)


def interleaved_median(
  funs: dict[str, Callable[[], Any]],
  rounds: int,
  per_round: int,
  warmup: int = 1,
  cpu_time: bool = False,
):
  """Median seconds per call of each zero-argument ``fun``, measured round-robin.

  Each round runs every function ``per_round`` times back to back (``block_until_ready`` on the
  last result) and records the mean; the order of the functions alternates between rounds, so
  load from other processes on a shared machine hits all of them alike. Returns the medians over
  rounds of wall time and, with ``cpu_time``, also of this process's CPU time (all threads).
  """
  for fun in funs.values():
    for _ in range(warmup):
      block(fun())
  wall: dict[str, list[float]] = {name: [] for name in funs}
  cpu: dict[str, list[float]] = {name: [] for name in funs}
  for r in range(rounds):
    order = list(funs) if r % 2 == 0 else list(reversed(funs))
    for name in order:
      fun = funs[name]
      c0, t0 = time.process_time(), time.perf_counter()
      for _ in range(per_round):
        out = fun()
        block(out)
      wall[name].append((time.perf_counter() - t0) / per_round)
      cpu[name].append((time.process_time() - c0) / per_round)
  wall_med = {name: statistics.median(s) for name, s in wall.items()}
  if cpu_time:
    return wall_med, {name: statistics.median(s) for name, s in cpu.items()}
  return wall_med


# --- residuals -----------------------------------------------------------------------------------


def residual_stats(fun: Callable, primals: Sequence[Any], *, has_aux: bool = False) -> dict:
  """What ``jax.vjp(fun, *primals)`` keeps for the backward pass, in bytes.

  Traces ``jax.vjp`` to a jaxpr whose outputs are the leaves of the returned VJP function (the
  residuals). Outputs that are the function's inputs themselves (parameters, batch) are counted
  apart as ``arg_bytes``: they are kept alive by the caller anyway. ``bytes`` counts every other
  distinct residual (activations, casted copies of weights, masks) once.
  """

  def residuals(*primals):
    out = jax.vjp(fun, *primals, has_aux=has_aux)
    return jax.tree.leaves(out[1])

  closed = jax.make_jaxpr(residuals)(*primals)
  jaxpr = closed.jaxpr
  invars = set(jaxpr.invars)
  seen = set()
  stats = {
    "bytes": 0,
    "count": 0,
    "arg_bytes": 0,
    "arg_count": 0,
    "by_dtype": collections.Counter(),
  }
  for var in jaxpr.outvars:
    if not hasattr(var, "aval") or type(var).__name__ == "Literal" or var in seen:
      continue
    seen.add(var)
    aval = var.aval
    if not hasattr(aval, "dtype"):
      continue
    nbytes = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    if var in invars:
      stats["arg_bytes"] += nbytes
      stats["arg_count"] += 1
    else:
      stats["bytes"] += nbytes
      stats["count"] += 1
      stats["by_dtype"][str(aval.dtype)] += nbytes
  return stats


# --- jaxprs -------------------------------------------------------------------------------------


def jaxpr_count(jaxpr, primitive_name: str) -> int:
  """The ``primitive_name`` eqns of ``jaxpr`` (a Jaxpr or ClosedJaxpr) and of every jaxpr nested
  in its eqns' params (jit, scan, cond branches, custom_jvp/vjp, remat, ...)."""
  from jax.extend import core as jex_core

  def inner(value):
    if isinstance(value, jex_core.ClosedJaxpr):
      return value.jaxpr
    return value if isinstance(value, jex_core.Jaxpr) else None

  count = 0
  for eqn in inner(jaxpr).eqns:
    count += eqn.primitive.name == primitive_name
    for value in eqn.params.values():
      for item in value if isinstance(value, tuple | list) else (value,):
        sub = inner(item)
        if sub is not None:
          count += jaxpr_count(sub, primitive_name)
  return count


# --- HLO text ------------------------------------------------------------------------------------

_HLO_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^=]*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>.*)$"
)
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")


def _hlo_dtype(type_str: str) -> str:
  match = re.match(r"\(?\s*([a-z]+\d*)", type_str)
  return match.group(1) if match else type_str


def _split_args(args: str) -> str:
  """The operand list of an HLO instruction (up to its matching parenthesis)."""
  depth = 1
  for i, ch in enumerate(args):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        return args[:i]
  return args


def parse_hlo(text: str) -> list[dict]:
  """The instructions of an HLO module's text: name, type, dtype, opcode, operands, attrs."""
  instrs = []
  for line in text.splitlines():
    match = _HLO_INSTR.match(line)
    if not match:
      continue
    args = _split_args(match.group("args"))
    attrs = match.group("args")[len(args) + 1 :]
    instrs.append(
      {
        "name": match.group("name"),
        "type": match.group("type"),
        "dtype": _hlo_dtype(match.group("type")),
        "op": match.group("op"),
        "operands": _HLO_OPERAND.findall(args),
        "attrs": attrs,
      }
    )
  return instrs


def hlo_converts(text: str) -> list[dict]:
  """Every ``convert`` of a compiled HLO module (fusion bodies included) with its dtypes."""
  instrs = parse_hlo(text)
  types = {i["name"]: i["type"] for i in instrs}
  out = []
  for instr in instrs:
    if instr["op"] != "convert":
      continue
    src = types.get(instr["operands"][0], "?") if instr["operands"] else "?"
    out.append({"src": _hlo_dtype(src), "dst": instr["dtype"], "type": instr["type"]})
  return out


_MATMUL_TARGET = re.compile(r"gemm|matmul|conv|cudnn|cublas|triton", re.I)


def hlo_matmul_dtypes(text: str) -> collections.Counter:
  """(kind, operand dtypes -> result dtype) of the dots, convolutions and matmul custom calls.

  ``kind`` is ``dot``, ``convolution``, the custom call's target (``__cublas$gemm``,
  ``__cudnn$convForward``, ...) or ``fusion:<kind>`` for custom (e.g. Triton gemm) fusions.
  """
  instrs = parse_hlo(text)
  types = {i["name"]: i["type"] for i in instrs}
  found: collections.Counter = collections.Counter()
  for instr in instrs:
    op = instr["op"]
    kind = None
    if op in ("dot", "convolution"):
      kind = op
    elif op == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', instr["attrs"])
      if target and _MATMUL_TARGET.search(target.group(1)):
        kind = target.group(1)
    elif op == "fusion" and re.search(r"kind=kCustom", instr["attrs"]):
      calls = re.search(r"calls=%([\w.\-]+)", instr["attrs"])
      name = calls.group(1) if calls else ""
      if _MATMUL_TARGET.search(name) or "gemm" in instr["attrs"]:
        kind = "fusion:custom"
    if kind is None:
      continue
    operands = [_hlo_dtype(types.get(o, "?")) for o in instr["operands"][:2]]
    found[(kind, "x".join(operands), instr["dtype"])] += 1
  return found


# --- StableHLO text ------------------------------------------------------------------------------

_SHLO_OP = re.compile(r"^\s*(?P<results>%[\w#:, ]+?)\s*=\s*\"?(?P<op>[\w.]+)\"?[ (](?P<rest>.*)$")
_SHLO_CONVERT = re.compile(
  r"stablehlo\.convert\s+(?P<arg>%[\w#]+)\s*:\s*\(tensor<(?P<src>[^>]*)>\)\s*->\s*"
  r"tensor<(?P<dst>[^>]*)>(?:\s*loc\((?P<loc>#loc\d*)\))?"
)


def _tensor_dtype(tensor: str) -> str:
  return tensor.rsplit("x", 1)[-1] if "x" in tensor else tensor


def _tensor_shape(tensor: str) -> str:
  return "x".join(tensor.split("x")[:-1])


def stablehlo_converts(text: str) -> list[dict]:
  """Every ``stablehlo.convert`` with src/dst types, its producer and its consumers' op names.

  ``text`` is ``lowered.as_text(debug_info=True)``; locations give the name stack of each op.
  """
  locs = {m.group(1): m.group(2) for m in re.finditer(r"^(#loc\d*) = (.*)$", text, re.M)}
  name_cache: dict[str, str] = {}

  def loc_name(ref: str | None, depth: int = 0) -> str:
    if ref is None or depth > 50:
      return ""
    if ref in name_cache:
      return name_cache[ref]
    body = locs.get(ref, "")
    match = re.match(r'loc\("([^"]*)"', body)
    if match and "/" in match.group(1):
      name = match.group(1)
    else:
      name = ""
      for inner in re.findall(r"#loc\d+", body):
        name = loc_name(inner, depth + 1)
        if name:
          break
    name_cache[ref] = name
    return name

  defs: dict[str, tuple[str, str]] = {}  # value -> (op, loc name)
  users: dict[str, list[str]] = collections.defaultdict(list)
  converts = []
  for line in text.splitlines():
    match = _SHLO_OP.match(line)
    if not match:
      continue
    loc = re.search(r"loc\((#loc\d*)\)\s*$", line)
    name = loc_name(loc.group(1) if loc else None)
    op = match.group("op")
    for result in re.findall(r"%[\w#]+", match.group("results")):
      defs[result.split("#")[0]] = (op, name)
    for operand in re.findall(r"%[\w#]+", match.group("rest")):
      users[operand.split("#")[0]].append(f"{op.removeprefix('stablehlo.')}@{_short(name)}")
    conv = _SHLO_CONVERT.search(line)
    if conv:
      result = re.findall(r"%[\w#]+", match.group("results"))[0].split("#")[0]
      converts.append(
        {
          "result": result,
          "arg": conv.group("arg").split("#")[0],
          "src": _tensor_dtype(conv.group("src")),
          "dst": _tensor_dtype(conv.group("dst")),
          "shape": _tensor_shape(conv.group("src")),
          "name": _short(name),
        }
      )
  for conv in converts:
    producer = defs.get(conv["arg"])
    conv["producer"] = (
      f"{producer[0].removeprefix('stablehlo.')}@{_short(producer[1])}" if producer else "argument"
    )
    conv["consumers"] = users.get(conv["result"], [])
  return converts


def _short(name: str) -> str:
  """A name stack without the jit(...) prefix and transform wrappers."""
  name = re.sub(r"^jit\([^)]*\)/", "", name)
  name = re.sub(r"(jvp|transpose|vmap|remat|checkpoint)\(", "", name).replace(")", "")
  return name


def convert_pairs(converts: list[dict]) -> collections.Counter:
  return collections.Counter(f"{c['src']}->{c['dst']}" for c in converts)


def _size(shape: str | None) -> int:
  if not shape:
    return 1
  return int(np.prod([int(d) for d in shape.split("x") if d.isdigit()], dtype=np.int64))


def extra_converts(ours: list[dict], theirs: list[dict], limit: int = 8) -> list[dict]:
  """Converts of ``ours`` beyond those ``theirs`` has with the same (src, dst, element count).

  Element counts rather than shapes: casting a bias before or after its reshape is the same cost.
  """
  budget = collections.Counter((c["src"], c["dst"], _size(c.get("shape"))) for c in theirs)
  extra = []
  for conv in ours:
    key = (conv["src"], conv["dst"], _size(conv.get("shape")))
    if budget[key] > 0:
      budget[key] -= 1
    else:
      extra.append(conv)
  return extra[:limit] if limit else extra


# --- tables --------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
  cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
  if markdown:
    lines = [
      "| " + " | ".join(cells[0]) + " |",
      "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
    return "\n".join(lines)
  widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
  lines = [
    "  ".join(
      c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
    )
    for row in cells
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
  return str(value)


def mib(nbytes: float) -> str:
  return f"{nbytes / 2**20:.2f}"


def ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f}"


def ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}x" if b else "n/a"


def target_mark(value: float, target: float) -> str:
  return "ok" if value <= target + 1e-9 else "MISSED"
