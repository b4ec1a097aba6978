"""scripts/gpu_check.py, the GPU checks in one device call: steps run under their own limits, a
step past its limit is stopped with everything it started, and results land under $OUT."""

import pathlib
import time

import pytest
import script_modules

gpu_check = script_modules.load("gpu_check")


def test_the_steps_run_in_order_and_their_outcome_is_summarised_under_out(tmp_path, monkeypatch):
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check.main(["--dry-run", "--steps", "env,fp8", "--budget", "60"]) == 0
  summary = (tmp_path / "summary.txt").read_text().splitlines()
  assert [line.split(":")[0] for line in summary] == ["env", "fp8"]
  assert all("exit 0" in line for line in summary)
  assert (
    "jax" in (tmp_path / "env.log").read_text() or "Device" in (tmp_path / "env.log").read_text()
  )
  assert "skipped" in (tmp_path / "fp8.md").read_text()  # no GPU here


def test_a_step_past_its_limit_is_stopped_with_the_processes_it_started(tmp_path):
  start = time.monotonic()
  rc = gpu_check.run_step("slow", "sleep 41 & sleep 42; echo fin''ished", 1, tmp_path)
  assert rc == 124 and time.monotonic() - start < 10
  assert "finished" not in (tmp_path / "slow.log").read_text()
  deadline = time.monotonic() + 5  # killed processes take a moment to go
  while _running({"sleep\x0041", "sleep\x0042"}) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _running({"sleep\x0041", "sleep\x0042"})


def _running(cmdlines: set[str]) -> bool:
  """Whether a process runs with one of these command lines (arguments joined by NUL)."""
  for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
      if cmdline.read_bytes().decode(errors="replace").rstrip("\x00") in cmdlines:
        return True
    except OSError:  # gone meanwhile
      continue
  return False


def test_steps_left_without_budget_are_reported_not_started(tmp_path, monkeypatch):
  monkeypatch.setenv("OUT", str(tmp_path))
  gpu_check.main(["--dry-run", "--steps", "env", "--budget", "5"])
  assert "env: not started" in (tmp_path / "summary.txt").read_text()


def test_an_unknown_step_is_refused_with_the_valid_ones(capsys):
  with pytest.raises(SystemExit):
    gpu_check.main(["--steps", "tests,benchmarks"])
  assert "the steps are env, install, tests, bench, fp8, scaler" in capsys.readouterr().err


def test_the_wheels_the_gpu_image_lacks_cover_what_the_tests_import():
  # the test modules import hypothesis and haiku at the top; torch, flax, equinox are on the image
  assert {"hypothesis", "dm-haiku", "jmp"} <= set(gpu_check.MISSING_ON_IMAGE)
