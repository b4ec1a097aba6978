"""The benchmark scripts run, and their parsers read what XLA prints (CPU and GPU HLO alike).

No timing is checked: the benchmarks print ratios for people to read. These tests keep the
scripts working (section 6 included, which only measures on a GPU) and check the numbers they
derive from jaxprs and HLO text.
"""

import contextlib
import io
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, run

TINY = [
  "--quick",
  "--markdown",
  "--policies",  # one policy: float32, hand-written and autocast variants of each model
  "cpu",
  "--layers",
  "1",
  "--d-model",
  "32",
  "--heads",
  "2",
  "--seq",
  "8",
  "--batch",
  "2",
  "--vocab",
  "32",
  "--conv-batch",
  "2",
  "--scaler-params",
  "0.02",
  "--scaler-leaves",
  "4",
  "--haiku-batch",
  "2",
  "--compile-reps",
  "1",
  "--step-rounds",
  "1",
]

GPU_HLO = """
HloModule jit_train_step
%gemm_fusion_dot_computation (p: f16[8,64], q: f16[64,32]) -> f16[8,32] {
  %p = f16[8,64]{1,0} parameter(0)
  %q = f16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = f16[8,32]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (x: f16[8,64], w: f16[64,32], img: f16[2,8,8,3], k: f16[3,3,3,4]) -> f16[8,32] {
  %x = f16[8,64]{1,0} parameter(0)
  %w = f16[64,32]{1,0} parameter(1)
  %img = f16[2,8,8,3]{3,2,1,0} parameter(2)
  %k = f16[3,3,3,4]{3,2,1,0} parameter(3)
  %custom-call.1 = (f16[8,32]{1,0}, s8[4194304]{0}) custom-call(f16[8,64]{1,0} %x, f16[64,32]{1,0} %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{}}
  %cudnn-conv.2 = (f16[2,8,8,4]{3,2,1,0}, u8[0]{0}) custom-call(f16[2,8,8,3]{3,2,1,0} %img, f16[3,3,3,4]{3,2,1,0} %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  %gemm_fusion_dot.3 = f16[8,32]{1,0} fusion(f16[8,64]{1,0} %x, f16[64,32]{1,0} %w), kind=kCustom, calls=%gemm_fusion_dot_computation
  %convert.4 = f32[8,32]{1,0} convert(f16[8,32]{1,0} %gemm_fusion_dot.3)
  ROOT %tuple.5 = (f32[8,32]{1,0}) tuple(%convert.4)
}
"""


@pytest.fixture(scope="module")
def quick_report() -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    assert run.main(TINY) == 0
  return out.getvalue()


@pytest.mark.slow  # runs every benchmark script once (minutes)
def test_quick_run_reports_every_section(quick_report):
  for heading in (
    "### transformer LM",
    "### conv net",
    "### Haiku ResNet",
    "### loss scaler",
    "### 6. GPU",
    "### targets",
  ):
    assert heading in quick_report


@pytest.mark.slow  # runs every benchmark script once (minutes)
def test_quick_run_rates_every_target(quick_report):
  targets = quick_report[quick_report.index("### targets") :]
  for model in ("lm", "conv"):
    for metric in ("compile ms", "residual MiB", "step ms", "StableHLO converts", "HLO converts"):
      assert f"| {model} | cpu | {metric} |" in targets
  for metric in (
    "compile ms",
    "residual MiB",
    "step ms",
    "jaxpr converts",
    "StableHLO converts",
    "HLO converts",
  ):
    assert f"| haiku | cpu | {metric} |" in targets
  assert "| optimizer | - | update ms (adam vs scaler) |" in targets


@pytest.mark.slow  # runs every benchmark script once (minutes)
def test_haiku_section_compares_autocast_with_the_jmp_policies(quick_report):
  section = quick_report[quick_report.index("### Haiku ResNet") : quick_report.index("### loss")]
  for variant in ("float32", "jmp bfloat16", "autocast cpu"):
    assert f"| {variant} |" in section
  targets = quick_report[quick_report.index("### targets") :]
  for metric in ("jaxpr converts", "StableHLO converts"):  # converts a Haiku model costs, counted
    row = next(
      line for line in targets.splitlines() if line.startswith(f"| haiku | cpu | {metric} |")
    )
    assert row.endswith("| ok |"), row


@pytest.mark.slow  # runs every benchmark script once (minutes)
def test_gpu_section_says_why_it_was_skipped_on_cpu(quick_report):
  assert "skipped: jax.default_backend() is 'cpu', not 'gpu'." in quick_report


@pytest.mark.slow
def test_the_overrides_benchmark_rates_its_target(capsys):
  from benchmarks import bench_overrides

  assert bench_overrides.main(["--depths", "1", "--reps", "1"]) == 0
  printed = capsys.readouterr().out
  assert "same program" in printed and "router-style" in printed
  assert "ok" in printed or "MISSED" in printed


def test_gemm_conv_and_triton_calls_of_a_gpu_module_are_counted_with_their_dtypes():
  found = common.hlo_matmul_dtypes(GPU_HLO)
  assert found == {
    ("__cublas$gemm", "f16xf16", "f16"): 1,
    ("__cudnn$convForward", "f16xf16", "f16"): 1,
    ("fusion:custom", "f16xf16", "f16"): 1,
    ("dot", "f16xf16", "f16"): 1,
  }


def test_converts_of_an_hlo_module_are_listed_with_their_dtypes():
  assert [(c["src"], c["dst"]) for c in common.hlo_converts(GPU_HLO)] == [("f16", "f32")]


def test_gpu_table_gives_the_speed_up_over_float32_and_the_kernel_dtypes():
  results = {
    "lm": {
      "float32": {"step": 0.02, "step_hlo_matmuls": {("dot", "f32xf32", "f32"): 3}},
      "autocast cuda": {"step": 0.01, "step_hlo_matmuls": common.hlo_matmul_dtypes(GPU_HLO)},
    }
  }
  table = run.gpu_table(results, markdown=True)
  assert "| lm | autocast cuda | 10.0 | 2.00x | __cublas$gemm f16xf16->f16 x1" in table
  assert "| lm | float32 | 20.0 | 1.00x | dot f32xf32->f32 x3 |" in table


def test_residual_stats_count_what_the_backward_keeps_apart_from_the_inputs():
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
  stats = common.residual_stats(lambda w, x: jnp.sin(x @ w).sum(), (w, x))
  assert stats["bytes"] == 4 * 16 * 4  # cos(x @ w), float32
  assert stats["arg_bytes"] == (x.size + w.size) * 4  # each needed for the other's gradient


def test_stablehlo_converts_are_read_from_lowered_text():
  lowered = jax.jit(lambda x: (x.astype(jnp.bfloat16) * 2).astype(jnp.float32)).lower(
    jnp.ones((2, 3))
  )
  pairs = common.convert_pairs(common.stablehlo_converts(lowered.as_text(debug_info=True)))
  assert pairs == {"f32->bf16": 1, "bf16->f32": 1}


def _peers_cases_without_measuring(monkeypatch) -> types.ModuleType:
  """``bench_scaler_peers`` with ``measure`` stubbed: ``run`` gives each case its programs' names
  (what is compared where) without compiling them (the quick run measures the optimizer case)."""
  from benchmarks import bench_scaler_peers

  monkeypatch.setattr(
    bench_scaler_peers, "measure", lambda steps, params, **_: dict.fromkeys(steps, None)
  )
  return bench_scaler_peers


def test_the_scaler_peers_lm_cases_are_as_deep_as_their_leaf_counts_ask(monkeypatch):
  bench_scaler_peers = _peers_cases_without_measuring(monkeypatch)
  lm = dict(layers=1, d_model=8, heads=1, seq=2, batch=1, vocab=8)
  leaves = lambda layers: len(
    jax.tree.leaves(bench_scaler_peers.models.lm_task(None, **dict(lm, layers=layers)).params)
  )
  assert leaves(2) == len(jax.tree.leaves(bench_scaler_peers.models.lm_param_shapes(layers=2)))
  assert bench_scaler_peers.lm_layers_for(50, lm) == 3 and leaves(3) == 54  # 6 + 16 a layer
  deep = bench_scaler_peers.lm_layers_for(500, lm)
  assert len(jax.tree.leaves(bench_scaler_peers.models.lm_param_shapes(layers=deep))) == 502
  assert bench_scaler_peers.lm_layers_for(1, lm) == 1
  res = bench_scaler_peers.run(lm=lm, lm_leaves=(20, 110), leaves=(), log=print)
  assert list(res["cases"]) == ["LM train step (22 leaves)", "LM train step (102 leaves)"]
  assert set(res["cases"]["LM train step (22 leaves)"]) == set(bench_scaler_peers.PEERS)
  assert "flax DynamicScale" not in res["cases"]["LM train step (102 leaves)"]  # > 100 leaves


def test_the_scaler_peers_lm_step_runs_under_autocast_for_a_gpu_run(monkeypatch):
  bench_scaler_peers = _peers_cases_without_measuring(monkeypatch)
  lm = dict(layers=1, d_model=32, heads=2, seq=8, batch=2, vocab=32)
  res = bench_scaler_peers.run(lm=lm, lm_device_type="cuda", leaves=(), log=print)
  (case,) = res["cases"]
  assert case.startswith("LM train step, autocast cuda")
  steps, params = bench_scaler_peers.lm_steps(lm, "cuda")
  for name, (step, opt_state, batch) in steps.items():
    text = str(jax.make_jaxpr(step)(params, opt_state, batch))
    assert "f16[" in text, name  # the forward and backward run in float16
