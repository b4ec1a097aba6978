"""The recorded torch CPU autocast results, and the script that recorded them (for live runs)."""

import functools
import importlib.util
import pathlib

import pytest

GOLDEN = pathlib.Path(__file__).parent / "goldens" / "torch_cpu_autocast.json"
SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "record_torch_autocast_goldens.py"


@functools.cache
def recorder():
  """The golden script as a module (its torch helpers); skips the test when torch is missing."""
  pytest.importorskip("torch")
  spec = importlib.util.spec_from_file_location("record_torch_autocast_goldens", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
