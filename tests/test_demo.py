"""The main job, `python -m jaxamp.demo`, runs end to end."""

from jaxamp import demo


def test_demo_trains_three_variants_end_to_end(tmp_path):
  results = demo.main(["--steps", "15", "--out", str(tmp_path)])
  assert [r["name"] for r in results] == [name for name, _, _ in demo.VARIANTS]
  assert all(r["loss"] == r["loss"] for r in results)  # finite, not NaN
  assert (tmp_path / "demo.png").exists()
