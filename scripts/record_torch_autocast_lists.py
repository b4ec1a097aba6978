"""Records torch's own autocast test lists, and what torch's CPU autocast does with the CPU ones.

Regenerate (needs torch; the committed golden was made with torch 2.13.0, CPU build):

  . .venv/bin/activate
  python scripts/record_torch_autocast_lists.py   # -> tests/goldens/torch_autocast_lists.json

The lists are ``torch/testing/_internal/autocast_test_lists.py``: ``AutocastTestLists`` (CUDA,
float16; used by torch's ``test/test_cuda.py``) and ``AutocastCPUTestLists`` (CPU, bfloat16 and
float16; used by ``test/test_autocast.py``), both built here on the CPU. For every entry the
golden file stores its op, the shapes and dtypes of its tensor arguments (in order, tensors inside
sequence arguments included), a description of its other arguments, the dtype torch's own test
expects of it (the list's ``run_as_type``, or the entry's ``out_type``; ``"raises"`` for the
banned list) and the shapes of its results (run without autocast, on float32 inputs). The CPU
entries also run the way torch's test runs them, inside
``torch.autocast("cpu", dtype=torch.bfloat16)`` and ``dtype=torch.float16``, and the dtypes
torch returned are stored (the CUDA entries cannot run on this machine).

Entry ids are the op's name, with ``#2``, ``#3``, ... for an op's later entries in one list.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import pathlib
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

SEED = 20240611
OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/goldens/torch_autocast_lists.json"
CPU_MODES = ("bfloat16", "float16")
_LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# The lists torch's tests run, and the dtype each expects (``run_as_type``; None: per entry).
CUDA_LISTS = {
  "torch_expect_builtin_promote": None,
  "methods_expect_builtin_promote": None,
  "torch_fp16": "float16",
  "torch_fp32": "float32",
  "torch_need_autocast_promote": "float32",
  "nn_fp16": "float16",
  "nn_fp32": "float32",
  "linalg_fp16": "float16",
  "methods_fp16": "float16",
  "methods_fp32": "float32",
  "banned": "raises",
}
CPU_LISTS = {
  "torch_expect_builtin_promote": None,
  "methods_expect_builtin_promote": None,
  "torch_16": "low",
  "nn_16": "low",
  "torch_fp32": "float32",
  "nn_fp32": "float32",
  "torch_need_autocast_promote": "float32",
}


def _module(list_name: str) -> Any:
  """The namespace torch's test looks the op up in (None: a Tensor method)."""
  if list_name.startswith("nn_"):
    return torch._C._nn
  if list_name.startswith("linalg_"):
    return torch._C._linalg
  if list_name.startswith("methods_"):
    return None
  return torch


class Entry(NamedTuple):
  """One entry of a list, split the way torch's test splits it.

  Attributes:
    device: "cuda" or "cpu".
    list_name: the list's attribute name.
    id: the op's name, with ``#k`` for the k-th entry of the same op in the list.
    op: the op's name.
    calls: mode -> positional arguments (CPU promote lists have one tuple per mode).
    kwargs: keyword arguments.
    module: where the op is looked up (None: a method of the first argument).
    expect: mode -> the dtype torch's test expects (its name), or "raises".
    skipped_by_torch: torch's test does not run the entry (the third item of a ``torch_fp16``
      entry is its skip flag).
    unused: items of the entry torch's test does not pass to the op (a skip flag).
  """

  device: str
  list_name: str
  id: str
  op: str
  calls: dict[str, tuple]
  kwargs: dict[str, Any]
  module: Any
  expect: dict[str, str]
  skipped_by_torch: bool
  unused: tuple = ()


def _dtype_name(dtype: torch.dtype) -> str:
  return str(dtype).removeprefix("torch.")


def _split(device: str, list_name: str, item: tuple) -> tuple:
  """(calls, kwargs, module, expect, skipped, unused) of one list item, as torch's test reads it."""
  rest = item[1:]
  module, kwargs, skipped, unused = _module(list_name), {}, False, ()
  modes = ("float16",) if device == "cuda" else CPU_MODES
  run_as = (CUDA_LISTS if device == "cuda" else CPU_LISTS)[list_name]
  if list_name.endswith("expect_builtin_promote"):
    *args, out_type = rest
    calls = dict(zip(modes, args, strict=True))
    expect = dict.fromkeys(modes, _dtype_name(out_type))
    return calls, kwargs, module, expect, skipped, unused
  if device == "cpu" and list_name == "torch_need_autocast_promote":
    calls = dict(zip(modes, rest, strict=True))
  else:
    calls = dict.fromkeys(modes, rest[0])
    if list_name == "banned":
      module = rest[1]
    elif len(rest) == 2 and list_name == "torch_fp16":
      # test_cuda.py: ``skip_test = op_with_args[2]`` (TEST_WITH_ROCM). einsum's operands sit
      # there (its equation is read as its arguments): a non-empty tuple, so it is skipped.
      skipped, unused = bool(rest[1]), rest[1:]
    elif len(rest) == 2:
      kwargs = rest[1]
  expect = {mode: mode if run_as == "low" else run_as for mode in modes}
  return calls, kwargs, module, expect, skipped, unused


@functools.cache
def torch_lists() -> dict[str, Any]:
  """``{"cuda": AutocastTestLists, "cpu": AutocastCPUTestLists}``, built on the CPU."""
  try:
    lists = importlib.import_module("torch.testing._internal.autocast_test_lists")
  except ImportError:
    # common_utils needs torch's test-only dependencies (expecttest); the lists need only two
    # of its names.
    name = "torch.testing._internal.common_utils"
    saved = sys.modules.get(name)
    sys.modules[name] = types.SimpleNamespace(TEST_WITH_ROCM=False, TestCase=object)
    try:
      lists = importlib.import_module("torch.testing._internal.autocast_test_lists")
    finally:
      if saved is None:
        del sys.modules[name]
      else:
        sys.modules[name] = saved
  torch.manual_seed(SEED)
  cpu = torch.device("cpu")
  return {"cuda": lists.AutocastTestLists(cpu), "cpu": lists.AutocastCPUTestLists(cpu)}


@functools.cache
def entries() -> tuple[Entry, ...]:
  """Every entry of the CUDA and CPU lists torch's tests run."""
  out = []
  for device, names in (("cuda", CUDA_LISTS), ("cpu", CPU_LISTS)):
    lists = torch_lists()[device]
    for list_name in names:
      seen: collections.Counter = collections.Counter()
      for item in getattr(lists, list_name):
        op = item[0]
        seen[op] += 1
        entry_id = op if seen[op] == 1 else f"{op}#{seen[op]}"
        out.append(Entry(device, list_name, entry_id, op, *_split(device, list_name, item)))
  return tuple(out)


def tensors(value: Any) -> Iterator[torch.Tensor]:
  """The tensors of an argument tuple, in order (inside sequences too)."""
  if isinstance(value, torch.Tensor):
    yield value
  elif isinstance(value, tuple | list):
    for item in value:
      yield from tensors(item)


def substitute(value: Any, replacements: Iterator[torch.Tensor]) -> Any:
  """``value`` with its tensors replaced, in order, by ``replacements``."""
  if isinstance(value, torch.Tensor):
    return next(replacements)
  if isinstance(value, tuple | list):
    return type(value)(substitute(item, replacements) for item in value)
  return value


def _call(entry: Entry, args: tuple) -> Any:
  if entry.module is not None and hasattr(entry.module, entry.op):
    return getattr(entry.module, entry.op)(*args, **entry.kwargs)
  return getattr(args[0], entry.op)(*args[1:], **entry.kwargs)


def run(entry: Entry, mode: str, inputs: list[torch.Tensor] | None = None) -> Any:
  """The entry's op under ``torch.autocast("cpu", dtype=mode)``, as torch's test calls it.

  ``inputs`` replace the entry's own tensors (same shapes and dtypes).
  """
  args = entry.calls[mode]
  if inputs is not None:
    args = substitute(args, iter(inputs))
  with torch.autocast("cpu", dtype=_LOW[mode]):
    return _call(entry, args)


def result_shapes(entry: Entry, mode: str) -> list | None:
  """The shapes of the entry's results without autocast, its floating tensors as float32.

  (torch's CPU kernels lack float16 versions of some ops, and the promote-list ops reject mixed
  dtypes without autocast; the shapes do not depend on the dtype.) None where it cannot run on
  the CPU.
  """
  as_float32 = [t.float() if t.is_floating_point() else t for t in tensors(entry.calls[mode])]
  try:
    output = _call(entry, substitute(entry.calls[mode], iter(as_float32)))
  except (RuntimeError, TypeError, ValueError, NotImplementedError):
    return None
  if isinstance(output, tuple | list):
    return [list(item.shape) for item in output]
  return [list(output.shape)] if isinstance(output, torch.Tensor) else []


def result_dtype(output: Any) -> str | list:
  """A result's dtype name; a list of them for a tuple; the type name of a non-tensor."""
  if isinstance(output, torch.Tensor):
    return _dtype_name(output.dtype)
  if isinstance(output, tuple | list):
    return [result_dtype(item) for item in output]
  return type(output).__name__


def _describe(value: Any) -> Any:
  if isinstance(value, torch.Tensor):
    return f"Tensor[{_dtype_name(value.dtype)}]{tuple(value.shape)}"
  if isinstance(value, tuple | list):
    return [_describe(item) for item in value]
  if isinstance(value, dict):
    return {key: _describe(item) for key, item in value.items()}
  if isinstance(value, types.ModuleType):
    return value.__name__
  if isinstance(value, torch.dtype):
    return _dtype_name(value)
  return value


def describe(entry: Entry) -> dict[str, Any]:
  """An entry as stored in the golden file (the CPU entries with torch's results)."""
  record = {
    "id": entry.id,
    "op": entry.op,
    "module": "Tensor" if entry.module is None else entry.module.__name__,
    "args": {mode: _describe(args) for mode, args in entry.calls.items()},
    "kwargs": _describe(entry.kwargs),
    "tensors": {
      mode: [[_dtype_name(t.dtype), list(t.shape)] for t in tensors((args, entry.unused))]
      for mode, args in entry.calls.items()
    },
    "expect": entry.expect,
    "shapes": {mode: result_shapes(entry, mode) for mode in entry.calls},
    "skipped_by_torch": entry.skipped_by_torch,
  }
  if entry.device == "cpu":
    results = {}
    for mode in CPU_MODES:
      try:
        results[mode] = result_dtype(run(entry, mode))
      except Exception as error:  # noqa: BLE001  (torch's error is the result)
        results[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    record["results"] = results
  return record


def record() -> dict[str, Any]:
  lists: dict[str, dict[str, list]] = {"cuda": {}, "cpu": {}}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # deprecations of chain_matmul, cross, ...
    for entry in entries():
      lists[entry.device].setdefault(entry.list_name, []).append(describe(entry))
  return {
    "generator": "scripts/record_torch_autocast_lists.py",
    "source": "torch/testing/_internal/autocast_test_lists.py",
    "torch_version": torch.__version__,
    "seed": SEED,
    "cpu_modes": list(CPU_MODES),
    "lists": lists,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  args = parser.parse_args()
  golden = record()
  args.out.write_text(json.dumps(golden, indent=1) + "\n")
  count = sum(len(entries) for lists in golden["lists"].values() for entries in lists.values())
  print(f"wrote {count} entries to {args.out}")


if __name__ == "__main__":
  main()
