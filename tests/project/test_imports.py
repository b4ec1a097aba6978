"""Optional libraries stay unimported until the user imports them: autocast finds their objects
through ``sys.modules`` instead."""

import subprocess
import sys

_AUTOCAST_A_MATMUL = """
import sys
import jax.numpy as jnp
import jaxamp
assert "flax" not in sys.modules, "import jaxamp imports flax"
jaxamp.autocast(lambda x: x @ x, device_type="cuda")(jnp.ones((2, 2)))
assert "flax" not in sys.modules, "an autocast call imports flax"
"""


def test_importing_jaxamp_and_autocasting_import_no_flax():
  result = subprocess.run(
    [sys.executable, "-c", _AUTOCAST_A_MATMUL], capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr
