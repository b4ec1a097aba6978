"""The coverage document lists every op of torch's reference lists, realised as torch says."""

import importlib.util
import json

import pytest
from paths import ROOT

import jaxamp  # noqa: F401  (registers jaxamp.functional's op regions)
from jaxamp._src.autocast import library_ops, regions
from jaxamp._src.policies import policy
from jaxamp._src.reports import coverage

_spec = importlib.util.spec_from_file_location("make_coverage", ROOT / "scripts/make_coverage.py")
make_coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_coverage)


def _ops():
  return make_coverage.reference_ops()


def test_torchs_op_lists_are_kept_in_the_repository_with_their_source_and_license():
  assert make_coverage.REFERENCE.is_relative_to(ROOT)
  reference = json.loads(make_coverage.REFERENCE.read_text())
  assert "PyTorch documentation" in reference["source"] and "BSD-3-Clause" in reference["license"]
  lists = {(x["device"], x["category"]): x["ops"] for x in reference["lists"]}
  assert set(lists) == set(make_coverage.SECTIONS.values())
  assert {"matmul", "conv2d"} <= set(lists["cuda", "lower"]) and "softmax" in lists[
    "cuda", "float32"
  ]


def test_every_reference_op_is_realised_in_its_torch_category_or_not_applicable():
  for device_type, category, name in _ops():
    line = coverage.coverage(device_type, name)
    assert line.startswith((f"{category}:", "not applicable:")), (device_type, name, line)


def test_coverage_document_is_up_to_date():
  committed = (ROOT / "docs" / "coverage.md").read_text()
  assert committed == make_coverage.render(_ops()), "run python scripts/make_coverage.py"


@pytest.mark.parametrize("device_type", policy.device_types())
def test_every_op_region_of_a_table_has_an_implementation(device_type):
  library = {name for _, _, name in library_ops.LIBRARY_OPS}
  registered = set(regions.registered_ops())
  for row in policy.get_table(device_type).rows:
    for op in row.ops:
      name = op.partition("[")[0]  # an op used as a variant: avg_pool[3d]
      assert name in library | registered | coverage.NATIVE_PROMOTION, (device_type, op)


def test_every_op_of_torch_xlas_tpu_lists_is_realised_in_its_category():
  # torch's reference has no TPU lists; these are torch_xla's (coverage.TPU_REFERENCE).
  ops = make_coverage.tpu_ops()
  assert {category for _, category, _ in ops} == {"lower", "float32", "promote"}
  for device_type, category, name in ops:
    assert device_type == "tpu"
    line = coverage.coverage(device_type, name)
    assert line.startswith(f"{category}:"), (name, line)


def test_coverage_document_lists_torch_xlas_tpu_ops():
  rows = (ROOT / "docs" / "coverage.md").read_text().splitlines()
  for _, category, name in make_coverage.tpu_ops():
    assert any(row.startswith(f"| tpu | `{name}` | {category} |") for row in rows), name
