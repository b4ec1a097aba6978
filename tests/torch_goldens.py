"""The recorded torch CPU autocast results, and the script that recorded them (for live runs)."""

import functools
import pathlib

import pytest
import script_modules

GOLDEN = pathlib.Path(__file__).parent / "goldens" / "torch_cpu_autocast.json"


@functools.cache
def recorder():
  """The golden script as a module (its torch helpers); skips the test when torch is missing."""
  pytest.importorskip("torch")
  return script_modules.load("record_torch_autocast_goldens")
