"""jaxamp's demo: one model trained in float32, bfloat16 autocast and float16 autocast + scaling.

    python -m jaxamp.demo [--steps N] [--out DIR]

Trains a small MLP on scikit-learn's handwritten digits (shipped with scikit-learn, no download)
three ways side by side and prints loss, accuracy, step time, skipped steps and the final loss
scale of each; with matplotlib installed it also saves the loss curves to ``DIR/demo.png``.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

VARIANTS = (
    ("float32", None, None),
    ("bfloat16 autocast (cpu policy)", "cpu", False),
    ("float16 autocast (cuda policy) + loss scaling", "cuda", True),
)


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


def init_mlp(key, sizes=(64, 256, 256, 10)) -> list[dict[str, jax.Array]]:
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
          for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  logits = mlp(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(device_type: str | None, scaled: bool, tx):
  forward = loss_fn if device_type is None else jaxamp.autocast(loss_fn, device_type=device_type)

  @jax.jit
  def step(params, opt_state, x, y):
    def objective(p):
      loss = forward(p, x, y).astype(jnp.float32)
      return (jaxamp.scale_loss(loss, opt_state) if scaled else loss), loss

    grads, loss = jax.grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def accuracy(params, x, y) -> float:
  return float((jnp.argmax(mlp(params, x), -1) == y).mean())


def _progress(iterable: Iterable, total: int, label: str):
  try:
    from tqdm import tqdm
  except ImportError:
    return iterable
  return tqdm(iterable, total=total, desc=label, leave=False)


def train(name, device_type, scaled, data, steps: int, batch: int = 128):
  x_train, y_train, x_test, y_test = data
  base = optax.adam(1e-3)
  tx = jaxamp.dynamic_loss_scale(base, growth_interval=100) if scaled else base
  params = init_mlp(jax.random.key(0))
  opt_state = tx.init(params)
  step = make_step(device_type, scaled, tx)
  rng = np.random.default_rng(1)
  losses, scales, times = [], [], []
  for i in _progress(range(steps), steps, name):
    idx = rng.integers(0, len(x_train), batch)
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
    loss = float(loss)
    if i > 0:
      times.append(time.perf_counter() - start)
    losses.append(loss)
    scales.append(float(jaxamp.get_scale(opt_state)) if scaled else 1.0)
  skipped = int(opt_state.skipped_steps) if scaled else 0
  return {"name": name, "loss": losses[-1], "accuracy": accuracy(params, x_test, y_test),
          "step_ms": 1e3 * float(np.median(times)) if times else float("nan"),
          "skipped": skipped, "scale": scales[-1], "losses": losses, "scales": scales}


def plot(results, out: pathlib.Path) -> pathlib.Path | None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
  for r in results:
    ax_loss.plot(r["losses"], label=r["name"], linewidth=1)
  ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
  ax_loss.legend(fontsize=8)
  scaled = [r for r in results if r["skipped"] or r["scale"] != 1.0]
  for r in scaled:
    ax_scale.plot(r["scales"], label=r["name"])
  ax_scale.set(xlabel="step", ylabel="loss scale", yscale="log", title="dynamic loss scale")
  out.mkdir(parents=True, exist_ok=True)
  path = out / "demo.png"
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m jaxamp.demo", description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=600, help="training steps per variant")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"),
                      help="folder for demo.png")
  args = parser.parse_args(argv)
  print(f"jaxamp demo on {jax.default_backend()}: MLP on scikit-learn digits, {args.steps} steps")
  data = load_digits()
  results = [train(name, device, scaled, data, args.steps) for name, device, scaled in VARIANTS]
  print(f"{'variant':48s} {'loss':>8s} {'acc':>6s} {'ms/step':>8s} {'skipped':>8s} {'scale':>10s}")
  for r in results:
    print(f"{r['name']:48s} {r['loss']:8.4f} {r['accuracy']:6.3f} {r['step_ms']:8.2f} "
          f"{r['skipped']:8d} {r['scale']:10.1f}")
  path = plot(results, args.out)
  if path is not None:
    print(f"saved {path}")
  return results


if __name__ == "__main__":
  main()
