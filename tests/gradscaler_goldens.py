"""torch's GradScaler surface as recorded by ``scripts/record_gradscaler_surface_goldens.py``
(``goldens/gradscaler_scale_dtypes.json``, ``goldens/gradscaler_surface.json``), the script
itself (its decoder, and its torch runs for live comparisons), and bitwise comparisons."""

import json

import numpy as np
import script_modules
from paths import GOLDENS

recorder = script_modules.load("record_gradscaler_surface_goldens")
DTYPE_GOLDENS = json.loads((GOLDENS / "gradscaler_scale_dtypes.json").read_text())
SURFACE_GOLDENS = json.loads((GOLDENS / "gradscaler_surface.json").read_text())
UINT = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def bits(x):
  """The bit patterns of a float array (its dtype's width), for bitwise comparisons."""
  x = np.asarray(x)
  return x.view(UINT[str(x.dtype)])


def assert_bitwise_equal(actual, expected, err_msg=""):
  assert str(np.asarray(actual).dtype) == str(np.asarray(expected).dtype), err_msg
  assert np.shape(actual) == np.shape(expected), err_msg
  np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=err_msg)
