"""The test run itself: without torch it ends by saying what did not run and how to run it; the
default run is the fast subset (``-m "not slow"``), and the notebooks belong to the slow tests."""

import os
import pathlib
import subprocess
import sys
import types

import conftest
import pytest
from paths import ROOT

SMALL_FILE_WITH_TORCH_COMPARISONS = "tests/autocast/test_scalar_constants.py"


def pytest_in_a_subprocess(*args: str, without_torch: bool = False) -> str:
  env = dict(os.environ)
  env.pop("JAXAMP_TESTS_WITHOUT_TORCH", None)
  if without_torch:
    env["JAXAMP_TESTS_WITHOUT_TORCH"] = "1"
  out = subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def test_the_summary_line_counts_the_deselected_comparisons_and_says_how_to_run_them():
  items = [type("Item", (), {"path": pathlib.Path(name)})() for name in ("a.py", "a.py", "b.py")]
  line = conftest.torch_summary(items)
  assert line.startswith("3 comparisons with live torch (2 test files) were deselected")
  assert "golden files" in line and "pip install torch==2.13.0" in line


def test_there_is_no_summary_line_when_nothing_was_deselected():
  assert conftest.torch_summary([]) is None


@pytest.mark.slow
def test_a_run_without_torch_ends_with_the_summary_line():
  printed = pytest_in_a_subprocess(
    "--collect-only", SMALL_FILE_WITH_TORCH_COMPARISONS, without_torch=True
  )
  summary = printed.split("without torch", 1)[1]  # after the section line, not only under -rs
  assert "comparisons with live torch (1 test file) were deselected" in summary
  assert "pip install torch==2.13.0" in summary


@pytest.mark.slow  # pytest in a subprocess
@pytest.mark.skipif(not conftest.HAS_TORCH, reason="torch is not installed here")
def test_a_run_with_torch_has_no_summary_line():
  printed = pytest_in_a_subprocess("--collect-only", SMALL_FILE_WITH_TORCH_COMPARISONS)
  assert "without torch" not in printed


@pytest.mark.slow  # pytest in a subprocess
def test_the_notebooks_are_slow_tests():
  fast = pytest_in_a_subprocess(
    "--collect-only", "-m", "not slow", "tests/project/test_imports.py", "notebooks"
  )
  slow = pytest_in_a_subprocess(
    "--collect-only", "-m", "slow", "tests/project/test_imports.py", "notebooks"
  )
  assert ".ipynb" not in fast and slow.count(".ipynb::") == len(
    list(ROOT.glob("notebooks/*.ipynb"))
  )


@pytest.mark.slow  # collects the whole suite in a subprocess, unless this run collected it
def test_every_test_module_has_tests_in_the_fast_subset(request):
  modules = {str(path.relative_to(ROOT)) for path in ROOT.glob("tests/**/test_*.py")}
  this_run = request.config.stash.get(conftest.COLLECTED, [])
  if modules <= {str(item.path.relative_to(ROOT)) for item in this_run}:
    fast = {item.nodeid for item in this_run if item.get_closest_marker("slow") is None}
  else:
    fast = pytest_in_a_subprocess("--collect-only", "-m", "not slow", "tests").splitlines()
  collected = {nodeid.split("::", 1)[0] for nodeid in fast if "::" in nodeid}
  assert not modules - collected, "test modules with no test outside the slow marker"


@pytest.mark.slow  # pytest in a subprocess
def test_a_test_marked_slow_after_first_keeps_only_its_first_case_in_the_fast_subset():
  module = "tests/functional/test_functional.py"
  cases = "test_invalid_reduction_raises["
  fast = pytest_in_a_subprocess("--collect-only", "-m", "not slow", module)
  every = pytest_in_a_subprocess("--collect-only", module)
  assert fast.count(cases) == 1 and every.count(cases) > 1
  first = next(line for line in every.splitlines() if cases in line)
  assert first in fast.splitlines()


def configured(*args: str, source=pytest.Config.ArgsSource.TESTPATHS, markexpr: str = "") -> str:
  """The mark expression ``conftest.pytest_configure`` leaves for a command line of ``args``
  (``markexpr``: the one pytest parsed, from ``PYTEST_ADDOPTS`` too)."""
  option = types.SimpleNamespace(markexpr=markexpr)
  config = types.SimpleNamespace(
    args_source=source,
    option=option,
    invocation_params=types.SimpleNamespace(args=args),
    addinivalue_line=lambda *_: None,
  )
  conftest.pytest_configure(config)
  return option.markexpr


def test_the_default_run_is_the_fast_subset():
  assert configured() == "not slow"
  assert configured("-q", "-x") == "not slow"


def test_a_mark_expression_or_named_paths_choose_what_runs():
  assert configured("-m", "") == ""  # -m "" runs everything
  assert configured("-mslow") == ""  # the command line's own expression stands
  assert configured("tests/scaler", source=pytest.Config.ArgsSource.ARGS) == ""
  assert configured(markexpr="slow") == "slow"  # PYTEST_ADDOPTS="-m slow"


@pytest.mark.slow  # pytest in a subprocess
def test_a_run_without_paths_deselects_the_slow_tests():
  printed = pytest_in_a_subprocess(
    "--collect-only", "-o", "testpaths=tests/project/test_imports.py notebooks"
  )
  assert ".ipynb" not in printed and "deselected" in printed
  assert "test_imports.py::" in printed
