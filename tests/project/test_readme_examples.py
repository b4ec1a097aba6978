"""Every ``python`` code block of README.md and docs/*.md runs as written.

Each block is a complete program, executed on its own (one test per block, id ``file:line``);
fragments are fenced as plain listings (a bare fence) and are not run. A ``print`` line with a
trailing comment, ``print(x.dtype)  # float32``, must print what the comment says.

A ``python multihost`` block (docs/scaling.md) is a program for every process of a multi-host job,
``train.py COORDINATOR NUM_PROCESSES PROCESS_ID``: it is written to a file and run as two
processes of two CPU devices each (``multiprocess_launcher``), and every process must print the
commented lines.
"""

from __future__ import annotations

import builtins
import re
import sys

import jax
import jax.numpy as jnp
import multiprocess_launcher
import numpy as np
import optax
import pytest
from paths import ROOT

import jaxamp

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
MULTIHOST_FENCE = re.compile(r"^```python multihost[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
CHECKED_PRINT = re.compile(r"^print\(.*\)\s+# (.*?)\s*$")


def python_blocks(fence: re.Pattern = FENCE) -> list:
  """One ``pytest.param(document, code, first_line)`` per ``python`` block, id ``file:line``."""
  params = []
  for path in DOCUMENTS:
    text = path.read_text()
    for match in fence.finditer(text):
      line = text.count("\n", 0, match.start(1)) + 1  # the block's first line of code
      document = str(path.relative_to(ROOT))
      quickstart = path.name == "README.md" and not params  # the fast subset's one block
      marks = () if quickstart else pytest.mark.slow
      params.append(
        pytest.param(document, match.group(1), line, marks=marks, id=f"{document}:{line}")
      )
  return params


BLOCKS = python_blocks()
MULTIHOST_BLOCKS = python_blocks(MULTIHOST_FENCE)


def test_the_documents_have_python_blocks():
  ids = [block.id for block in BLOCKS]
  assert any(i.startswith("README.md:") for i in ids)
  assert any(i.startswith("docs/") for i in ids)


@pytest.mark.parametrize("document, code, first_line", BLOCKS)
def test_documented_program_runs(document, code, first_line, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # blocks that write files write them here
  printed: dict[int, list[str]] = {}

  def recording_print(*args, **kwargs):
    frame = sys._getframe(1)
    if frame.f_code.co_filename == document and kwargs.get("file") is None:
      printed.setdefault(frame.f_lineno, []).append(kwargs.get("sep", " ").join(map(str, args)))
    builtins.print(*args, **kwargs)

  # Line numbers of the compiled block are those of the document.
  source = "\n" * (first_line - 1) + code
  # The documents print what a user gets: JAX's default threefry (conftest.py picks the other).
  with jax.threefry_partitionable(True):
    exec(compile(source, document, "exec"), {"__name__": "__docs__", "print": recording_print})
  for lineno, text in enumerate(source.splitlines(), 1):
    expected = CHECKED_PRINT.match(text)
    if expected:
      assert printed.get(lineno), f"{document}:{lineno} printed nothing"
      assert printed[lineno][-1] == expected.group(1), f"{document}:{lineno} printed"


def test_docs_scaling_has_multihost_programs():
  assert any(block.id.startswith("docs/scaling.md:") for block in MULTIHOST_BLOCKS)


@pytest.mark.slow  # two JAX processes
@pytest.mark.parametrize("document, code, first_line", MULTIHOST_BLOCKS)
def test_documented_multihost_program_runs_in_two_processes(document, code, first_line, tmp_path):
  program = tmp_path / "train.py"
  program.write_text("\n" * (first_line - 1) + code)  # tracebacks give the document's lines
  results = multiprocess_launcher.run_processes(str(program), cwd=str(tmp_path), timeout=240)
  for process_id, result in enumerate(results):
    assert result.returncode == 0, f"process {process_id}: {result.stderr[-5000:]}"
    printed = result.stdout.splitlines()
    for lineno, text in enumerate(code.splitlines(), first_line):
      expected = CHECKED_PRINT.match(text)
      if expected:
        assert expected.group(1) in printed, f"{document}:{lineno} in process {process_id}"


# --- claims of the documents that running their blocks does not check ---------------------------


@pytest.mark.slow  # eight steps of three optimizers, two ways
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_clipping_after_unscale_matches_clipping_inside_the_wrapper_to_float32_rounding(name):
  """docs/loss_scaling.md: bitwise equal at the first step, then within float32 rounding."""
  inner = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
  }[name]
  clip = optax.clip_by_global_norm(0.5)
  inside = jaxamp.dynamic_loss_scale(optax.chain(clip, inner()))
  outside = jaxamp.dynamic_loss_scale(inner())
  loss_fn = lambda params, x, y: jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
  params = {"w": jax.random.normal(jax.random.key(0), (16, 8)), "b": jnp.zeros(8)}

  def scaled_grads(params, s, x, y):
    return jax.grad(lambda params: jaxamp.scale_loss(loss_fn(params, x, y), s))(params)

  @jax.jit
  def clip_inside(params, s, x, y):
    updates, s = inside.update(scaled_grads(params, s, x, y), s, params)
    return optax.apply_updates(params, updates), s

  @jax.jit
  def clip_after_unscale(params, s, x, y):
    grads, found_inf = jaxamp.unscale(scaled_grads(params, s, x, y), s)
    grads, _ = clip.update(grads, clip.init(grads))
    updates, s = outside.update(grads, s, params, found_inf=found_inf)
    return optax.apply_updates(params, updates), s

  a, a_state = params, inside.init(params)
  b, b_state = params, outside.init(params)
  for step in range(1, 9):
    x = jax.random.normal(jax.random.key(10 + step), (32, 16))
    y = jax.random.normal(jax.random.key(100 + step), (32, 8)) * (jnp.inf if step == 4 else 1.0)
    a, a_state = clip_inside(a, a_state, x, y)
    b, b_state = clip_after_unscale(b, b_state, x, y)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      if step == 1:
        np.testing.assert_array_equal(u, v)
      np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6 * float(np.abs(v).max()))
    for field in ("scale", "growth_tracker", "found_inf", "skipped_steps"):
      assert getattr(a_state, field) == getattr(b_state, field), (step, field)
  assert b_state.skipped_steps == 1
