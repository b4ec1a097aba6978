"""Runs a test script in a subprocess with several virtual CPU devices.

``--xla_force_host_platform_device_count`` must be set before jax is imported, so multi-device
tests run their body as a script in a fresh interpreter that prints one JSON line (or "OK").
"""

import json
import os
import subprocess
import sys
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
  """Runs ``script`` on ``devices`` CPU devices, with this checkout importable."""
  env = dict(
    os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu"
  )
  env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(
    [sys.executable, "-c", script],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def run_json(script: str, devices: int, timeout: int = 300) -> Any:
  """The JSON value on the last line ``script`` prints; fails the test if the script fails."""
  out = run_script(script, devices, timeout)
  assert out.returncode == 0, out.stderr[-5000:]
  return json.loads(out.stdout.strip().splitlines()[-1])
