"""jaxamp's demo: one model trained in float32, bfloat16 autocast and float16 autocast + scaling.

    python -m jaxamp.demo [--steps N] [--out DIR]     # --help: the options and their defaults

Trains a flax linen MLP (64-512-512-512-10) on scikit-learn's handwritten digits (shipped with
scikit-learn, no download) three ways, with ``jaxamp.make_train_step`` and a flax
``TrainState``, and prints a table per variant:

- ``loss``: the mean training loss of the last 50 steps (fewer in shorter runs);
- ``test acc``: the accuracy on the held-out 20% of the digits, with the forward pass under the
  variant's autocast policy;
- ``ms/step``: the median wall time of a jitted train step, host sync included;
- ``residuals KiB``: the memory kept for the backward pass, i.e. the bytes of the residuals
  that the forward pass saves for the backward pass of one batch, counted from the jaxpr (not
  measured on a device). It is the sum of the sizes of
  the leaves of the function ``jax.vjp`` returns for the loss function (with the variant's
  autocast), leaving out the leaves that are the arguments themselves (the float32 parameters
  and the batch, held anyway). Low-precision copies of the weights made for the matmuls count,
  as torch's autocast keeps them too. It is measured before XLA's fusion and buffer reuse, so it
  describes the program rather than one backend's allocator (``compiled.memory_analysis()`` of
  the jitted step would give XLA:CPU's temporary buffers instead);
- ``skipped``: updates skipped by ``dynamic_loss_scale`` for Inf/NaN gradients;
- ``scale``: the final loss scale (1.0 without a scaler). The scaler uses
  ``growth_interval=100`` (``GROWTH_INTERVAL``) instead of torch's default 2000, so that a run of
  a few hundred steps shows the scale grow after it backs off.

It saves ``DIR/demo.png`` with the loss curves, the loss-scale trajectory (skipped steps marked)
and the residual memory per variant in KiB, as in the table (needs matplotlib). The default run
takes about one to two minutes on two CPU cores; progress shows as tqdm bars on a terminal and as
a plain line every tenth of the steps when stderr goes to a file or a pipe. On CPU there is no
speed-up to expect (XLA:CPU computes 16-bit dots in float32 internally); the memory and the dtypes
are real on every backend.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import jaxamp

# name, autocast device type (None: float32, no autocast), loss scaling
VARIANTS = (
  ("float32", None, False),
  ("bfloat16 autocast (cpu policy)", "cpu", False),
  ("float16 autocast (cuda policy) + loss scaling", "cuda", True),
)
HIDDEN = (512, 512, 512)
BATCH_SIZE = 256
GROWTH_INTERVAL = 100  # torch's default is 2000; shorter, so a short run shows the trajectory
LOSS_WINDOW = 50
PROGRESS_LINES = 10  # progress lines per variant when stderr is not a terminal


def load_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """scikit-learn's 8x8 digits, scaled to [0, 1], split 80/20."""
  try:
    from sklearn.datasets import load_digits as sklearn_digits
  except ImportError as error:  # pragma: no cover - the demo extra installs it
    raise SystemExit('The demo needs scikit-learn: pip install -e ".[demo]"') from error
  data = sklearn_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return x[:split], y[:split], x[split:], y[split:]


class MLP(nn.Module):
  """ReLU MLP from the 64 pixels to the 10 classes."""

  hidden: tuple[int, ...] = HIDDEN

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(10)(x)


MODEL = MLP()


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean softmax cross-entropy of the MLP on ``batch = (x, y)``."""
  logits = MODEL.apply({"params": params}, batch[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


def autocast_kwargs(device_type: str | None) -> dict[str, Any]:
  return {"enabled": False} if device_type is None else {"device_type": device_type}


def residual_bytes(fun: Callable, params: Any, batch: Any) -> int:
  """Bytes ``fun(params, batch)`` saves for its backward pass (``jax.vjp``'s residuals).

  The leaves of the function ``jax.vjp`` returns are the residuals; those that are the arguments
  themselves are not counted.
  """
  batch = jax.tree.map(jnp.asarray, batch)  # device arrays: the residuals may be these objects
  _, backward = jax.vjp(lambda params: fun(params, batch), params)
  arguments = {id(leaf) for leaf in jax.tree.leaves((params, batch))}
  return sum(
    leaf.size * leaf.dtype.itemsize
    for leaf in jax.tree.leaves(backward)
    if id(leaf) not in arguments
  )


def _progress(iterable: Iterable, total: int, label: str) -> Iterable:
  """A tqdm bar on a terminal; elsewhere (a log file, a pipe) a plain line every tenth."""
  if sys.stderr.isatty():
    try:
      from tqdm import tqdm
    except ImportError:
      pass
    else:
      return tqdm(iterable, total=total, desc=label, leave=False)
  return _progress_lines(iterable, total, label)


def _progress_lines(iterable: Iterable, total: int, label: str) -> Iterator:
  every = max(1, total // PROGRESS_LINES)
  start = time.perf_counter()
  for i, item in enumerate(iterable, 1):
    yield item
    if i % every == 0 or i == total:
      print(
        f"{label}: step {i}/{total} ({time.perf_counter() - start:.1f} s)",
        file=sys.stderr,
        flush=True,
      )


def train(
  name: str, device_type: str | None, scaled: bool, data, steps: int, batch_size: int = BATCH_SIZE
) -> dict[str, Any]:
  """Trains one variant for ``steps`` (at least 1) steps; returns its summary and curves."""
  if steps < 1:
    raise ValueError(f"`steps` must be at least 1; got {steps}.")
  x_train, y_train, x_test, y_test = data
  base = optax.adam(1e-3)
  tx = jaxamp.dynamic_loss_scale(base, growth_interval=GROWTH_INTERVAL) if scaled else base
  init_scale = float(jaxamp.scaler.get_scale(tx.init({}))) if scaled else 1.0
  params = MODEL.init(jax.random.key(0), x_train[:1])["params"]
  state = TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)
  kwargs = autocast_kwargs(device_type)
  step = jax.jit(jaxamp.make_train_step(loss_fn, **kwargs))
  saved = residual_bytes(
    jaxamp.autocast(loss_fn, **kwargs), params, (x_train[:batch_size], y_train[:batch_size])
  )
  rng = np.random.default_rng(1)
  losses, scales, skipped_at, times = [], [], [], []
  for i in _progress(range(steps), steps, name):
    idx = rng.integers(0, len(x_train), batch_size)
    start = time.perf_counter()
    state, metrics = step(state, (x_train[idx], y_train[idx]))
    loss = float(metrics["loss"])  # syncs: the step time includes the device work
    if i > 0:  # the first call compiles
      times.append(time.perf_counter() - start)
    losses.append(loss)
    scales.append(float(metrics["scale"]))
    if bool(metrics["found_inf"]):
      skipped_at.append(i)
  forward = jax.jit(jaxamp.autocast(lambda params, x: MODEL.apply({"params": params}, x), **kwargs))
  accuracy = float((jnp.argmax(forward(state.params, x_test), -1) == y_test).mean())
  return {
    "name": name,
    "loss": float(np.mean(losses[-LOSS_WINDOW:])),
    "accuracy": accuracy,
    "step_ms": 1e3 * float(np.median(times)) if times else float("nan"),
    "saved_bytes": saved,
    "skipped": int(metrics["skipped_steps"]),
    "scale": scales[-1],
    "scaled": scaled,
    "init_scale": init_scale,
    "losses": losses,
    "scales": scales,
    "skipped_at": skipped_at,
  }


def _smooth(values: list[float], window: int = 20) -> np.ndarray:
  values = np.asarray(values)
  window = max(1, min(window, len(values)))
  return np.convolve(values, np.ones(window) / window, mode="valid")


def plot(results: list[dict[str, Any]], out: pathlib.Path) -> pathlib.Path | None:
  """Saves loss curves, the loss-scale trajectory and the residual memory to ``out/demo.png``."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (ax_loss, ax_scale, ax_memory) = plt.subplots(1, 3, figsize=(16, 4.5))
  styles = [{"color": "black", "linestyle": "--", "zorder": 3}, {"color": "C1"}, {"color": "C2"}]
  for r, style in zip(results, styles, strict=False):
    ax_loss.plot(r["losses"], linewidth=0.5, alpha=0.25, color=style["color"])
    smooth = _smooth(r["losses"])
    ax_loss.plot(
      np.arange(len(smooth)) + len(r["losses"]) - len(smooth),
      smooth,
      label=r["name"],
      linewidth=1.5,
      **style,
    )
  ax_loss.set(
    xlabel="step",
    ylabel="training loss",
    yscale="log",
    title="training loss (20-step running mean)",
  )
  ax_loss.legend(fontsize=8)
  for r in (r for r in results if r["scaled"]):
    used = [r["init_scale"], *r["scales"][:-1]]  # the scale each step's gradients were scaled by
    ax_scale.step(range(len(used)), used, where="post", label=r["name"], color="C2")
    if r["skipped_at"]:
      ax_scale.plot(
        r["skipped_at"],
        [used[i] for i in r["skipped_at"]],
        "rx",
        label="skipped step (Inf/NaN gradients)",
      )
    ax_scale.legend(fontsize=8)
  ax_scale.set(
    xlabel="step", ylabel="loss scale used by the step", yscale="log", title="dynamic loss scale"
  )
  names = [r["name"].replace(" + ", "\n+ ").replace(" (", "\n(") for r in results]
  ax_memory.bar(names, [r["saved_bytes"] / 2**10 for r in results], color=["black", "C1", "C2"])
  ax_memory.set(
    ylabel="KiB",
    title=f"residuals saved for the backward pass (batch {BATCH_SIZE}, from the jaxpr)",
  )
  ax_memory.tick_params(axis="x", labelsize=8)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "demo.png"
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def print_table(results: list[dict[str, Any]]) -> None:
  """The final table: one row per variant, then what its columns are."""
  print(
    f"{'variant':46s} {'loss':>8s} {'test acc':>8s} {'ms/step':>7s} {'residuals KiB':>13s} "
    f"{'skipped':>7s} {'scale':>8s}"
  )
  for r in results:
    print(
      f"{r['name']:46s} {r['loss']:8.2e} {r['accuracy']:8.3f} {r['step_ms']:7.2f} "
      f"{r['saved_bytes'] / 2**10:13.0f} {r['skipped']:7d} {r['scale']:8.3g}"
    )
  print(
    f"loss: mean of the last {LOSS_WINDOW} steps; test acc: on the 20% of the digits held out\n"
    "residuals KiB: what the forward pass saves for the backward pass (jax.vjp's residuals,\n"
    "  counted from the jaxpr); skipped: steps the loss scaler skipped for Inf/NaN gradients\n"
    f"scale: the final loss scale; growth_interval={GROWTH_INTERVAL} (torch's default is 2000) "
    "so that a short\n  run shows the scale grow after a backoff"
  )


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be a whole number; got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
  return value


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(
    prog="python -m jaxamp.demo",
    description=__doc__.split("\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--steps", type=_positive_int, default=2000, help="training steps per variant"
  )
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("out"), help="folder for demo.png"
  )
  args = parser.parse_args(argv)
  sizes = "-".join(str(n) for n in (64, *HIDDEN, 10))
  print(
    f"jaxamp demo on {jax.default_backend()}: MLP {sizes} on scikit-learn digits, "
    f"{args.steps} steps of batch {BATCH_SIZE}"
  )
  data = load_digits()
  results = [train(name, device, scaled, data, args.steps) for name, device, scaled in VARIANTS]
  print_table(results)
  if jax.default_backend() == "cpu":
    print("(on CPU, XLA computes 16-bit dots in float32: expect no speed-up, only the memory)")
  path = plot(results, args.out)
  if path is not None:
    print(f"saved {path}")
  return results


if __name__ == "__main__":
  main()
