"""The torch CPU autocast cases (``torch_autocast_cases``) with the inputs and results recorded
for them in ``goldens/torch_cpu_autocast.json``, and the script that recorded them (live runs)."""

import functools
import json
import pathlib

import pytest
import script_modules
import torch_autocast_cases

GOLDEN = pathlib.Path(__file__).parent / "goldens" / "torch_cpu_autocast.json"
RECORDED = json.loads(GOLDEN.read_text())
# The definition of a case: what ``torch_autocast_cases`` states and the golden file repeats.
DEFINITION = ("name", "expr", "group", "torch_op", "functional")


def _replayed(case: dict, recorded: dict) -> dict:
  """``case`` as defined, with the input values and the results recorded for it."""
  inputs = {
    name: dict(spec, values=recorded["inputs"][name]["values"])
    for name, spec in case["inputs"].items()
  }
  return dict(recorded, **{key: case[key] for key in DEFINITION}, inputs=inputs)


_RECORDED_BY_NAME = {c["name"]: c for c in RECORDED["cases"]}
# name -> case, for every defined case the golden file records (``test_torch_golden_cases``
# checks it records each, as defined).
CASES = {
  c["name"]: _replayed(c, _RECORDED_BY_NAME[c["name"]])
  for c in torch_autocast_cases.all_cases()
  if c["name"] in _RECORDED_BY_NAME
}


@functools.cache
def recorder():
  """The golden script as a module (its torch helpers); skips the test when torch is missing."""
  pytest.importorskip("torch")
  return script_modules.load("record_torch_autocast_goldens")
