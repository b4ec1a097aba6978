"""The README's Equinox and Haiku training steps run as written (issue #14 extends this to
every ``python`` block of the docs)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def blocks_under(heading: str) -> list[str]:
  """The ``python`` code blocks of README's section ``heading`` (up to the next heading)."""
  text = README.read_text()
  section = text.split(heading, 1)[1]
  section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


EXAMPLES = blocks_under("### Equinox and Haiku")


def test_the_equinox_and_haiku_section_has_its_two_examples():
  assert len(EXAMPLES) == 2
  assert "import equinox" in EXAMPLES[0] and "import haiku" in EXAMPLES[1]


@pytest.mark.parametrize("code", EXAMPLES, ids=["equinox", "haiku"])
def test_readme_training_step_runs(code, capsys):
  exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
  assert "float32" in capsys.readouterr().out
