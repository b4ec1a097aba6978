"""Runs a Python program as several JAX processes on this machine, talking over loopback only.

``run_processes(program, args)`` (or ``start_processes`` then ``wait_processes``) starts
``num_processes`` interpreters, each with ``--xla_force_host_platform_device_count=devices`` CPU
devices, as ``python multiprocess_launcher.py PROGRAM COORDINATOR NUM_PROCESSES PROCESS_ID
ARGS...``, and waits for all of them (killing all if one outlives the timeout). In each child
this file runs PROGRAM as ``__main__`` after making ``jax.distributed.initialize``
loopback-only: the coordinator service of process 0 binds ``COORDINATOR`` (127.0.0.1 and a free
port) instead of every interface, and the gloo CPU collectives bind 127.0.0.1 instead of the
address of the machine's hostname (through JAX internals; where they are missing, gloo's default
stays, which ``listening_addresses`` shows). The program itself reads ``COORDINATOR
NUM_PROCESSES PROCESS_ID`` from ``sys.argv`` and calls ``jax.distributed.initialize`` as a
multi-host program does. ``listening_addresses()`` (Linux) lists the TCP addresses the calling
process listens on, for the tests to check.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  """A TCP port of 127.0.0.1 that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(devices: int) -> dict[str, str]:
  """The environment of a child: ``devices`` CPU devices, this checkout importable, no proxy."""
  env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(
    [ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")]
  )
  return env


def start_processes(
  program: str,
  args: list[str] | tuple[str, ...] = (),
  *,
  num_processes: int = 2,
  devices: int = 2,
  cwd: str | None = None,
) -> list[subprocess.Popen]:
  """Starts ``program`` as ``num_processes`` JAX processes; ``wait_processes`` collects them."""
  coordinator = f"127.0.0.1:{free_port()}"
  env = child_env(devices)
  launcher = os.path.abspath(__file__)
  return [
    subprocess.Popen(
      [sys.executable, launcher, program, coordinator, str(num_processes), str(i), *args],
      env=env,
      cwd=cwd,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(num_processes)
  ]


def wait_processes(
  procs: list[subprocess.Popen], timeout: float, grace: float = 15
) -> list[subprocess.CompletedProcess]:
  """Waits for every process, in process-id order; kills the ones still running at ``timeout``.

  Once one process has failed, the others (which may wait for it forever in a collective) get
  ``grace`` more seconds. A killed process has a negative return code, and its stderr ends with
  why it was killed.
  """
  outputs: list[Any] = [None] * len(procs)

  def collect(i: int) -> None:
    outputs[i] = procs[i].communicate()

  readers = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(procs))]
  for reader in readers:
    reader.start()
  deadline, killed = time.monotonic() + timeout, {}
  while any(reader.is_alive() for reader in readers):
    if any(process.poll() not in (None, 0) for process in procs):
      deadline = min(deadline, time.monotonic() + grace)
      why = "KILLED: another process failed"
    else:
      why = f"TIMED OUT after {timeout} s"
    if time.monotonic() >= deadline:
      for i, proc in enumerate(procs):
        if proc.poll() is None:
          proc.kill()
          killed[i] = why
      break
    time.sleep(0.05)
  for reader in readers:
    reader.join()
  results = []
  for i, proc in enumerate(procs):
    out, err = outputs[i]
    if i in killed:
      err += f"\n{killed[i]}"
    results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
  return results


def run_processes(
  program: str,
  args: list[str] | tuple[str, ...] = (),
  *,
  num_processes: int = 2,
  devices: int = 2,
  timeout: float = 120,
  cwd: str | None = None,
) -> list[subprocess.CompletedProcess]:
  """Runs ``program`` as ``num_processes`` JAX processes; their results, by process id."""
  procs = start_processes(program, args, num_processes=num_processes, devices=devices, cwd=cwd)
  return wait_processes(procs, timeout)


def last_json(result: subprocess.CompletedProcess) -> Any:
  """The JSON value on the last line a process printed; fails with its stderr if it failed."""
  assert result.returncode == 0, result.stderr[-5000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def listening_addresses() -> list[str] | None:
  """The addresses of the TCP sockets this process listens on; None off Linux."""
  try:
    fds = os.listdir("/proc/self/fd")
  except OSError:
    return None
  inodes = set()
  for fd in fds:
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile (the listing's own descriptor)
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:[") : -1])
  try:
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
      if os.path.exists(table):
        with open(table) as f:
          rows += [line.split() for line in f.readlines()[1:]]
  except OSError:
    return None
  addresses = []
  for row in rows:
    local, state, inode = row[1], row[3], row[9]
    if state == "0A" and inode in inodes:  # 0A: LISTEN
      host, port = local.split(":")
      raw = bytes.fromhex(host)  # in 32-bit words of host (little-endian) byte order
      raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
      addresses.append(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
  return addresses


def is_loopback(address: str) -> bool:
  host = ipaddress.ip_address(address.rsplit(":", 1)[0])
  mapped = getattr(host, "ipv4_mapped", None)
  return host.is_loopback or (mapped is not None and mapped.is_loopback)


def _gloo_on_loopback() -> None:
  """Makes the CPU backend's gloo collectives bind 127.0.0.1 (JAX internals; skipped if gone)."""
  try:
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    make_collectives = _jax.make_gloo_tcp_collectives
    make_cpu_client = xla_bridge.make_cpu_client
    client = distributed.global_state.client
  except (ImportError, AttributeError):
    return

  def factory():
    collectives = make_collectives(distributed_client=client, hostname="127.0.0.1")
    return make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)


def _loopback_initialize(original):
  signature = inspect.signature(original)

  def initialize(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    if bound.arguments.get("coordinator_bind_address") is None:
      bound.arguments["coordinator_bind_address"] = bound.arguments["coordinator_address"]
    original(*bound.args, **bound.kwargs)
    _gloo_on_loopback()

  return initialize


def _main(argv: list[str]) -> None:
  program = argv[0]
  import jax

  jax.distributed.initialize = _loopback_initialize(jax.distributed.initialize)
  sys.argv = list(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
  runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
  _main(sys.argv[1:])
