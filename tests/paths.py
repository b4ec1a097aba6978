"""Where the repository's files are, for tests in any folder of ``tests/``."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
GOLDENS = TESTS / "goldens"
BENCHMARKS = ROOT / "benchmarks"
