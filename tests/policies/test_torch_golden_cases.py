"""The torch CPU autocast golden file records the cases ``torch_autocast_cases`` defines, as
defined: the tests replay the definitions with the recorded inputs and results, so a case edited
without re-running ``scripts/record_torch_autocast_goldens.py`` fails here."""

import torch_autocast_cases
import torch_goldens

DEFINED = torch_autocast_cases.all_cases()
RECORDED = torch_goldens.RECORDED


def test_the_golden_file_records_every_defined_case_in_order():
  assert [c["name"] for c in RECORDED["cases"]] == [c["name"] for c in DEFINED]


def test_each_recorded_case_states_its_definition():
  for defined, recorded in zip(DEFINED, RECORDED["cases"], strict=True):
    for key in torch_goldens.DEFINITION:
      assert recorded[key] == defined[key], (defined["name"], key)


def test_each_recorded_input_has_its_defined_name_shape_and_dtype():
  for defined, recorded in zip(DEFINED, RECORDED["cases"], strict=True):
    shapes = {name: (s["shape"], s["dtype"]) for name, s in recorded["inputs"].items()}
    assert shapes == {name: (s["shape"], s["dtype"]) for name, s in defined["inputs"].items()}


def test_the_recorded_inputs_are_those_the_recorded_seed_draws():
  drawn = torch_autocast_cases.with_inputs(RECORDED["seed"])
  for case, recorded in zip(drawn, RECORDED["cases"], strict=True):
    assert case["inputs"] == recorded["inputs"], case["name"]


def test_every_case_is_recorded_in_every_mode():
  assert RECORDED["modes"] == list(torch_autocast_cases.MODES)
  assert all(list(c["results"]) == RECORDED["modes"] for c in RECORDED["cases"])


def test_the_replayed_cases_are_the_definitions_with_the_recorded_values():
  for defined, recorded in zip(DEFINED, RECORDED["cases"], strict=True):
    replayed = torch_goldens.CASES[defined["name"]]
    assert replayed["expr"] == defined["expr"]
    assert replayed["results"] == recorded["results"]
    for name, spec in replayed["inputs"].items():
      assert spec == dict(defined["inputs"][name], values=recorded["inputs"][name]["values"])
