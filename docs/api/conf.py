"""Sphinx configuration of jaxamp's API reference.

Build: ``sphinx-build -W --keep-going -b html docs/api docs/api/_build`` (``pip install -e
".[docs]"`` first); warnings are errors, so a broken docstring fails the build.
"""

import pathlib
import sys

# The reference documents the checkout it sits in, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jaxamp  # noqa: E402

project = "jaxamp"
author = "jaxamp authors"
copyright = "jaxamp authors"
release = jaxamp.__version__
version = release

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
# No intersphinx: the build reads nothing from the network.

# Google-style docstrings (Args:, Returns:, Raises:, Attributes:), read as optax's are.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# A class's "Attributes:" section is its field list (the text gives each field's dtype and shape,
# which the annotations do not); the fields are not documented again as members
# (skip_namedtuple_fields).
napoleon_use_ivar = True
napoleon_attr_annotations = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"

exclude_patterns = ["_build"]

try:
  import furo  # noqa: F401

  html_theme = "furo"
except ImportError:  # the reference builds with Sphinx alone
  html_theme = "alabaster"
html_title = f"jaxamp {release}"


def skip_namedtuple_fields(app, what, name, obj, skip, options):
  """Leaves out a NamedTuple's field accessors: the class's "Attributes:" section lists them."""
  if what == "class" and (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  app.connect("autodoc-skip-member", skip_namedtuple_fields)
