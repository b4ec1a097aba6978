"""Test-run configuration: without torch, the comparisons with live torch fold into one skip.

A test compares with live torch when it is marked ``@pytest.mark.torch`` or its body calls
``pytest.importorskip("torch")`` or ``torch_goldens.recorder()`` (the suite's two spellings).
With torch installed (CI installs its CPU build) they all run. Without it they are deselected and
one skipped test, ``live_torch_comparisons``, says how many there are and how to run them, as does
a line at the end of the run; the comparisons with the recorded golden files run either way.
``JAXAMP_TESTS_WITHOUT_TORCH=1`` runs the tests as if torch were not installed.

The default run, ``python -m pytest`` with no paths and no ``-m``, is the fast subset (``-m "not
slow"``), in which every test module keeps some tests; ``-m slow`` runs the rest and ``-m ""``
everything (CI runs both halves). Naming paths or node ids runs all of what they name. The
notebooks (collected from ``notebooks/`` by nbmake) are marked ``slow``, as the slow tests are. A
parametrized test marked ``slow_after_first`` keeps its first case in the fast subset and marks
the others ``slow`` (``fast_subset.first_of_each_family`` picks one case per family in the large
parametrizations).
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import jax
import pytest

# XLA:CPU compiles JAX's default, partitionable threefry 10-30x slower than the classic one for
# small shapes (a (3, 3, 4, 8) normal: ~12 s against ~0.4 s), and the suite draws thousands of
# small weights. The tests run the classic one in-process; what they start as subprocesses (the
# README, notebooks, scripts) keeps JAX's default, and tests/autocast/test_prng.py runs both.
jax.config.update("jax_threefry_partitionable", False)

# Keras 3 picks its backend when first imported (tests/integrations/test_keras.py), whoever
# imports it first: JAX's, before any test module is.
os.environ.setdefault("KERAS_BACKEND", "jax")


def _has_torch() -> bool:
  if os.environ.get("JAXAMP_TESTS_WITHOUT_TORCH") == "1":
    return False
  try:
    return importlib.util.find_spec("torch") is not None
  except ImportError:  # a finder that hides torch
    return False


HAS_TORCH = _has_torch()
TORCH_MARKER = "torch: compares with live torch; without torch installed it is folded into one skip"
SLOW_AFTER_FIRST_MARKER = (
  "slow_after_first: the first parametrized case is in the fast subset, the others are slow"
)
INSTALL_TORCH = "pip install torch==2.13.0 (its CPU build is enough)"
FAST_SUBSET = "not slow"
DESELECTED_FOR_TORCH = pytest.StashKey[list]()
# The items the run collected, slow ones marked, before ``-m``/``-k`` deselect any.
COLLECTED = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line("markers", TORCH_MARKER)
  config.addinivalue_line("markers", SLOW_AFTER_FIRST_MARKER)
  if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not _selects_by_mark(config):
    config.option.markexpr = FAST_SUBSET  # the default run (xdist hands it to its workers)


def _selects_by_mark(config: pytest.Config) -> bool:
  """Whether the run was given a mark expression: on the command line (``-m ""`` too:
  everything) or in ``PYTEST_ADDOPTS``."""
  given = any(arg.startswith("-m") for arg in config.invocation_params.args)
  return given or bool(config.option.markexpr)


def _calls_torch(function) -> bool:
  """Whether a test's body calls ``pytest.importorskip("torch")``/``torch_goldens.recorder()``."""
  code = getattr(inspect.unwrap(function), "__code__", None)
  if code is None:
    return False
  names = set(code.co_names)
  return ({"importorskip"} <= names and "torch" in code.co_consts) or (
    {"torch_goldens", "recorder"} <= names
  )


def needs_torch(item: pytest.Item) -> bool:
  if item.get_closest_marker("torch") is not None:
    return True
  function = getattr(item, "function", None)
  return function is not None and _calls_torch(function)


def _live_torch_comparisons() -> None:
  """Stands in for the comparisons with live torch when torch is not installed."""


def _mark_slow(items: list[pytest.Item]) -> None:
  """The notebooks, and every case but the first fast one of a test marked
  ``slow_after_first``."""
  first_cases: set[tuple] = set()
  for item in items:
    if item.path.suffix == ".ipynb":
      item.add_marker(pytest.mark.slow)
    elif item.get_closest_marker("slow_after_first") and not item.get_closest_marker("slow"):
      function = (item.parent.nodeid, getattr(item, "originalname", item.name))
      if function in first_cases:
        item.add_marker(pytest.mark.slow)
      first_cases.add(function)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(
  session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
  _mark_slow(items)
  if not HAS_TORCH:
    _fold_live_torch_comparisons(config, items)
  config.stash[COLLECTED] = list(items)


def _fold_live_torch_comparisons(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Deselects the comparisons with live torch; one skipped test stands in for them."""
  live = [item for item in items if needs_torch(item)]
  config.stash[DESELECTED_FOR_TORCH] = live
  if not live:
    return
  config.hook.pytest_deselected(items=live)
  first = items.index(live[0])
  keep = set(map(id, live))
  items[:] = [item for item in items if id(item) not in keep]
  files = sorted({item.path.name for item in live})
  stand_in = pytest.Function.from_parent(
    live[0].parent, name="live_torch_comparisons", callobj=_live_torch_comparisons
  )
  stand_in.add_marker(
    pytest.mark.skip(
      reason=(
        f"torch is not installed: {len(live)} comparisons with live torch ({', '.join(files)}) "
        f"did not run; the recorded golden files stand in for them. To run them: {INSTALL_TORCH}"
      )
    )
  )
  items.insert(first, stand_in)


def torch_summary(live: list[pytest.Item]) -> str | None:
  """The line the run ends with when comparisons with live torch were deselected, else None."""
  if not live:
    return None
  files = len({item.path for item in live})
  return (
    f"{len(live)} comparisons with live torch ({files} test file{'s' * (files != 1)}) were "
    "deselected: torch is not installed. The recorded golden files stand in for them. "
    f"To run them: {INSTALL_TORCH}."
  )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
  line = torch_summary(config.stash.get(DESELECTED_FOR_TORCH, []))
  if line is not None:
    terminalreporter.write_sep("-", "without torch")
    terminalreporter.write_line(line)
