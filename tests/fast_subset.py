"""The fast subset's share of a large parametrization: the first case of each family.

``python -m pytest -m "not slow"`` runs every test module in a few minutes. A module that checks
hundreds of cases the same way (torch's autocast lists, the golden cases) keeps one case of each
family in the fast subset and marks the others ``slow``; the full run runs them all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
  from _pytest.mark import ParameterSet  # what pytest.param returns


def _skipped(param: ParameterSet) -> bool:
  return any(mark.name in ("skip", "skipif", "xfail") for mark in param.marks)


def first_of_each_family(
  params: Iterable[ParameterSet], family: Callable[[ParameterSet], Hashable]
) -> list[ParameterSet]:
  """``params`` in order, all marked ``slow`` but the first case of each ``family(param)``.

  A skipped case does not stand for its family: the first case that runs does.
  """
  seen: set[Hashable] = set()
  out = []
  for param in params:
    key = family(param)
    if key in seen or _skipped(param):
      param = pytest.param(*param.values, marks=[*param.marks, pytest.mark.slow], id=param.id)
    else:
      seen.add(key)
    out.append(param)
  return out
