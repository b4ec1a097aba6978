"""The repository's golden-recording scripts, imported as modules (their helpers and constants)."""

import importlib.util
import pathlib
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load(name: str) -> ModuleType:
  """``scripts/<name>.py`` as a module."""
  spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
