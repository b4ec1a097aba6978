"""The main job, `python -m jaxamp.demo`, runs end to end."""

import contextlib
import io

import pytest

from jaxamp import demo


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
  """A 15-step demo run: (results, printed output, output folder)."""
  out = tmp_path_factory.mktemp("demo")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    results = demo.main(["--steps", "15", "--out", str(out)])
  return results, printed.getvalue(), out


@pytest.mark.slow  # trains the demo's three variants
def test_demo_trains_three_variants_end_to_end(short_run):
  results, _, out = short_run
  assert [r["name"] for r in results] == [name for name, _, _ in demo.VARIANTS]
  assert all(r["loss"] == r["loss"] for r in results)  # finite, not NaN
  assert (out / "demo.png").exists()


@pytest.mark.slow  # trains the demo's three variants
def test_demo_prints_a_table_with_every_column(short_run):
  _, printed, _ = short_run
  header = next(line for line in printed.splitlines() if line.startswith("variant"))
  assert header.split()[1:] == [
    "loss",
    "test",
    "acc",
    "ms/step",
    "residuals",
    "KiB",
    "skipped",
    "scale",
  ]


@pytest.mark.slow  # trains the demo's three variants
def test_demo_low_precision_variants_save_less_for_the_backward_pass(short_run):
  float32, bfloat16, float16 = (r["saved_bytes"] for r in short_run[0])
  assert bfloat16 < float32 and float16 < float32


@pytest.mark.slow  # trains the demo's three variants
def test_demo_reports_the_loss_scale_only_for_the_scaled_variant(short_run):
  assert [r["scale"] == 1.0 for r in short_run[0]] == [True, True, False]


def test_residual_bytes_leave_out_the_arguments():
  import jax.numpy as jnp

  w, x = jnp.ones((4, 3)), jnp.ones((4, 3))
  # saved: cos(w) for sin (48 bytes), and x for the product, which is an argument: not counted
  assert demo.residual_bytes(lambda w, x: jnp.sum(jnp.sin(w) * x), w, x) == 48


def test_demo_help_names_its_options(capsys):
  with pytest.raises(SystemExit):
    demo.main(["--help"])
  assert "--steps" in capsys.readouterr().out


def test_demo_help_shows_the_defaults(capsys):
  with pytest.raises(SystemExit):
    demo.main(["--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "(default: 2000)" in out and "(default: out)" in out


@pytest.mark.parametrize("steps", ["0", "-3", "ten"])
def test_demo_rejects_a_step_count_below_one_with_a_usage_error(steps, capsys):
  with pytest.raises(SystemExit) as error:
    demo.main(["--steps", steps])
  assert error.value.code == 2
  assert "argument --steps: must be" in capsys.readouterr().err


def test_demo_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys):
  # capsys's stderr is not a terminal, as a log file or a pipe is not.
  assert list(demo._progress(range(25), 25, "variant")) == list(range(25))
  lines = capsys.readouterr().err.splitlines()
  assert "\r" not in "".join(lines)
  assert len(lines) == 13  # every 2nd step (a tenth of 25), and the last
  assert lines[0].startswith("variant: step 2/25 (") and lines[-1].startswith("variant: step 25/25")
