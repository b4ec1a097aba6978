"""Records ``torch.amp.GradScaler("cpu")`` trajectories as golden files for jaxamp's tests.

Regenerate (needs the CPU build of torch; the output is deterministic, byte for byte):

    python scripts/record_gradscaler_goldens.py  # writes tests/goldens/gradscaler_trajectories.json

Each configuration trains a tiny linear model (``W: 2x3``, ``b: 2``) with ``torch.optim.SGD`` and a
real ``GradScaler`` on seeded random data. At seeded random steps an Inf, -Inf or NaN is written
into one gradient entry after ``backward()``, and very large initial scales overflow by
themselves. Per step the file keeps the scaled gradients torch's scaler saw (so jaxamp can replay
them exactly), whether the step found an Inf/NaN, the scale after ``update()`` (float32 bit pattern
and value), the growth tracker and the parameters after the step. Every float32 array is stored
as bit patterns (``"0x3f800000"``): exact, and JSON has no Inf/NaN.

``run_config`` is also imported by ``tests/scaler/test_loss_scale_goldens.py`` for the live
comparison.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "goldens"
OUT_FILE = OUT / "gradscaler_trajectories.json"

# Nine hyperparameter sets: every (growth, backoff) pair, intervals 1..5. Each set gets four
# configurations (init scale, injection rate, data seed), so a replay compiles once per set.
HYPERPARAMETER_SETS = [
  dict(growth_factor=g, backoff_factor=b, growth_interval=i % 5 + 1)
  for i, (g, b) in enumerate((g, b) for g in (2.0, 1.1, 16.0) for b in (0.5, 0.3, 0.25))
]
# Scales that must appear: float32's max, huge, tiny, subnormal ones that back off to zero.
_REQUIRED_SCALES = [1e38, 3.4028234e38, 1e-30, 1e-44, 3e-45, 2.0**16, 1.0, 12345.678, 1e-38]
_SCALE_POOL = [2.0**16, 1e38, 3.0e38, 1e-30, 1e-20, 1.0, 72089.6, 0.1, 2.0**24]


def make_configs(per_set: int = 4, seed: int = 0) -> list[dict[str, Any]]:
  """The recorded configurations: ``per_set`` seeded random ones per hyperparameter set."""
  rng = np.random.default_rng(seed)
  n = per_set * len(HYPERPARAMETER_SETS)
  scales = _REQUIRED_SCALES + [float(rng.choice(_SCALE_POOL)) for _ in range(n)]
  configs = []
  for i in range(n):
    configs.append(
      dict(
        HYPERPARAMETER_SETS[i % len(HYPERPARAMETER_SETS)],
        init_scale=scales[i],  # the required scales first, one per set
        p_inject=float(rng.choice([0.0, 0.15, 0.3, 0.5])),
        seed=seed * 1000 + i,
        steps=24,
        lr=0.05,
      )
    )
  return configs


def to_hex(a: Any) -> list[str]:
  """float32 values (flattened) -> bit patterns as hex strings."""
  bits = np.asarray(a, np.float32).reshape(-1).view(np.uint32)
  return [f"0x{int(b):08x}" for b in bits]


def from_hex(h: list[str], shape: tuple[int, ...] = (-1,)) -> np.ndarray:
  """Inverse of ``to_hex``."""
  return np.array([int(x, 16) for x in h], np.uint32).view(np.float32).reshape(shape)


def initial_params(seed: int) -> dict[str, np.ndarray]:
  """The model's initial parameters for a configuration."""
  rng = np.random.default_rng(seed)
  return {
    "W": rng.standard_normal((2, 3)).astype(np.float32),
    "b": rng.standard_normal(2).astype(np.float32),
  }


def batch(seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
  """The data of one step: ``x (4, 3)`` and targets ``y (4, 2)``."""
  rng = np.random.default_rng([seed, step])
  x = rng.standard_normal((4, 3)).astype(np.float32)
  y = rng.standard_normal((4, 2)).astype(np.float32)
  return x, y


def injections(cfg: dict[str, Any]) -> list[tuple[str, int, str] | None]:
  """Per step: ``None`` or ``(param name, flat index, "inf" | "-inf" | "nan")`` to inject."""
  rng = np.random.default_rng([cfg["seed"], 7])
  out: list[tuple[str, int, float] | None] = []
  for _ in range(cfg["steps"]):
    if rng.random() < cfg["p_inject"]:
      name = str(rng.choice(["W", "b"]))
      index = int(rng.integers(0, 6 if name == "W" else 2))
      out.append((name, index, str(rng.choice(["inf", "-inf", "nan"]))))
    else:
      out.append(None)
  return out


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
  """Trains with a real ``torch.amp.GradScaler("cpu")`` and returns the recorded trajectory."""
  import torch

  init = initial_params(cfg["seed"])
  params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
  opt = torch.optim.SGD(list(params.values()), lr=cfg["lr"])
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=cfg["init_scale"],
    growth_factor=cfg["growth_factor"],
    backoff_factor=cfg["backoff_factor"],
    growth_interval=cfg["growth_interval"],
  )
  steps = []
  for step, inject in enumerate(injections(cfg)):
    x, y = (torch.from_numpy(a) for a in batch(cfg["seed"], step))
    opt.zero_grad()
    loss = ((x @ params["W"].T + params["b"] - y) ** 2).mean()
    scaler.scale(loss).backward()
    if inject is not None:
      name, index, value = inject
      with torch.no_grad():
        params[name].grad.view(-1)[index] = float(value)
    grads = {k: to_hex(p.grad.detach().numpy()) for k, p in params.items()}
    scaler.step(opt)
    found_inf = sum(
      float(v.item())
      for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    )
    scaler.update()
    scale = scaler._scale.detach().clone()
    steps.append(
      {
        "grads": grads,
        "found_inf": bool(found_inf > 0),
        "scale": float(scale.item()),
        "scale_hex": to_hex(scale.numpy())[0],
        "growth_tracker": int(scaler._growth_tracker.item()),
        "params": {k: to_hex(p.detach().numpy()) for k, p in params.items()},
      }
    )
  return {
    "config": cfg,
    "init_params": {k: to_hex(v) for k, v in init.items()},
    "injections": injections(cfg),
    "state_dict": scaler.state_dict(),
    "steps": steps,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT_FILE)
  args = parser.parse_args()
  import torch

  goldens = {
    "torch_version": torch.__version__,
    "trajectories": [run_config(c) for c in make_configs()],
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps(goldens, indent=None, separators=(",", ":"), allow_nan=False)
  args.out.write_text(text + "\n")
  print(f"wrote {len(goldens['trajectories'])} trajectories, {len(text)} bytes, to {args.out}")


if __name__ == "__main__":
  main()
