"""Mixed-precision training across processes: two JAX processes of two CPU devices each.

``multiprocess_worker.py`` runs in a pair of processes joined by ``jax.distributed.initialize``
on 127.0.0.1 (gloo CPU collectives), on a mesh over all 4 devices, and once in a single process
on 4 local devices with the same global batches (the reference). Each process holds half of every
global batch; step ``OVERFLOW_STEP``'s inf is in process 1's half only. The scenarios: data
parallel and FSDP under ``jit``, the FSDP step under ``shard_map`` with ``axis_name``,
``jaxamp.make_train_step``, and the scaler alone under ``shard_map`` with and without
``axis_name``. The FSDP run saves an orbax checkpoint after ``CHECKPOINT_AFTER`` steps; a new pair
of processes restores it and runs the remaining steps (started as soon as the checkpoint exists,
while the other scenarios still run). Each process prints a JSON report; the tests compare them.

Across processes everything is bit-identical. Against the single-process run the scale, the skip
decisions and the growth tracker are equal and losses and params agree to float32 rounding: the
cross-process all-reduce (gloo) sums in another order than the in-process one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import multiprocess_launcher
import multiprocess_worker as worker
import numpy as np
import pytest
from paths import TESTS

WORKER = str(TESTS / "multiprocess_worker.py")
TIMEOUT = 240  # seconds, for each group of processes
TRAINED = ["data_parallel", "fsdp", "shard_map", "train_step"]


def start_single() -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, WORKER, "single"],
    env=multiprocess_launcher.child_env(devices=4),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def wait_for_checkpoint(directory: str, trainers: list[subprocess.Popen]) -> None:
  """Until the training pair has saved its checkpoint, or one of the pair has ended."""
  deadline = time.monotonic() + TIMEOUT
  saved = os.path.join(directory, worker.SAVED)
  while not os.path.exists(saved) and time.monotonic() < deadline:
    if any(process.poll() is not None for process in trainers):
      return
    time.sleep(0.2)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  """The reports of the training pair, the single-process run and the restoring pair.

  The three run at the same time: the restoring pair starts once the checkpoint is saved.
  """
  checkpoint = str(tmp_path_factory.mktemp("checkpoint"))
  started = []
  try:
    trainers = multiprocess_launcher.start_processes(WORKER, ["train", checkpoint])
    started += trainers
    single = start_single()
    started.append(single)
    wait_for_checkpoint(checkpoint, trainers)
    restorers = multiprocess_launcher.start_processes(WORKER, ["restore", checkpoint])
    started += restorers
    results = {
      "pair": multiprocess_launcher.wait_processes(trainers, TIMEOUT),
      "single": multiprocess_launcher.wait_processes([single], TIMEOUT)[0],
      "restored": multiprocess_launcher.wait_processes(restorers, TIMEOUT),
    }
  finally:  # none outlives the fixture
    for proc in started:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  last_json = multiprocess_launcher.last_json
  return {
    "pair": [last_json(r) for r in results["pair"]],
    "single": last_json(results["single"]),
    "restored": [last_json(r) for r in results["restored"]],
  }


def arrays(encoded):
  return [np.frombuffer(bytes.fromhex(h), dtype=d).reshape(s) for d, s, h in encoded]


def without_local_fields(log):
  """A step log without what differs between processes by design: whether their rows are finite."""
  return [{k: v for k, v in entry.items() if k != "local_rows_finite"} for entry in log]


def assert_close(a, b):
  for x, y in zip(arrays(a), arrays(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_each_process_holds_two_of_the_four_devices_of_the_mesh(reports):
  for i, report in enumerate(reports["pair"] + reports["restored"]):
    assert report["process_index"] == i % 2
    assert report["process_count"] == 2
    assert (report["devices"], report["local_devices"]) == (4, 2)


@pytest.mark.slow  # two JAX processes of two CPU devices each
@pytest.mark.parametrize("scenario", TRAINED)
def test_every_process_agrees_bit_for_bit_on_loss_scale_found_inf_and_params(reports, scenario):
  first, second = (report[scenario] for report in reports["pair"])
  assert without_local_fields(first["log"]) == without_local_fields(second["log"])
  assert first["params"] == second["params"]
  for entry in first["log"]:  # and every local device holds the same copy
    for field in ("loss", "scale", "found_inf"):
      assert len({json.dumps(v) for v in entry[field]}) == 1, (field, entry)


@pytest.mark.slow  # two JAX processes of two CPU devices each
@pytest.mark.parametrize("scenario", TRAINED)
def test_the_processes_match_a_single_process_run_of_the_same_global_batches(reports, scenario):
  pair, single = reports["pair"][0][scenario], reports["single"][scenario]
  for step, (a, b) in enumerate(zip(pair["log"], single["log"], strict=True)):
    assert a["scale"][0] == b["scale"][0] and a["found_inf"][0] == b["found_inf"][0], step
    assert a.get("state_dict") == b.get("state_dict"), step
    np.testing.assert_allclose(a["loss"][0], b["loss"][0], rtol=1e-6)
  assert_close(pair["params"], single["params"])


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_fsdp_keeps_params_and_optimizer_state_sharded_over_the_processes(reports):
  for report in reports["pair"]:
    assert report["fsdp"]["sharded_params"] == [4, 4]  # every leaf split over the 4 devices
    assert report["fsdp"]["sharded_opt_state"] == [8, 13]  # adam's moments; not the scalars
    assert report["data_parallel"]["sharded_params"] == [0, 4]


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_fsdp_processes_agree_bit_for_bit_on_the_optimizer_state(reports):
  first, second = (report["fsdp"] for report in reports["pair"])
  assert first["opt_state"] == second["opt_state"]


@pytest.mark.slow  # two JAX processes of two CPU devices each
@pytest.mark.parametrize("scenario", TRAINED)
def test_an_inf_in_one_process_rows_skips_the_step_in_every_process(reports, scenario):
  pair = [report[scenario]["log"] for report in reports["pair"]]
  if scenario != "train_step":
    assert [log[worker.OVERFLOW_STEP]["local_rows_finite"] for log in pair] == [True, False]
  for log in pair:
    for step, entry in enumerate(log):
      skipped = step == worker.OVERFLOW_STEP
      assert entry["found_inf"] == [skipped, skipped], step
      assert entry["params_unchanged"] == skipped, step
    assert log[worker.OVERFLOW_STEP - 1]["scale"] == [worker.INIT_SCALE] * 2
    assert log[worker.OVERFLOW_STEP]["scale"] == [worker.INIT_SCALE / 2] * 2


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_make_train_step_reports_the_skip_in_its_metrics_in_every_process(reports):
  for report in reports["pair"]:
    skipped = [entry["skipped_steps"] for entry in report["train_step"]["log"]]
    assert skipped == [[0, 0]] + [[1, 1]] * (worker.STEPS - 1)


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_the_shard_map_step_with_axis_name_matches_the_jit_fsdp_step(reports):
  for report in reports["pair"]:
    assert report["shard_map"]["sharded_params"] == [4, 4]
    assert_close(report["shard_map"]["params"], report["fsdp"]["params"])


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_with_axis_name_an_inf_in_one_process_shard_skips_every_device(reports):
  for report in reports["pair"]:
    with_axis = report["axis_name"]["with"]
    assert with_axis["found_inf"] == [True, True]
    assert with_axis["scale"] == [worker.INIT_SCALE / 2] * 2


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_without_axis_name_only_the_device_holding_the_inf_skips(reports):
  first, second = (report["axis_name"]["without"] for report in reports["pair"])
  assert first["found_inf"] == [False, False] and second["found_inf"] == [False, True]
  assert second["scale"] == [worker.INIT_SCALE, worker.INIT_SCALE / 2]


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_without_axis_name_check_vma_rejects_the_replicated_scale(reports):
  for report in reports["pair"]:
    error = report["axis_name"]["without_check_vma_error"]
    assert error is not None and "out_specs.scale" in error


# --- the checkpoint, restored by a new pair of processes -----------------------------------------


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_a_new_pair_of_processes_restores_the_checkpoint_bit_for_bit(reports):
  saved = reports["pair"][0]["fsdp"]["at_checkpoint"]
  for report in reports["restored"]:
    assert report["restore"]["restored_opt_state"] == saved["opt_state"]
    assert report["restore"]["state_dict"] == saved["state_dict"]
    assert report["restore"]["sharded_params"] == [4, 4]
    assert report["restore"]["sharded_opt_state"] == [8, 13]


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_the_restored_run_continues_bit_identically_to_the_uninterrupted_one(reports):
  uninterrupted = reports["pair"][0]["fsdp"]
  for report in reports["restored"]:
    restored = report["restore"]
    assert restored["log"] == uninterrupted["log"][worker.CHECKPOINT_AFTER :]
    assert restored["params"] == uninterrupted["params"]
    assert restored["opt_state"] == uninterrupted["opt_state"]


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_the_restored_growth_tracker_grows_the_scale_on_schedule(reports):
  saved = reports["pair"][0]["fsdp"]["at_checkpoint"]["state_dict"]
  assert saved["_growth_tracker"] == 1 and saved["scale"] == worker.INIT_SCALE / 2
  first_step = reports["restored"][0]["restore"]["log"][0]
  assert first_step["scale"] == [worker.INIT_SCALE] * 2  # the interval of 2 completes here


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_load_state_dict_restores_an_overwritten_scale_in_every_process(reports):
  uninterrupted = reports["pair"][0]["fsdp"]
  for report in reports["restored"]:
    loaded = report["restore"]["load_state_dict"]
    assert loaded["wrong_scale"] == 1.0
    assert loaded["state_dict"] == report["restore"]["state_dict"]
    assert loaded["opt_state"] == report["restore"]["restored_opt_state"]
    assert loaded["scale_sharding_kept"]
    assert loaded["log"] == uninterrupted["log"][worker.CHECKPOINT_AFTER :]
    assert loaded["params"] == uninterrupted["params"]


def test_the_listening_check_finds_a_listening_socket_and_tells_loopback_from_any_address():
  """What the loopback test relies on: the sockets a process listens on, classified."""
  if multiprocess_launcher.listening_addresses() is None:
    pytest.skip("no /proc/self/net here: the listening sockets cannot be listed")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert f"127.0.0.1:{port}" in multiprocess_launcher.listening_addresses()
  assert multiprocess_launcher.is_loopback(f"127.0.0.1:{port}")
  assert multiprocess_launcher.is_loopback("::ffff:127.0.0.1:80")
  assert not multiprocess_launcher.is_loopback("0.0.0.0:80")
  assert not multiprocess_launcher.is_loopback("10.1.2.3:80")


@pytest.mark.slow  # two JAX processes of two CPU devices each
def test_the_processes_listen_on_loopback_only(reports):
  listening = [report["listening"] for report in reports["pair"] + reports["restored"]]
  if None in listening:
    pytest.skip("no /proc/self/net here: the listening sockets cannot be listed")
  assert listening[0], "process 0 runs the coordinator service: it must list a socket"
  for addresses in listening:
    assert all(multiprocess_launcher.is_loopback(a) for a in addresses), addresses
